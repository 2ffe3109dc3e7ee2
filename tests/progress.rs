//! The progress display's numbers are real while a step is still running,
//! and it names the phase the run is in.
//!
//! Regression: the progress line read `candidates_per_s: 0.00` for the first half minute of the
//! demo, because candidates were counted only when their step was decided, and a step waits for
//! its slowest ticket. Here one of two workers holds its ticket until the test releases it, so
//! the first step cannot be decided; the other worker's results must already count.

use crate::support;

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use stageb::roles;
use stageb_coordinator::progress::{Phase, ProgressSnapshot, ReflectPass};
use stageb_coordinator::run::{ProgressHandle, files};
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use support::{
    Behaviour, Script, ScriptedEngine, copy_demo_mission, read_jsonl, write_config,
    write_toy_mission,
};

/// A gate the held worker waits on (false = closed).
type Gate = Arc<(Mutex<bool>, Condvar)>;

/// The scripted engine, but every rollout waits for the gate to open (test double).
struct HeldEngine {
    inner: ScriptedEngine,
    gate: Gate,
}

impl Engine for HeldEngine {
    fn fingerprint(&self) -> &ModelFingerprint {
        self.inner.fingerprint()
    }

    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        let (open, changed) = &*self.gate;
        let mut open = open.lock().unwrap();
        while !*open {
            open = changed.wait(open).unwrap();
        }
        drop(open);
        self.inner.rollout(request)
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.inner.generate(request)
    }
}

/// Opens the gate: held rollouts go on.
fn open(gate: &Gate) {
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
}

