//! Valid configs: the original's production config loads with the expected notices, the
//! defaults of the original's table apply, and the resolved config serializes.

use stageb_shared::config::{
    ConfigNotice, LoadedConfig, RunConfig, SelectionPolicy, TieBreak, load_config, parse_config,
    resolve_config_path,
};
use stageb_shared::domain::DecodeSpec;
use stageb_shared::error::ErrorCode;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/config")
        .join(name)
}

fn load(name: &str) -> LoadedConfig {
    load_config(&fixture(name)).unwrap_or_else(|err| panic!("{name} should load: {err}"))
}

fn notice_keys_and_lines(notices: &[ConfigNotice]) -> Vec<(&str, usize)> {
    notices
        .iter()
        .map(|notice| (notice.key.as_str(), notice.line))
        .collect()
}

#[test]
fn production_config_of_the_original_loads_with_notices_for_unimplemented_keys() {
    let loaded = load("bbu_line.yaml");
    let config = &loaded.config;

    assert_eq!(config.seed, 17);
    assert_eq!(
        config.stage_a_paths,
        vec![PathBuf::from("output_post/stage_a/bbu_line.jsonl")]
    );
    assert_eq!(
        config.model.model_name_or_path,
        "models/SmolLM2-135M-Instruct-Q4_1.gguf"
    );
    assert_eq!(
        config.guidance.path,
        PathBuf::from("output_post/stage_b/initial_guidance.json")
    );
    assert_eq!(config.guidance.retention, 5);
    assert!(config.guidance.reset_on_rerun);
    assert_eq!(config.output.root, PathBuf::from("output_post/stage_b"));
    assert_eq!(config.output.run_name, "12-18");
    assert_eq!(config.sampler.samples_per_decode, 1);
    assert!(
        config.sampler.constrained,
        "constrained decoding is on by default"
    );
    assert_eq!(config.candidates_per_ticket(), 3);
    let temperatures: Vec<f32> = config
        .sampler
        .grid
        .iter()
        .map(|entry| entry.temperature)
        .collect();
    assert_eq!(temperatures, vec![0.1, 0.4, 0.7]);
    assert_eq!(
        config.sampler.decode_specs()[2],
        DecodeSpec {
            temperature: 0.7,
            top_p: 0.9,
            max_new_tokens: 1024,
            repetition_penalty: 1.05
        }
    );

    let reflection = &config.reflection;
    assert_eq!(
        reflection.decision_prompt_path.as_deref(),
        Some(Path::new(
            "configs/prompts/stage_b_reflection_decision_prompt.txt"
        ))
    );
    assert_eq!(reflection.batch_size, 16);
    assert_eq!(reflection.max_operations, Some(2));
    assert_eq!(reflection.change_cap_per_epoch, None);
    assert_eq!(reflection.temperature, 0.1);
    assert_eq!(reflection.max_new_tokens, 12000);
    assert_eq!(reflection.max_reflection_length, 24000);
    assert_eq!(reflection.token_budget, 24000);
    assert_eq!(reflection.retry_budget_per_group_per_epoch, 2);
    assert_eq!(reflection.max_calls_per_epoch, None);

    assert_eq!(config.selection.policy, SelectionPolicy::TopLabel);
    assert_eq!(config.selection.tie_break, TieBreak::Temperature);
    assert_eq!(config.manual_review.min_verdict_agreement, 0.67);
    assert_eq!(config.runner.epochs, 3);
    assert_eq!(config.runner.per_rank_rollout_batch_size, 4);
    assert_eq!(config.runner.logging_steps, 64);
    assert_eq!(config.runner.lease_ttl_s, 60);
    assert_eq!(config.runner.heartbeat_interval_s, 5);
    let lifecycle = config.guidance_lifecycle.as_ref().expect("section present");
    assert_eq!(lifecycle.confidence_drop_threshold, 0.35);
    assert_eq!(lifecycle.min_miss_before_drop, 3);
    assert!(lifecycle.enable_auto_cleanup);

    assert_eq!(
        notice_keys_and_lines(&loaded.notices),
        vec![
            ("default_domain", 6),
            ("model.torch_dtype", 9),
            ("model.device_map", 10),
            ("model.attn_implementation", 11),
            ("output.group_report", 19),
            ("sampler.grid[0].seed", 23),
            ("sampler.grid[0].stop", 23),
            ("sampler.grid[1].seed", 24),
            ("sampler.grid[1].stop", 24),
            ("sampler.grid[2].seed", 25),
            ("sampler.grid[2].stop", 25),
            ("stage_b_distillation", 46),
        ]
    );
    for notice in &loaded.notices {
        assert_eq!(notice.code, ErrorCode::UnsupportedConfigKey);
        assert!(
            notice.message.starts_with("accepted but ignored: "),
            "{notice}"
        );
        assert!(notice.file.ends_with("bbu_line.yaml"));
    }
    let shown = loaded.notices[0].to_string();
    assert!(
        shown.contains("bbu_line.yaml:6: `default_domain` accepted but ignored"),
        "{shown}"
    );
    assert!(shown.ends_with("[E_UNSUPPORTED_CONFIG_KEY]"), "{shown}");
}

