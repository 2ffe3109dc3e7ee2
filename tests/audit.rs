//! `stageb audit` catches what it claims to catch. A clean scripted run audits OK; each test
//! then tampers with one artifact the way a bug (or a hand edit) would, and the audit must name
//! the broken invariant. An audit that never fails would prove nothing.

use crate::support;

use std::sync::OnceLock;

use serde_json::{Value, json};
use stageb_coordinator::artifacts::files;
use support::{RunDir, ScriptedMission, ScriptedRun, audit_checks, copy_of_run, rewrite_jsonl};

/// A small clean run (toy mission, 2 epochs, reflection on), made once and copied per tamper
/// test.
fn clean_run() -> RunDir {
    static RUN: OnceLock<ScriptedRun> = OnceLock::new();
    let run = RUN.get_or_init(|| {
        let run = ScriptedMission::toy().run(json!({"runner": {"epochs": 2}}));
        let report = stageb_inspect::audit::audit(&run.run_dir);
        assert!(
            report.ok(),
            "the untouched run must audit clean: {:?}",
            report.violations
        );
        run
    });
    copy_of_run(&run.run_dir)
}

#[test]
fn a_ticket_selected_twice_is_caught() {
    let run = clean_run();
    rewrite_jsonl(&run.join(files::SELECTIONS), |rows| {
        let dup = rows[0].clone();
        rows.push(dup);
    });
    assert!(audit_checks(&run).contains(&"one_selection_per_ticket"));
}

#[test]
fn a_verdict_that_disagrees_with_its_raw_text_is_caught() {
    let run = clean_run();
    rewrite_jsonl(&run.join(files::TRAJECTORIES), |rows| {
        let r = &mut rows[0]["result"];
        let flipped = if r["verdict"] == "pass" {
            "fail"
        } else {
            "pass"
        };
        r["verdict"] = json!(flipped);
    });
    let found = audit_checks(&run);
    assert!(found.contains(&"trajectory_parse"), "{found:?}");
}

#[test]
fn metrics_that_do_not_follow_from_selections_are_caught() {
    let run = clean_run();
    rewrite_jsonl(&run.join(files::METRICS), |rows| {
        let row = rows.iter_mut().find(|r| r["event"] == "epoch_end").unwrap();
        row["include_manual_review"]["fp"] = json!(999);
    });
    assert!(audit_checks(&run).contains(&"metrics_recomputed"));
}

#[test]
fn a_torn_last_line_is_caught() {
    let run = clean_run();
    let path = run.join(files::SELECTIONS);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.extend_from_slice(b"{\"schema_version\":1,\"ticket");
    std::fs::write(&path, bytes).unwrap();
    let found = audit_checks(&run);
    assert!(
        found.contains(&"jsonl_framing") && found.contains(&"jsonl_parse"),
        "{found:?}"
    );
}

#[test]
fn evidence_outside_the_learnable_set_is_caught() {
    let run = clean_run();
    let mut tampered = false;
    rewrite_jsonl(&run.join(files::REFLECTION), |rows| {
        for row in rows.iter_mut() {
            if let Some(op) = row["applied_ops"]
                .as_array_mut()
                .and_then(|ops| ops.first_mut())
            {
                op["evidence"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("NOT-LEARNABLE::fail"));
                tampered = true;
                break;
            }
        }
    });
    assert!(
        tampered,
        "the clean run applied no op; the fixture must exercise reflection"
    );
    assert!(audit_checks(&run).contains(&"evidence_subset_of_learnable"));
}

#[test]
fn an_edited_scaffold_rule_or_guidance_chain_is_caught() {
    let run = clean_run();
    let path = run.join("guidance.json");
    let mut g: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let section = g.as_object_mut().unwrap().values_mut().next().unwrap();
    let experiences = section["experiences"].as_object_mut().unwrap();
    let s_key = experiences
        .keys()
        .find(|k| k.starts_with('S'))
        .cloned()
        .expect("the toy guidance has an S rule");
    experiences.insert(s_key, json!("被篡改的结构规则"));
    std::fs::write(&path, serde_json::to_vec_pretty(&g).unwrap()).unwrap();
    let found = audit_checks(&run);
    assert!(
        found.contains(&"guidance_chain") || found.contains(&"scaffold_untouched"),
        "{found:?}"
    );
}

/// Coverage counts only applied changes: a cycle claiming a ticket as covered that no
/// applied op cites is caught, and so is a rule text naming a group id of the run.
#[test]
fn coverage_without_an_applied_op_and_a_label_in_a_rule_are_caught() {
    let run = clean_run();
    let mut tampered = false;
    rewrite_jsonl(&run.join(files::REFLECTION), |rows| {
        if let Some(row) = rows.iter_mut().find(|r| {
            r["learnable"].as_array().is_some_and(|l| !l.is_empty()) && r["applied"] == false
        }) {
            row["covered"] = row["learnable"].clone();
            tampered = true;
        }
        if let Some(op) = rows
            .iter_mut()
            .find_map(|r| r["accepted_ops"].as_array_mut()?.first_mut())
        {
            op["op"]["text"] = json!("若工单 QC TOY F3 出现则判不通过");
        }
    });
    assert!(
        tampered,
        "the clean run has no unapplied cycle with learnable tickets"
    );
    let found = audit_checks(&run);
    assert!(found.contains(&"coverage_from_applied_ops"), "{found:?}");
    assert!(found.contains(&"no_label_in_rules"), "{found:?}");
}

/// Regression: runs written before `runner.speculation_*` existed failed the audit with "no
/// readable resolved config" once those keys were added to the config type.
#[test]
fn a_manifest_from_before_newer_config_keys_still_audits() {
    let run = clean_run();
    let path = run.join(files::MANIFEST);
    let mut manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let runner = manifest["config"]["runner"].as_object_mut().unwrap();
    assert!(runner.remove("speculation_multiple").is_some());
    assert!(runner.remove("speculation_min_ms").is_some());
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    assert_eq!(audit_checks(&run), Vec::<&str>::new());
}

/// A torn last line, a row that is not JSON and a duplicate candidate in one file: each is
/// reported with its line, and the rows around them are still checked.
#[test]
fn broken_lines_are_reported_where_they_are() {
    let run = clean_run();
    let path = run.join(files::TRAJECTORIES);
    let mut text = std::fs::read_to_string(&path).unwrap();
    let first = text.lines().next().unwrap().to_string();
    text.push_str("not json\n");
    text.push_str(&first);
    std::fs::write(&path, text).unwrap();
    let report = stageb_inspect::audit::audit(&run);
    let found: Vec<(&str, Option<usize>)> = report
        .violations
        .iter()
        .map(|v| (v.check, v.line))
        .collect();
    assert!(found.contains(&("jsonl_framing", None)), "{found:?}");
    assert!(
        found
            .iter()
            .any(|(c, l)| *c == "jsonl_parse" && l.is_some()),
        "{found:?}"
    );
    assert!(
        found.iter().any(|(c, _)| *c == "one_row_per_candidate"),
        "{found:?}"
    );
}
