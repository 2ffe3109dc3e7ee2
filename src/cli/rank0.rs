//! Rank 0's flags: [`Rank0Args`] (in `run`, `coordinator` and `launch`), and the gRPC edge's
//! limits and TLS (in `coordinator` and `launch`, which serve beyond loopback).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use stageb::roles::{self, CoordinatorSettings, StartMode};
use stageb_coordinator::cluster::edge::EdgeLimits;
use stageb_shared::tls::ServerTls;

use super::MetricsArgs;

/// What every rank 0 takes: the run, how it starts in its directory, how it stops, what it
/// exports and writes at the end.
#[derive(Args, Clone)]
pub(crate) struct Rank0Args {
    /// The run config (YAML, the Python original's keys).
    #[arg(long, env = "STAGEB_CONFIG")]
    pub(crate) config: PathBuf,
    #[command(flatten)]
    pub(crate) start: StartArgs,
    #[command(flatten)]
    pub(crate) drain: DrainArgs,
    #[command(flatten)]
    pub(crate) metrics: MetricsArgs,
    #[command(flatten)]
    pub(crate) report: ReportArgs,
}

impl Rank0Args {
    /// Rank 0's settings for serving on `listen`: the start and the drain from these flags,
    /// the library's defaults for the rest.
    pub(crate) fn settings(&self, listen: SocketAddr) -> CoordinatorSettings {
        CoordinatorSettings {
            start: self.start.mode(),
            drain_timeout: Duration::from_secs(self.drain.drain_timeout_s),
            ..CoordinatorSettings::new(listen)
        }
    }
}

/// What to do when the run directory already holds a run.
#[derive(Args, Clone, Copy)]
pub(crate) struct StartArgs {
    /// Continue the run in the run directory: answers it already has are replayed from its job
    /// journal, the rest is computed (starts fresh when there is nothing to continue).
    #[arg(long, conflicts_with = "overwrite")]
    pub(crate) resume: bool,
    /// Replace the run in the run directory, if any.
    #[arg(long)]
    pub(crate) overwrite: bool,
}

impl StartArgs {
    pub(crate) fn mode(self) -> StartMode {
        match (self.resume, self.overwrite) {
            (true, _) => StartMode::Resume,
            (_, true) => StartMode::Overwrite,
            _ => StartMode::Fresh,
        }
    }
}

/// How rank 0 stops on SIGTERM/SIGINT.
#[derive(Args, Clone, Copy)]
pub(crate) struct DrainArgs {
    /// On SIGTERM/SIGINT, wait this long for the jobs in flight (no new leases meanwhile),
    /// then exit 75: interrupted, resumable with --resume.
    #[arg(long, env = "STAGEB_DRAIN_TIMEOUT_S", default_value_t = roles::DEFAULT_DRAIN_TIMEOUT.as_secs())]
    pub(crate) drain_timeout_s: u64,
}

/// The HTML report rank 0 writes beside the artifacts when a run completes.
#[derive(Args, Clone, Copy)]
pub(crate) struct ReportArgs {
    /// Do not write `report.html` into the run directory at the end of the run.
    #[arg(long, env = "STAGEB_NO_REPORT")]
    pub(crate) no_report: bool,
}

/// Limits of the coordinator's gRPC edge (the rest are fixed; docs/design/security.md lists
/// them all).
#[derive(Args, Clone, Copy)]
pub(crate) struct EdgeArgs {
    /// Most connections held at once (default: 4096, lowered to fit the descriptor limit).
    #[arg(long, env = "STAGEB_MAX_CONNECTIONS")]
    pub(crate) max_connections: Option<usize>,
    /// Seconds to wait for open connections at shutdown before closing them.
    #[arg(long, env = "STAGEB_SHUTDOWN_GRACE_S", default_value_t = 5)]
    pub(crate) shutdown_grace_s: u64,
}

impl EdgeArgs {
    pub(crate) fn limits(self) -> EdgeLimits {
        let mut limits = EdgeLimits::default();
        if let Some(n) = self.max_connections {
            limits.max_connections = n.max(1);
        }
        limits.shutdown_grace = Duration::from_secs(self.shutdown_grace_s);
        limits
    }
}

/// TLS on the coordinator's gRPC port.
#[derive(Args, Clone)]
pub(crate) struct ServerTlsArgs {
    /// The coordinator's certificate (PEM); with --tls-key, the port serves TLS only.
    #[arg(long, env = "STAGEB_TLS_CERT")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "STAGEB_TLS_KEY")]
    pub(crate) tls_key: Option<PathBuf>,
    /// CA that worker certificates must chain to: every worker must present one (mutual TLS).
    #[arg(long, env = "STAGEB_TLS_CLIENT_CA")]
    pub(crate) tls_client_ca: Option<PathBuf>,
}

impl ServerTlsArgs {
    pub(crate) fn load(&self) -> Result<Option<ServerTls>> {
        Ok(ServerTls::from_files(
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
            self.tls_client_ca.as_deref(),
        )?)
    }
}
