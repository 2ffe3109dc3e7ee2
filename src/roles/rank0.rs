//! Serving one run as rank 0: bind, plan the start, lock the run directory, serve the workers,
//! run the epoch loop, and on SIGTERM/SIGINT drain the jobs in flight.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stageb_coordinator::cluster::dispatch::Dispatch;
use stageb_coordinator::cluster::scheduler::journal::{Journal, ReplayCache};
use stageb_coordinator::cluster::scheduler::{
    Completion, ControlSignal, ProgressRule, Scheduler, SchedulerConfig, SpeculationConfig,
};
use stageb_coordinator::cluster::server::{self, EdgeConfig, ServiceConfig};
use stageb_coordinator::run::dir::{RunDir, RunJournal};
use stageb_coordinator::run::start;
use stageb_coordinator::run::{ProgressHandle, RunError, RunInputs, RunLoop, RunSummary};
use stageb_shared::config::RunnerConfig;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::oneshot;

use super::local_workers::{LocalPin, LocalStart, LocalWorkers};
use super::model::model_pin;
use super::{ClusterError, CoordinatorSettings};

/// Serve one run as rank 0. `spawn_local` receives the bound address, the token and the model
/// pin ([`LocalStart`]) and starts in-process workers; pass a closure returning no handles for a coordinator alone.
/// Serving stops within the edge's shutdown grace once the run is over, whatever clients
/// still hold connections.
pub async fn run_coordinator(
    inputs: RunInputs,
    settings: CoordinatorSettings,
    spawn_local: impl FnOnce(LocalStart) -> LocalWorkers,
) -> Result<RunSummary, ClusterError> {
    run_coordinator_until(inputs, settings, spawn_local, std::future::pending()).await
}

/// [`run_coordinator`] that stops early when `interrupt` resolves (SIGINT/SIGTERM): no new
/// leases, workers told to stop, and an error naming what is on disk. Rows are written only for
/// completed steps and synced at every step boundary, so an interrupted run never leaves a
/// half-written step behind.
///
/// The steps, in this order: bind the port (the listen policy first: refusing an
/// unauthenticated public address outranks anything about the run directory), decide the
/// device-tuned settings left unset (said in one line), plan the start,
/// pin the model, lock the run directory, open the job journal, start the local workers, serve
/// and the progress display, run the epoch loop until it ends or `interrupt` drains it, then
/// stop the workers, the display and the server.
pub async fn run_coordinator_until(
    inputs: RunInputs,
    settings: CoordinatorSettings,
    spawn_local: impl FnOnce(LocalStart) -> LocalWorkers,
    interrupt: impl std::future::Future<Output = ()>,
) -> Result<RunSummary, ClusterError> {
    let (listener, edge) = bind(&settings).await?;
    let mut inputs = inputs;
    let tuning = inputs
        .config
        .runner
        .tune_for(settings.workers_device, settings.local_max_jobs);
    tracing::info!("throughput settings in force: {tuning}");
    inputs.tuning = Some(tuning);
    let plan = start::plan(&inputs, settings.start)?;
    let model = model_pin(&inputs, &plan, &settings).await?;
    // Locked before anything is written: a second process on it must not truncate it.
    let (run_dir, RunJournal { journal, replay }) = RunDir::open(plan)?;
    let (scheduler, completions) = scheduler(&inputs.config.runner, &settings, journal, replay);
    let service = server::build_service(
        scheduler.clone(),
        &ServiceConfig {
            run_id: run_id(&inputs),
            token: settings.token.clone(),
            model,
            heartbeat_interval: heartbeat_interval(&inputs.config.runner),
        },
    );
    let model = service.model_handle();
    let addr = listener
        .local_addr()
        .map_err(|e| ClusterError::Serve(e.to_string()))?;
    tracing::info!(%addr, auth = settings.token.is_some(), transport = ?edge.transport(), max_connections = edge.limits.max_connections, "coordinator listening");
    // Rank 0's own workers start before it serves, so their numerics are awaited from the
    // first Register on (a peer registering first cannot decide them).
    let workers = spawn_local(LocalStart {
        addr,
        token: settings.token.clone(),
        pin: LocalPin::new(model.clone()),
    });
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server_task = tokio::spawn(server::serve(listener, service, edge, async {
        let _ = stop_rx.await;
    }));
    let (progress, progress_display) = ProgressDisplay::start(&settings);
    let shown = progress.clone();

    let result = async {
        let dispatch = Dispatch::new(scheduler.clone(), completions, settings.worker_grace);
        let run = RunLoop::prepare(inputs, &run_dir, dispatch, model, progress)
            .inspect_err(|_| run_dir.discard_unused())?;
        tracing::info!(run_dir = %run.run_dir().display(), "run started");
        let run = run.run();
        tokio::pin!(run);
        tokio::select! {
            r = &mut run => return r.map_err(ClusterError::from),
            _ = interrupt => {}
        }
        shown
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .start_draining();
        drain(&scheduler, run, settings.drain_timeout, run_dir.path()).await
    }
    .await;

    // Tell workers the run is over, give them a moment to take the message, then stop serving.
    stop_local_workers(&scheduler, workers).await;
    progress_display.stop().await;
    let _ = stop_tx.send(());
    match server_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("server stopped with an error: {e}"),
        Err(e) => tracing::warn!("server task failed: {e}"),
    }
    result
}

