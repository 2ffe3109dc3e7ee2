//! Every flag of `stageb`, as clap types. A group of flags that several commands take is
//! declared once and flattened into each:
//! - this file: [`Cli`], [`Command`], the four roles' flags ([`RunArgs`], [`CoordinatorArgs`],
//!   [`WorkerArgs`], [`LaunchArgs`]) and the groups every role takes ([`MetricsArgs`],
//!   [`TokenArgs`]).
//! - `rank0.rs`: rank 0's flags ([`Rank0Args`]: the config, the start in a run directory, the
//!   drain, metrics and report, in `run`, `coordinator` and `launch`), the gRPC edge's limits
//!   and its TLS.
//! - `worker.rs`: a worker's flags ([`ModelArgs`]: device, threads, context, numerics, in
//!   `run`, `worker`, `launch` and `generate`) and its TLS toward rank 0.
//! - `tools.rs`: the one-shot commands (`tls-init`, `validate`, `generate`, `audit`, `report`,
//!   `compare`).
//! - `probe.rs`: the hidden diagnostics `stageb probe` (the GPU check's measurements).
//!
//! Every flag a launcher may set reads a `STAGEB_*` variable when it is not given (README.md,
//! "Flags and environment variables", lists them). Three read none on purpose: `--resume` and
//! `--overwrite` decide the fate of a run directory's artifacts, so they stay on the command
//! line (a variable left in a job's environment would replace the run at every requeue, and
//! clap counts even `STAGEB_RESUME=false` as given, which would make `--overwrite` an error);
//! `--token-file`'s variables (`STAGEB_TOKEN_FILE`, `STAGEB_TOKEN`) are read by
//! `stageb_shared::auth`, so the token's source never shows in `--help`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use stageb::roles::{self, ClusterError};
use stageb_shared::auth::AuthToken;
use stageb_shared::telemetry::LogFormat;

mod probe;
mod rank0;
mod tools;
mod worker;

pub(crate) use probe::{Probe, ProbeArgs, ProbeIdsArgs, ProbeLogitsArgs, ProbeRolloutArgs};
pub(crate) use rank0::{EdgeArgs, Rank0Args, ReportArgs, ServerTlsArgs};
pub(crate) use tools::{
    AuditArgs, CompareArgs, GenerateArgs, ReportCommandArgs, TlsInitArgs, ValidateArgs,
};
pub(crate) use worker::{LaunchTlsArgs, ModelArgs, WorkerTlsArgs, device_kind};

/// `stageb --version`: the version and the compute backend this binary was built with, so a
/// launcher can tell a CPU-only build before it asks for GPUs (`scripts/stage_b.sh` does):
/// `0.1.0 (cpu; built without cuda)` or `0.1.0 (cuda 13.0, sm_90a)` (`build.rs` writes the part
/// in parentheses).
pub(crate) const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("STAGEB_BUILD_BACKEND"),
    ")"
);

/// Stage-B training-free verdict loop on a cluster of workers.
#[derive(Parser)]
#[command(name = "stageb", version = VERSION, about, propagate_version = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Log format: text or json (logs go to stderr).
    #[arg(long, global = true, env = "STAGEB_LOG_FORMAT", default_value = "text")]
    pub(crate) log_format: LogFormat,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run a mission: coordinator plus local workers in one process (over loopback gRPC).
    Run(RunArgs),
    /// Serve a run as rank 0 only; workers join with `stageb worker`.
    Coordinator(CoordinatorArgs),
    /// Run one worker against a coordinator.
    Worker(WorkerArgs),
    /// Pick the role from the launcher's environment (torchrun, Slurm, Kubernetes, MPI):
    /// rank 0 serves the run and runs a local worker, other ranks run a worker.
    Launch(LaunchArgs),
    /// Make a certificate authority and one certificate for every rank of a job (mutual TLS):
    /// `ca.pem`, `node.pem`, `node.key` in DIR, readable by the owner only. The CA's key is
    /// not kept: nothing can be signed with it later.
    TlsInit(TlsInitArgs),
    /// Check a config and its inputs without running anything.
    Validate(ValidateArgs),
    /// Try the engine on one prompt.
    Generate(GenerateArgs),
    /// Re-derive a run's decisions from its artifacts and check every invariant.
    Audit(AuditArgs),
    /// Write a run's report: one self-contained HTML page (no network, no script) with the
    /// audit's verdict, accuracy, votes, malformed candidates, reflection, guidance history,
    /// need-review and throughput.
    Report(ReportCommandArgs),
    /// Compare a run's artifacts with a reference run's, aside runtime fields (timings,
    /// workers, wall-clock times, the config's path): exit 0 when identical, 1 when not (the
    /// first difference of each file is printed), 2 when a run cannot be read.
    Compare(CompareArgs),
    /// Diagnostics for the GPU check (docs/GPU-TEST.md): prompt ids, logits and greedy tokens,
    /// the timed rollout workload. Not part of a run.
    #[command(hide = true)]
    Probe(ProbeArgs),
}

