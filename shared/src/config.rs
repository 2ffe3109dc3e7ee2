//! The YAML run config: the Python original's keys, strictly validated, located errors.
//!
//! This module owns the translation of a user's `stage_b` YAML file into [`RunConfig`], the
//! plain typed value the rest of stageb runs on and records (serialized) in `manifest.json`.
//! Users bring configs of the Python original, so the key names, required-ness, defaults and
//! ranges are those of the original's loader (`src/stage_b/config.py` @ace7fb7). A config of
//! the original loads with at most `model.model_name_or_path` changed.
//!
//! # Stricter than the original
//! - An unknown key is an error ([`ErrorCode::UnknownConfigKey`]) at every nesting level,
//!   including inside `sampler.grid[i]`, with the line of the key and a "did you mean"
//!   suggestion (the original silently ignored them: `runner.rollout_batch_size` fell back to
//!   a batch of 1).
//! - Keys of features stageb does not implement are accepted and reported as
//!   [`ConfigNotice`]s ([`ErrorCode::UnsupportedConfigKey`], "accepted but ignored: <why>"):
//!   `default_domain`, `domain_map`, `model.torch_dtype`, `model.device_map`,
//!   `model.attn_implementation` / `model.attn_impl`, `output.group_report`,
//!   `stage_b_distillation` (the whole section), `reflection.hypothesis_*`, the legacy
//!   `reflection.allow_uncertain` / `eligibility_policy` / `all_wrong_strategy`, and
//!   `sampler.grid[].seed` / `stop` / `no_repeat_ngram_size`. Their values are not checked.
//! - `selection.policy` / `selection.tie_break` are honored, so only `top_label` /
//!   `temperature` are accepted; `top_semantic` is rejected as not implemented.
//! - Integers must be YAML integers (`epochs: 3.0` or `"3"` is an error); floats accept
//!   integers; `.nan` / `.inf` are rejected; `null` is accepted only where the original's
//!   type is nullable (and for the stageb-optional prompt paths, meaning "built-in").
//! - `output.run_name` must be one plain path component (it names a directory).
//!
//! # stageb's own keys (all optional)
//! - `sampler.constrained` (bool, default `true`): constrained decoding on.
//! - `reflection.decision_prompt_path` / `reflection.ops_prompt_path` are optional (required in
//!   the original); absent or `null` selects the built-in prompts.
//! - `model.max_model_len` (int or null, ≥ 256): the run's context in tokens, below the
//!   model's own (see [`crate::limits`] for how asked lengths are fitted into it).
//! - `runner.lease_ttl_s` (default 60) and `runner.heartbeat_interval_s` (default 5, must be
//!   smaller than the lease TTL): lease timing between rank 0 and the workers.
//! - `runner.speculation_multiple` (default 3, 0 turns it off) and `runner.speculation_min_ms`
//!   (default 2000): when rank 0 leases a second copy of a straggling job.
//!
//! # Paths
//! Paths are kept exactly as written. Like the original, relative paths mean "relative to
//! the current working directory"; resolving them is the caller's decision, with
//! [`resolve_config_path`] / [`RunConfig::with_paths_resolved`] as the helpers. Prompt files
//! are not read here (the caller checks they exist and are non-empty).
//!
//! # How lines are found
//! The document is parsed once into a `serde_norway::Value` for structure (YAML syntax errors
//! carry serde_norway's location). `Value` has no positions, so the line of a key (for
//! unknown keys, notices, wrong types, ranges) is found by a *probe*: a second pass of the
//! same parser over the same text with a `DeserializeSeed` that walks to the key's path and
//! fails with a marker error while the key's own scalar is being deserialized.
//! serde_norway stamps an error with the mark of the innermost event being deserialized, so
//! the marker error comes back carrying the key's line. Using the same parser for structure
//! and positions means the two can never disagree (no hand-written YAML scanner, correct for
//! flow mappings like `{temperature: 0.1, top_p: 0.9}` too). Probes only run when a line is
//! needed, on files of a few dozen lines. When a probe cannot find a path (a key that came
//! in through a `<<` merge), the nearest enclosing key's line is used.

use crate::digest::sha256_hex;
use crate::domain::DecodeSpec;
use crate::error::{ErrorCode, InputError};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_norway::{Mapping, Value};
use std::fmt;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// Run-time types
// ---------------------------------------------------------------------------------------------

/// Smallest `sampler.grid[].max_new_tokens` when `sampler.constrained` is on (the worker's
/// `MIN_CONSTRAINED_NEW_TOKENS`).
pub const MIN_CONSTRAINED_NEW_TOKENS: u32 = 20;

/// The validated run config. `Deserialize` exists to read the resolved copy back from
/// `manifest.json`; user YAML always goes through [`parse_config`] / [`load_config`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Run seed: candidate seeds, epoch shuffles and reflection seeds derive from it.
    pub seed: u64,
    /// Stage-A JSONL files, as written (a single string in YAML becomes one entry).
    pub stage_a_paths: Vec<PathBuf>,
    pub model: ModelConfig,
    pub guidance: GuidanceConfig,
    pub output: OutputConfig,
    pub sampler: SamplerConfig,
    pub reflection: ReflectionConfig,
    pub selection: SelectionConfig,
    pub manual_review: ManualReviewConfig,
    pub runner: RunnerConfig,
    /// `None` when the section is absent: no low-confidence cleanup.
    pub guidance_lifecycle: Option<LifecycleConfig>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// A model file or directory (GGUF or safetensors); kept as written.
    pub model_name_or_path: String,
    /// stageb addition: the run's context in tokens (prompt + generated). `None`: the model's
    /// own (GGUF `*.context_length`, `config.json` `max_position_embeddings`). At least
    /// [`MIN_MODEL_LEN`]; more than the model declares is refused when the model is loaded.
    #[serde(default)]
    pub max_model_len: Option<u32>,
}

