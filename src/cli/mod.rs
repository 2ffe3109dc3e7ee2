//! Every flag of `stageb`: the clap types, and what each group of flags turns into.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use stageb::cluster::{self, ClusterError, StartMode};
use stageb_shared::telemetry::LogFormat;
use stageb_shared::tls::{ClientTls, ServerTls};
use stageb_worker::engine::{KernelChoice, Numerics};

/// `stageb --version`: the version and the compute backend this binary was built with, so a
/// launcher can tell a CPU-only build before it asks for GPUs (`scripts/stage_b.sh` does).
pub(crate) const VERSION: &str = if cfg!(feature = "cuda") {
    concat!(env!("CARGO_PKG_VERSION"), " (cuda)")
} else {
    concat!(env!("CARGO_PKG_VERSION"), " (cpu)")
};

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

#[derive(Args, Clone)]
pub(crate) struct ModelArgs {
    /// Device: auto (CUDA at LOCAL_RANK when built with `cuda`, else CPU), cpu, cuda:N.
    #[arg(long, env = "STAGEB_DEVICE", default_value = "auto")]
    pub(crate) device: String,
    /// Compute threads per worker (default: all cores).
    #[arg(long, env = "STAGEB_THREADS")]
    pub(crate) threads: Option<usize>,
    /// Context length in tokens (prompt + generated) this worker holds; default: what the model
    /// declares (GGUF `*.context_length`, `config.json` `max_position_embeddings`). Rank 0
    /// refuses a worker that holds less than the run plans with.
    #[arg(long, env = "STAGEB_MAX_MODEL_LEN")]
    pub(crate) max_model_len: Option<u32>,
    /// Matmul arithmetic on the CPU: int8 (activations rounded to 8 bits per block of 32,
    /// integer dot products; fast) or f32 (exact weights, f32 activations). Part of the model
    /// fingerprint: every worker of a run must use the same.
    #[arg(long, env = "STAGEB_NUMERICS", default_value = "int8")]
    pub(crate) numerics: Numerics,
    /// CPU kernels: auto (the best this CPU has) or at most avx512vnni, avx512bw, avx2 or
    /// scalar. Every choice computes the same bits; for benchmarks and diagnosis.
    #[arg(long, env = "STAGEB_KERNELS", default_value = "auto")]
    pub(crate) kernels: KernelChoice,
    /// MiB of recent rollout prompts' KV a worker keeps, so the next ticket's prefill starts
    /// after the system prompt and guidance they share (CPU fast path; 0 = off). Results are
    /// the same bits either way.
    #[arg(long, env = "STAGEB_PREFIX_CACHE_MIB", default_value_t = 256)]
    pub(crate) prefix_cache_mib: usize,
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

/// How rank 0 stops on SIGTERM/SIGINT.
#[derive(Args, Clone, Copy)]
pub(crate) struct DrainArgs {
    /// On SIGTERM/SIGINT, wait this long for the jobs in flight (no new leases meanwhile),
    /// then exit 75: interrupted, resumable with --resume.
    #[arg(long, env = "STAGEB_DRAIN_TIMEOUT_S", default_value_t = cluster::DEFAULT_DRAIN_TIMEOUT.as_secs())]
    pub(crate) drain_timeout_s: u64,
}

/// The HTML report rank 0 writes beside the artifacts when a run completes.
#[derive(Args, Clone, Copy)]
pub(crate) struct ReportArgs {
    /// Do not write `report.html` into the run directory at the end of the run.
    #[arg(long, env = "STAGEB_NO_REPORT")]
    pub(crate) no_report: bool,
}

/// `stageb report --audit`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum AuditChoice {
    Auto,
    Always,
    Never,
}

/// Limits of the coordinator's gRPC edge (the rest are fixed; docs/ARCHITECTURE.md §11.2).
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
    pub(crate) fn limits(self) -> stageb_coordinator::cluster::edge::EdgeLimits {
        let mut limits = stageb_coordinator::cluster::edge::EdgeLimits::default();
        if let Some(n) = self.max_connections {
            limits.max_connections = n.max(1);
        }
        limits.shutdown_grace = Duration::from_secs(self.shutdown_grace_s);
        limits
    }
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

