//! Process roles. Every role talks gRPC, even the embedded default: `stageb run` starts the
//! coordinator on loopback and N local workers in the same process, so the single-machine path
//! exercises exactly the protocol a multi-node run uses.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stageb_coordinator::cluster::edge::EdgeLimits;
use stageb_coordinator::cluster::scheduler::{
    ControlSignal, Scheduler, SchedulerConfig, SpeculationConfig,
};
use stageb_coordinator::cluster::server::{self, EdgeConfig, ModelPin, ServiceConfig};
use stageb_coordinator::run::start;
pub use stageb_coordinator::run::start::StartMode;
use stageb_coordinator::run::{ProgressHandle, RunError, RunInputs, RunLoop, RunSummary};
use stageb_shared::auth::AuthToken;
use stageb_shared::config::{self, load_config};
use stageb_shared::error::{ErrorCode, InputError};
use stageb_shared::ingest::load_tickets;
use stageb_shared::limits;
use stageb_shared::tls::{ClientTls, ServerTls};
use stageb_worker::client::{WorkerOptions, WorkerSummary, run_worker};
use stageb_worker::engine::Engine;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error(transparent)]
    Bind(#[from] server::BindError),
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("cannot determine the working directory: {0}")]
    Cwd(std::io::Error),
    #[error("gRPC server failed: {0}")]
    Serve(String),
    #[error("{0}")]
    Launch(String),
    #[error(
        "interrupted before the run was over: {answers} answers are journaled and every \
         completed step is on disk{abandoned_note}; continue with --resume (run directory {})",
        run_dir.display()
    )]
    Interrupted {
        run_dir: PathBuf,
        /// Answers accepted (and journaled) during the drain.
        answers: u64,
        /// Jobs still in flight when the drain timed out (recomputed on resume).
        abandoned: usize,
        abandoned_note: String,
    },
}

/// Load and validate the config and its Stage-A inputs. Relative paths resolve against the
/// working directory, as in the original.
pub fn prepare_inputs(config_path: &Path, mode: &str) -> Result<RunInputs, ClusterError> {
    let loaded = load_config(config_path)?;
    for notice in &loaded.notices {
        tracing::warn!("{notice}");
    }
    let cwd = std::env::current_dir().map_err(ClusterError::Cwd)?;
    let config = loaded.config.with_paths_resolved(&cwd);
    let ingested = load_tickets(&config.stage_a_paths)?;
    tracing::info!(mission = %ingested.mission, tickets = ingested.tickets.len(), "inputs loaded");
    Ok(RunInputs {
        config,
        config_path: config_path.to_path_buf(),
        config_sha256: loaded.source_text_sha256,
        notices: loaded.notices,
        ingested,
        mode: mode.to_string(),
    })
}

/// How rank 0 serves a run.
#[derive(Debug, Clone)]
pub struct CoordinatorSettings {
    pub listen: SocketAddr,
    pub token: Option<AuthToken>,
    /// TLS (mutual when it has a client CA); `None` serves plaintext.
    pub tls: Option<ServerTls>,
    /// Connection and request limits of the gRPC edge.
    pub edge_limits: EdgeLimits,
    /// How long to wait with no live worker before giving up.
    pub worker_grace: Duration,
    /// Period of the progress log line when stderr is not a terminal.
    pub progress_every: Duration,
    /// Report progress at all (tests turn it off).
    pub show_progress: bool,
    /// Where the run publishes its progress (a test may watch it); `None`: a handle of its own.
    pub progress: Option<ProgressHandle>,
    /// A fresh start, `--overwrite` or `--resume` (see `stageb_coordinator::run::start`).
    pub start: StartMode,
    /// On SIGTERM/SIGINT: how long to wait for the jobs in flight before exiting (below
    /// Slurm's `--signal=TERM@120` and Kubernetes' grace period).
    pub drain_timeout: Duration,
}

/// Default [`CoordinatorSettings::drain_timeout`]: room for a few long reflection jobs, and
/// 30 s under the two minutes Slurm's `--signal=TERM@120` and our pod spec's grace give.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(90);

/// Handles of workers started in this process.
pub type LocalWorkers = Vec<JoinHandle<Result<WorkerSummary, String>>>;

