//! Provenance of failure rows: a malformed candidate's
//! `failure_malformed.jsonl` row carries the same `epoch_step`, `guidance_step` and
//! `guidance_hash` as its ticket's selection row, so a failure can be placed in the guidance
//! history like any decision. The raw text (special tokens included) is kept as generated.

use crate::support;

use std::path::{Path, PathBuf};

use serde_json::json;
use stageb::roles;
use stageb_coordinator::artifacts::files;
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use support::missions::{base_config, merge};
use support::{
    Script, ScriptedEngine, ScriptedMission, ScriptedRun, assert_audit_ok, coordinator_settings,
    read_json, read_jsonl, run_prepared, write_toy_mission,
};

/// The scripted engine, except that the first candidate of every rollout starts with special
/// tokens (a chat-template echo) that the contract does not allow.
struct SpecialTokenEngine(ScriptedEngine);

impl Engine for SpecialTokenEngine {
    fn fingerprint(&self) -> &ModelFingerprint {
        self.0.fingerprint()
    }

    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        let mut out = self.0.rollout(request)?;
        if let Some(c) = out.candidates.first_mut() {
            c.text = format!("<|im_start|>assistant\n{}", c.text);
        }
        Ok(out)
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.0.generate(request)
    }
}

#[test]
fn regression_failure_rows_carry_the_provenance_of_selections() {
    let ScriptedRun { run_dir, .. } = ScriptedMission::toy()
        .quiet()
        .run_with(json!({"runner": {"epochs": 2}}), |script, _| {
            SpecialTokenEngine(ScriptedEngine::new(script))
        });
    let failures = read_jsonl(&run_dir, files::FAILURE_MALFORMED);
    let selections = read_jsonl(&run_dir, files::SELECTIONS);
    assert!(!failures.is_empty());
    for f in &failures {
        assert!(
            f["raw_text"]
                .as_str()
                .unwrap()
                .starts_with("<|im_start|>assistant\n")
        );
        let sel = selections
            .iter()
            .find(|s| s["epoch"] == f["epoch"] && s["ticket_key"] == f["ticket_key"])
            .expect("the ticket's selection row");
        for field in ["epoch_step", "guidance_hash"] {
            assert!(!f[field].is_null(), "{field} missing: {f}");
            assert_eq!(f[field], sel[field], "{field}");
        }
        assert_eq!(f["guidance_step"], sel["result"]["guidance_step"]);
    }
    // Guidance changed between epochs, so the provenance is not trivially constant.
    let steps: std::collections::BTreeSet<String> = failures
        .iter()
        .map(|f| f["guidance_hash"].to_string())
        .collect();
    assert!(steps.len() > 1, "{steps:?}");
    assert_audit_ok(&run_dir);
}

/// A checkout holding the toy mission and a config naming it as users write configs: relative
/// to the working directory (the checkout). Returns the config's path.
fn checkout_with_relative_config(dir: &Path) -> PathBuf {
    write_toy_mission(dir);
    let mut config = base_config(dir);
    merge(
        &mut config,
        json!({
            "stage_a_paths": ["stage_a.jsonl"],
            "guidance": {"path": "guidance.json"},
            "output": {"root": "runs"},
        }),
    );
    let path = dir.join("config.yaml");
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    path
}

/// `manifest.json` without its `runtime` object (when the run started and ended, its workers).
fn manifest_but_runtime(run_dir: &Path) -> serde_json::Value {
    let mut manifest = read_json(run_dir, files::MANIFEST);
    manifest.as_object_mut().unwrap().remove("runtime");
    manifest
}

#[test]
fn the_same_config_run_from_two_checkouts_records_the_same_manifest() {
    let checkouts = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let run_dirs: Vec<PathBuf> = checkouts
        .iter()
        .map(|checkout| {
            let config = checkout_with_relative_config(checkout.path());
            // Run from the checkout: its relative paths resolve there.
            let inputs =
                roles::prepare_inputs_in(&config, "embedded", checkout.path()).expect("inputs");
            let script = Script::new(Default::default());
            let summary = run_prepared(
                inputs,
                1,
                move |_| ScriptedEngine::new(script.clone()),
                coordinator_settings(roles::StartMode::Fresh),
                std::future::pending(),
            )
            .expect("the run completes");
            assert!(
                summary.run_dir.starts_with(checkout.path()),
                "runs where run"
            );
            summary.run_dir
        })
        .collect();
    let (a, b) = (
        manifest_but_runtime(&run_dirs[0]),
        manifest_but_runtime(&run_dirs[1]),
    );
    assert!(
        a == b,
        "the manifests differ at {}",
        stageb_inspect::compare::first_difference(&a, &b, String::new()).unwrap_or_default()
    );
    // The inputs are named as the config wrote them, not where this checkout put them.
    assert_eq!(a["config_path"], "config.yaml");
    assert_eq!(a["config"]["stage_a_paths"], json!(["stage_a.jsonl"]));
    assert_eq!(a["config"]["guidance"]["path"], "guidance.json");
    assert_eq!(a["config"]["output"]["root"], "runs");
    assert_eq!(a["input_digests"][0]["path"], "stage_a.jsonl");
    assert_eq!(a["guidance"]["source"], "guidance.json");
    // And compared the way `scripts/compare-runs.py` compares runs, they are the same run.
    support::compare::assert_same_artifacts(&run_dirs[0], &run_dirs[1]);
    for dir in &run_dirs {
        assert_audit_ok(dir);
    }
}

#[test]
fn a_run_from_another_checkout_resumes_and_still_sees_a_changed_ticket() {
    let first = tempfile::tempdir().unwrap();
    let config = checkout_with_relative_config(first.path());
    let run = |base: &Path, mode| {
        let inputs = roles::prepare_inputs_in(&config, "embedded", base)?;
        let script = Script::new(Default::default());
        run_prepared(
            inputs,
            1,
            move |_| ScriptedEngine::new(script.clone()),
            coordinator_settings(mode),
            std::future::pending(),
        )
    };
    let done = run(first.path(), roles::StartMode::Fresh).expect("the run completes");
    // The checkout moved (same files, another directory): the run is still the same run.
    let moved = tempfile::tempdir().unwrap();
    let moved_root = moved.path().join("checkout");
    std::fs::rename(first.path(), &moved_root).unwrap();
    std::fs::create_dir(first.path()).unwrap();
    let config = moved_root.join("config.yaml");
    let run = |mode| {
        let inputs = roles::prepare_inputs_in(&config, "embedded", &moved_root)?;
        let script = Script::new(Default::default());
        run_prepared(
            inputs,
            1,
            move |_| ScriptedEngine::new(script.clone()),
            coordinator_settings(mode),
            std::future::pending(),
        )
    };
    let resumed = run(roles::StartMode::Resume).expect("the moved run resumes");
    assert_eq!(resumed.candidates, done.candidates);
    // A ticket edited in place is another input: the resume is refused by the tickets' digest.
    let stage_a = moved_root.join("stage_a.jsonl");
    let text = std::fs::read_to_string(&stage_a).unwrap();
    std::fs::write(&stage_a, text.replacen("QC-TOY-P0", "QC-TOY-PX", 1)).unwrap();
    let refused = run(roles::StartMode::Resume).expect_err("a changed ticket is seen");
    let message = refused.to_string();
    assert!(
        message.contains("E_RESUME_MISMATCH") && message.contains("tickets"),
        "{message}"
    );
}
