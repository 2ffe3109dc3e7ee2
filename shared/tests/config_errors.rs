//! Bad configs: every error has a stable code, the file and the line, and says what to do.

use stageb_shared::config::{load_config, parse_config};
use stageb_shared::error::{ErrorCode, InputError};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/config")
        .join(name)
}

fn load_err(name: &str) -> InputError {
    match load_config(&fixture(name)) {
        Ok(_) => panic!("{name} should be rejected"),
        Err(err) => {
            assert!(err.file.ends_with(name), "error names the file: {err}");
            err
        }
    }
}

/// `minimal.yaml` with one textual replacement, parsed inline.
fn minimal_with(from: &str, to: &str) -> Result<stageb_shared::config::LoadedConfig, InputError> {
    let text = std::fs::read_to_string(fixture("minimal.yaml")).unwrap();
    assert!(
        text.contains(from),
        "test setup: {from:?} not in minimal.yaml"
    );
    parse_config(&text.replacen(from, to, 1), "inline.yaml")
}

fn inline_err(from: &str, to: &str) -> InputError {
    minimal_with(from, to).expect_err("should be rejected")
}

#[test]
fn smoke_config_rollout_batch_size_is_unknown_with_a_suggestion() {
    let err = load_err("smoke_rollout_batch_size.yaml");
    assert_eq!(err.code, ErrorCode::UnknownConfigKey);
    assert_eq!(err.line, Some(26));
    assert!(
        err.message.contains("`runner.rollout_batch_size`"),
        "{}",
        err.message
    );
    assert!(
        err.message
            .contains("did you mean `runner.per_rank_rollout_batch_size`?"),
        "{}",
        err.message
    );
    assert!(err.to_string().ends_with("[E_UNKNOWN_CONFIG_KEY]"), "{err}");
}

#[test]
fn misspelled_key_in_a_block_grid_entry() {
    let err = load_err("grid_misspelled_key.yaml");
    assert_eq!(err.code, ErrorCode::UnknownConfigKey);
    assert_eq!(err.line, Some(17));
    assert!(
        err.message.contains("`sampler.grid[1].temperatur`"),
        "{}",
        err.message
    );
    assert!(
        err.message
            .contains("did you mean `sampler.grid[1].temperature`?"),
        "{}",
        err.message
    );
}

#[test]
fn misspelled_key_in_a_flow_grid_entry() {
    let err = load_err("grid_misspelled_flow_key.yaml");
    assert_eq!(err.code, ErrorCode::UnknownConfigKey);
    assert_eq!(err.line, Some(16));
    assert!(
        err.message
            .contains("did you mean `sampler.grid[1].top_p`?"),
        "{}",
        err.message
    );
}

#[test]
fn key_in_the_wrong_section_suggests_the_right_one() {
    let err = inline_err("seed: 0\n", "seed: 0\nlogging_steps: 64\n");
    assert_eq!(err.code, ErrorCode::UnknownConfigKey);
    assert_eq!(err.line, Some(3));
    assert!(
        err.message.contains("did you mean `runner.logging_steps`?"),
        "{}",
        err.message
    );
}

#[test]
fn unknown_key_without_a_close_match_lists_the_allowed_keys() {
    let err = inline_err("  epochs: 1\n", "  epochs: 1\n  zzz: 1\n");
    assert_eq!(err.code, ErrorCode::UnknownConfigKey);
    assert_eq!(err.line, Some(25));
    assert!(
        err.message
            .contains("the keys allowed here are: epochs, per_rank_rollout_batch_size"),
        "{}",
        err.message
    );
}

#[test]
fn unknown_key_is_reported_before_the_missing_key_it_causes() {
    let err = inline_err("  epochs: 1\n", "  epoch: 1\n");
    assert_eq!(err.code, ErrorCode::UnknownConfigKey);
    assert_eq!(err.line, Some(24));
    assert!(
        err.message.contains("did you mean `runner.epochs`?"),
        "{}",
        err.message
    );
}

#[test]
fn misspelled_key_inside_an_ignored_section_is_still_unknown() {
    let err = inline_err(
        "seed: 0\n",
        "seed: 0\nstage_b_distillation: {enabeld: true}\n",
    );
    assert_eq!(err.code, ErrorCode::UnknownConfigKey);
    assert_eq!(err.line, Some(3));
    assert!(
        err.message
            .contains("did you mean `stage_b_distillation.enabled`?"),
        "{}",
        err.message
    );
}