/// `stageb run`.
#[derive(Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) rank0: Rank0Args,
    /// Local workers to start.
    #[arg(long, env = "STAGEB_WORKERS", default_value_t = 1)]
    pub(crate) workers: usize,
    /// Address the coordinator listens on (port 0 picks a free one).
    #[arg(long, env = "STAGEB_LISTEN", default_value = "127.0.0.1:0")]
    pub(crate) listen: SocketAddr,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
}

/// `stageb coordinator`.
#[derive(Args)]
pub(crate) struct CoordinatorArgs {
    #[command(flatten)]
    pub(crate) rank0: Rank0Args,
    #[arg(long, env = "STAGEB_LISTEN", default_value = "127.0.0.1:50051")]
    pub(crate) listen: SocketAddr,
    #[command(flatten)]
    pub(crate) token: TokenArgs,
    /// Give up after this many seconds without any live worker.
    #[arg(long, env = "STAGEB_WORKER_GRACE_S", default_value_t = roles::DEFAULT_WORKER_GRACE.as_secs())]
    pub(crate) worker_grace_s: u64,
    #[command(flatten)]
    pub(crate) tls: ServerTlsArgs,
    #[command(flatten)]
    pub(crate) edge: EdgeArgs,
    /// The numerics every worker must load the model with, as `DTYPE/DEVICE` (what a worker
    /// logs as `numerics=` when its model is loaded, e.g. `cpu-q8-fixed-order/cpu`).
    /// Without it the first worker to register decides them (rank 0 runs no worker here).
    #[arg(long, env = "STAGEB_WORKER_NUMERICS", value_parser = parse_worker_numerics)]
    pub(crate) worker_numerics: Option<String>,
    /// The sha256 of the model's weights (64 hex digits, as a worker logs it as
    /// `weights_sha256=` when its model is loaded; a GGUF file's sha256sum), for a host that
    /// cannot read the model: every worker's weights must have it. Else the config's
    /// `model.weights_sha256`, else rank 0 hashes the model itself; off loopback one of them
    /// is required.
    #[arg(long, env = "STAGEB_MODEL_DIGEST", value_parser = parse_model_digest)]
    pub(crate) model_digest: Option<String>,
}

/// `--model-digest`: 64 hex digits, kept lowercase.
fn parse_model_digest(value: &str) -> Result<String, String> {
    stageb_shared::config::parse_weights_sha256(value)
}

/// `--worker-numerics DTYPE/DEVICE` as the fingerprint's numerics
/// (`candle-<ver>|dtype|device`), if this build produces them.
fn parse_worker_numerics(value: &str) -> Result<String, String> {
    let (dtype, device) = value
        .split_once('/')
        .ok_or_else(|| format!("`{value}` is not DTYPE/DEVICE (e.g. cpu-q8-fixed-order/cpu)"))?;
    let version = stageb_worker::engine::CANDLE_VERSION;
    let numerics = format!("candle-{version}|{dtype}|{device}");
    if stageb_worker::engine::numerics_known(&numerics) {
        Ok(numerics)
    } else {
        Err(format!(
            "`{value}`: no worker of this build loads a model with these numerics \
             (dtypes: cpu-q8-fixed-order, cpu-f32-fixed-order, cpu-f32, cpu-bf16 on cpu; \
             cuda-f32, cuda-bf16 on cuda; gguf-quantized, f32-dequantized on either)"
        ))
    }
}

