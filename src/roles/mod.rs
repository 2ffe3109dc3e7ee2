//! Process roles. Every role talks gRPC, even the embedded default: `stageb run` starts the
//! coordinator on loopback and N local workers in the same process, so the single-machine path
//! exercises exactly the protocol a multi-node run uses.
//!
//! # Layout
//! - this file: [`ClusterError`], [`CoordinatorSettings`] and the roles' timing defaults
//!   (drain, worker grace, progress period, connect timeouts).
//! - `inputs.rs`: the config and Stage-A inputs a role starts from ([`prepare_inputs`],
//!   [`model_path_of`]), recorded as the config wrote them.
//! - `model.rs`: the model: loading it at startup ([`load_model`]: a missing or unreadable
//!   file is bad input), the one rank 0 pins a run to, the context the run plans with
//!   ([`run_context`], [`declared_context`]).
//! - `rank0.rs`: serving one run as rank 0 ([`run_coordinator_until`]) and the drain on
//!   SIGTERM/SIGINT.
//! - `local_workers.rs`: workers started in this process ([`spawn_local_workers`],
//!   [`worker_name`]).
//! - `topology.rs`: a process's place in a launched job ([`resolve_topology`]).
//! - `device.rs`: the device each worker of this process opens ([`place_device`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use stageb_coordinator::cluster::edge::EdgeLimits;
use stageb_coordinator::cluster::server;
use stageb_coordinator::run::start::StartError;
pub use stageb_coordinator::run::start::StartMode;
use stageb_coordinator::run::{ProgressHandle, RunError};
use stageb_shared::auth::AuthToken;
use stageb_shared::config::{DeviceKind, Tuned};
use stageb_shared::error::InputError;
use stageb_shared::tls::ServerTls;

mod device;
mod inputs;
mod local_workers;
mod model;
mod rank0;
mod topology;

pub use device::place_device;
pub use inputs::{model_path_of, prepare_inputs, prepare_inputs_in};
pub use local_workers::{LocalPin, LocalStart, LocalWorkers, spawn_local_workers, worker_name};
pub use model::{declared_context, load_model, run_context};
pub use rank0::{run_coordinator, run_coordinator_until};
pub use topology::{DEFAULT_LAUNCH_PORT, LaunchTopology, resolve_topology, topology_from};

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
    /// Workers the run was started with (`run --workers N`, the launcher's world size; 0 when
    /// unknown): no worker leases more than its share of the work among this many.
    pub expected_workers: usize,
    /// The numerics every worker must present (`candle-<ver>|dtype|device`), decided by the
    /// operator (`stageb coordinator --worker-numerics`); `None`: rank 0's own worker decides,
    /// else the first acceptable worker.
    pub worker_numerics: Option<String>,
    /// Rank 0 starts no worker of its own (`stageb coordinator`): off loopback and nothing
    /// resumed, it then refuses to start without the weights decided (`model_digest` or a
    /// model it can read) and without `worker_numerics`.
    pub rank0_runs_no_worker: bool,
    /// The weights digest every worker's model must have, as the operator gave it
    /// (`--model-digest`, else the config's `model.weights_sha256`): for a rank 0 that cannot
    /// read the model. `None`: rank 0 hashes the config's model itself.
    pub model_digest: Option<String>,
    /// The kind of device the workers compute on, as far as rank 0 knows (its own workers'
    /// `--device`, the device of `--worker-numerics`): unset `runner.pipeline_*` keys take its
    /// defaults. `None`: unknown, the CPU's.
    pub workers_device: Option<DeviceKind>,
    /// The jobs each of rank 0's own workers holds (`--max-jobs`, else the device's default)
    /// and where that came from; `None` when it runs none.
    pub local_max_jobs: Option<Tuned>,
}

impl From<StartError> for ClusterError {
    fn from(e: StartError) -> Self {
        match e {
            StartError::Input(e) => ClusterError::Input(e),
            StartError::Run(e) => ClusterError::Run(e),
        }
    }
}

/// Default [`CoordinatorSettings::drain_timeout`]: room for a few long reflection jobs, and
/// 30 s under the two minutes Slurm's `--signal=TERM@120` and our pod spec's grace give.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(90);

/// Default [`CoordinatorSettings::worker_grace`] (`stageb coordinator --worker-grace-s`, and
/// `launch`'s rank 0): room for remote workers to start (a node to come up, a model to load)
/// or to come back after a restart.
pub const DEFAULT_WORKER_GRACE: Duration = Duration::from_secs(600);

/// [`CoordinatorSettings::worker_grace`] of `stageb run`: its workers live in its own process
/// and start at once, so none is coming from elsewhere; two minutes without a live one means
/// every one of them failed.
pub const EMBEDDED_WORKER_GRACE: Duration = Duration::from_secs(120);

/// Default [`CoordinatorSettings::progress_every`]: often enough for a scheduler's log to
/// show liveness, rarely enough not to flood it.
pub const DEFAULT_PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// How long a `stageb worker` keeps trying to reach rank 0 before giving up (its
/// `--connect-timeout-s` default).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(300);

/// How long `launch`'s ranks > 0 keep trying to reach rank 0: every rank starts at once, and
/// rank 0 hashes the model and opens the run before it serves.
pub const LAUNCH_CONNECT_TIMEOUT: Duration = Duration::from_secs(600);

impl CoordinatorSettings {
    /// Serve on `listen` with the defaults: no token and no TLS (loopback only, see
    /// `stageb_shared::auth`), the edge's default limits, [`DEFAULT_WORKER_GRACE`], progress
    /// shown every [`DEFAULT_PROGRESS_EVERY`], a fresh start, [`DEFAULT_DRAIN_TIMEOUT`], no
    /// expected worker count.
    pub fn new(listen: SocketAddr) -> Self {
        CoordinatorSettings {
            listen,
            token: None,
            tls: None,
            edge_limits: EdgeLimits::default(),
            worker_grace: DEFAULT_WORKER_GRACE,
            progress_every: DEFAULT_PROGRESS_EVERY,
            show_progress: true,
            progress: None,
            start: StartMode::Fresh,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            expected_workers: 0,
            worker_numerics: None,
            rank0_runs_no_worker: false,
            model_digest: None,
            workers_device: None,
            local_max_jobs: None,
        }
    }
}
