//! The progress display's numbers are real while a step is still running (issue 8, item 10).
//!
//! Regression: the progress line read `candidates_per_s: 0.00` for the first half minute of the
//! demo, because candidates were counted only when their step was decided, and a step waits for
//! its slowest ticket. Here one of two workers holds its ticket until the test releases it, so
//! the first step cannot be decided; the other worker's results must already count.

mod support;

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use stageb::cluster;
use stageb_coordinator::run::{ProgressHandle, files};
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use support::{Behaviour, Script, ScriptedEngine, copy_demo_mission, write_config};

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
                cluster::StartMode::Fresh,
                std::future::pending(),
                Some(progress),
            )
        })
    };

    // The free worker's answers arrive while the held one keeps the first step open.
    let deadline = Instant::now() + Duration::from_secs(60);
    let seen = loop {
        let p = progress.lock().unwrap().clone();
        if p.candidates > 0 {
            break p;
        }
        assert!(Instant::now() < deadline, "no candidates counted: {p:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
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

    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
    let summary = run.join().unwrap().expect("the run completes");
    assert_eq!(summary.tickets, 48);
    let p = progress.lock().unwrap().clone();
    assert_eq!(p.candidates, summary.candidates);
}