/// Smallest `model.max_model_len`: a rollout's contract alone needs a few dozen tokens, and a
/// reflection call a system prompt, the guidance and one case.
pub const MIN_MODEL_LEN: u32 = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuidanceConfig {
    /// The global seed guidance file (read, never written back).
    pub path: PathBuf,
    /// Number of guidance snapshots kept (> 0).
    pub retention: u32,
    /// Re-running a run name reseeds guidance from `path` (default `true`); `false` asks to
    /// continue from the guidance the previous run left. Per-run artifacts always start fresh.
    pub reset_on_rerun: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputConfig {
    pub root: PathBuf,
    /// One plain path component: artifacts go to `{root}/{run_name}/{mission}/`.
    pub run_name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// Non-empty.
    pub grid: Vec<GridEntry>,
    /// Candidates per grid entry (> 0).
    pub samples_per_decode: u32,
    /// stageb addition: constrained decoding (default `true`).
    pub constrained: bool,
}

impl SamplerConfig {
    /// The grid as decode specs, in grid order (the decode index is the position).
    pub fn decode_specs(&self) -> Vec<DecodeSpec> {
        self.grid.iter().map(GridEntry::decode_spec).collect()
    }
}

/// One `sampler.grid[]` entry (the keys stageb honors).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GridEntry {
    /// ≥ 0 (0 means greedy).
    pub temperature: f32,
    /// In (0, 1].
    pub top_p: f32,
    /// > 0.
    pub max_new_tokens: u32,
    /// > 0, default 1.0.
    pub repetition_penalty: f32,
}

impl GridEntry {
    pub fn decode_spec(&self) -> DecodeSpec {
        DecodeSpec {
            temperature: self.temperature,
            top_p: self.top_p,
            max_new_tokens: self.max_new_tokens,
            repetition_penalty: self.repetition_penalty,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReflectionConfig {
    /// `None`: the built-in decision prompt.
    pub decision_prompt_path: Option<PathBuf>,
    /// `None`: the built-in ops prompt.
    pub ops_prompt_path: Option<PathBuf>,
    /// Gradient candidates per reflection batch (> 0).
    pub batch_size: u32,
    /// Cap on accepted ops per ops pass; `None` = unlimited.
    pub max_operations: Option<u32>,
    /// Cap on applied reflection cycles per epoch; `None` = unlimited.
    pub change_cap_per_epoch: Option<u32>,
    pub temperature: f32,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub max_new_tokens: u32,
    /// Prompt token limit of a reflection call (an over-long prompt is dropped, never cut).
    pub max_reflection_length: u32,
    /// Token budget for packing cases into a prompt; defaults to `max_reflection_length`.
    pub token_budget: u32,
    pub retry_budget_per_group_per_epoch: u32,
    /// Cap on decision + ops calls per epoch; `None` = unlimited.
    pub max_calls_per_epoch: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectionConfig {
    pub policy: SelectionPolicy,
    pub tie_break: TieBreak,
}

/// How a ticket's verdict is chosen from its candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionPolicy {
    /// Majority over format-ok candidates, ties to `fail`.
    TopLabel,
}

/// Candidate order used for tie handling and reporting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TieBreak {
    /// Candidates ordered by (temperature, candidate index).
    Temperature,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManualReviewConfig {
    /// In [0, 1]; `vote_strength` below it makes a ticket `low_agreement`. Default 0.8.
    pub min_verdict_agreement: f64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerConfig {
    pub epochs: u32,
    /// Tickets per reference rank per step: a step is `per_rank × 8` tickets whatever the number
    /// of workers (stageb-coordinator `run::REFERENCE_RANKS`). Default 1.
    pub per_rank_rollout_batch_size: u32,
    /// Metrics window in tickets. Default 256.
    pub logging_steps: u32,
    /// stageb addition: lease time-to-live in seconds. Default 60.
    pub lease_ttl_s: u64,
    /// stageb addition: worker heartbeat period in seconds, < `lease_ttl_s`. Default 5.
    pub heartbeat_interval_s: u64,
    /// stageb addition: straggler speculation. When the queue is empty and a lease has run
    /// longer than this multiple of the median job time (of its kind), an idle worker gets the
    /// same job; the first answer wins. 0 turns it off. Default 3. (Defaulted when absent, so
    /// manifests written before these keys existed still read.)
    #[serde(default = "default_speculation_multiple")]
    pub speculation_multiple: u32,
    /// stageb addition: never speculate on a lease younger than this (milliseconds), however
    /// fast the median job. Default 2000.
    #[serde(default = "default_speculation_min_ms")]
    pub speculation_min_ms: u64,
}

fn default_speculation_multiple() -> u32 {
    3
}

fn default_speculation_min_ms() -> u64 {
    2000
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LifecycleConfig {
    /// In [0, 1]. Default 0.35.
    pub confidence_drop_threshold: f64,
    /// Default 3.
    pub min_miss_before_drop: u32,
    /// Default true.
    pub enable_auto_cleanup: bool,
}

impl RunConfig {
    /// `len(sampler.grid) × sampler.samples_per_decode` (validated to fit in a `u32`).
    pub fn candidates_per_ticket(&self) -> u32 {
        let grid_len = u32::try_from(self.sampler.grid.len()).unwrap_or(u32::MAX);
        grid_len.saturating_mul(self.sampler.samples_per_decode)
    }

    /// A copy with every relative path (Stage-A files, guidance, output root, prompt files)
    /// joined onto `base_dir`; absolute paths are unchanged. `model_name_or_path` is left
    /// alone: it may be a model name rather than a path.
    pub fn with_paths_resolved(&self, base_dir: &Path) -> RunConfig {
        let mut resolved = self.clone();
        for path in &mut resolved.stage_a_paths {
            *path = resolve_config_path(path, base_dir);
        }
        resolved.guidance.path = resolve_config_path(&resolved.guidance.path, base_dir);
        resolved.output.root = resolve_config_path(&resolved.output.root, base_dir);
        for prompt in [
            &mut resolved.reflection.decision_prompt_path,
            &mut resolved.reflection.ops_prompt_path,
        ]
        .into_iter()
        .flatten()
        {
            *prompt = resolve_config_path(prompt, base_dir);
        }
        resolved
    }
}

/// `path` if absolute, else `base_dir.join(path)`. Pass the current directory for the
/// original's semantics, or the config file's directory for config-relative paths.
pub fn resolve_config_path(path: &Path, base_dir: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        base_dir.join(path)
    }
}

/// A key that was accepted but has no effect in stageb. The CLI prints these as warnings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigNotice {
    /// Always [`ErrorCode::UnsupportedConfigKey`]; serialized as its string code.
    #[serde(serialize_with = "serialize_code")]
    pub code: ErrorCode,
    pub file: String,
    /// Dotted path, e.g. `sampler.grid[0].seed`.
    pub key: String,
    /// 1-based line of the key.
    pub line: usize,
    /// `accepted but ignored: <why>`.
    pub message: String,
}

impl fmt::Display for ConfigNotice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: `{}` {} [{}]",
            self.file, self.line, self.key, self.message, self.code
        )
    }
}

