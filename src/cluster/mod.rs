//! Process roles. Every role talks gRPC, even the embedded default: `stageb run` starts the
//! coordinator on loopback and N local workers in the same process, so the single-machine path
//! exercises exactly the protocol a multi-node run uses.
//!
//! # Layout
//! - this file: [`ClusterError`], [`CoordinatorSettings`] and their defaults.
//! - `inputs.rs`: the config and Stage-A inputs a role starts from ([`prepare_inputs`],
//!   [`model_path_of`]).
//! - `model.rs`: the model rank 0 pins a run to and the context it plans with
//!   ([`run_context`], [`declared_context`]).
//! - `rank0.rs`: serving one run as rank 0 ([`run_coordinator_until`]) and the drain on
//!   SIGTERM/SIGINT.
//! - `local_workers.rs`: workers started in this process ([`spawn_local_workers`],
//!   [`worker_name`]).
//! - `topology.rs`: a process's place in a launched job ([`resolve_topology`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use stageb_coordinator::cluster::edge::EdgeLimits;
use stageb_coordinator::cluster::server;
pub use stageb_coordinator::run::start::StartMode;
use stageb_coordinator::run::{ProgressHandle, RunError};
use stageb_shared::auth::AuthToken;
use stageb_shared::error::InputError;
use stageb_shared::tls::ServerTls;

mod inputs;
mod local_workers;
mod model;
mod rank0;
mod topology;

pub use inputs::{model_path_of, prepare_inputs};
pub use local_workers::{LocalWorkers, spawn_local_workers, worker_name};
pub use model::{declared_context, run_context};
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
}

/// Default [`CoordinatorSettings::drain_timeout`]: room for a few long reflection jobs, and
/// 30 s under the two minutes Slurm's `--signal=TERM@120` and our pod spec's grace give.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(90);