/// Which model the run accepts: the one an earlier attempt recorded (resume), else the one
/// the config names when rank 0 can read it, else the first worker's (said in the log). The
/// run's context is decided with it: the earlier attempt's, else `model.max_model_len` or the
/// model's declaration, else the first worker's.
async fn model_pin(inputs: &RunInputs, plan: &start::StartPlan) -> Result<ModelPin, ClusterError> {
    let path = PathBuf::from(&inputs.config.model.model_name_or_path);
    let read = tokio::task::spawn_blocking({
        let path = path.clone();
        let hash = plan.pinned_fingerprint.is_none();
        move || {
            let declared = declared_context(&path);
            (
                hash.then(|| stageb_worker::engine::weights_sha256(&path)),
                declared,
            )
        }
    })
    .await
    .map_err(|e| ClusterError::Serve(format!("reading the model failed: {e}")))?;
    let (hashed, declared) = read;
    let pin = match (plan.pinned_fingerprint.clone(), hashed) {
        (Some(fingerprint), _) => ModelPin::by_resumed_run(fingerprint),
        (None, Some(Ok(weights))) => {
            tracing::info!(model = %path.display(), weights_sha256 = %&weights[..weights.len().min(16)], "run model pinned by the config");
            ModelPin::by_config(weights)
        }
        (None, Some(Err(e))) => {
            tracing::warn!(model = %path.display(), "rank 0 cannot read the config's model ({e}): the first worker to register pins the run's model");
            ModelPin::by_first_worker()
        }
        (None, None) => ModelPin::by_first_worker(),
    };
    if let Some(context) = plan.pinned_context {
        return Ok(pin.with_context(context));
    }
    let context = run_context(inputs, declared)?;
    Ok(match context {
        Some(context) => pin.with_context(context),
        None => pin,
    })
}

/// The run's context from `model.max_model_len` and the model's declaration (`Err`: rank 0
/// cannot read the model); a conflict is an input error at the config's line.
pub fn run_context(
    inputs: &RunInputs,
    declared: Result<Option<u32>, String>,
) -> Result<Option<limits::RunContext>, InputError> {
    limits::decide_context(inputs.config.model.max_model_len, Some(declared)).map_err(|e| {
        let text = std::fs::read_to_string(&inputs.config_path).unwrap_or_default();
        let line = config::key_line(&text, "model.max_model_len")
            .or_else(|| config::key_line(&text, "model.model_name_or_path"));
        InputError::new(
            ErrorCode::InvalidConfigValue,
            inputs.config_path.display().to_string(),
            line,
            e.to_string(),
        )
    })
}

/// What the model at `path` declares as its context (`Err`: it cannot be read).
pub fn declared_context(path: &Path) -> Result<Option<u32>, String> {
    stageb_worker::engine::declared_context(path)
        .map(|n| n.map(|n| u32::try_from(n).unwrap_or(u32::MAX)))
        .map_err(|e| e.to_string())
}

/// After an input error found once the run directory exists: remove the journal this start
/// created if nothing was written to it, and the directory if that leaves it empty.
fn discard_empty_start(dir: &Path) {
    let journal = dir.join(stageb_coordinator::cluster::scheduler::journal::JOURNAL_FILE);
    if std::fs::metadata(&journal).is_ok_and(|m| m.len() == 0) {
        let _ = std::fs::remove_file(&journal);
        let _ = std::fs::remove_file(dir.join(start::LOCK_FILE));
    }
    let _ = std::fs::remove_dir(dir);
}

/// Serve one run as rank 0. `spawn_local` receives the bound address (and the token) and
/// starts in-process workers; pass a closure returning no handles for a coordinator alone.
/// Serving stops within the edge's shutdown grace once the run is over, whatever clients
/// still hold connections.
pub async fn run_coordinator(
    inputs: RunInputs,
    settings: CoordinatorSettings,
    spawn_local: impl FnOnce(SocketAddr, Option<AuthToken>) -> LocalWorkers,
) -> Result<RunSummary, ClusterError> {
    run_coordinator_until(inputs, settings, spawn_local, std::future::pending()).await
}

