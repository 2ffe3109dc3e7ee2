//! `--resume` after rank 0 dies, and the guard against starting over an earlier run
//! (DESIGN §9: "Coordinator loss: `stageb run --resume` continues from the artifacts").
//!
//! The spec: a run stopped at any point and resumed writes exactly the artifacts an
//! uninterrupted run writes (timing and provenance aside), and the workers only compute what
//! the stopped attempt had not finished. A plain start never truncates an earlier run.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use stageb::cluster::{ClusterError, StartMode};
use stageb_coordinator::run::files;
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use support::compare::{assert_same_artifacts, comparable};
use support::{Behaviour, Script, ScriptedEngine, assert_audit_ok, copy_demo_mission, try_run};

/// The scripted engine, counting the rollouts and generations it is asked for.
struct Counting {
    inner: ScriptedEngine,
    rollouts: Arc<AtomicUsize>,
    generations: Arc<AtomicUsize>,
}

impl Engine for Counting {
    fn fingerprint(&self) -> &ModelFingerprint {
        self.inner.fingerprint()
    }

    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        self.rollouts.fetch_add(1, Ordering::SeqCst);
        self.inner.rollout(request)
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.generations.fetch_add(1, Ordering::SeqCst);
        self.inner.generate(request)
    }
}

#[derive(Clone, Default)]
struct Counters {
    rollouts: Arc<AtomicUsize>,
    generations: Arc<AtomicUsize>,
}

impl Counters {
    fn engines(&self, script: &Arc<Script>) -> impl Fn(usize) -> Counting + Send + Sync + 'static {
        let (script, counters) = (script.clone(), self.clone());
        move |_| Counting {
            inner: ScriptedEngine::new(script.clone()),
            rollouts: counters.rollouts.clone(),
            generations: counters.generations.clone(),
        }
    }

    fn rollouts(&self) -> usize {
        self.rollouts.load(Ordering::SeqCst)
    }

    fn generations(&self) -> usize {
        self.generations.load(Ordering::SeqCst)
    }
}

/// Two epochs of the 48-ticket demo mission, steps of 8 tickets, reflection after each step.
fn config(dir: &Path, run_name: &str) -> PathBuf {
    support::write_config(
        dir,
        json!({
            "output": {"root": dir.join("runs"), "run_name": run_name},
            "runner": {"epochs": 2, "per_rank_rollout_batch_size": 1, "logging_steps": 16},
            "reflection": {
                "batch_size": 8, "max_operations": 3, "max_new_tokens": 384,
                "retry_budget_per_group_per_epoch": 2, "max_calls_per_epoch": 12,
            },
        }),
    )
}

/// Where the first attempt is stopped: once the workers have started this many jobs.
#[derive(Clone, Copy, Debug)]
enum StopAfter {
    Rollouts(usize),
    Generations(usize),
}

