//! Rollouts queued ahead (`runner.pipeline_steps`): while a step's
//! reflection runs, the next step's rollouts are already queued under the guidance of that
//! moment. An answer is used only when its step's guidance is still the one it ran under;
//! otherwise its job is withdrawn and queued again. Artifacts are the same bytes with and
//! without it, with one worker or three, whether reflection changes the guidance at a
//! boundary or never.
//!
//! Fixtures: the toy mission (16 tickets, steps of 8, reflection batches of 4) for one step
//! ahead, the demo mission (48 tickets, six steps an epoch) for three; two epochs, every run in
//! one directory under its own run name.

use crate::support;

use std::path::Path;

use serde_json::{Value, json};
use stageb_coordinator::artifacts::documents::AheadStats;
use stageb_coordinator::learn::reflection::CallsAheadStats;
use stageb_coordinator::run::RunSummary;
use support::compare::assert_same_artifacts;
use support::{
    Behaviour, assert_audit_ok, copy_demo_mission, run_scripted, toy_fail_key, write_config,
    write_toy_mission,
};

/// The mission written in `dir` (toy or demo) as run `name`, two epochs, with `pipeline_steps`
/// and `workers`.
fn run(dir: &Path, name: &str, pipeline_steps: u32, workers: usize, b: &Behaviour) -> RunSummary {
    let ahead = json!({"pipeline_steps": pipeline_steps});
    run_ahead(dir, name, ahead, workers, b)
}

/// The mission written in `dir` as run `name`, two epochs, with the `runner` keys of `ahead`
/// and `workers`; its audit passes.
fn run_ahead(dir: &Path, name: &str, ahead: Value, workers: usize, b: &Behaviour) -> RunSummary {
    let mut runner = json!({"epochs": 2});
    runner
        .as_object_mut()
        .unwrap()
        .extend(ahead.as_object().unwrap().clone());
    let config = write_config(dir, json!({"output": {"run_name": name}, "runner": runner}));
    let summary = run_scripted(&config, workers, b);
    assert_audit_ok(&summary.run_dir);
    summary
}

/// Runs the toy mission without queueing ahead, then with it on 1 and 3 workers: the same
/// artifacts every time. Returns the sequential run and each pipelined run's counts.
fn compare_pipelined(b: &Behaviour) -> (RunSummary, Vec<AheadStats>) {
    let dir = tempfile::tempdir().unwrap();
    write_toy_mission(dir.path());
    let sequential = run(dir.path(), "sequential", 0, 1, b);
    assert_eq!(sequential.runtime_facts().pipeline, AheadStats::default());
    let mut stats = Vec::new();
    for workers in [1, 3] {
        let ahead = run(dir.path(), &format!("ahead-{workers}"), 1, workers, b);
        assert_same_artifacts(&sequential.run_dir, &ahead.run_dir);
        let p = ahead.runtime_facts().pipeline;
        // Two epochs of two steps: each epoch's second step was queued ahead, 8 jobs each.
        assert_eq!(
            (p.steps_ahead, p.jobs_ahead),
            (2, 16),
            "{workers} workers: {p:?}"
        );
        assert_eq!(p.steps_used + p.steps_discarded, p.steps_ahead, "{p:?}");
        stats.push(p);
    }
    (sequential, stats)
}

#[test]
fn queued_ahead_steps_whose_guidance_changed_are_discarded_and_change_no_byte() {
    let (sequential, stats) = compare_pipelined(&Behaviour::default());
    assert!(sequential.guidance_step > 0, "the toy mission learns rules");
    for p in stats {
        assert!(
            p.steps_discarded >= 1,
            "reflection changed the guidance: {p:?}"
        );
        assert_eq!(p.jobs_discarded, 8 * p.steps_discarded, "{p:?}");
    }
}

#[test]
fn queued_ahead_steps_are_used_as_they_are_when_the_guidance_holds() {
    // Every fail ticket is declared no-evidence and never cited: no rule is learned, and the
    // guidance holds at every step boundary.
    let fail_keys: std::collections::BTreeSet<String> = (0..8).map(toy_fail_key).collect();
    let b = Behaviour {
        always_stop: fail_keys.clone(),
        never_cover: fail_keys,
        ..Behaviour::default()
    };
    let (_, stats) = compare_pipelined(&b);
    for p in stats {
        assert_eq!(
            (p.steps_used, p.jobs_used, p.jobs_discarded),
            (2, 16, 0),
            "{p:?}"
        );
    }
}

#[test]
fn a_pipeline_deeper_than_sixteen_steps_is_refused_at_its_line() {
    assert_refused_past_sixteen("pipeline_steps");
}

/// `runner.{key}: 17` is refused, the message naming the key and its range.
fn assert_refused_past_sixteen(key: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), json!({"runner": {key: 17}}));
    let err = stageb_shared::config::load_config(&path).unwrap_err();
    let text = err.to_string();
    assert!(text.contains(key) && text.contains("0..=16"), "{text}");
}