#[test]
fn wrong_type_names_the_key_the_value_and_the_line() {
    let err = load_err("wrong_type_epochs.yaml");
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert_eq!(err.line, Some(26));
    assert!(
        err.message
            .contains("`runner.epochs` must be an integer, got string \"three\""),
        "{}",
        err.message
    );
}

#[test]
fn float_where_an_integer_is_required_is_rejected() {
    let err = inline_err("  epochs: 1\n", "  epochs: 1.5\n");
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert_eq!(err.line, Some(24));
}

#[test]
fn missing_required_key_points_at_its_section() {
    let err = load_err("missing_required_retention.yaml");
    assert_eq!(err.code, ErrorCode::MissingConfigKey);
    assert_eq!(err.line, Some(6));
    assert!(
        err.message
            .contains("missing required key `guidance.retention`"),
        "{}",
        err.message
    );
}

#[test]
fn missing_required_top_level_key_points_at_the_document() {
    let err = inline_err("seed: 0\n", "");
    assert_eq!(err.code, ErrorCode::MissingConfigKey);
    assert_eq!(err.line, Some(2), "the first line of the top-level mapping");
    assert!(err.message.contains("`seed`"), "{}", err.message);
}

#[test]
fn missing_required_section() {
    let err = inline_err("runner:\n  epochs: 1\n", "");
    assert_eq!(err.code, ErrorCode::MissingConfigKey);
    assert!(err.message.contains("`runner`"), "{}", err.message);
    assert!(err.line.is_some());
}

#[test]
fn min_verdict_agreement_above_one_is_out_of_range() {
    let err = load_err("min_agreement_out_of_range.yaml");
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert_eq!(err.line, Some(14));
    assert!(
        err.message.contains("between 0 and 1, got float 1.5"),
        "{}",
        err.message
    );
}

#[test]
fn zero_samples_per_decode_is_out_of_range() {
    let err = load_err("samples_per_decode_zero.yaml");
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert_eq!(err.line, Some(8));
    assert!(
        err.message
            .contains("`sampler.samples_per_decode` must be an integer >= 1, got integer 0"),
        "{}",
        err.message
    );
}

#[test]
fn other_ranges_of_the_original() {
    let cases = [
        ("  retention: 3\n", "  retention: 0\n", 8),
        (
            "  batch_size: 4\n",
            "  batch_size: 4\n  max_operations: 0\n",
            20,
        ),
        ("      top_p: 0.9\n", "      top_p: 0\n", 16),
        ("      top_p: 0.9\n", "      top_p: 1.01\n", 16),
        ("    - temperature: 0.7\n", "    - temperature: -0.1\n", 15),
        ("    - temperature: 0.7\n", "    - temperature: .nan\n", 15),
        ("  epochs: 1\n", "  epochs: 1\n  logging_steps: 0\n", 25),
        (
            "  epochs: 1\n",
            "  epochs: 1\n  heartbeat_interval_s: 60\n",
            25,
        ),
        ("seed: 0\n", "seed: -1\n", 2),
        ("  run_name: run1\n", "  run_name: ../escape\n", 11),
        (
            "stage_a_paths: data/stage_a.jsonl\n",
            "stage_a_paths: []\n",
            3,
        ),
        (
            "  grid:\n    - temperature: 0.7\n      top_p: 0.9\n      max_new_tokens: 64\n",
            "  grid: []\n",
            14,
        ),
    ];
    for (from, to, line) in cases {
        let err = inline_err(from, to);
        assert_eq!(err.code, ErrorCode::InvalidConfigValue, "{to:?}: {err}");
        assert_eq!(err.line, Some(line), "{to:?}: {err}");
    }
}

#[test]
fn null_is_accepted_only_where_the_original_allows_it() {
    let loaded = minimal_with(
        "  batch_size: 4\n",
        "  batch_size: 4\n  max_operations: null\n  ops_prompt_path: null\n",
    )
    .expect("nullable keys accept null");
    assert_eq!(loaded.config.reflection.max_operations, None);
    let err = inline_err("  epochs: 1\n", "  epochs: 1\n  logging_steps: null\n");
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert!(err.message.contains("got null"), "{}", err.message);
}

#[test]
fn invalid_yaml_reports_the_parser_line() {
    let err = load_err("invalid_yaml.yaml");
    assert_eq!(err.code, ErrorCode::InvalidYaml);
    assert_eq!(err.line, Some(8));
}

#[test]
fn duplicate_yaml_key_is_invalid_yaml() {
    let err = inline_err("  epochs: 1\n", "  epochs: 1\n  epochs: 2\n");
    assert_eq!(err.code, ErrorCode::InvalidYaml);
    assert!(err.line.is_some(), "{err}");
}

