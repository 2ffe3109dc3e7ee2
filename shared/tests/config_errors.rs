//! Bad configs: every error has a stable code, the file and the line, and says what to do.
//! Each test is one spec: the input, the code, the line and what the message must say.

use crate::support;

use stageb_shared::config::{LoadedConfig, load_config, parse_config};
use stageb_shared::error::ErrorCode::{
    FileNotFound, InvalidConfigValue, InvalidUtf8, InvalidYaml, MissingConfigKey, UnknownConfigKey,
};
use stageb_shared::error::{ErrorCode, InputError};
use std::path::{Path, PathBuf};
use support::assert_error;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/config")
        .join(name)
}

/// The fixture `name` is rejected with `code` at `line`, naming the file and saying each of
/// `says`.
#[track_caller]
fn fixture_fails(name: &str, code: ErrorCode, line: usize, says: &[&str]) -> InputError {
    let err = load_config(&fixture(name)).expect_err("the fixture should be rejected");
    assert!(err.file.ends_with(name), "error names the file: {err}");
    assert_error(&err, code, Some(line), says);
    err
}

/// `minimal.yaml` with each `(from, to)` textual replacement made once, parsed inline.
fn minimal_with(edits: &[(&str, &str)]) -> Result<LoadedConfig, InputError> {
    let mut text = std::fs::read_to_string(fixture("minimal.yaml")).unwrap();
    for (from, to) in edits {
        assert!(
            text.contains(from),
            "test setup: {from:?} not in minimal.yaml"
        );
        text = text.replacen(from, to, 1);
    }
    parse_config(&text, "inline.yaml")
}

/// `minimal.yaml` with `from` replaced by `to` is rejected with `code` at `line`, saying each
/// of `says`.
#[track_caller]
fn edited_fails(from: &str, to: &str, code: ErrorCode, line: usize, says: &[&str]) {
    let err = minimal_with(&[(from, to)]).expect_err("the edited config should be rejected");
    assert_error(&err, code, Some(line), says);
}

/// The config text `text` is rejected with `code` at `line`.
#[track_caller]
fn text_fails(text: &str, code: ErrorCode, line: usize) {
    let err = parse_config(text, "inline.yaml").expect_err("the config should be rejected");
    assert_error(&err, code, Some(line), &[]);
}

#[test]
fn smoke_config_rollout_batch_size_is_unknown_with_a_suggestion() {
    let err = fixture_fails(
        "smoke_rollout_batch_size.yaml",
        UnknownConfigKey,
        26,
        &[
            "`runner.rollout_batch_size`",
            "did you mean `runner.per_rank_rollout_batch_size`?",
        ],
    );
    assert!(err.to_string().ends_with("[E_UNKNOWN_CONFIG_KEY]"), "{err}");
}

#[test]
fn misspelled_key_in_a_block_grid_entry() {
    fixture_fails(
        "grid_misspelled_key.yaml",
        UnknownConfigKey,
        17,
        &[
            "`sampler.grid[1].temperatur`",
            "did you mean `sampler.grid[1].temperature`?",
        ],
    );
}

#[test]
fn misspelled_key_in_a_flow_grid_entry() {
    fixture_fails(
        "grid_misspelled_flow_key.yaml",
        UnknownConfigKey,
        16,
        &["did you mean `sampler.grid[1].top_p`?"],
    );
}

#[test]
fn key_in_the_wrong_section_suggests_the_right_one() {
    edited_fails(
        "seed: 0\n",
        "seed: 0\nlogging_steps: 64\n",
        UnknownConfigKey,
        3,
        &["did you mean `runner.logging_steps`?"],
    );
}

#[test]
fn unknown_key_without_a_close_match_lists_the_allowed_keys() {
    edited_fails(
        "  epochs: 1\n",
        "  epochs: 1\n  zzz: 1\n",
        UnknownConfigKey,
        25,
        &["the keys allowed here are: epochs, per_rank_rollout_batch_size"],
    );
}