fn serialize_code<S: Serializer>(code: &ErrorCode, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(code.code())
}

/// A parsed config with what the loader noticed and the digest of the exact bytes read.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadedConfig {
    pub config: RunConfig,
    pub notices: Vec<ConfigNotice>,
    /// Lowercase hex sha256 of the config text as read.
    pub source_text_sha256: String,
}

/// Read and validate a config file. A missing or unreadable file is
/// [`ErrorCode::FileNotFound`]; bytes that are not UTF-8 are [`ErrorCode::InvalidUtf8`].
pub fn load_config(path: &Path) -> Result<LoadedConfig, InputError> {
    let file_label = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|err| {
        InputError::new(
            ErrorCode::FileNotFound,
            &file_label,
            None,
            format!("cannot read config file: {err}"),
        )
    })?;
    let text = std::str::from_utf8(&bytes).map_err(|err| {
        let line = bytes[..err.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1;
        InputError::new(
            ErrorCode::InvalidUtf8,
            &file_label,
            Some(line),
            format!(
                "config is not valid UTF-8 (byte offset {})",
                err.valid_up_to()
            ),
        )
    })?;
    parse_config(text, &file_label)
}

/// Validate config text; `file_label` names the source in errors and notices.
pub fn parse_config(text: &str, file_label: &str) -> Result<LoadedConfig, InputError> {
    let mut root: Value = serde_norway::from_str(text).map_err(|err| {
        InputError::new(
            ErrorCode::InvalidYaml,
            file_label,
            err.location().map(|loc| loc.line()),
            format!("invalid YAML: {err}"),
        )
    })?;
    root.apply_merge().map_err(|err| {
        InputError::new(
            ErrorCode::InvalidYaml,
            file_label,
            err.location().map(|loc| loc.line()),
            format!("invalid YAML merge: {err}"),
        )
    })?;
    let mut doc = Doc {
        text,
        file: file_label,
        notices: Vec::new(),
    };
    let Value::Mapping(top) = &root else {
        return Err(doc.error(
            ErrorCode::InvalidConfigValue,
            &[],
            format!(
                "the config must be a mapping of keys (seed, stage_a_paths, model, ...), got {}",
                describe(&root)
            ),
        ));
    };
    // Keys first, over the whole document: a misspelled key must be reported as such, not as
    // the "missing required key" it causes.
    doc.check_keys(top, &[], &TOP_SCHEMA)?;
    let config = build_run_config(
        &doc,
        &Section {
            path: Vec::new(),
            map: top,
        },
    )?;
    Ok(LoadedConfig {
        config,
        notices: doc.notices,
        source_text_sha256: sha256_hex(text.as_bytes()),
    })
}

// ---------------------------------------------------------------------------------------------
// Schema: the keys of each section
// ---------------------------------------------------------------------------------------------

/// The keys one mapping may have. `prefix` is the dotted path of the section as shown in
/// suggestions (`sampler.grid[]` for grid entries).
struct SectionSchema {
    prefix: &'static str,
    /// Keys stageb reads.
    known: &'static [&'static str],
    /// Keys accepted and reported as notices, with why they are ignored.
    ignored: &'static [(&'static str, &'static str)],
}

const NO_DOMAIN_PACKS: &str =
    "stageb has no domain packs; the rollout prompt carries no domain block";
const LEGACY_UNUSED: &str = "a legacy key that the Python original did not use either";
const NO_HYPOTHESIS_POOL: &str = "stageb has no hypothesis pool (reflection closure is L == E)";
const MODEL_PLACEMENT: &str = "the candle engine takes dtype, device and attention kernels from the model file and the worker's device";

const TOP_SCHEMA: SectionSchema = SectionSchema {
    prefix: "",
    known: &[
        "seed",
        "stage_a_paths",
        "model",
        "guidance",
        "output",
        "sampler",
        "reflection",
        "selection",
        "manual_review",
        "runner",
        "guidance_lifecycle",
    ],
    ignored: &[
        ("default_domain", NO_DOMAIN_PACKS),
        ("domain_map", NO_DOMAIN_PACKS),
        (
            "stage_b_distillation",
            "distill_chatml.jsonl export is not implemented",
        ),
    ],
};

const MODEL_SCHEMA: SectionSchema = SectionSchema {
    prefix: "model",
    known: &["model_name_or_path", "max_model_len"],
    ignored: &[
        ("torch_dtype", MODEL_PLACEMENT),
        ("device_map", MODEL_PLACEMENT),
        ("attn_implementation", MODEL_PLACEMENT),
        ("attn_impl", MODEL_PLACEMENT),
    ],
};

const GUIDANCE_SCHEMA: SectionSchema = SectionSchema {
    prefix: "guidance",
    known: &["path", "retention", "reset_on_rerun"],
    ignored: &[],
};

const OUTPUT_SCHEMA: SectionSchema = SectionSchema {
    prefix: "output",
    known: &["root", "run_name"],
    ignored: &[(
        "group_report",
        "group_report.jsonl is not written; selections.jsonl has the per-ticket rows",
    )],
};

const SAMPLER_SCHEMA: SectionSchema = SectionSchema {
    prefix: "sampler",
    known: &["grid", "samples_per_decode", "constrained"],
    ignored: &[],
};

const GRID_ENTRY_SCHEMA: SectionSchema = SectionSchema {
    prefix: "sampler.grid[]",
    known: &[
        "temperature",
        "top_p",
        "max_new_tokens",
        "repetition_penalty",
    ],
    ignored: &[
        ("no_repeat_ngram_size", "the sampler has no n-gram blocking"),
        (
            "seed",
            "stageb derives a seed per candidate from (seed, epoch, ticket, decode index, sample index)",
        ),
        (
            "stop",
            "the two-line contract ends every candidate; no stop strings are applied",
        ),
    ],
};

const REFLECTION_SCHEMA: SectionSchema = SectionSchema {
    prefix: "reflection",
    known: &[
        "decision_prompt_path",
        "ops_prompt_path",
        "batch_size",
        "max_operations",
        "change_cap_per_epoch",
        "temperature",
        "top_p",
        "repetition_penalty",
        "max_new_tokens",
        "max_reflection_length",
        "token_budget",
        "retry_budget_per_group_per_epoch",
        "max_calls_per_epoch",
    ],
    ignored: &[
        ("allow_uncertain", LEGACY_UNUSED),
        ("eligibility_policy", LEGACY_UNUSED),
        ("all_wrong_strategy", LEGACY_UNUSED),
        ("hypothesis_min_support_cycles", NO_HYPOTHESIS_POOL),
        ("hypothesis_min_unique_ticket_keys", NO_HYPOTHESIS_POOL),
    ],
};

