//! The run-time config types: [`RunConfig`] and its sections, the notices of accepted but
//! ignored keys and the loaded config with its source digest. Plain values, serialized into
//! `manifest.json`; nothing here reads YAML.

use crate::domain::DecodeSpec;
use crate::error::ErrorCode;
use serde::{Deserialize, Serialize, Serializer};
use std::fmt;
use std::path::{Path, PathBuf};

/// Smallest `sampler.grid[].max_new_tokens` when `sampler.constrained` is on (the worker's
/// `MIN_CONSTRAINED_NEW_TOKENS`).
pub const MIN_CONSTRAINED_NEW_TOKENS: u32 = 20;

/// The validated run config. `Deserialize` exists to read the resolved copy back from
/// `manifest.json`; user YAML always goes through [`parse_config`](super::parse_config) /
/// [`load_config`](super::load_config).
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
    /// stageb addition: the sha256 of the model's weights (lowercase hex, as a worker logs it
    /// when its model is loaded), for a rank 0 whose host cannot read the model: every
    /// worker's weights must have it. `None`: rank 0 hashes `model_name_or_path` itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_sha256: Option<String>,
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
    /// Held-out splits (`reflection.gate`); off unless the config turns it on. Left out of
    /// the manifest's resolved config while off, so runs without it write the same bytes.
    #[serde(default, skip_serializing_if = "GateConfig::is_off")]
    pub gate: GateConfig,
}

/// `reflection.gate`: the mission's groups split, by a seeded ranking, into train (reflection
/// learns from them), gate and final (rolled out and decided like the others, never shown to
/// reflection; the final split is never selected on).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct GateConfig {
    pub enabled: bool,
    /// Share of the groups held out as the gate split, in [0, 1).
    pub gate_fraction: f64,
    /// Share of the groups held out as the final split, in [0, 1); with `gate_fraction` < 1.
    pub final_fraction: f64,
    /// Rejected edits remembered (shown to the ops pass as already rejected, refused when
    /// proposed again); 0 remembers none.
    pub remember_rejected: u32,
    /// Evaluate each cycle's validated edits on the gate split before applying them. This
    /// and the keys below read as off from a manifest written before they existed (as those
    /// runs behaved); a config always sets them.
    #[serde(default)]
    pub check_edits: bool,
    /// Gate accuracy a candidate may lose against its parent and still be applied, in [0, 1].
    #[serde(default)]
    pub tolerance: f64,
    /// Paired-bootstrap probability that the candidate is better on the gate split, needed
    /// to apply it, in [0, 1]; 0 leaves only the tolerance check.
    #[serde(default)]
    pub min_p_better: f64,
    /// Leave-one-rule-out on the gate split at the end of every N-th epoch; 0 never.
    #[serde(default)]
    pub ablation_every: u32,
}

impl GateConfig {
    pub fn is_off(&self) -> bool {
        !self.enabled
    }
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
    /// stageb addition: liveness by progress. A lease whose worker reports its progress and
    /// whose progress stands still longer than this multiple of the worker's longest recent
    /// stall (never less than `no_progress_floor_ms`) is revoked, and its job leased again.
    /// 0 turns it off. Default 8.
    #[serde(default = "default_no_progress_multiple")]
    pub no_progress_multiple: u32,
    /// stageb addition: the least time (milliseconds) a lease may make no progress before it
    /// is revoked, and the whole bound while the worker's pace is not known yet. Default
    /// 120000.
    #[serde(default = "default_no_progress_floor_ms")]
    pub no_progress_floor_ms: u64,
    /// stageb addition: steps whose rollouts are queued ahead, under the guidance of the
    /// moment, while the current step's reflection runs (0 to 16, never past the epoch's end;
    /// steps queued under a guidance that has changed are queued again at the next boundary).
    /// An answer is used only if its step's guidance is still the one it ran under, so
    /// artifacts never depend on it.
    /// Default by device ([`super::DeviceKind::defaults`]): 0 on the CPU, where on two cores
    /// with one worker it cost 6% of the demo's wall time (the reflection calls on the
    /// critical path share their steps with the queued rollouts; docs/PERFORMANCE.md); 1 on a
    /// GPU, whose capacity is to spare.
    #[serde(default = "default_pipeline_steps")]
    pub pipeline_steps: u32,
    /// stageb addition: reflection cycles whose model calls are queued ahead while a cycle
    /// runs (0 to 16): the next cycles' decision calls under the guidance of the moment, and
    /// the ops call of a cycle whose decision answer is already in. A call's answer is used
    /// only when the sequential loop asks for exactly the same job (prompt, seed and
    /// parameters), so artifacts never depend on it. Default by device
    /// ([`super::DeviceKind::defaults`]): 0 on the CPU, where with one worker on two cores the
    /// calls queued ahead share their steps with the call on the critical path; 4 on a GPU.
    #[serde(default = "default_pipeline_cycles")]
    pub pipeline_cycles: u32,
    /// Which of `pipeline_steps` / `pipeline_cycles` the file wrote: the others take the
    /// device's default when rank 0 starts ([`RunnerConfig::tune_for`]). Not serialized: the
    /// manifest records the values in force and where each came from (`runtime.tuning`).
    #[serde(skip)]
    pub written: WrittenTuning,
}

/// Which of the device-tuned `runner` keys the config file wrote (a key it did not write takes
/// its device's default when rank 0 starts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WrittenTuning {
    pub pipeline_steps: bool,
    pub pipeline_cycles: bool,
}

pub(super) fn default_pipeline_steps() -> u32 {
    0
}

pub(super) fn default_pipeline_cycles() -> u32 {
    0
}

pub(super) fn default_speculation_multiple() -> u32 {
    3
}

pub(super) fn default_speculation_min_ms() -> u64 {
    2000
}

pub(super) fn default_no_progress_multiple() -> u32 {
    8
}

pub(super) fn default_no_progress_floor_ms() -> u64 {
    120_000
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

    /// This config with the paths of `other` (the same config with its paths resolved or as
    /// written): the paths [`RunConfig::with_paths_resolved`] rewrites, and nothing else.
    pub fn with_paths_of(&self, other: &RunConfig) -> RunConfig {
        let mut out = self.clone();
        out.stage_a_paths.clone_from(&other.stage_a_paths);
        out.guidance.path.clone_from(&other.guidance.path);
        out.output.root.clone_from(&other.output.root);
        out.reflection
            .decision_prompt_path
            .clone_from(&other.reflection.decision_prompt_path);
        out.reflection
            .ops_prompt_path
            .clone_from(&other.reflection.ops_prompt_path);
        out
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