/// The demo mission with the `runner` keys of `ahead` (runs named `label-N`) on 1 and 3
/// workers, each against the sequential run: the same artifacts. Returns what each queued ahead.
fn demo_against_sequential(b: &Behaviour, label: &str, ahead: Value) -> Vec<AheadStats> {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    let sequential = run_ahead(dir.path(), "sequential", json!({}), 1, b);
    let mut stats = Vec::new();
    for workers in [1, 3] {
        let name = format!("{label}-{workers}");
        let pipelined = run_ahead(dir.path(), &name, ahead.clone(), workers, b);
        assert_same_artifacts(&sequential.run_dir, &pipelined.run_dir);
        stats.push(pipelined.runtime_facts().pipeline);
    }
    stats
}

/// Three steps ahead on the demo mission, 1 and 3 workers, against the sequential run.
fn compare_three_ahead(b: &Behaviour) -> Vec<AheadStats> {
    let stats = demo_against_sequential(b, "ahead3", json!({"pipeline_steps": 3}));
    for p in &stats {
        assert_eq!(p.steps_used + p.steps_discarded, p.steps_ahead, "{p:?}");
        assert_eq!(p.jobs_ahead, 8 * p.steps_ahead, "{p:?}");
    }
    stats
}

#[test]
fn three_steps_ahead_change_no_byte_when_the_guidance_changes_under_them() {
    for p in compare_three_ahead(&Behaviour::default()) {
        // Each epoch's steps 2-6 are queued ahead at least once; a change of guidance
        // queues the steps still ahead again.
        assert!(p.steps_ahead > 10, "a change requeued steps ahead: {p:?}");
        assert!(p.steps_discarded >= 1, "{p:?}");
    }
}

#[test]
fn three_steps_ahead_are_each_queued_once_and_used_when_the_guidance_holds() {
    let fail_keys: std::collections::BTreeSet<String> = demo_keys("fail");
    let b = Behaviour {
        always_stop: fail_keys.clone(),
        never_cover: fail_keys,
        ..Behaviour::default()
    };
    for p in compare_three_ahead(&b) {
        // Per epoch: steps 2, 3, 4 after step 1, then 5, then 6; never past the epoch's end.
        assert_eq!(
            (p.steps_ahead, p.steps_used, p.jobs_discarded),
            (10, 10, 0),
            "{p:?}"
        );
    }
}

/// The demo mission's ticket keys with `label`.
fn demo_keys(label: &str) -> std::collections::BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/demo/stage_a.jsonl");
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["label"] == label)
        .map(|v| format!("{}::{label}", v["group_id"].as_str().unwrap()))
        .collect()
}

// Reflection calls queued ahead (`runner.pipeline_cycles`): while a cycle runs, the next
// cycles' likely calls are queued under the guidance of the moment; a cycle uses one only
// when it asks for exactly the same job.

/// Three cycles ahead on the demo mission, 1 and 3 workers, against the sequential run: the
/// same artifacts. Returns what each run queued ahead.
fn compare_cycles_ahead(b: &Behaviour) -> Vec<CallsAheadStats> {
    let stats = demo_against_sequential(b, "cycles3", json!({"pipeline_cycles": 3}));
    let calls: Vec<CallsAheadStats> = stats.into_iter().map(|p| p.reflection).collect();
    for c in &calls {
        // Whatever no cycle used is withdrawn by the end of its boundary.
        assert_eq!(c.calls_used + c.calls_withdrawn, c.calls_ahead, "{c:?}");
    }
    calls
}

#[test]
fn reflection_calls_queued_ahead_change_no_byte_when_the_guidance_changes_under_them() {
    for c in compare_cycles_ahead(&Behaviour::default()) {
        assert!(c.calls_used > 0, "some guesses held: {c:?}");
        assert!(
            c.calls_withdrawn > 0,
            "an applied edit made guesses wrong: {c:?}"
        );
    }
}

#[test]
fn reflection_calls_queued_ahead_are_used_when_the_guidance_holds() {
    // No ops pass cites any case: nothing is applied and the guidance never changes, so
    // every cycle's decision call, and the ops call of each cycle whose decision answer came
    // in ahead, is used as queued.
    let mut every_key = demo_keys("pass");
    every_key.extend(demo_keys("fail"));
    let b = Behaviour {
        never_cover: every_key,
        ..Behaviour::default()
    };
    for c in compare_cycles_ahead(&b) {
        assert!(c.calls_used * 2 > c.calls_ahead, "most guesses held: {c:?}");
    }
}

#[test]
fn a_pipeline_of_more_than_sixteen_cycles_is_refused_at_its_line() {
    assert_refused_past_sixteen("pipeline_cycles");
}