#[test]
fn source_digest_is_the_sha256_of_the_file_bytes() {
    let loaded = load("bbu_line.yaml");
    let bytes = std::fs::read(fixture("bbu_line.yaml")).unwrap();
    assert_eq!(
        loaded.source_text_sha256,
        stageb_shared::digest::sha256_hex(&bytes)
    );
    assert_eq!(loaded.source_text_sha256.len(), 64);
}

#[test]
fn minimal_config_gets_the_documented_defaults() {
    let loaded = load("minimal.yaml");
    assert!(loaded.notices.is_empty());
    let config = loaded.config;
    assert_eq!(
        config.stage_a_paths,
        vec![PathBuf::from("data/stage_a.jsonl")],
        "a single string is one path"
    );
    // Reuse of a previous run's guidance is opt-in (`reset_on_rerun: false`); absent, a rerun
    // reseeds, which is also what the original actually did (it wiped the run directory).
    assert!(config.guidance.reset_on_rerun);
    assert_eq!(config.sampler.grid[0].repetition_penalty, 1.0);
    assert_eq!(config.candidates_per_ticket(), 2);
    assert_eq!(
        config.reflection.decision_prompt_path, None,
        "absent prompt paths select the built-in prompts"
    );
    assert_eq!(config.reflection.ops_prompt_path, None);
    assert_eq!(config.reflection.max_operations, None);
    assert_eq!(config.reflection.temperature, 1.0);
    assert_eq!(config.reflection.top_p, 0.95);
    assert_eq!(config.reflection.repetition_penalty, 1.0);
    assert_eq!(config.reflection.max_new_tokens, 1024);
    assert_eq!(config.reflection.max_reflection_length, 4096);
    assert_eq!(
        config.reflection.token_budget, 4096,
        "token_budget defaults to max_reflection_length"
    );
    assert_eq!(config.reflection.retry_budget_per_group_per_epoch, 2);
    assert_eq!(
        config.manual_review.min_verdict_agreement, 0.8,
        "the section is optional"
    );
    assert_eq!(config.runner.per_rank_rollout_batch_size, 1);
    assert_eq!(config.runner.logging_steps, 256);
    assert_eq!(config.guidance_lifecycle, None);
}