const SELECTION_SCHEMA: SectionSchema = SectionSchema {
    prefix: "selection",
    known: &["policy", "tie_break"],
    ignored: &[],
};

const MANUAL_REVIEW_SCHEMA: SectionSchema = SectionSchema {
    prefix: "manual_review",
    known: &["min_verdict_agreement"],
    ignored: &[],
};

const RUNNER_SCHEMA: SectionSchema = SectionSchema {
    prefix: "runner",
    known: &[
        "epochs",
        "per_rank_rollout_batch_size",
        "logging_steps",
        "lease_ttl_s",
        "heartbeat_interval_s",
        "speculation_multiple",
        "speculation_min_ms",
    ],
    ignored: &[],
};

const LIFECYCLE_SCHEMA: SectionSchema = SectionSchema {
    prefix: "guidance_lifecycle",
    known: &[
        "confidence_drop_threshold",
        "min_miss_before_drop",
        "enable_auto_cleanup",
    ],
    ignored: &[],
};

/// The section is ignored as a whole (one notice at the top level), but a misspelled key in
/// it is still a misspelling.
const DISTILLATION_SCHEMA: SectionSchema = SectionSchema {
    prefix: "stage_b_distillation",
    known: &["enabled", "log_chatml_path"],
    ignored: &[],
};

const ALL_SCHEMAS: [&SectionSchema; 12] = [
    &TOP_SCHEMA,
    &MODEL_SCHEMA,
    &GUIDANCE_SCHEMA,
    &OUTPUT_SCHEMA,
    &SAMPLER_SCHEMA,
    &GRID_ENTRY_SCHEMA,
    &REFLECTION_SCHEMA,
    &SELECTION_SCHEMA,
    &MANUAL_REVIEW_SCHEMA,
    &RUNNER_SCHEMA,
    &LIFECYCLE_SCHEMA,
    &DISTILLATION_SCHEMA,
];

/// The schema of a mapping-valued top-level key.
fn section_schema(top_key: &str) -> Option<&'static SectionSchema> {
    Some(match top_key {
        "model" => &MODEL_SCHEMA,
        "guidance" => &GUIDANCE_SCHEMA,
        "output" => &OUTPUT_SCHEMA,
        "sampler" => &SAMPLER_SCHEMA,
        "reflection" => &REFLECTION_SCHEMA,
        "selection" => &SELECTION_SCHEMA,
        "manual_review" => &MANUAL_REVIEW_SCHEMA,
        "runner" => &RUNNER_SCHEMA,
        "guidance_lifecycle" => &LIFECYCLE_SCHEMA,
        "stage_b_distillation" => &DISTILLATION_SCHEMA,
        _ => return None,
    })
}

/// The closest known key to `unknown`, as a full dotted path. Keys of the same section win;
/// a key of another section is suggested only when its name is (nearly) the same, which
/// catches keys put in the wrong section (`logging_steps` at the top level).
fn suggest(unknown: &str, here: &[Seg], schema: &SectionSchema) -> Option<String> {
    const SAME_SECTION_MIN: f64 = 0.6;
    const OTHER_SECTION_MIN: f64 = 0.85;
    let similarity = |candidate: &str| {
        let edit = strsim::normalized_damerau_levenshtein(unknown, candidate);
        // A key that is a part of the real one (`rollout_batch_size` in
        // `per_rank_rollout_batch_size`) is a likely intent whatever the edit distance says.
        let (short, long) = if unknown.len() <= candidate.len() {
            (unknown, candidate)
        } else {
            (candidate, unknown)
        };
        if short.len() >= 4 && long.contains(short) {
            edit.max(0.75)
        } else {
            edit
        }
    };
    let mut best: Option<(f64, String)> = None;
    let mut consider = |score: f64, path: String| {
        if best
            .as_ref()
            .is_none_or(|(best_score, _)| score > *best_score)
        {
            best = Some((score, path));
        }
    };
    for candidate in schema
        .known
        .iter()
        .chain(schema.ignored.iter().map(|(key, _)| key))
    {
        let score = similarity(candidate);
        if score >= SAME_SECTION_MIN {
            consider(score + 0.1, dotted_with(here, candidate));
        }
    }
    for other in ALL_SCHEMAS
        .iter()
        .filter(|other| other.prefix != schema.prefix)
    {
        for candidate in other
            .known
            .iter()
            .chain(other.ignored.iter().map(|(key, _)| key))
        {
            let score = similarity(candidate);
            if score >= OTHER_SECTION_MIN {
                let path = if other.prefix.is_empty() {
                    candidate.to_string()
                } else {
                    format!("{}.{candidate}", other.prefix)
                };
                consider(score, path);
            }
        }
    }
    best.map(|(_, path)| path)
}

// ---------------------------------------------------------------------------------------------
// Paths into the document and line lookup
// ---------------------------------------------------------------------------------------------

/// One step of a path into the YAML document.
#[derive(Debug, Clone)]
enum Seg {
    Key(String),
    Index(usize),
}

fn dotted(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(key) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Seg::Index(index) => out.push_str(&format!("[{index}]")),
        }
    }
    out
}

fn dotted_with(path: &[Seg], key: &str) -> String {
    let mut full = path.to_vec();
    full.push(Seg::Key(key.to_string()));
    dotted(&full)
}

/// The text a mapping key is matched and shown by (keys that are not strings included).
fn key_text(key: &Value) -> String {
    match key {
        Value::String(text) => text.clone(),
        Value::Number(number) => number.to_string(),
        Value::Bool(flag) => flag.to_string(),
        Value::Null => "null".to_string(),
        Value::Sequence(_) | Value::Mapping(_) | Value::Tagged(_) => "<complex key>".to_string(),
    }
}

/// Marker carried by the probe's error; no real serde_norway message contains a NUL.
const PROBE_HIT: &str = "\u{0}stageb-config-probe-hit";

/// 1-based line of the node at `path` (the key itself for a key, the item for an index), or
/// `None` when the path cannot be followed in the raw event stream. See the module header.
/// The line of a config key (`section.key`) in the config's text, for errors found after
/// parsing (a value the model cannot honour). `None` when the key is not written there.
pub fn key_line(text: &str, dotted_key: &str) -> Option<usize> {
    let path: Vec<Seg> = dotted_key
        .split('.')
        .map(|k| Seg::Key(k.to_string()))
        .collect();
    probe_line(text, &path)
}