/// [`run_coordinator`] that stops early when `interrupt` resolves (SIGINT/SIGTERM): no new
/// leases, workers told to stop, and an error naming what is on disk. Rows are written only for
/// completed steps and synced at every step boundary, so an interrupted run never leaves a
/// half-written step behind.
pub async fn run_coordinator_until(
    inputs: RunInputs,
    settings: CoordinatorSettings,
    spawn_local: impl FnOnce(SocketAddr, Option<AuthToken>) -> LocalWorkers,
    interrupt: impl std::future::Future<Output = ()>,
) -> Result<RunSummary, ClusterError> {
    let runner = &inputs.config.runner;
    // The listen policy first: refusing an unauthenticated public address outranks anything
    // about the run directory.
    let edge = EdgeConfig {
        token: settings.token.clone(),
        tls: settings.tls.clone(),
        limits: settings.edge_limits.clone(),
        connections: Default::default(),
    };
    let (listener, warnings) =
        server::bind(settings.listen, settings.token.as_ref(), edge.transport()).await?;
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    let plan = start::plan(&inputs, settings.start).map_err(|e| match e {
        start::StartError::Input(e) => ClusterError::Input(e),
        start::StartError::Run(e) => ClusterError::Run(e),
    })?;
    let model = model_pin(&inputs, &plan).await?;
    let (run_dir, resuming) = (plan.dir.clone(), plan.resuming);
    // Before anything is written: a second process on this directory must not truncate it.
    let _run_lock = start::lock_run_dir(&plan.dir).map_err(|e| match e {
        start::StartError::Input(e) => ClusterError::Input(e),
        start::StartError::Run(e) => ClusterError::Run(e),
    })?;
    let journal = plan.open_journal()?;
    let (scheduler, completions) = Scheduler::new(SchedulerConfig {
        speculation: SpeculationConfig {
            multiple: runner.speculation_multiple,
            min_age: Duration::from_millis(runner.speculation_min_ms),
        },
        ..SchedulerConfig::with_lease_ttl(Duration::from_secs(runner.lease_ttl_s.max(1)))
    });
    let scheduler = Arc::new(scheduler.with_journal(journal, plan.replay));
    let run_id = format!("{}-{}", inputs.config.output.run_name, &uuid_hex()[..8]);
    let service = server::build_service(
        scheduler.clone(),
        &ServiceConfig {
            run_id,
            token: settings.token.clone(),
            model,
            heartbeat_interval: Duration::from_secs(runner.heartbeat_interval_s.max(1)),
        },
    );
    let model = service.model_handle();
    let addr = listener
        .local_addr()
        .map_err(|e| ClusterError::Serve(e.to_string()))?;
    tracing::info!(%addr, auth = settings.token.is_some(), transport = ?edge.transport(), max_connections = edge.limits.max_connections, "coordinator listening");
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server_task = tokio::spawn(server::serve(listener, service, edge, async {
        let _ = stop_rx.await;
    }));
    let workers = spawn_local(addr, settings.token.clone());

    let progress: ProgressHandle = settings
        .progress
        .clone()
        .unwrap_or_else(|| Arc::new(Mutex::new(Default::default())));
    let (progress_stop_tx, progress_stop_rx) = oneshot::channel::<()>();
    let progress_task = settings.show_progress.then(|| {
        tokio::spawn(crate::progress::report(
            progress.clone(),
            settings.progress_every,
            async {
                let _ = progress_stop_rx.await;
            },
        ))
    });

    let result = async {
        let run = RunLoop::prepare(
            inputs,
            resuming,
            scheduler.clone(),
            completions,
            model,
            progress,
        )
        .inspect_err(|_| {
            if !resuming {
                discard_empty_start(&run_dir);
            }
        })?
        .with_worker_grace(settings.worker_grace);
        tracing::info!(run_dir = %run.run_dir().display(), "run started");
        let run = run.run();
        tokio::pin!(run);
        tokio::select! {
            r = &mut run => return r.map_err(ClusterError::from),
            _ = interrupt => {}
        }
        drain(&scheduler, run, settings.drain_timeout, &run_dir).await
    }
    .await;

    // Tell workers the run is over, give them a moment to take the message, then stop serving.
    scheduler.set_control(ControlSignal::Stop);
    for w in workers {
        match tokio::time::timeout(Duration::from_secs(30), w).await {
            Ok(Ok(Ok(summary))) => tracing::debug!(?summary, "local worker finished"),
            Ok(Ok(Err(e))) => tracing::warn!("local worker failed: {e}"),
            Ok(Err(e)) => tracing::warn!("local worker panicked: {e}"),
            Err(_) => tracing::warn!("local worker did not stop in time"),
        }
    }
    let _ = progress_stop_tx.send(());
    if let Some(t) = progress_task {
        let _ = t.await;
    }
    let _ = stop_tx.send(());
    match server_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("server stopped with an error: {e}"),
        Err(e) => tracing::warn!("server task failed: {e}"),
    }
    result
}

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

