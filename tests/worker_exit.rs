//! A worker gives its device back soon after rank 0 is gone (issue 10, item 3).
//!
//! Regression: a registered worker kept redialing a vanished rank 0 for its whole first-contact
//! window (600 s under `stageb launch`), holding the GPU and the Slurm allocation idle. Once it
//! has registered, losing the coordinator is bounded by `reconnect_timeout` (default 60 s).

use std::sync::Arc;
use std::time::{Duration, Instant};

use stageb_coordinator::cluster::edge::EdgeLimits;
use stageb_coordinator::cluster::scheduler::{Scheduler, SchedulerConfig};
use stageb_coordinator::cluster::server::{self, EdgeConfig, ModelPin, ServiceConfig};
use stageb_worker::client::{WorkerError, WorkerOptions, run_worker};
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use tokio::net::TcpListener;

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
    let service = server::build_service(
        scheduler.clone(),
        &ServiceConfig {
            run_id: "run".into(),
            token: None,
            model: ModelPin::by_first_worker(),
            heartbeat_interval: Duration::from_millis(200),
        },
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let edge = EdgeConfig {
        limits: EdgeLimits {
            shutdown_grace: Duration::from_millis(200),
            ..EdgeLimits::default()
        },
        ..Default::default()
    };
    let server = tokio::spawn(server::serve(listener, service, edge, async {
        let _ = stopped.await;
    }));

    let engine = IdleEngine(ModelFingerprint {
        weights_sha256: "w".into(),
        candle_version: "c".into(),
        dtype: "d".into(),
        device: "cpu".into(),
        architecture: "idle".into(),
    });
    let opts = WorkerOptions {
        coordinator: addr.to_string(),
        token: None,
        tls: None,
        name: "worker-under-test".into(),
        device: "cpu".into(),
        run_id: String::new(),
        connect_timeout: Duration::from_secs(600),
        reconnect_timeout: Duration::from_secs(2),
    };
    let worker = tokio::spawn(run_worker(engine, opts, std::future::pending()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while scheduler.live_workers() == 0 {
        assert!(Instant::now() < deadline, "the worker never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Rank 0 goes away for good.
    let gone = Instant::now();
    stop.send(()).unwrap();
    let _ = server.await;
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