async fn stop_after(counters: Counters, at: StopAfter) {
    loop {
        let reached = match at {
            StopAfter::Rollouts(n) => counters.rollouts() >= n,
            StopAfter::Generations(n) => counters.generations() >= n,
        };
        if reached {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[test]
fn a_run_stopped_mid_epoch_and_resumed_equals_the_uninterrupted_run() {
    // Inside the second step of epoch 2, after several reflection cycles.
    stop_and_resume(StopAfter::Rollouts(60));
}

#[test]
fn a_run_stopped_inside_a_reflection_cycle_and_resumed_equals_the_uninterrupted_run() {
    // Between the passes (or retries) of an epoch-1 reflection cycle.
    stop_and_resume(StopAfter::Generations(5));
}

fn stop_and_resume(at: StopAfter) {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());

    // The reference: one uninterrupted run.
    let reference = Counters::default();
    let script = Script::new(Behaviour::default());
    let whole = try_run(
        &config(dir.path(), "whole"),
        2,
        reference.engines(&script),
        StartMode::Fresh,
        std::future::pending(),
    )
    .expect("the uninterrupted run completes");

    // The same run, stopped at `at`, then resumed. The resumed workers share the stopped ones'
    // scripted reflector, as a real model would answer the same way twice.
    let config_path = config(dir.path(), "stopped");
    let script = Script::new(Behaviour::default());
    let first = Counters::default();
    let stopped = try_run(
        &config_path,
        2,
        first.engines(&script),
        StartMode::Fresh,
        stop_after(first.clone(), at),
    );
    assert!(
        matches!(stopped, Err(ClusterError::Interrupted { .. })),
        "the first attempt is cut short"
    );
    let second = Counters::default();
    let resumed = try_run(
        &config_path,
        2,
        second.engines(&script),
        StartMode::Resume,
        std::future::pending(),
    )
    .expect("the resumed run completes");

    // Exactly the uninterrupted run's artifacts.
    let (whole_dir, resumed_dir) = (&whole.run_dir, &resumed.run_dir);
    assert_same_artifacts(whole_dir, resumed_dir);
    assert_eq!(resumed.epoch_accuracy, whole.epoch_accuracy);
    assert_eq!(resumed.guidance_hash, whole.guidance_hash);
    assert_audit_ok(resumed_dir);

    // And the workers only computed what the first attempt had not finished.
    let replayed = resumed.runtime["scheduler"]["replayed"].as_u64().unwrap() as usize;
    let total_rollouts = reference.rollouts();
    assert_eq!(total_rollouts, 96, "48 tickets × 2 epochs");
    eprintln!(
        "stopped after {at:?}: {replayed} answers replayed, {} rollouts and {} generations computed again",
        second.rollouts(),
        second.generations()
    );
    let started = first.rollouts() + first.generations();
    assert!(
        replayed + 4 >= started && replayed > 0,
        "all but the jobs in flight at the stop are replayed ({replayed} of {started})"
    );
    assert_eq!(
        second.rollouts() + second.generations() + replayed,
        total_rollouts + reference.generations(),
        "every job is either replayed or computed once"
    );
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(resumed_dir.join(files::MANIFEST)).unwrap())
            .unwrap();
    assert_eq!(manifest["runtime"]["resumed"], true);
}

#[test]
fn starting_over_an_earlier_run_is_refused_unless_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    let config_path = config(dir.path(), "again");
    let script = Script::new(Behaviour::default());
    let counters = Counters::default();
    let run = |start: StartMode| {
        try_run(
            &config_path,
            1,
            counters.engines(&script),
            start,
            std::future::pending(),
        )
    };
    let first = run(StartMode::Fresh).expect("first run");
    let selections = std::fs::read(first.run_dir.join(files::SELECTIONS)).unwrap();

    let err = run(StartMode::Fresh).expect_err("a plain start over a finished run is refused");
    let ClusterError::Input(input) = &err else {
        panic!("an input error (exit 2), got {err}")
    };
    assert_eq!(input.code.code(), "E_RUN_EXISTS");
    assert!(input.file.ends_with("manifest.json"), "{input}");
    assert!(err.to_string().contains("--resume"), "{err}");
    assert_eq!(
        std::fs::read(first.run_dir.join(files::SELECTIONS)).unwrap(),
        selections,
        "nothing of the earlier run was touched"
    );

    // Resuming a finished run computes nothing and rewrites the same artifacts.
    let before = counters.rollouts() + counters.generations();
    let again = run(StartMode::Resume).expect("resume of a finished run");
    assert_eq!(counters.rollouts() + counters.generations(), before);
    assert_eq!(
        comparable(&again.run_dir.join(files::SELECTIONS)),
        comparable(&first.run_dir.join(files::SELECTIONS))
    );

    // Resuming with another config is refused (it would be another run).
    let text = std::fs::read_to_string(&config_path).unwrap();
    std::fs::write(&config_path, text.replace("\"seed\": 17", "\"seed\": 18")).unwrap();
    let err = run(StartMode::Resume).expect_err("resume with a changed config");
    let ClusterError::Input(input) = &err else {
        panic!("an input error (exit 2), got {err}")
    };
    assert_eq!(input.code.code(), "E_RESUME_MISMATCH");
    assert!(err.to_string().contains("config"), "{err}");

    // --overwrite starts over.
    run(StartMode::Overwrite).expect("overwrite");
}
