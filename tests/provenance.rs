//! Provenance of failure rows (issue 8, item 6): a malformed candidate's
//! `failure_malformed.jsonl` row carries the same `epoch_step`, `guidance_step` and
//! `guidance_hash` as its ticket's selection row, so a failure can be placed in the guidance
//! history like any decision. The raw text (special tokens included) is kept as generated.

use crate::support;

use serde_json::json;
use stageb_coordinator::artifacts::files;
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use support::{ScriptedEngine, ScriptedMission, ScriptedRun, assert_audit_ok, read_jsonl};

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
fn regression_issue8_failure_rows_carry_the_provenance_of_selections() {
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