#[test]
fn unknown_key_is_reported_before_the_missing_key_it_causes() {
    edited_fails(
        "  epochs: 1\n",
        "  epoch: 1\n",
        UnknownConfigKey,
        24,
        &["did you mean `runner.epochs`?"],
    );
}

#[test]
fn misspelled_key_inside_an_ignored_section_is_still_unknown() {
    edited_fails(
        "seed: 0\n",
        "seed: 0\nstage_b_distillation: {enabeld: true}\n",
        UnknownConfigKey,
        3,
        &["did you mean `stage_b_distillation.enabled`?"],
    );
}

#[test]
fn wrong_type_names_the_key_the_value_and_the_line() {
    fixture_fails(
        "wrong_type_epochs.yaml",
        InvalidConfigValue,
        26,
        &["`runner.epochs` must be an integer, got string \"three\""],
    );
}

#[test]
fn float_where_an_integer_is_required_is_rejected() {
    edited_fails(
        "  epochs: 1\n",
        "  epochs: 1.5\n",
        InvalidConfigValue,
        24,
        &[],
    );
}

#[test]
fn a_weights_digest_that_is_not_64_hex_digits_is_rejected_at_its_line() {
    edited_fails(
        "  model_name_or_path: models/model.gguf\n",
        "  model_name_or_path: models/model.gguf\n  weights_sha256: abc123\n",
        InvalidConfigValue,
        6,
        &["`model.weights_sha256`", "64 hex digits", "\"abc123\""],
    );
}

#[test]
fn missing_required_key_points_at_its_section() {
    fixture_fails(
        "missing_required_retention.yaml",
        MissingConfigKey,
        6,
        &["missing required key `guidance.retention`"],
    );
}

#[test]
fn missing_required_top_level_key_points_at_the_document() {
    // Line 2: the first line of the top-level mapping.
    edited_fails("seed: 0\n", "", MissingConfigKey, 2, &["`seed`"]);
}

#[test]
fn missing_required_section() {
    edited_fails(
        "runner:\n  epochs: 1\n",
        "",
        MissingConfigKey,
        2,
        &["`runner`"],
    );
}

#[test]
fn min_verdict_agreement_above_one_is_out_of_range() {
    fixture_fails(
        "min_agreement_out_of_range.yaml",
        InvalidConfigValue,
        14,
        &["between 0 and 1, got float 1.5"],
    );
}

#[test]
fn zero_samples_per_decode_is_out_of_range() {
    fixture_fails(
        "samples_per_decode_zero.yaml",
        InvalidConfigValue,
        8,
        &["`sampler.samples_per_decode` must be an integer >= 1, got integer 0"],
    );
}

/// Regression: `samples_per_decode: 100000` passed `validate`, then the run aborted on
/// allocation. Candidates per ticket are capped (`wire::MAX_CANDIDATES_PER_JOB`).
#[test]
fn regression_samples_per_decode_100000_is_refused_at_its_line() {
    edited_fails(
        "  samples_per_decode: 2\n",
        "  samples_per_decode: 100000\n",
        InvalidConfigValue,
        13,
        &["candidates per ticket; at most 256"],
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
        edited_fails(from, to, InvalidConfigValue, line, &[]);
    }
}

#[test]
fn null_is_accepted_only_where_the_original_allows_it() {
    let loaded = minimal_with(&[(
        "  batch_size: 4\n",
        "  batch_size: 4\n  max_operations: null\n  ops_prompt_path: null\n",
    )])
    .expect("nullable keys accept null");
    assert_eq!(loaded.config.reflection.max_operations, None);
    edited_fails(
        "  epochs: 1\n",
        "  epochs: 1\n  logging_steps: null\n",
        InvalidConfigValue,
        25,
        &["got null"],
    );
}

#[test]
fn invalid_yaml_reports_the_parser_line() {
    fixture_fails("invalid_yaml.yaml", InvalidYaml, 8, &[]);
}

#[test]
fn duplicate_yaml_key_is_invalid_yaml() {
    // serde_norway locates a repeated key at the start of its mapping: line 24, `epochs: 1`.
    edited_fails(
        "  epochs: 1\n",
        "  epochs: 1\n  epochs: 2\n",
        InvalidYaml,
        24,
        &[],
    );
}