fn probe_line(text: &str, path: &[Seg]) -> Option<usize> {
    let deserializer = serde_norway::Deserializer::from_str(text);
    match (Probe { path }).deserialize(deserializer) {
        Ok(()) => None,
        Err(err) if err.to_string().contains(PROBE_HIT) => err.location().map(|loc| loc.line()),
        Err(_) => None,
    }
}

fn probe_hit<E: de::Error>() -> E {
    E::custom(PROBE_HIT)
}

/// Walks to `path`; fails with [`PROBE_HIT`] while deserializing the target node.
struct Probe<'p> {
    path: &'p [Seg],
}

impl Probe<'_> {
    /// A scalar: the target if the path ends here, otherwise the path does not exist.
    fn scalar<E: de::Error>(self) -> Result<(), E> {
        if self.path.is_empty() {
            Err(probe_hit())
        } else {
            Ok(())
        }
    }
}

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any YAML node")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.scalar()
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_i128<E: de::Error>(self, _: i128) -> Result<(), E> {
        self.scalar()
    }
    fn visit_u128<E: de::Error>(self, _: u128) -> Result<(), E> {
        self.scalar()
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.scalar()
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.scalar()
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.scalar()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        match self.path.split_first() {
            None => Err(probe_hit()),
            Some((Seg::Index(target), rest)) => {
                let mut index = 0;
                loop {
                    let more = if index == *target {
                        seq.next_element_seed(Probe { path: rest })?.is_some()
                    } else {
                        seq.next_element::<IgnoredAny>()?.is_some()
                    };
                    if !more {
                        return Ok(());
                    }
                    index += 1;
                }
            }
            Some((Seg::Key(_), _)) => {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(())
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        match self.path.split_first() {
            None => Err(probe_hit()),
            Some((Seg::Key(target), rest)) => {
                while let Some(matched) = map.next_key_seed(KeyProbe {
                    target,
                    hit_on_match: rest.is_empty(),
                })? {
                    if matched {
                        map.next_value_seed(Probe { path: rest })?;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(())
            }
            Some((Seg::Index(_), _)) => {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(())
            }
        }
    }
}

/// Deserializes one mapping key: `Ok(true)` when it is the target (and the walk goes on),
/// the marker error when it is the target and the walk ends at this key.
struct KeyProbe<'t> {
    target: &'t str,
    hit_on_match: bool,
}

impl KeyProbe<'_> {
    fn compare<E: de::Error>(self, key: &str) -> Result<bool, E> {
        match (key == self.target, self.hit_on_match) {
            (true, true) => Err(probe_hit()),
            (matched, _) => Ok(matched),
        }
    }
}

impl<'de> DeserializeSeed<'de> for KeyProbe<'_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for KeyProbe<'_> {
    type Value = bool;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a mapping key")
    }

    fn visit_bool<E: de::Error>(self, key: bool) -> Result<bool, E> {
        self.compare(&key.to_string())
    }
    fn visit_i64<E: de::Error>(self, key: i64) -> Result<bool, E> {
        self.compare(&key.to_string())
    }
    fn visit_u64<E: de::Error>(self, key: u64) -> Result<bool, E> {
        self.compare(&key.to_string())
    }
    fn visit_f64<E: de::Error>(self, key: f64) -> Result<bool, E> {
        self.compare(&serde_norway::Number::from(key).to_string())
    }
    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        self.compare(key)
    }
    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        self.compare("null")
    }
    fn visit_none<E: de::Error>(self) -> Result<bool, E> {
        self.compare("null")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(false)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(false)
    }
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

/// The document being validated: its text (for line probes), label and collected notices.
struct Doc<'t> {
    text: &'t str,
    file: &'t str,
    notices: Vec<ConfigNotice>,
}

impl Doc<'_> {
    /// Line of `path`, else of the nearest enclosing node that the probe can find.
    fn line_of(&self, path: &[Seg]) -> usize {
        (0..=path.len())
            .rev()
            .find_map(|len| probe_line(self.text, &path[..len]))
            .unwrap_or(1)
    }

    fn error(&self, code: ErrorCode, path: &[Seg], message: impl Into<String>) -> InputError {
        InputError::new(code, self.file, Some(self.line_of(path)), message)
    }

    /// Pass 1: every key of `map` (a mapping at `path` described by `schema`) is known or
    /// ignored; recurses into sub-sections and grid entries. Ignored keys become notices.
    fn check_keys(
        &mut self,
        map: &Mapping,
        path: &[Seg],
        schema: &SectionSchema,
    ) -> Result<(), InputError> {
        for (key, value) in map {
            let name = key_text(key);
            let mut key_path = path.to_vec();
            key_path.push(Seg::Key(name.clone()));
            let is_string_key = matches!(key, Value::String(_));
            if is_string_key && schema.known.contains(&name.as_str()) {
                self.check_nested_keys(&name, value, &key_path, schema)?;
            } else if let Some((_, why)) = schema
                .ignored
                .iter()
                .find(|(ignored, _)| is_string_key && *ignored == name)
            {
                self.notices.push(ConfigNotice {
                    code: ErrorCode::UnsupportedConfigKey,
                    file: self.file.to_string(),
                    key: dotted(&key_path),
                    line: self.line_of(&key_path),
                    message: format!("accepted but ignored: {why}"),
                });
                // Ignored sections are still spell-checked.
                self.check_nested_keys(&name, value, &key_path, schema)?;
            } else {
                let message = match suggest(&name, path, schema) {
                    Some(suggestion) => {
                        format!(
                            "unknown key `{}`; did you mean `{suggestion}`?",
                            dotted(&key_path)
                        )
                    }
                    None => format!(
                        "unknown key `{}`; the keys allowed here are: {}",
                        dotted(&key_path),
                        schema.known.join(", ")
                    ),
                };
                return Err(self.error(ErrorCode::UnknownConfigKey, &key_path, message));
            }
        }
        Ok(())
    }

    /// Descends into the value of `name` when it is a section or the grid. Values of the
    /// wrong shape are left to pass 2, which reports them with their type.
    fn check_nested_keys(
        &mut self,
        name: &str,
        value: &Value,
        key_path: &[Seg],
        schema: &SectionSchema,
    ) -> Result<(), InputError> {
        let nested_schema = if schema.prefix.is_empty() {
            section_schema(name)
        } else if schema.prefix == "sampler" && name == "grid" {
            if let Value::Sequence(entries) = value {
                for (index, entry) in entries.iter().enumerate() {
                    if let Value::Mapping(entry_map) = entry {
                        let mut entry_path = key_path.to_vec();
                        entry_path.push(Seg::Index(index));
                        self.check_keys(entry_map, &entry_path, &GRID_ENTRY_SCHEMA)?;
                    }
                }
            }
            None
        } else {
            None
        };
        if let (Some(nested_schema), Value::Mapping(nested)) = (nested_schema, value) {
            self.check_keys(nested, key_path, nested_schema)?;
        }
        Ok(())
    }
}

