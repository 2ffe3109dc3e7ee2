//! A worker gives its device back soon after rank 0 is gone (so a scheduler can reuse it).
//!
//! Regression: a registered worker kept redialing a vanished rank 0 for its whole first-contact
//! window (600 s under `stageb launch`), holding the GPU and the Slurm allocation idle. Once it
//! has registered, losing the coordinator is bounded by `reconnect_timeout` (default 60 s).

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use stageb_coordinator::cluster::scheduler::{Scheduler, SchedulerConfig};
use stageb_worker::client::{WorkerError, WorkerOptions, run_worker};
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use support::{fingerprint, serve_for_workers, worker_options};

/// An engine that is never asked to run anything here (test double).
struct IdleEngine(ModelFingerprint);

impl Engine for IdleEngine {
    fn fingerprint(&self) -> &ModelFingerprint {
        &self.0
    }
    fn rollout(&mut self, _: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        Err(EngineError::InvalidRequest("idle engine".into()))
    }
    fn generate(&mut self, _: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        Err(EngineError::InvalidRequest("idle engine".into()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_worker_exits_within_its_reconnect_window_once_rank_0_is_gone() {
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig::default());
    let scheduler = Arc::new(scheduler);
    let server = serve_for_workers(scheduler.clone(), Duration::from_millis(200)).await;
    let engine = IdleEngine(fingerprint("idle"));
    let opts = WorkerOptions {
        connect_timeout: Duration::from_secs(600),
        reconnect_timeout: Duration::from_secs(2),
        limits: Default::default(),
        ..worker_options(server.addr.to_string())
    };
    let worker = tokio::spawn(run_worker(engine, opts, std::future::pending()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while scheduler.live_workers() == 0 {
        assert!(Instant::now() < deadline, "the worker never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Rank 0 goes away for good.
    let gone = Instant::now();
    server.stop.send(()).unwrap();
    let _ = server.task.await;
    let ended = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("the worker still redials after 60 s (its first-contact window is 600 s)")
        .unwrap();
    assert!(
        matches!(ended, Err(WorkerError::Unreachable { .. })),
        "{ended:?}"
    );
    eprintln!("worker exited {:?} after rank 0 stopped", gone.elapsed());
}