/// Bind the gRPC port under the listen policy (the token, TLS and the edge's limits); the
/// policy's warnings go to the log.
async fn bind(
    settings: &CoordinatorSettings,
) -> Result<(tokio::net::TcpListener, EdgeConfig), ClusterError> {
    let edge = EdgeConfig {
        token: settings.token.clone(),
        tls: settings.tls.clone(),
        limits: settings.edge_limits.clone(),
        ..Default::default()
    };
    let (listener, warnings) =
        server::bind(settings.listen, settings.token.as_ref(), edge.transport()).await?;
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    Ok((listener, edge))
}

/// The lease table of a run (the config's `runner.*` timings, the settings' expected workers),
/// journaling every answer and replaying `replay`'s.
fn scheduler(
    runner: &RunnerConfig,
    settings: &CoordinatorSettings,
    journal: Journal,
    replay: ReplayCache,
) -> (Arc<Scheduler>, UnboundedReceiver<Completion>) {
    let (scheduler, completions) = Scheduler::new(SchedulerConfig {
        speculation: SpeculationConfig {
            multiple: runner.speculation_multiple,
            min_age: Duration::from_millis(runner.speculation_min_ms),
        },
        progress: ProgressRule {
            multiple: runner.no_progress_multiple,
            floor: Duration::from_millis(runner.no_progress_floor_ms),
            heartbeat: heartbeat_interval(runner),
        },
        expected_workers: settings.expected_workers,
        ..SchedulerConfig::with_lease_ttl(Duration::from_secs(runner.lease_ttl_s.max(1)))
    });
    (
        Arc::new(scheduler.with_journal(journal, replay)),
        completions,
    )
}

fn heartbeat_interval(runner: &RunnerConfig) -> Duration {
    Duration::from_secs(runner.heartbeat_interval_s.max(1))
}

/// This attempt's id: the run name and 8 random hex digits.
fn run_id(inputs: &RunInputs) -> String {
    format!("{}-{}", inputs.config.output.run_name, &uuid_hex()[..8])
}

/// Rank 0's progress display ([`crate::progress`]), when the settings ask for it.
struct ProgressDisplay {
    stop: oneshot::Sender<()>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl ProgressDisplay {
    /// The handle the run publishes its progress to (the settings' own, else a new one), and
    /// the display reading it.
    fn start(settings: &CoordinatorSettings) -> (ProgressHandle, Self) {
        let progress: ProgressHandle = settings
            .progress
            .clone()
            .unwrap_or_else(|| Arc::new(Mutex::new(Default::default())));
        let (stop, stop_rx) = oneshot::channel::<()>();
        let task = settings.show_progress.then(|| {
            tokio::spawn(crate::progress::report(
                progress.clone(),
                settings.progress_every,
                async {
                    let _ = stop_rx.await;
                },
            ))
        });
        (progress, Self { stop, task })
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        if let Some(t) = self.task {
            let _ = t.await;
        }
    }
}

/// Tell the workers of this process the run is over and wait up to
/// [`LOCAL_WORKER_STOP_TIMEOUT`] for each to leave.
async fn stop_local_workers(scheduler: &Scheduler, workers: LocalWorkers) {
    scheduler.set_control(ControlSignal::Stop);
    for w in workers {
        match tokio::time::timeout(LOCAL_WORKER_STOP_TIMEOUT, w).await {
            Ok(Ok(Ok(summary))) => tracing::debug!(?summary, "local worker finished"),
            Ok(Ok(Err(e))) => tracing::warn!("local worker failed: {e}"),
            Ok(Err(e)) => tracing::warn!("local worker panicked: {e}"),
            Err(_) => tracing::warn!("local worker did not stop in time"),
        }
    }
}

/// How long a worker of this process gets to take the stop message and leave once the run is
/// over (it finishes the job at hand first).
const LOCAL_WORKER_STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// After SIGTERM/SIGINT: lease nothing more, tell the workers to drain, and wait up to
/// `timeout` for the jobs in flight. Every answer that arrives meanwhile is journaled (and the
/// run loop keeps going, so a step those answers complete is written); then the journal is
/// synced and the run ends as [`ClusterError::Interrupted`], resumable. Should the run finish
/// during the drain, it simply completes.
async fn drain(
    scheduler: &Scheduler,
    run: std::pin::Pin<&mut impl std::future::Future<Output = Result<RunSummary, RunError>>>,
    timeout: Duration,
    run_dir: &Path,
) -> Result<RunSummary, ClusterError> {
    let accepted_before = scheduler.stats().submits_accepted;
    tracing::warn!(
        in_flight = scheduler.in_flight(),
        timeout_s = timeout.as_secs(),
        "interrupted: draining (no new leases; waiting for the jobs in flight)"
    );
    scheduler.set_control(ControlSignal::Drain);
    let settled = async {
        while scheduler.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        r = run => return r.map_err(ClusterError::from),
        _ = settled => {}
        _ = tokio::time::sleep(timeout) => {}
    }
    let abandoned = scheduler.in_flight();
    if let Err(e) = scheduler.sync_journal() {
        tracing::warn!("syncing the job journal failed: {e}");
    }
    let answers = scheduler.stats().submits_accepted - accepted_before;
    tracing::warn!(answers, abandoned, "drained");
    Err(ClusterError::Interrupted {
        run_dir: run_dir.to_path_buf(),
        answers,
        abandoned,
        abandoned_note: if abandoned > 0 {
            format!(" ({abandoned} jobs still running at the drain timeout are recomputed)")
        } else {
            String::new()
        },
    })
}

fn uuid_hex() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}