/// A mapping at a known path, with typed accessors that report located errors.
struct Section<'v> {
    path: Vec<Seg>,
    map: &'v Mapping,
}

/// Range rules for floats.
#[derive(Clone, Copy)]
enum FloatRule {
    /// ≥ 0.
    NonNegative,
    /// > 0.
    Positive,
    /// In [0, 1].
    UnitClosed,
    /// In (0, 1].
    UnitOpenBelow,
}

impl FloatRule {
    fn admits(self, value: f64) -> bool {
        match self {
            FloatRule::NonNegative => value >= 0.0,
            FloatRule::Positive => value > 0.0,
            FloatRule::UnitClosed => (0.0..=1.0).contains(&value),
            FloatRule::UnitOpenBelow => value > 0.0 && value <= 1.0,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            FloatRule::NonNegative => "a number >= 0",
            FloatRule::Positive => "a number > 0",
            FloatRule::UnitClosed => "a number between 0 and 1",
            FloatRule::UnitOpenBelow => "a number > 0 and <= 1",
        }
    }
}

/// How a value was written, for error messages.
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(flag) => format!("boolean {flag}"),
        Value::Number(number) if number.is_f64() => format!("float {number}"),
        Value::Number(number) => format!("integer {number}"),
        Value::String(text) => format!("string {text:?}"),
        Value::Sequence(_) => "a list".to_string(),
        Value::Mapping(_) => "a mapping".to_string(),
        Value::Tagged(tagged) => format!("a value tagged {}", tagged.tag),
    }
}

impl<'v> Section<'v> {
    fn key_path(&self, key: &str) -> Vec<Seg> {
        let mut path = self.path.clone();
        path.push(Seg::Key(key.to_string()));
        path
    }

    fn name(&self, key: &str) -> String {
        dotted(&self.key_path(key))
    }

    fn get(&self, key: &str) -> Option<&'v Value> {
        self.map.get(key)
    }

    fn missing(&self, doc: &Doc, key: &str) -> InputError {
        let container = if self.path.is_empty() {
            "the config".to_string()
        } else {
            format!("`{}`", dotted(&self.path))
        };
        doc.error(
            ErrorCode::MissingConfigKey,
            &self.path,
            format!("missing required key `{}` in {container}", self.name(key)),
        )
    }

    fn invalid(&self, doc: &Doc, key: &str, message: String) -> InputError {
        doc.error(
            ErrorCode::InvalidConfigValue,
            &self.key_path(key),
            format!("`{}` {message}", self.name(key)),
        )
    }

    fn required(&self, doc: &Doc, key: &str) -> Result<&'v Value, InputError> {
        self.get(key).ok_or_else(|| self.missing(doc, key))
    }

    /// An integer in `[min, max]`.
    fn int_value(
        &self,
        doc: &Doc,
        key: &str,
        value: &Value,
        min: u64,
        max: u64,
    ) -> Result<u64, InputError> {
        let out_of_range = || {
            let bound = if max == u64::from(u32::MAX) || max == u64::MAX {
                format!("an integer >= {min}")
            } else {
                format!("an integer between {min} and {max}")
            };
            self.invalid(
                doc,
                key,
                format!("must be {bound}, got {}", describe(value)),
            )
        };
        match value {
            Value::Number(number) if !number.is_f64() => match number.as_u64() {
                Some(parsed) if (min..=max).contains(&parsed) => Ok(parsed),
                _ => Err(out_of_range()),
            },
            other => Err(self.invalid(
                doc,
                key,
                format!("must be an integer, got {}", describe(other)),
            )),
        }
    }

    fn req_u32(&self, doc: &Doc, key: &str, min: u32) -> Result<u32, InputError> {
        let value = self.required(doc, key)?;
        self.int_value(doc, key, value, u64::from(min), u64::from(u32::MAX))
            .map(narrow_u32)
    }

    fn opt_u32(&self, doc: &Doc, key: &str, default: u32, min: u32) -> Result<u32, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => self
                .int_value(doc, key, value, u64::from(min), u64::from(u32::MAX))
                .map(narrow_u32),
        }
    }

    /// Nullable integer (`null` or absent → `None`).
    fn nullable_u32(&self, doc: &Doc, key: &str, min: u32) -> Result<Option<u32>, InputError> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => self
                .int_value(doc, key, value, u64::from(min), u64::from(u32::MAX))
                .map(|v| Some(narrow_u32(v))),
        }
    }

    fn opt_u64(&self, doc: &Doc, key: &str, default: u64, min: u64) -> Result<u64, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => self.int_value(doc, key, value, min, u64::MAX),
        }
    }

    fn float_value(
        &self,
        doc: &Doc,
        key: &str,
        value: &Value,
        rule: FloatRule,
    ) -> Result<f64, InputError> {
        let parsed = match value {
            Value::Number(number) => number.as_f64(),
            _ => None,
        };
        match parsed {
            Some(parsed) if parsed.is_finite() && rule.admits(parsed) => Ok(parsed),
            Some(_) => Err(self.invalid(
                doc,
                key,
                format!("must be {}, got {}", rule.describe(), describe(value)),
            )),
            None => Err(self.invalid(
                doc,
                key,
                format!("must be a number, got {}", describe(value)),
            )),
        }
    }

    fn req_float(&self, doc: &Doc, key: &str, rule: FloatRule) -> Result<f64, InputError> {
        let value = self.required(doc, key)?;
        self.float_value(doc, key, value, rule)
    }

    fn opt_float(
        &self,
        doc: &Doc,
        key: &str,
        default: f64,
        rule: FloatRule,
    ) -> Result<f64, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => self.float_value(doc, key, value, rule),
        }
    }

    fn opt_bool(&self, doc: &Doc, key: &str, default: bool) -> Result<bool, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(flag)) => Ok(*flag),
            Some(other) => Err(self.invalid(
                doc,
                key,
                format!("must be true or false, got {}", describe(other)),
            )),
        }
    }

    fn string_value(&self, doc: &Doc, key: &str, value: &Value) -> Result<String, InputError> {
        match value {
            Value::String(text) if !text.trim().is_empty() => Ok(text.clone()),
            Value::String(_) => Err(self.invalid(doc, key, "must not be empty".to_string())),
            other => Err(self.invalid(
                doc,
                key,
                format!("must be a string, got {}", describe(other)),
            )),
        }
    }

    fn req_string(&self, doc: &Doc, key: &str) -> Result<String, InputError> {
        let value = self.required(doc, key)?;
        self.string_value(doc, key, value)
    }

    /// Optional path (`null` or absent → `None`).
    fn nullable_path(&self, doc: &Doc, key: &str) -> Result<Option<PathBuf>, InputError> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => self
                .string_value(doc, key, value)
                .map(|text| Some(PathBuf::from(text))),
        }
    }

    /// A nested section. `Ok(None)` when absent or `null`.
    fn section(&self, doc: &Doc, key: &str) -> Result<Option<Section<'v>>, InputError> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Mapping(map)) => Ok(Some(Section {
                path: self.key_path(key),
                map,
            })),
            Some(other) => Err(self.invalid(
                doc,
                key,
                format!("must be a mapping of keys, got {}", describe(other)),
            )),
        }
    }

    fn req_section(&self, doc: &Doc, key: &str) -> Result<Section<'v>, InputError> {
        self.section(doc, key)?
            .ok_or_else(|| self.missing(doc, key))
    }
}