/// A worker's identity for logs: `host:pid:index`.
pub fn worker_name(index: usize) -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}:{index}", std::process::id())
}

fn uuid_hex() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Start `n` in-process workers, each with its own engine built by `make_engine(index)` on a
/// blocking thread (model loading is CPU-heavy).
pub fn spawn_local_workers<E, F>(
    n: usize,
    addr: SocketAddr,
    token: Option<AuthToken>,
    tls: Option<ClientTls>,
    make_engine: F,
) -> LocalWorkers
where
    E: Engine + 'static,
    F: Fn(usize) -> Result<E, String> + Send + Sync + 'static,
{
    let make_engine = Arc::new(make_engine);
    (0..n)
        .map(|i| {
            let make_engine = make_engine.clone();
            let token = token.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let engine = tokio::task::spawn_blocking(move || make_engine(i))
                    .await
                    .map_err(|e| format!("engine loader panicked: {e}"))??;
                let opts = WorkerOptions {
                    coordinator: addr.to_string(),
                    token,
                    tls,
                    name: worker_name(i),
                    device: "local".into(),
                    run_id: String::new(),
                    connect_timeout: Duration::from_secs(30),
                    reconnect_timeout: stageb_worker::client::DEFAULT_RECONNECT_TIMEOUT,
                };
                run_worker(engine, opts, std::future::pending())
                    .await
                    .map_err(|e| e.to_string())
            })
        })
        .collect()
}

/// A process's place in a launched job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchTopology {
    pub rank: u32,
    pub rank_source: String,
    pub local_rank: u32,
    /// `host:port` the other ranks dial.
    pub coordinator: String,
    pub coordinator_source: String,
    /// The port rank 0 listens on: always the port of `coordinator`, so rank 0 listens where
    /// the other ranks dial whichever variable named the address.
    pub listen_port: u16,
}

fn env_u32(env: &impl Fn(&str) -> Option<String>, names: &[&str]) -> Option<(u32, String)> {
    names.iter().find_map(|n| {
        env(n)
            .and_then(|v| v.trim().parse().ok())
            .map(|v| (v, n.to_string()))
    })
}

/// Resolve the launch topology from the process environment (see [`topology_from`]).
pub fn resolve_topology(listen_port: Option<u16>) -> Result<LaunchTopology, ClusterError> {
    topology_from(|name| std::env::var(name).ok(), listen_port)
}

/// The port `rank 0` serves on when nothing names one (`--listen-port` unset, no launcher
/// address).
pub const DEFAULT_LAUNCH_PORT: u16 = 50051;

