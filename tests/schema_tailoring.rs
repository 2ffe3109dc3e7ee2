//! The reflection schemas rank 0 tailors per batch (ids restricted to the batch's ticket keys,
//! rule keys to existing `G` keys, `G0` never offered for delete or merge-away) compile into
//! llguidance constraints over the real model's vocabulary, with and without removable rules.

use crate::support;

use std::collections::BTreeSet;

use stageb_coordinator::guidance::{GuidanceRepo, RepoOptions};
use stageb_coordinator::learn::reflection::{tailor_decision_schema, tailor_ops_schema};
use stageb_shared::domain::TicketKey;
use stageb_worker::constraint::ConstraintSpec;
use stageb_worker::engine::{EngineOptions, ModelEngine};
use support::real_model;

fn repo(dir: &std::path::Path, experiences: serde_json::Value) -> GuidanceRepo {
    std::fs::create_dir_all(dir).unwrap();
    let global = dir.join("global.json");
    let doc = serde_json::json!({"挡风板安装检查": {"step": 1, "updated_at": "2026-01-01T00:00:00+00:00", "experiences": experiences}});
    std::fs::write(&global, serde_json::to_vec(&doc).unwrap()).unwrap();
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    GuidanceRepo::create(&global, "挡风板安装检查", &run, RepoOptions::default()).unwrap()
}

#[test]
fn tailored_reflection_schemas_compile_for_the_real_vocabulary() {
    let engine = ModelEngine::load(&real_model(), &EngineOptions::default()).unwrap();
    let factory = engine.constraint_factory().unwrap();
    let batch: BTreeSet<TicketKey> = ["QC-1::fail", "QC-2::pass"]
        .iter()
        .map(|k| TicketKey(k.to_string()))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let with_rules = repo(
        &dir.path().join("a"),
        serde_json::json!({"S1": "只看挡风板", "G0": "检查挡风板", "G1": "若缺失则不通过"}),
    );
    let only_g0 = repo(
        &dir.path().join("b"),
        serde_json::json!({"S1": "只看挡风板", "G0": "检查挡风板"}),
    );
    for schema in [
        tailor_decision_schema(&batch, 320),
        tailor_ops_schema(3, &batch, &with_rules, 320, false),
        tailor_ops_schema(3, &batch, &only_g0, 320, false),
    ] {
        factory
            .build(&ConstraintSpec::JsonSchema(schema.clone()))
            .unwrap_or_else(|e| panic!("{e}: {schema}"));
    }
    // With only G0, delete and merge are not offered at all.
    let ops = tailor_ops_schema(3, &batch, &only_g0, 320, false).to_string();
    assert!(
        !ops.contains("\"delete\"") && !ops.contains("\"merge\""),
        "{ops}"
    );
}