/// Values were range-checked against `u32::MAX` before narrowing.
fn narrow_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

/// f64 → f32 for decode parameters; the values are range-checked small numbers.
fn to_f32(value: f64) -> f32 {
    value as f32
}

/// Pass 2: typed values, required keys, ranges.
fn build_run_config(doc: &Doc, top: &Section) -> Result<RunConfig, InputError> {
    let seed = {
        let value = top.required(doc, "seed")?;
        top.int_value(doc, "seed", value, 0, u64::MAX)?
    };
    let stage_a_paths = build_stage_a_paths(doc, top)?;

    let model_section = top.req_section(doc, "model")?;
    let model = ModelConfig {
        model_name_or_path: model_section.req_string(doc, "model_name_or_path")?,
        max_model_len: model_section.nullable_u32(doc, "max_model_len", MIN_MODEL_LEN)?,
    };

    let guidance_section = top.req_section(doc, "guidance")?;
    let guidance = GuidanceConfig {
        path: PathBuf::from(guidance_section.req_string(doc, "path")?),
        retention: guidance_section.req_u32(doc, "retention", 1)?,
        reset_on_rerun: guidance_section.opt_bool(doc, "reset_on_rerun", true)?,
    };

    let output_section = top.req_section(doc, "output")?;
    let output = OutputConfig {
        root: PathBuf::from(output_section.req_string(doc, "root")?),
        run_name: build_run_name(doc, &output_section)?,
    };

    let sampler = build_sampler(doc, &top.req_section(doc, "sampler")?)?;
    let reflection = build_reflection(doc, &top.req_section(doc, "reflection")?)?;
    let selection = build_selection(doc, &top.req_section(doc, "selection")?)?;

    let manual_review = match top.section(doc, "manual_review")? {
        Some(section) => ManualReviewConfig {
            min_verdict_agreement: section.opt_float(
                doc,
                "min_verdict_agreement",
                0.8,
                FloatRule::UnitClosed,
            )?,
        },
        None => ManualReviewConfig {
            min_verdict_agreement: 0.8,
        },
    };

    let runner = build_runner(doc, &top.req_section(doc, "runner")?)?;

    let guidance_lifecycle = match top.section(doc, "guidance_lifecycle")? {
        Some(section) => Some(LifecycleConfig {
            confidence_drop_threshold: section.opt_float(
                doc,
                "confidence_drop_threshold",
                0.35,
                FloatRule::UnitClosed,
            )?,
            min_miss_before_drop: section.opt_u32(doc, "min_miss_before_drop", 3, 0)?,
            enable_auto_cleanup: section.opt_bool(doc, "enable_auto_cleanup", true)?,
        }),
        None => None,
    };

    // The ignored distillation section must at least be a mapping (or null) to be a config
    // of the original at all.
    top.section(doc, "stage_b_distillation")?;

    Ok(RunConfig {
        seed,
        stage_a_paths,
        model,
        guidance,
        output,
        sampler,
        reflection,
        selection,
        manual_review,
        runner,
        guidance_lifecycle,
    })
}

fn build_stage_a_paths(doc: &Doc, top: &Section) -> Result<Vec<PathBuf>, InputError> {
    const KEY: &str = "stage_a_paths";
    match top.required(doc, KEY)? {
        Value::String(_) => Ok(vec![PathBuf::from(top.req_string(doc, KEY)?)]),
        Value::Sequence(items) if items.is_empty() => Err(top.invalid(
            doc,
            KEY,
            "must list at least one Stage-A JSONL file".to_string(),
        )),
        Value::Sequence(items) => items
            .iter()
            .enumerate()
            .map(|(index, item)| match item {
                Value::String(text) if !text.trim().is_empty() => Ok(PathBuf::from(text)),
                other => {
                    let mut item_path = top.key_path(KEY);
                    item_path.push(Seg::Index(index));
                    Err(doc.error(
                        ErrorCode::InvalidConfigValue,
                        &item_path,
                        format!(
                            "`{}` must be a non-empty path string, got {}",
                            dotted(&item_path),
                            describe(other)
                        ),
                    ))
                }
            })
            .collect(),
        other => Err(top.invalid(
            doc,
            KEY,
            format!("must be a path or a list of paths, got {}", describe(other)),
        )),
    }
}

/// `run_name` names a directory under `output.root`: one plain component, so a run can never
/// write outside its root.
fn build_run_name(doc: &Doc, output: &Section) -> Result<String, InputError> {
    let run_name = output.req_string(doc, "run_name")?;
    let plain = run_name != "." && run_name != ".." && !run_name.contains(['/', '\\', '\0']);
    if plain {
        Ok(run_name)
    } else {
        Err(output.invalid(
            doc,
            "run_name",
            format!(
                "must be a single directory name (no `/`, `\\`, `.` or `..`), got {run_name:?}"
            ),
        ))
    }
}