#[test]
fn top_semantic_is_named_as_not_implemented() {
    let err = load_err("top_semantic.yaml");
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert_eq!(err.line, Some(12));
    assert!(
        err.message.contains("`top_semantic` is not implemented"),
        "{}",
        err.message
    );
}

#[test]
fn unknown_tie_break_is_rejected() {
    let err = inline_err("  tie_break: temperature\n", "  tie_break: index\n");
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert_eq!(err.line, Some(22));
}

#[test]
fn top_level_must_be_a_mapping() {
    for text in ["", "- a\n- b\n", "just a string\n"] {
        let err = parse_config(text, "inline.yaml").expect_err("not a mapping");
        assert_eq!(err.code, ErrorCode::InvalidConfigValue, "{text:?}: {err}");
        assert!(err.line.is_some());
    }
}

#[test]
fn missing_file_and_non_utf8_file() {
    let err = load_config(Path::new("/nonexistent/stageb/config.yaml")).expect_err("missing");
    assert_eq!(err.code, ErrorCode::FileNotFound);
    assert_eq!(err.line, None);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("latin1.yaml");
    std::fs::write(&path, b"seed: 0\n# caf\xe9\n").unwrap();
    let err = load_config(&path).expect_err("not UTF-8");
    assert_eq!(err.code, ErrorCode::InvalidUtf8);
    assert_eq!(err.line, Some(2));
}

mod never_panics {
    use proptest::prelude::*;
    use stageb_shared::config::parse_config;
    use stageb_shared::error::ErrorCode;

    /// Lines mixing real keys, values and YAML punctuation, so inputs get past the YAML
    /// parser into key checks, typing and line probes.
    fn yamlish_text() -> impl Strategy<Value = String> {
        let line = prop_oneof![
            Just("seed: 1".to_string()),
            Just("stage_a_paths: [a.jsonl]".to_string()),
            Just("model: {model_name_or_path: m}".to_string()),
            Just("guidance: {path: g.json, retention: 2}".to_string()),
            Just("output: {root: o, run_name: r}".to_string()),
            Just("sampler:".to_string()),
            Just("  samples_per_decode: 1".to_string()),
            Just("  grid: [{temperature: 0.1, top_p: 0.9, max_new_tokens: 8}]".to_string()),
            Just("  grid:".to_string()),
            Just("    - {temperatur: 1, seed: null}".to_string()),
            Just("reflection: {batch_size: 1}".to_string()),
            Just("selection: {policy: top_label, tie_break: temperature}".to_string()),
            Just("runner: {epochs: 1}".to_string()),
            Just("runner:".to_string()),
            Just("  epochs: three".to_string()),
            Just("<<: *a".to_string()),
            Just("base: &a {epochs: 1}".to_string()),
            Just("? [complex]\n: key".to_string()),
            Just("1: 2".to_string()),
            Just("!tag x: y".to_string()),
            "[ -~]{0,12}".prop_map(|text| text),
        ];
        prop::collection::vec(line, 0..16).prop_map(|lines| lines.join("\n"))
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,256}") {
            let _ = parse_config(&text, "fuzz.yaml");
        }

        #[test]
        fn yamlish_text_never_panics_and_errors_have_lines(text in yamlish_text()) {
            if let Err(err) = parse_config(&text, "fuzz.yaml") {
                // serde_norway reports some syntax errors (an undefined alias) without a
                // location; every error stageb raises itself is located.
                if err.code != ErrorCode::InvalidYaml {
                    prop_assert!(err.line.is_some(), "{}", err);
                }
            }
        }
    }
}

/// A constrained rollout cannot fit the forced `Verdict: …\nReason: ` prefix, a reason and the
/// end token in fewer than 20 tokens: refused up front with the line, not at run time.
#[test]
fn constrained_max_new_tokens_below_the_minimum_is_refused_with_its_line() {
    let text = std::fs::read_to_string(fixture("minimal.yaml")).unwrap();
    let short = text.replace("max_new_tokens: 64", "max_new_tokens: 12");
    let err = stageb_shared::config::parse_config(&short, "short.yaml").unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert_eq!(err.line, Some(17), "{err}");
    assert!(err.message.contains(">= 20"), "{}", err.message);
    // Unconstrained decoding has no such floor.
    let free = short.replace("sampler:\n", "sampler:\n  constrained: false\n");
    assert!(stageb_shared::config::parse_config(&free, "free.yaml").is_ok());
}