/// TLS toward the coordinator, as a worker.
#[derive(Args, Clone)]
pub(crate) struct WorkerTlsArgs {
    /// CA to verify the coordinator's certificate with (PEM): the worker dials TLS.
    #[arg(long, env = "STAGEB_TLS_CA")]
    pub(crate) tls_ca: Option<PathBuf>,
    /// This worker's certificate for mutual TLS (PEM).
    #[arg(long, env = "STAGEB_TLS_CERT")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "STAGEB_TLS_KEY")]
    pub(crate) tls_key: Option<PathBuf>,
    /// Name expected in the coordinator's certificate (default: the host dialed).
    #[arg(long, env = "STAGEB_TLS_SERVER_NAME")]
    pub(crate) tls_server_name: Option<String>,
}

impl WorkerTlsArgs {
    pub(crate) fn load(&self) -> Result<Option<ClientTls>> {
        Ok(ClientTls::from_files(
            self.tls_ca.as_deref(),
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
            self.tls_server_name.as_deref(),
        )?)
    }
}

/// TLS for `launch`: rank 0 serves with the certificate and key; every rank (rank 0's local
/// worker too) dials with them as its client certificate.
#[derive(Args, Clone)]
pub(crate) struct LaunchTlsArgs {
    #[command(flatten)]
    pub(crate) server: ServerTlsArgs,
    /// CA to verify the coordinator with (default: --tls-client-ca).
    #[arg(long, env = "STAGEB_TLS_CA")]
    pub(crate) tls_ca: Option<PathBuf>,
    /// Name expected in the coordinator's certificate (default: the host dialed).
    #[arg(long, env = "STAGEB_TLS_SERVER_NAME")]
    pub(crate) tls_server_name: Option<String>,
}