/// `stageb worker`.
#[derive(Args)]
pub(crate) struct WorkerArgs {
    /// Coordinator address, host:port.
    #[arg(long, env = "STAGEB_COORDINATOR")]
    pub(crate) coordinator: String,
    /// Model file (GGUF) or directory (safetensors).
    #[arg(long, env = "STAGEB_MODEL")]
    pub(crate) model: PathBuf,
    #[command(flatten)]
    pub(crate) token: TokenArgs,
    #[command(flatten)]
    pub(crate) model_args: ModelArgs,
    #[command(flatten)]
    pub(crate) metrics: MetricsArgs,
    /// Keep trying to reach the coordinator for this long.
    #[arg(long, env = "STAGEB_CONNECT_TIMEOUT_S", default_value_t = roles::DEFAULT_CONNECT_TIMEOUT.as_secs())]
    pub(crate) connect_timeout_s: u64,
    /// Once registered, exit when the coordinator stays unreachable this long (it is gone).
    #[arg(long, env = "STAGEB_RECONNECT_TIMEOUT_S", default_value_t = 60)]
    pub(crate) reconnect_timeout_s: u64,
    #[command(flatten)]
    pub(crate) tls: WorkerTlsArgs,
}

/// `stageb launch`: rank 0's flags and a worker's, the role decided by the environment.
#[derive(Args)]
pub(crate) struct LaunchArgs {
    #[command(flatten)]
    pub(crate) rank0: Rank0Args,
    /// Port rank 0 listens on (all interfaces; a token is required) and the other ranks
    /// dial, where no launcher variable names one (`STAGEB_COORDINATOR`'s port, torchrun's
    /// `MASTER_PORT+1`); default 50051.
    #[arg(long, env = "STAGEB_LISTEN_PORT")]
    pub(crate) listen_port: Option<u16>,
    #[command(flatten)]
    pub(crate) token: TokenArgs,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) tls: LaunchTlsArgs,
    #[command(flatten)]
    pub(crate) edge: EdgeArgs,
    /// Ranks > 0: once registered, exit when rank 0 stays unreachable this long (it is
    /// gone), giving the GPU back.
    #[arg(long, env = "STAGEB_RECONNECT_TIMEOUT_S", default_value_t = 60)]
    pub(crate) reconnect_timeout_s: u64,
}

/// The Prometheus endpoint.
#[derive(Args, Clone, Copy)]
pub(crate) struct MetricsArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (off by default; e.g. 127.0.0.1:9464).
    /// Under `launch`, a rank's port is this port plus its local rank, so ranks sharing a node
    /// never collide.
    #[arg(long, env = "STAGEB_METRICS_LISTEN")]
    pub(crate) metrics_listen: Option<SocketAddr>,
}

impl MetricsArgs {
    /// Start the endpoint when asked, `port_offset` added to the port (local rank).
    pub(crate) async fn start(self, port_offset: u32) -> Result<()> {
        if let Some(mut addr) = self.metrics_listen {
            if addr.port() != 0 {
                let port = u32::from(addr.port()) + port_offset;
                addr.set_port(u16::try_from(port).map_err(|_| {
                    ClusterError::Launch(format!("metrics port {port} is out of range"))
                })?);
            }
            stageb::metrics_endpoint::start(addr).await?;
        }
        Ok(())
    }
}

/// The shared token of a cluster (`coordinator`, `worker`, `launch`).
#[derive(Args, Clone)]
pub(crate) struct TokenArgs {
    /// File holding the shared token (else STAGEB_TOKEN_FILE or STAGEB_TOKEN).
    #[arg(long)]
    pub(crate) token_file: Option<PathBuf>,
}

impl TokenArgs {
    /// The token from `--token-file`, else the environment; `None` when none is configured.
    pub(crate) fn load(&self) -> Result<Option<AuthToken>> {
        Ok(AuthToken::from_sources(self.token_file.as_deref())?)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_worker_numerics;

    #[test]
    fn a_model_digest_is_64_hex_digits_kept_lowercase() {
        let digest = "AB".repeat(32);
        assert_eq!(super::parse_model_digest(&digest).unwrap(), "ab".repeat(32));
        assert!(super::parse_model_digest("abc").is_err());
        assert!(super::parse_model_digest(&"g".repeat(64)).is_err());
    }

    #[test]
    fn worker_numerics_are_dtype_slash_device_of_this_build() {
        let version = stageb_worker::engine::CANDLE_VERSION;
        assert_eq!(
            parse_worker_numerics("cpu-q8-fixed-order/cpu").unwrap(),
            format!("candle-{version}|cpu-q8-fixed-order|cpu")
        );
        assert!(parse_worker_numerics("cuda-bf16/cpu").is_err());
        assert!(parse_worker_numerics("cpu-q8-fixed-order").is_err());
    }
}