/// The progress state once `cond` holds, polled every 20 ms; fails with `what` after `secs`.
fn wait_for(
    progress: &ProgressHandle,
    secs: u64,
    what: &str,
    cond: impl Fn(&ProgressSnapshot) -> bool,
) -> ProgressSnapshot {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let p = progress.lock().unwrap().clone();
        if cond(&p) {
            return p;
        }
        assert!(Instant::now() < deadline, "{what}: {p:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Either the scripted engine or the held one, so one closure can make both workers.
enum Worker {
    Free(ScriptedEngine),
    Held(HeldEngine),
}

impl Engine for Worker {
    fn fingerprint(&self) -> &ModelFingerprint {
        match self {
            Worker::Free(e) => e.fingerprint(),
            Worker::Held(e) => e.fingerprint(),
        }
    }

    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        match self {
            Worker::Free(e) => e.rollout(request),
            Worker::Held(e) => e.rollout(request),
        }
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        match self {
            Worker::Free(e) => e.generate(request),
            Worker::Held(e) => e.generate(request),
        }
    }
}

#[test]
fn candidates_count_as_results_arrive_regression_zero_rate_until_a_step_is_decided() {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    let config = write_config(
        dir.path(),
        json!({"runner": {"epochs": 1, "per_rank_rollout_batch_size": 1}}),
    );
    let script = Script::new(Behaviour::default());
    let gate: Gate = Arc::new((Mutex::new(false), Condvar::new()));
    let progress: ProgressHandle = Arc::new(Mutex::new(Default::default()));
    let run = {
        let (gate, progress, config) = (gate.clone(), progress.clone(), config.clone());
        std::thread::spawn(move || {
            support::try_run_watched(
                &config,
                2,
                move |i| {
                    let inner = ScriptedEngine::new(script.clone());
                    if i == 1 {
                        Worker::Held(HeldEngine {
                            inner,
                            gate: gate.clone(),
                        })
                    } else {
                        Worker::Free(inner)
                    }
                },
                roles::StartMode::Fresh,
                std::future::pending(),
                Some(progress),
            )
        })
    };

    // The free worker's answers arrive while the held one keeps the first step open.
    let seen = wait_for(&progress, 60, "no candidates counted", |p| p.candidates > 0);
    let selections = dir
        .path()
        .join("runs/it/挡风板安装检查")
        .join(files::SELECTIONS);
    let decided = std::fs::read_to_string(&selections).unwrap_or_default();
    assert_eq!(
        decided.lines().count(),
        0,
        "the first step is still open (one worker holds its ticket)"
    );
    assert!(seen.done > 0 && seen.done < 8, "{seen:?}");
    assert_eq!(
        seen.candidates,
        seen.done * 4,
        "4 candidates per answered ticket"
    );

    open(&gate);
    let summary = run.join().unwrap().expect("the run completes");
    assert_eq!(summary.tickets, 48);
    let p = progress.lock().unwrap().clone();
    assert_eq!(p.candidates, summary.candidates);
}

/// Regression: the progress line read `live_workers=0` until a step's first result arrived
/// (the count was refreshed only per result), so a run whose workers were busy with long
/// first jobs, a whole batch of them at once, looked as if it had no workers. Here the only
/// worker holds its first ticket: the count must show it before any result.
#[test]
fn live_workers_count_the_worker_before_its_first_result_regression_zero_until_a_result() {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    let config = write_config(dir.path(), json!({"runner": {"epochs": 1}}));
    let script = Script::new(Behaviour::default());
    let gate: Gate = Arc::new((Mutex::new(false), Condvar::new()));
    let progress: ProgressHandle = Arc::new(Mutex::new(Default::default()));
    let run = {
        let (gate, progress) = (gate.clone(), progress.clone());
        std::thread::spawn(move || {
            support::try_run_watched(
                &config,
                1,
                move |_| HeldEngine {
                    inner: ScriptedEngine::new(script.clone()),
                    gate: gate.clone(),
                },
                roles::StartMode::Fresh,
                std::future::pending(),
                Some(progress),
            )
        })
    };
    let seen = wait_for(&progress, 30, "the worker never counted", |p| {
        p.live_workers > 0
    });
    assert_eq!((seen.live_workers, seen.done), (1, 0), "{seen:?}");
    open(&gate);
    let summary = run.join().unwrap().expect("the run completes");
    assert_eq!(summary.tickets, 48);
}

/// The progress state names every phase as the run enters it. A toy run of
/// one epoch in two steps of 8 tickets goes: rollouts of step 1, the reflection cycles due at
/// its boundary, rollouts of step 2, the cycles due then and those the epoch end drains, then
/// writing and done; and the reflection phases are exactly the calls of `reflection.jsonl`,
/// cycle by cycle and pass by pass (a JSON retry stays in its pass).
#[test]
fn the_phase_names_each_step_and_each_reflection_call_in_run_order() {
    let dir = tempfile::tempdir().unwrap();
    write_toy_mission(dir.path());
    let config = write_config(dir.path(), json!({}));
    let progress: ProgressHandle = Arc::new(Mutex::new(ProgressSnapshot {
        phase_log: Some(Vec::new()),
        ..ProgressSnapshot::default()
    }));
    let script = Script::new(Behaviour::default());
    let summary = support::try_run_watched(
        &config,
        1,
        move |_| ScriptedEngine::new(script.clone()),
        roles::StartMode::Fresh,
        std::future::pending(),
        Some(progress.clone()),
    )
    .expect("the run completes");
    let log = progress.lock().unwrap().phase_log.clone().unwrap();

    let rollouts = |step| Phase::Rollouts { step, steps: 2 };
    let at = |phase: Phase| log.iter().position(|p| *p == phase).unwrap();
    assert_eq!(log.first(), Some(&rollouts(1)), "{log:?}");
    assert_eq!(
        log[log.len() - 2..],
        [Phase::Writing, Phase::Done],
        "{log:?}"
    );
    assert!(at(rollouts(1)) < at(rollouts(2)), "{log:?}");

    let reflecting: Vec<Phase> = log
        .iter()
        .copied()
        .filter(|p| matches!(p, Phase::Reflecting { .. }))
        .collect();
    let mut calls: Vec<Phase> = Vec::new();
    for row in read_jsonl(&summary.run_dir, files::REFLECTION) {
        let cycle = row["reflection_cycle"].as_u64().unwrap();
        for call in row["calls"].as_array().unwrap() {
            let pass = match call["pass"].as_str().unwrap() {
                "decision" => ReflectPass::Decision,
                "ops" => ReflectPass::Ops,
                _ => ReflectPass::Revision,
            };
            let phase = Phase::Reflecting { cycle, pass };
            if calls.last() != Some(&phase) {
                calls.push(phase);
            }
        }
    }
    assert!(!calls.is_empty(), "the toy run reflects");
    assert_eq!(reflecting, calls, "one phase per call, in run order");
    let shown: Vec<String> = log.iter().map(ToString::to_string).collect();
    assert_eq!(shown[0], "rollouts step 1/2");
    assert!(
        shown.contains(&"reflecting cycle 0 (decision)".to_string()),
        "{shown:?}"
    );
}