#[test]
fn stageb_additions_are_read() {
    let text = std::fs::read_to_string(fixture("minimal.yaml")).unwrap()
        + "  lease_ttl_s: 30\n  heartbeat_interval_s: 3\n"
        + "guidance_lifecycle: {}\n";
    let text = text.replace(
        "  samples_per_decode: 2\n",
        "  samples_per_decode: 2\n  constrained: false\n",
    );
    let digest = "AB".repeat(32);
    let text = text.replace(
        "  model_name_or_path: models/model.gguf\n",
        &format!("  model_name_or_path: models/model.gguf\n  weights_sha256: {digest}\n"),
    );
    let config = parse_config(&text, "inline.yaml").unwrap().config;
    assert_eq!(
        config.model.weights_sha256.as_deref(),
        Some("ab".repeat(32).as_str()),
        "kept lowercase, as fingerprints write it"
    );
    assert!(!config.sampler.constrained);
    assert_eq!(config.runner.lease_ttl_s, 30);
    assert_eq!(config.runner.heartbeat_interval_s, 3);
    let lifecycle = config
        .guidance_lifecycle
        .expect("an empty section takes the defaults");
    assert_eq!(lifecycle.confidence_drop_threshold, 0.35);
}

#[test]
fn resolved_config_serializes_and_reads_back() {
    let config = load("bbu_line.yaml").config;
    let json = serde_json::to_value(&config).unwrap();
    assert_eq!(json["selection"]["policy"], "top_label");
    assert_eq!(json["selection"]["tie_break"], "temperature");
    assert_eq!(
        json["stage_a_paths"][0],
        "output_post/stage_a/bbu_line.jsonl"
    );
    assert_eq!(
        json["sampler"]["grid"][1]["temperature"],
        serde_json::json!(0.4f32)
    );
    let back: RunConfig = serde_json::from_value(json).unwrap();
    assert_eq!(back, config);
}

#[test]
fn notices_serialize_with_the_string_code() {
    let loaded = load("bbu_line.yaml");
    let json = serde_json::to_value(&loaded.notices[0]).unwrap();
    assert_eq!(json["code"], "E_UNSUPPORTED_CONFIG_KEY");
    assert_eq!(json["key"], "default_domain");
    assert_eq!(json["line"], 6);
}

#[test]
fn paths_stay_as_written_and_resolve_on_request() {
    let config = load("bbu_line.yaml").config;
    assert!(config.output.root.is_relative());
    let resolved = config.with_paths_resolved(Path::new("/srv/qc"));
    assert_eq!(
        resolved.output.root,
        PathBuf::from("/srv/qc/output_post/stage_b")
    );
    assert_eq!(
        resolved.stage_a_paths[0],
        PathBuf::from("/srv/qc/output_post/stage_a/bbu_line.jsonl")
    );
    assert_eq!(
        resolved.reflection.ops_prompt_path,
        Some(PathBuf::from(
            "/srv/qc/configs/prompts/stage_b_reflection_ops_prompt.txt"
        ))
    );
    assert_eq!(
        resolved.model.model_name_or_path, config.model.model_name_or_path,
        "may be a name, not a path"
    );
    assert_eq!(
        resolve_config_path(Path::new("/abs/x"), Path::new("/srv")),
        PathBuf::from("/abs/x")
    );
    // What a run records: the resolved config's values with the paths as written.
    assert_eq!(resolved.with_paths_of(&config), config);
    assert_eq!(config.with_paths_of(&resolved), resolved);
}

#[test]
fn attn_impl_alias_and_legacy_reflection_keys_are_notices() {
    let text = std::fs::read_to_string(fixture("minimal.yaml"))
        .unwrap()
        .replace(
            "  model_name_or_path: models/model.gguf\n",
            "  model_name_or_path: models/model.gguf\n  attn_impl: flash_attn\n",
        )
        .replace(
            "  batch_size: 4\n",
            "  batch_size: 4\n  allow_uncertain: false\n  hypothesis_min_support_cycles: 2\n",
        );
    let loaded = parse_config(&text, "inline.yaml").unwrap();
    assert_eq!(
        notice_keys_and_lines(&loaded.notices),
        vec![
            ("model.attn_impl", 6),
            ("reflection.allow_uncertain", 21),
            ("reflection.hypothesis_min_support_cycles", 22)
        ]
    );
}