#[test]
fn top_semantic_is_named_as_not_implemented() {
    fixture_fails(
        "top_semantic.yaml",
        InvalidConfigValue,
        12,
        &["`top_semantic` is not implemented"],
    );
}

#[test]
fn unknown_tie_break_is_rejected() {
    edited_fails(
        "  tie_break: temperature\n",
        "  tie_break: index\n",
        InvalidConfigValue,
        22,
        &[],
    );
}

#[test]
fn top_level_must_be_a_mapping() {
    text_fails("", InvalidConfigValue, 1);
    text_fails("- a\n- b\n", InvalidConfigValue, 1);
    text_fails("just a string\n", InvalidConfigValue, 1);
}

#[test]
fn missing_file_and_non_utf8_file() {
    let err = load_config(Path::new("/nonexistent/stageb/config.yaml")).expect_err("missing");
    assert_error(&err, FileNotFound, None, &[]);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("latin1.yaml");
    std::fs::write(&path, b"seed: 0\n# caf\xe9\n").unwrap();
    let err = load_config(&path).expect_err("not UTF-8");
    assert_error(&err, InvalidUtf8, Some(2), &[]);
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
    let short = ("max_new_tokens: 64", "max_new_tokens: 12");
    edited_fails(short.0, short.1, InvalidConfigValue, 17, &[">= 20"]);
    // Unconstrained decoding has no such floor.
    let free = ("sampler:\n", "sampler:\n  constrained: false\n");
    assert!(minimal_with(&[short, free]).is_ok());
}

#[test]
fn an_unknown_key_in_reflection_gate_is_an_error_at_its_line() {
    edited_fails(
        "  batch_size: 4\n",
        "  batch_size: 4\n  gate:\n    enabled: true\n    tolerence: 0.01\n",
        UnknownConfigKey,
        22,
        &["`reflection.gate.tolerence`"],
    );
}

#[test]
fn gate_fractions_that_leave_no_train_split_are_refused_at_the_key() {
    edited_fails(
        "  batch_size: 4\n",
        "  batch_size: 4\n  gate:\n    enabled: true\n    gate_fraction: 0.5\n    final_fraction: 0.5\n",
        InvalidConfigValue,
        23,
        &["below 1"],
    );
}

#[test]
fn the_gate_is_off_unless_enabled_and_keeps_its_fractions() {
    let off = minimal_with(&[]).unwrap();
    assert!(!off.config.reflection.gate.enabled);
    let on = minimal_with(&[(
        "  batch_size: 4\n",
        "  batch_size: 4\n  gate: {enabled: true, final_fraction: 0.3}\n",
    )])
    .unwrap();
    let gate = on.config.reflection.gate;
    assert!(gate.enabled);
    assert_eq!((gate.gate_fraction, gate.final_fraction), (0.2, 0.3));
}

/// Found by the `config_yaml` fuzz target: a config that is one comment line without a final
/// newline was reported at line 2 of a one-line file (the scanner's end-of-text position).
#[test]
fn a_comment_only_config_without_a_final_newline_names_its_one_line() {
    let err = parse_config("# runner.epochs: three", "inline.yaml").expect_err("not a mapping");
    assert_eq!(err.code, ErrorCode::InvalidConfigValue);
    assert_eq!(err.line, Some(1), "{err}");
}

#[test]
fn invalid_yaml_at_the_end_of_a_text_without_a_final_newline_names_its_last_line() {
    // Found by the config_yaml fuzz target: the scanner's end-of-text position is the line
    // after the last one, and the error named a line the file does not have.
    let text = include_str!("../../fuzz/regressions/config_yaml-eof-line");
    let lines = text.matches('\n').count() + 1;
    let err = parse_config(text, "fuzzed.yaml").expect_err("the fuzzed config is invalid");
    let line = err.line.expect("a line");
    assert!(
        (1..=lines).contains(&line),
        "line {line} of a {lines}-line text: {err}"
    );
}
