//! The invariant checks of every fuzz target, one module each: `check(data)` runs one input
//! and panics where an invariant does not hold. The libFuzzer targets (`fuzz/fuzz_targets/`,
//! nightly) and the corpus replay of the stable test suite (`tests/fuzz_corpus.rs`, which
//! includes this folder by path) call the same functions, so CI checks every committed seed
//! and regression input on every run without the sanitizer build.

pub mod support;

pub mod checkpoint_load;
pub mod config_yaml;
pub mod contract_finisher;
pub mod contract_parse;
pub mod guidance_json;
pub mod journal_replay;
pub mod reflection_decision;
pub mod reflection_ops;
pub mod run_dir_audit;
pub mod seal_verify;
pub mod stage_a_ingest;
pub mod submit_validate;

/// A target's name (its folder under `fuzz/corpus/`) and its check.
pub type Target = (&'static str, fn(&[u8]));

/// Every target, by name.
pub const TARGETS: &[Target] = &[
    ("checkpoint_load", checkpoint_load::check),
    ("config_yaml", config_yaml::check),
    ("contract_finisher", contract_finisher::check),
    ("contract_parse", contract_parse::check),
    ("guidance_json", guidance_json::check),
    ("journal_replay", journal_replay::check),
    ("reflection_decision", reflection_decision::check),
    ("reflection_ops", reflection_ops::check),
    ("run_dir_audit", run_dir_audit::check),
    ("seal_verify", seal_verify::check),
    ("stage_a_ingest", stage_a_ingest::check),
    ("submit_validate", submit_validate::check),
];