/// Resolve the launch topology: rank from `STAGEB_RANK`, `RANK` (torchrun), `SLURM_PROCID`,
/// `JOB_COMPLETION_INDEX` (Kubernetes Indexed Job), `OMPI_COMM_WORLD_RANK`; local rank from
/// `STAGEB_LOCAL_RANK`, `LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`; the
/// coordinator from `STAGEB_COORDINATOR`, else `MASTER_ADDR:(MASTER_PORT+1)` (torchrun's own
/// store keeps `MASTER_PORT`), else loopback on rank 0. `listen_port` (`--listen-port`) names
/// the port where no variable does; a variable's port wins, and rank 0 listens on it.
pub fn topology_from(
    env: impl Fn(&str) -> Option<String>,
    listen_port: Option<u16>,
) -> Result<LaunchTopology, ClusterError> {
    let (rank, rank_source) = env_u32(
        &env,
        &[
            "STAGEB_RANK",
            "RANK",
            "SLURM_PROCID",
            "JOB_COMPLETION_INDEX",
            "OMPI_COMM_WORLD_RANK",
        ],
    )
    .unwrap_or((0, "default (single process)".into()));
    let (local_rank, _) = env_u32(
        &env,
        &[
            "STAGEB_LOCAL_RANK",
            "LOCAL_RANK",
            "SLURM_LOCALID",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ],
    )
    .unwrap_or((0, String::new()));
    let fallback_port = listen_port.unwrap_or(DEFAULT_LAUNCH_PORT);
    let (host, port, coordinator_source) = if let Some(c) = env("STAGEB_COORDINATOR") {
        let (host, port) = c
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| {
                ClusterError::Launch(format!("STAGEB_COORDINATOR must be host:port, got {c:?}"))
            })?;
        (host, port, "STAGEB_COORDINATOR".to_string())
    } else if let Some(addr) = env("MASTER_ADDR") {
        let (port, source) = match env("MASTER_PORT").and_then(|p| p.trim().parse::<u16>().ok()) {
            Some(p) if p < u16::MAX => (p + 1, "MASTER_ADDR:MASTER_PORT+1"),
            _ => (fallback_port, "MASTER_ADDR:--listen-port"),
        };
        (addr, port, source.to_string())
    } else if rank == 0 {
        (
            "127.0.0.1".to_string(),
            fallback_port,
            "default".to_string(),
        )
    } else {
        return Err(ClusterError::Launch(
            "rank > 0 but no coordinator address: set STAGEB_COORDINATOR (or MASTER_ADDR/MASTER_PORT)".into(),
        ));
    };
    if let Some(asked) = listen_port
        && asked != port
    {
        tracing::warn!(asked, port, from = %coordinator_source, "--listen-port differs from the port the other ranks dial: rank 0 listens on the dialed port");
    }
    Ok(LaunchTopology {
        rank,
        rank_source,
        local_rank,
        coordinator: format!("{host}:{port}"),
        coordinator_source,
        listen_port: port,
    })
}

/// The model path of a config, resolved like the original (relative to the working directory).
pub fn model_path_of(config_path: &Path) -> Result<PathBuf, ClusterError> {
    let loaded = load_config(config_path)?;
    let cwd = std::env::current_dir().map_err(ClusterError::Cwd)?;
    Ok(stageb_shared::config::resolve_config_path(
        Path::new(&loaded.config.model.model_name_or_path),
        &cwd,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology(vars: &[(&str, &str)], listen_port: Option<u16>) -> LaunchTopology {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        topology_from(
            |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()),
            listen_port,
        )
        .unwrap()
    }

    /// Regression: under torchrun rank 0 listened on --listen-port (50051) while the other
    /// ranks dialed MASTER_PORT+1, so they never connected and rank 0 worked alone.
    #[test]
    fn under_torchrun_rank_0_listens_where_the_other_ranks_dial() {
        let env = [
            ("MASTER_ADDR", "node-a"),
            ("MASTER_PORT", "29500"),
            ("WORLD_SIZE", "4"),
        ];
        let rank0 = topology(&[env.as_slice(), &[("RANK", "0")]].concat(), None);
        let rank3 = topology(&[env.as_slice(), &[("RANK", "3")]].concat(), None);
        assert_eq!(rank0.listen_port, 29501);
        assert_eq!(rank3.coordinator, "node-a:29501");
        assert_eq!(rank3.rank, 3);
        // An explicit coordinator wins over torchrun's variables, and rank 0 serves its port.
        let explicit = [("STAGEB_COORDINATOR", "head:7000"), ("RANK", "0")];
        let t = topology(&[env.as_slice(), &explicit].concat(), Some(50051));
        assert_eq!((t.coordinator.as_str(), t.listen_port), ("head:7000", 7000));
    }

    #[test]
    fn without_launcher_variables_the_listen_port_names_the_port() {
        let t = topology(&[], Some(6000));
        assert_eq!(
            (t.coordinator.as_str(), t.listen_port),
            ("127.0.0.1:6000", 6000)
        );
        assert_eq!(topology(&[], None).listen_port, DEFAULT_LAUNCH_PORT);
        let slurm = topology(
            &[("SLURM_PROCID", "2"), ("STAGEB_COORDINATOR", "n1:50051")],
            None,
        );
        assert_eq!(slurm.rank, 2);
    }
}