impl LaunchTlsArgs {
    pub(crate) fn client(&self) -> Result<Option<ClientTls>> {
        WorkerTlsArgs {
            tls_ca: self
                .tls_ca
                .clone()
                .or_else(|| self.server.tls_client_ca.clone()),
            tls_cert: self.server.tls_cert.clone(),
            tls_key: self.server.tls_key.clone(),
            tls_server_name: self.tls_server_name.clone(),
        }
        .load()
    }
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run a mission: coordinator plus local workers in one process (over loopback gRPC).
    Run {
        /// The run config (YAML, the Python original's keys).
        #[arg(long)]
        config: PathBuf,
        /// Local workers to start.
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// Address the coordinator listens on (port 0 picks a free one).
        #[arg(long, env = "STAGEB_LISTEN", default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        start: StartArgs,
        #[command(flatten)]
        drain: DrainArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
        #[command(flatten)]
        report: ReportArgs,
    },
    /// Serve a run as rank 0 only; workers join with `stageb worker`.
    Coordinator {
        #[arg(long)]
        config: PathBuf,
        #[arg(long, env = "STAGEB_LISTEN", default_value = "127.0.0.1:50051")]
        listen: SocketAddr,
        /// File holding the shared token (else STAGEB_TOKEN_FILE or STAGEB_TOKEN).
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Give up after this many seconds without any live worker.
        #[arg(long, default_value_t = 600)]
        worker_grace_s: u64,
        #[command(flatten)]
        start: StartArgs,
        #[command(flatten)]
        drain: DrainArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
        #[command(flatten)]
        report: ReportArgs,
        #[command(flatten)]
        tls: ServerTlsArgs,
        #[command(flatten)]
        edge: EdgeArgs,
    },
    /// Run one worker against a coordinator.
    Worker {
        /// Coordinator address, host:port.
        #[arg(long, env = "STAGEB_COORDINATOR")]
        coordinator: String,
        /// Model file (GGUF) or directory (safetensors).
        #[arg(long, env = "STAGEB_MODEL")]
        model: PathBuf,
        #[arg(long)]
        token_file: Option<PathBuf>,
        #[command(flatten)]
        model_args: ModelArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
        /// Keep trying to reach the coordinator for this long.
        #[arg(long, default_value_t = 300)]
        connect_timeout_s: u64,
        /// Once registered, exit when the coordinator stays unreachable this long (it is gone).
        #[arg(long, env = "STAGEB_RECONNECT_TIMEOUT_S", default_value_t = 60)]
        reconnect_timeout_s: u64,
        #[command(flatten)]
        tls: WorkerTlsArgs,
    },
    /// Pick the role from the launcher's environment (torchrun, Slurm, Kubernetes, MPI):
    /// rank 0 serves the run and runs a local worker, other ranks run a worker.
    Launch {
        #[arg(long)]
        config: PathBuf,
        /// Port rank 0 listens on (all interfaces; a token is required) and the other ranks
        /// dial, where no launcher variable names one (`STAGEB_COORDINATOR`'s port, torchrun's
        /// `MASTER_PORT+1`); default 50051.
        #[arg(long, env = "STAGEB_LISTEN_PORT")]
        listen_port: Option<u16>,
        #[arg(long)]
        token_file: Option<PathBuf>,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        start: StartArgs,
        #[command(flatten)]
        drain: DrainArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
        #[command(flatten)]
        report: ReportArgs,
        #[command(flatten)]
        tls: LaunchTlsArgs,
        #[command(flatten)]
        edge: EdgeArgs,
        /// Ranks > 0: once registered, exit when rank 0 stays unreachable this long (it is
        /// gone), giving the GPU back.
        #[arg(long, env = "STAGEB_RECONNECT_TIMEOUT_S", default_value_t = 60)]
        reconnect_timeout_s: u64,
    },
    /// Make a certificate authority and one certificate for every rank of a job (mutual TLS):
    /// `ca.pem`, `node.pem`, `node.key` in DIR, readable by the owner only. The CA's key is
    /// not kept: nothing can be signed with it later.
    TlsInit {
        /// Directory to write into (created; on a shared filesystem for multi-node jobs).
        dir: PathBuf,
        /// Extra DNS names or IP addresses for the certificate (besides
        /// `stageb-coordinator`, `localhost`, `127.0.0.1`, `::1` and this host's name).
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// Days the certificates stay valid.
        #[arg(long, default_value_t = 7)]
        days: u32,
    },
    /// Check a config and its inputs without running anything.
    Validate { config: PathBuf },
    /// Try the engine on one prompt.
    Generate {
        #[arg(long, env = "STAGEB_MODEL")]
        model: PathBuf,
        /// File with the user message.
        #[arg(long)]
        prompt_file: PathBuf,
        /// Optional system message file.
        #[arg(long)]
        system_file: Option<PathBuf>,
        #[arg(long, default_value_t = 8)]
        candidates: u32,
        #[arg(long, default_value_t = 17)]
        seed: u64,
        #[arg(long, default_value_t = 0.7)]
        temperature: f32,
        #[arg(long, default_value_t = 0.9)]
        top_p: f32,
        #[arg(long, default_value_t = 1.0)]
        repetition_penalty: f32,
        #[arg(long, default_value_t = 48)]
        max_new_tokens: u32,
        /// Decode without the two-line contract constraint.
        #[arg(long)]
        unconstrained: bool,
        /// One JSON object per line per candidate.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        model_args: ModelArgs,
    },
    /// Re-derive a run's decisions from its artifacts and check every invariant.
    Audit {
        /// `{output.root}/{run_name}/{mission}`.
        run_dir: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a run's report: one self-contained HTML page (no network, no script) with the
    /// audit's verdict, accuracy, votes, malformed candidates, reflection, guidance history,
    /// need-review and throughput.
    Report {
        /// `{output.root}/{run_name}/{mission}`.
        run_dir: PathBuf,
        /// Where to write it (default: RUN_DIR/report.html).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Run `stageb audit` for the verdict at the top: auto skips it when the artifacts
        /// pass 256 MiB (the audit keeps every selection in memory).
        #[arg(long, value_enum, default_value_t = AuditChoice::Auto)]
        audit: AuditChoice,
    },
}
