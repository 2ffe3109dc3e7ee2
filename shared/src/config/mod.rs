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
//!   [`ConfigNotice`]s ([`ErrorCode::UnsupportedConfigKey`], `accepted but ignored: <why>`):
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
//! - `runner.no_progress_multiple` (default 8, 0 turns it off) and
//!   `runner.no_progress_floor_ms` (default 120000): when rank 0 revokes a lease whose
//!   progress stands still.
//! - `runner.pipeline_steps` (0..=16): queue the next steps' rollouts while the current
//!   step's reflection runs.
//! - `runner.pipeline_cycles` (0..=16): queue the next reflection cycles' calls while a cycle
//!   runs. Both default by the device the workers compute on (`tuning.rs`): unset, they are 0
//!   here and rank 0 gives them their device's values when it starts. A missing key that
//!   changes the model's maths is an error; these change no artifact byte, so they default.
//! - `model.weights_sha256` (64 hex digits): the weights every worker must have, for a rank 0
//!   that cannot read the model.
//!
//! # Paths
//! Paths are kept exactly as written. Like the original, relative paths mean "relative to
//! the current working directory"; resolving them is the caller's decision, with
//! [`resolve_config_path`] / [`RunConfig::with_paths_resolved`] as the helpers. A run keeps
//! both: the resolved config to open files with, and the paths as written to record
//! ([`RunConfig::with_paths_of`]), so the same config run from two checkouts records the same
//! manifest. Prompt files are not read here (the caller checks they exist and are non-empty).
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
//!
//! # Files
//! - `mod.rs`: [`load_config`] / [`parse_config`], the two passes in order, and the re-exports.
//! - `types.rs`: the run-time types ([`RunConfig`] and its sections, [`ConfigNotice`],
//!   [`LoadedConfig`]) and [`resolve_config_path`].
//! - `schema.rs`: the keys of each section and pass 1, the unknown/ignored-key check with its
//!   "did you mean" suggestions.
//! - `location.rs`: paths into the document, the line probe ([`key_line`]) and `Doc`, which
//!   turns a path into a located error.
//! - `section.rs`: `Section`, typed accessors on one mapping (integers, floats and their range
//!   rules, booleans, strings, paths, nested sections).
//! - `build.rs`: pass 2, the checked mapping into a [`RunConfig`] section by section, with
//!   defaults, ranges and the cross-key rules.
//! - `tuning.rs`: the settings that default by device (`--max-jobs`, `runner.pipeline_*`):
//!   the table of defaults and the record of the values in force ([`Tuning`]).

mod build;
mod location;
mod schema;
mod section;
mod tuning;
mod types;

pub use build::parse_weights_sha256;
pub use location::key_line;
pub use tuning::{DeviceDefaults, DeviceKind, Origin, Tuned, Tuning};
pub use types::{
    ConfigNotice, GateConfig, GridEntry, GuidanceConfig, LifecycleConfig, LoadedConfig,
    MIN_CONSTRAINED_NEW_TOKENS, MIN_MODEL_LEN, ManualReviewConfig, ModelConfig, OutputConfig,
    ReflectionConfig, RunConfig, RunnerConfig, SamplerConfig, SelectionConfig, SelectionPolicy,
    TieBreak, WrittenTuning, resolve_config_path,
};

use crate::digest::sha256_hex;
use crate::error::{ErrorCode, InputError};
use build::build_run_config;
use location::Doc;
use schema::TOP_SCHEMA;
use section::{Section, describe};
use serde_norway::Value;
use std::path::Path;

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

/// The YAML scanner places the end of a text without a final newline on the line after it; an
/// error there names the last line the text has.
fn last_line_at_most(text: &str, line: usize) -> usize {
    line.min(text.matches('\n').count() + 1)
}

/// Validate config text; `file_label` names the source in errors and notices.
pub fn parse_config(text: &str, file_label: &str) -> Result<LoadedConfig, InputError> {
    let mut root: Value = serde_norway::from_str(text).map_err(|err| {
        InputError::new(
            ErrorCode::InvalidYaml,
            file_label,
            err.location()
                .map(|loc| last_line_at_most(text, loc.line())),
            format!("invalid YAML: {err}"),
        )
    })?;
    root.apply_merge().map_err(|err| {
        InputError::new(
            ErrorCode::InvalidYaml,
            file_label,
            err.location()
                .map(|loc| last_line_at_most(text, loc.line())),
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