fn build_sampler(doc: &Doc, sampler: &Section) -> Result<SamplerConfig, InputError> {
    let grid = match sampler.required(doc, "grid")? {
        Value::Sequence(entries) if entries.is_empty() => {
            return Err(sampler.invalid(doc, "grid", "must have at least one entry".to_string()));
        }
        Value::Sequence(entries) => {
            // Constrained rollouts need room for the forced `Verdict: …\nReason: ` prefix, one
            // reason character and the end token (the engine refuses less at run time; say it
            // here, with the line).
            let constrained = sampler.opt_bool(doc, "constrained", true)?;
            let min_new_tokens = if constrained {
                MIN_CONSTRAINED_NEW_TOKENS
            } else {
                1
            };
            let mut grid = Vec::with_capacity(entries.len());
            for (index, entry) in entries.iter().enumerate() {
                let mut entry_path = sampler.key_path("grid");
                entry_path.push(Seg::Index(index));
                let Value::Mapping(map) = entry else {
                    return Err(doc.error(
                        ErrorCode::InvalidConfigValue,
                        &entry_path,
                        format!(
                            "`{}` must be a mapping (temperature, top_p, max_new_tokens, ...), got {}",
                            dotted(&entry_path),
                            describe(entry)
                        ),
                    ));
                };
                let entry = Section {
                    path: entry_path,
                    map,
                };
                grid.push(GridEntry {
                    temperature: to_f32(entry.req_float(
                        doc,
                        "temperature",
                        FloatRule::NonNegative,
                    )?),
                    top_p: to_f32(entry.req_float(doc, "top_p", FloatRule::UnitOpenBelow)?),
                    max_new_tokens: entry.req_u32(doc, "max_new_tokens", min_new_tokens)?,
                    repetition_penalty: to_f32(entry.opt_float(
                        doc,
                        "repetition_penalty",
                        1.0,
                        FloatRule::Positive,
                    )?),
                });
            }
            grid
        }
        other => {
            return Err(sampler.invalid(
                doc,
                "grid",
                format!("must be a list of decode entries, got {}", describe(other)),
            ));
        }
    };
    let samples_per_decode = sampler.req_u32(doc, "samples_per_decode", 1)?;
    let total_fits = u32::try_from(grid.len())
        .ok()
        .and_then(|len| len.checked_mul(samples_per_decode))
        .is_some();
    if !total_fits {
        return Err(sampler.invalid(
            doc,
            "samples_per_decode",
            format!(
                "times {} grid entries is too many candidates per ticket",
                grid.len()
            ),
        ));
    }
    Ok(SamplerConfig {
        grid,
        samples_per_decode,
        constrained: sampler.opt_bool(doc, "constrained", true)?,
    })
}

fn build_reflection(doc: &Doc, reflection: &Section) -> Result<ReflectionConfig, InputError> {
    let max_reflection_length = reflection.opt_u32(doc, "max_reflection_length", 4096, 1)?;
    Ok(ReflectionConfig {
        decision_prompt_path: reflection.nullable_path(doc, "decision_prompt_path")?,
        ops_prompt_path: reflection.nullable_path(doc, "ops_prompt_path")?,
        batch_size: reflection.req_u32(doc, "batch_size", 1)?,
        max_operations: reflection.nullable_u32(doc, "max_operations", 1)?,
        change_cap_per_epoch: reflection.nullable_u32(doc, "change_cap_per_epoch", 1)?,
        temperature: to_f32(reflection.opt_float(
            doc,
            "temperature",
            1.0,
            FloatRule::NonNegative,
        )?),
        top_p: to_f32(reflection.opt_float(doc, "top_p", 0.95, FloatRule::UnitOpenBelow)?),
        repetition_penalty: to_f32(reflection.opt_float(
            doc,
            "repetition_penalty",
            1.0,
            FloatRule::Positive,
        )?),
        max_new_tokens: reflection.opt_u32(doc, "max_new_tokens", 1024, 1)?,
        max_reflection_length,
        token_budget: reflection.opt_u32(doc, "token_budget", max_reflection_length, 1)?,
        retry_budget_per_group_per_epoch: reflection.opt_u32(
            doc,
            "retry_budget_per_group_per_epoch",
            2,
            0,
        )?,
        max_calls_per_epoch: reflection.nullable_u32(doc, "max_calls_per_epoch", 1)?,
    })
}

fn build_selection(doc: &Doc, selection: &Section) -> Result<SelectionConfig, InputError> {
    let policy = match selection.req_string(doc, "policy")?.as_str() {
        "top_label" => SelectionPolicy::TopLabel,
        "top_semantic" => {
            return Err(selection.invalid(
                doc,
                "policy",
                "value `top_semantic` is not implemented by stageb; use `top_label` (majority vote, ties to fail)".to_string(),
            ));
        }
        other => {
            return Err(selection.invalid(
                doc,
                "policy",
                format!("must be `top_label`, got {other:?}"),
            ));
        }
    };
    let tie_break = match selection.req_string(doc, "tie_break")?.as_str() {
        "temperature" => TieBreak::Temperature,
        other => {
            return Err(selection.invalid(
                doc,
                "tie_break",
                format!("must be `temperature`, got {other:?}"),
            ));
        }
    };
    Ok(SelectionConfig { policy, tie_break })
}

fn build_runner(doc: &Doc, runner: &Section) -> Result<RunnerConfig, InputError> {
    let config = RunnerConfig {
        epochs: runner.req_u32(doc, "epochs", 1)?,
        per_rank_rollout_batch_size: runner.opt_u32(doc, "per_rank_rollout_batch_size", 1, 1)?,
        logging_steps: runner.opt_u32(doc, "logging_steps", 256, 1)?,
        lease_ttl_s: runner.opt_u64(doc, "lease_ttl_s", 60, 1)?,
        heartbeat_interval_s: runner.opt_u64(doc, "heartbeat_interval_s", 5, 1)?,
        speculation_multiple: runner.opt_u32(
            doc,
            "speculation_multiple",
            default_speculation_multiple(),
            0,
        )?,
        speculation_min_ms: runner.opt_u64(
            doc,
            "speculation_min_ms",
            default_speculation_min_ms(),
            0,
        )?,
    };
    if config.heartbeat_interval_s >= config.lease_ttl_s {
        // Point at whichever of the two the user wrote (the heartbeat if both).
        let key = if runner.get("heartbeat_interval_s").is_some() {
            "heartbeat_interval_s"
        } else {
            "lease_ttl_s"
        };
        return Err(runner.invalid(
            doc,
            key,
            format!(
                "must keep runner.heartbeat_interval_s ({}) below runner.lease_ttl_s ({}), or leases expire between heartbeats",
                config.heartbeat_interval_s, config.lease_ttl_s
            ),
        ));
    }
    Ok(config)
}
