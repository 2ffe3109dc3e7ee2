//! The `stageb` binary: parse arguments, set up logging, call the library, map errors to the
//! documented exit codes (see [`stageb::exit`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use clap::{Args, Parser, Subcommand};
use stageb::cluster::{self, ClusterError, CoordinatorSettings, StartMode};
use stageb::exit;
use stageb_shared::auth::AuthToken;
use stageb_shared::domain::ChatMessage;
use stageb_shared::error::{ErrorCode, InputError};
use stageb_shared::limits::ContextSource;
use stageb_shared::telemetry::{LogFormat, init_tracing};
use stageb_shared::tls::{ClientTls, ServerTls};
use stageb_worker::client::{WorkerOptions, run_worker};
use stageb_worker::engine::{
    CandleEngine, DecodeRequest, DeviceSpec, Engine, EngineOptions, KernelChoice, Numerics,
    RolloutRequest,
};

/// `stageb --version`: the version and the compute backend this binary was built with, so a
/// launcher can tell a CPU-only build before it asks for GPUs (`scripts/stage_b.sh` does).
const VERSION: &str = if cfg!(feature = "cuda") {
    concat!(env!("CARGO_PKG_VERSION"), " (cuda)")
} else {
    concat!(env!("CARGO_PKG_VERSION"), " (cpu)")
};

/// Stage-B training-free verdict loop on a cluster of workers.
#[derive(Parser)]
#[command(name = "stageb", version = VERSION, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log format: text or json (logs go to stderr).
    #[arg(long, global = true, env = "STAGEB_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// Device: auto (CUDA at LOCAL_RANK when built with `cuda`, else CPU), cpu, cuda:N.
    #[arg(long, env = "STAGEB_DEVICE", default_value = "auto")]
    device: String,
    /// Compute threads per worker (default: all cores).
    #[arg(long, env = "STAGEB_THREADS")]
    threads: Option<usize>,
    /// Context length in tokens (prompt + generated) this worker holds; default: what the model
    /// declares (GGUF `*.context_length`, `config.json` `max_position_embeddings`). Rank 0
    /// refuses a worker that holds less than the run plans with.
    #[arg(long, env = "STAGEB_MAX_MODEL_LEN")]
    max_model_len: Option<u32>,
    /// Matmul arithmetic on the CPU: int8 (activations rounded to 8 bits per block of 32,
    /// integer dot products; fast) or f32 (exact weights, f32 activations). Part of the model
    /// fingerprint: every worker of a run must use the same.
    #[arg(long, env = "STAGEB_NUMERICS", default_value = "int8")]
    numerics: Numerics,
    /// CPU kernels: auto (the best this CPU has) or at most avx512vnni, avx512bw, avx2 or
    /// scalar. Every choice computes the same bits; for benchmarks and diagnosis.
    #[arg(long, env = "STAGEB_KERNELS", default_value = "auto")]
    kernels: KernelChoice,
    /// MiB of recent rollout prompts' KV a worker keeps, so the next ticket's prefill starts
    /// after the system prompt and guidance they share (CPU fast path; 0 = off). Results are
    /// the same bits either way.
    #[arg(long, env = "STAGEB_PREFIX_CACHE_MIB", default_value_t = 256)]
    prefix_cache_mib: usize,
}

/// What to do when the run directory already holds a run.
#[derive(Args, Clone, Copy)]
struct StartArgs {
    /// Continue the run in the run directory: answers it already has are replayed from its job
    /// journal, the rest is computed (starts fresh when there is nothing to continue).
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Replace the run in the run directory, if any.
    #[arg(long)]
    overwrite: bool,
}

/// The Prometheus endpoint.
#[derive(Args, Clone, Copy)]
struct MetricsArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (off by default; e.g. 127.0.0.1:9464).
    /// Under `launch`, a rank's port is this port plus its local rank, so ranks sharing a node
    /// never collide.
    #[arg(long, env = "STAGEB_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

impl MetricsArgs {
    /// Start the endpoint when asked, `port_offset` added to the port (local rank).
    async fn start(self, port_offset: u32) -> Result<()> {
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
struct DrainArgs {
    /// On SIGTERM/SIGINT, wait this long for the jobs in flight (no new leases meanwhile),
    /// then exit 75: interrupted, resumable with --resume.
    #[arg(long, env = "STAGEB_DRAIN_TIMEOUT_S", default_value_t = cluster::DEFAULT_DRAIN_TIMEOUT.as_secs())]
    drain_timeout_s: u64,
}

/// The HTML report rank 0 writes beside the artifacts when a run completes.
#[derive(Args, Clone, Copy)]
struct ReportArgs {
    /// Do not write `report.html` into the run directory at the end of the run.
    #[arg(long, env = "STAGEB_NO_REPORT")]
    no_report: bool,
}

/// `stageb report --audit`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum AuditChoice {
    Auto,
    Always,
    Never,
}

/// Limits of the coordinator's gRPC edge (the rest are fixed; docs/ARCHITECTURE.md §11.2).
#[derive(Args, Clone, Copy)]
struct EdgeArgs {
    /// Most connections held at once (default: 4096, lowered to fit the descriptor limit).
    #[arg(long, env = "STAGEB_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Seconds to wait for open connections at shutdown before closing them.
    #[arg(long, env = "STAGEB_SHUTDOWN_GRACE_S", default_value_t = 5)]
    shutdown_grace_s: u64,
}

impl EdgeArgs {
    fn limits(self) -> stageb_coordinator::cluster::edge::EdgeLimits {
        let mut limits = stageb_coordinator::cluster::edge::EdgeLimits::default();
        if let Some(n) = self.max_connections {
            limits.max_connections = n.max(1);
        }
        limits.shutdown_grace = Duration::from_secs(self.shutdown_grace_s);
        limits
    }
}

impl StartArgs {
    fn mode(self) -> StartMode {
        match (self.resume, self.overwrite) {
            (true, _) => StartMode::Resume,
            (_, true) => StartMode::Overwrite,
            _ => StartMode::Fresh,
        }
    }
}

/// TLS on the coordinator's gRPC port.
#[derive(Args, Clone)]
struct ServerTlsArgs {
    /// The coordinator's certificate (PEM); with --tls-key, the port serves TLS only.
    #[arg(long, env = "STAGEB_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "STAGEB_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// CA that worker certificates must chain to: every worker must present one (mutual TLS).
    #[arg(long, env = "STAGEB_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf>,
}

impl ServerTlsArgs {
    fn load(&self) -> Result<Option<ServerTls>> {
        Ok(ServerTls::from_files(
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
            self.tls_client_ca.as_deref(),
        )?)
    }
}

/// TLS toward the coordinator, as a worker.
#[derive(Args, Clone)]
struct WorkerTlsArgs {
    /// CA to verify the coordinator's certificate with (PEM): the worker dials TLS.
    #[arg(long, env = "STAGEB_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// This worker's certificate for mutual TLS (PEM).
    #[arg(long, env = "STAGEB_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "STAGEB_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Name expected in the coordinator's certificate (default: the host dialed).
    #[arg(long, env = "STAGEB_TLS_SERVER_NAME")]
    tls_server_name: Option<String>,
}

impl WorkerTlsArgs {
    fn load(&self) -> Result<Option<ClientTls>> {
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
struct LaunchTlsArgs {
    #[command(flatten)]
    server: ServerTlsArgs,
    /// CA to verify the coordinator with (default: --tls-client-ca).
    #[arg(long, env = "STAGEB_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Name expected in the coordinator's certificate (default: the host dialed).
    #[arg(long, env = "STAGEB_TLS_SERVER_NAME")]
    tls_server_name: Option<String>,
}

impl LaunchTlsArgs {
    fn client(&self) -> Result<Option<ClientTls>> {
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
enum Command {
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

fn engine_options(args: &ModelArgs) -> Result<EngineOptions> {
    let device: DeviceSpec = args.device.parse().map_err(|e| anyhow!("{e}"))?;
    stageb_worker::engine::int8::choose(args.kernels);
    Ok(EngineOptions {
        device,
        threads: args.threads,
        max_context: args.max_model_len.map(|n| n as usize),
        numerics: args.numerics,
        prefix_cache_bytes: args.prefix_cache_mib.saturating_mul(1 << 20),
        ..EngineOptions::default()
    })
}

fn load_engine(model: &Path, args: &ModelArgs) -> Result<CandleEngine> {
    let options = engine_options(args)?;
    Ok(load_model(model, &options)?)
}

/// Load a model, reporting a missing or unloadable file as bad input (exit code 2) with a
/// stable code: at startup the model file is the user's input like any other.
fn load_model(model: &Path, options: &EngineOptions) -> Result<CandleEngine, InputError> {
    if !model.exists() {
        return Err(InputError::new(
            ErrorCode::FileNotFound,
            model.display().to_string(),
            None,
            "model not found (scripts/fetch-model.sh fetches the demo model)",
        ));
    }
    CandleEngine::load(model, options).map_err(|e| {
        InputError::new(
            ErrorCode::UnsupportedModel,
            model.display().to_string(),
            None,
            e.to_string(),
        )
    })
}

/// Map a failure to its exit code: bad input is 2, an interrupted run 75, everything else 3.
fn classify(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<ClusterError>() {
        Some(ClusterError::Interrupted { .. }) => exit::INTERRUPTED,
        Some(ClusterError::Input(_)) | Some(ClusterError::Launch(_)) => exit::INPUT_ERROR,
        Some(ClusterError::Bind(stageb_coordinator::cluster::server::BindError::Policy(_))) => {
            exit::INPUT_ERROR
        }
        Some(ClusterError::Run(stageb_coordinator::run::RunError::Guidance(
            stageb_coordinator::guidance::GuidanceError::Input(_),
        ))) => exit::INPUT_ERROR,
        // The mission and run names come from the user's files: a bad one is bad input.
        Some(ClusterError::Run(stageb_coordinator::run::RunError::BadMission(_))) => {
            exit::INPUT_ERROR
        }
        _ if e
            .downcast_ref::<stageb_shared::error::InputError>()
            .is_some() =>
        {
            exit::INPUT_ERROR
        }
        _ if e.downcast_ref::<stageb_shared::auth::AuthError>().is_some() => exit::INPUT_ERROR,
        _ if matches!(
            e.downcast_ref::<stageb_inspect::report::ReportError>(),
            Some(stageb_inspect::report::ReportError::RunDir(_))
        ) =>
        {
            exit::INPUT_ERROR
        }
        _ if e.downcast_ref::<stageb_shared::tls::TlsError>().is_some() => exit::INPUT_ERROR,
        _ if matches!(
            e.downcast_ref::<stageb::certs::CertError>(),
            Some(stageb::certs::CertError::Validity)
        ) =>
        {
            exit::INPUT_ERROR
        }
        _ => exit::RUNTIME_ERROR,
    }
}

/// Whether logs are JSON lines: then the closing lines (the run's outcome, the error) are
/// JSON events too, so a log shipper never meets a plain-text line.
static JSON_LOGS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn json_logs() -> bool {
    JSON_LOGS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Report the error a command ended with, and return its exit code.
fn report_error(e: &anyhow::Error) -> u8 {
    let code = classify(e);
    if json_logs() {
        tracing::error!(exit_code = code, "{e:#}");
    } else {
        eprintln!("error: {e:#}");
    }
    code
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    JSON_LOGS.store(
        cli.log_format == LogFormat::Json,
        std::sync::atomic::Ordering::Relaxed,
    );
    // Connections, artifacts and the model all need descriptors: use what the system allows.
    stageb_coordinator::cluster::edge::raise_fd_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(exit::RUNTIME_ERROR);
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => ExitCode::from(report_error(&e)),
    }
}

/// The end of a completed run on rank 0: the report beside the artifacts (unless
/// `--no-report`), then the outcome line and exit code. A report that cannot be written is a
/// warning: the run itself is complete and its artifacts are on disk.
async fn finish_run(summary: &stageb_coordinator::run::RunSummary, report: ReportArgs) -> u8 {
    if !report.no_report {
        let run_dir = summary.run_dir.clone();
        let options = stageb_inspect::report::Options::default();
        match tokio::task::spawn_blocking(move || stageb_inspect::report::write(&run_dir, &options))
            .await
        {
            Ok(Ok(path)) => tracing::info!(report = %path.display(), "report written"),
            Ok(Err(e)) => tracing::warn!("no report: {e}"),
            Err(e) => tracing::warn!("no report: {e}"),
        }
    }
    summary_code(summary)
}

fn summary_code(summary: &stageb_coordinator::run::RunSummary) -> u8 {
    let code = if summary.hard_failures > 0 {
        exit::COMPLETED_WITH_FAILURES
    } else {
        exit::OK
    };
    if json_logs() {
        tracing::info!(
            tickets = summary.tickets,
            epochs = summary.epochs,
            candidates = summary.candidates,
            malformed = summary.malformed_candidates,
            hard_failures = summary.hard_failures,
            guidance_step = summary.guidance_step,
            need_review = summary.need_review,
            run_dir = %summary.run_dir.display(),
            exit_code = code,
            "run complete"
        );
    } else {
        eprintln!(
            "run complete: {} tickets × {} epochs, {} candidates ({} malformed), {} hard failures, guidance step {}, {} need-review rows\nartifacts: {}",
            summary.tickets,
            summary.epochs,
            summary.candidates,
            summary.malformed_candidates,
            summary.hard_failures,
            summary.guidance_step,
            summary.need_review,
            summary.run_dir.display()
        );
    }
    code
}

/// A worker's exit code: 0 when the run is over, [`exit::INTERRUPTED`] when it left early
/// (its own signal, or a draining rank 0): the run still needs workers, so a scheduler should
/// bring it back.
fn worker_code(summary: &stageb_worker::client::WorkerSummary) -> u8 {
    use stageb_worker::client::WorkerEnd;
    tracing::info!(
        jobs = summary.jobs_done,
        failed = summary.jobs_failed,
        cancelled = summary.jobs_cancelled,
        end = ?summary.end,
        "worker finished"
    );
    match summary.end {
        WorkerEnd::RunOver => exit::OK,
        WorkerEnd::Drained | WorkerEnd::Interrupted => exit::INTERRUPTED,
    }
}

/// SIGINT or SIGTERM, whichever comes first. The handlers are installed when this is called,
/// not when the future is first polled: a signal that arrives while the model loads or rank 0
/// starts up is kept and acted on (a drain) instead of killing the process outright. Call it
/// first thing in the commands that stop gracefully, and only there: once installed, the
/// default action of these signals is gone for the life of the process.
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                _ => std::future::pending().await,
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn dispatch(command: Command) -> Result<u8> {
    match command {
        Command::Run {
            config,
            workers,
            listen,
            model,
            start,
            drain,
            metrics,
            report,
        } => {
            let interrupt = shutdown_signal();
            if workers == 0 {
                return Err(ClusterError::Launch(
                    "--workers must be at least 1 (use `stageb coordinator` for a coordinator alone)".into(),
                )
                .into());
            }
            let inputs = cluster::prepare_inputs(&config, "embedded")?;
            metrics.start(0).await?;
            let model_path = PathBuf::from(&inputs.config.model.model_name_or_path);
            // Fail on a bad model before starting anything.
            let options = engine_options(&model)?;
            let first = load_model(&model_path, &options)?;
            if start.mode() == StartMode::Resume
                && let Some(recorded) =
                    stageb_coordinator::run::start::recorded_fingerprint(&inputs)
                && recorded != first.fingerprint().id()
            {
                return Err(ClusterError::Input(stageb_shared::error::InputError::new(
                    stageb_shared::error::ErrorCode::ResumeMismatch,
                    model_path.display().to_string(),
                    None,
                    format!(
                        "cannot resume: the run used the model {recorded}, this one is {}; \
                         use that model, or pass --overwrite to start over",
                        first.fingerprint().id()
                    ),
                ))
                .into());
            }
            let settings = CoordinatorSettings {
                listen,
                // The embedded run makes its own token: loopback today, but never unauthenticated.
                token: Some(AuthToken::generate()),
                tls: None,
                edge_limits: Default::default(),
                worker_grace: Duration::from_secs(120),
                progress_every: Duration::from_secs(10),
                show_progress: true,
                progress: None,
                start: start.mode(),
                drain_timeout: Duration::from_secs(drain.drain_timeout_s),
            };
            let first = std::sync::Mutex::new(Some(first));
            let summary = cluster::run_coordinator_until(
                inputs,
                settings,
                move |addr, token| {
                    cluster::spawn_local_workers(workers, addr, token, None, move |i| {
                        if let Some(engine) = first
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .take()
                            .filter(|_| i == 0)
                        {
                            return Ok(engine);
                        }
                        CandleEngine::load(&model_path, &options).map_err(|e| e.to_string())
                    })
                },
                interrupt,
            )
            .await?;
            Ok(finish_run(&summary, report).await)
        }
        Command::Coordinator {
            config,
            listen,
            token_file,
            worker_grace_s,
            start,
            drain,
            metrics,
            report,
            tls,
            edge,
        } => {
            let interrupt = shutdown_signal();
            let token = AuthToken::from_sources(token_file.as_deref())?;
            let tls = tls.load()?;
            let inputs = cluster::prepare_inputs(&config, "cluster")?;
            metrics.start(0).await?;
            let settings = CoordinatorSettings {
                listen,
                token,
                tls,
                edge_limits: edge.limits(),
                worker_grace: Duration::from_secs(worker_grace_s),
                progress_every: Duration::from_secs(10),
                show_progress: true,
                progress: None,
                start: start.mode(),
                drain_timeout: Duration::from_secs(drain.drain_timeout_s),
            };
            let summary =
                cluster::run_coordinator_until(inputs, settings, |_, _| Vec::new(), interrupt)
                    .await?;
            Ok(finish_run(&summary, report).await)
        }
        Command::Worker {
            coordinator,
            model,
            token_file,
            model_args,
            metrics,
            connect_timeout_s,
            reconnect_timeout_s,
            tls,
        } => {
            let interrupt = shutdown_signal();
            let token = AuthToken::from_sources(token_file.as_deref())?;
            metrics.start(0).await?;
            let tls = tls.load()?;
            let engine =
                tokio::task::spawn_blocking(move || load_engine(&model, &model_args)).await??;
            let opts = WorkerOptions {
                coordinator,
                token,
                tls,
                name: cluster::worker_name(0),
                device: engine.fingerprint().device.clone(),
                run_id: String::new(),
                connect_timeout: Duration::from_secs(connect_timeout_s),
                reconnect_timeout: Duration::from_secs(reconnect_timeout_s),
            };
            let summary = run_worker(engine, opts, interrupt).await?;
            Ok(worker_code(&summary))
        }
        Command::Launch {
            config,
            listen_port,
            token_file,
            model,
            start,
            drain,
            metrics,
            report,
            tls,
            edge,
            reconnect_timeout_s,
        } => {
            let interrupt = shutdown_signal();
            let topo = cluster::resolve_topology(listen_port)?;
            let client_tls = tls.client()?;
            tracing::info!(rank = topo.rank, rank_from = %topo.rank_source, local_rank = topo.local_rank,
                           coordinator = %topo.coordinator, coordinator_from = %topo.coordinator_source, "launch topology");
            let token = AuthToken::from_sources(token_file.as_deref())?;
            metrics.start(topo.local_rank).await?;
            let model_path = cluster::model_path_of(&config)?;
            let mut model = model;
            if model.device == "auto" && cfg!(feature = "cuda") {
                model.device = format!("cuda:{}", topo.local_rank);
            }
            if topo.rank == 0 {
                let inputs = cluster::prepare_inputs(&config, "cluster")?;
                let listen: SocketAddr = ([0, 0, 0, 0], topo.listen_port).into();
                let settings = CoordinatorSettings {
                    listen,
                    token,
                    tls: tls.server.load()?,
                    edge_limits: edge.limits(),
                    worker_grace: Duration::from_secs(600),
                    progress_every: Duration::from_secs(10),
                    show_progress: true,
                    progress: None,
                    start: start.mode(),
                    drain_timeout: Duration::from_secs(drain.drain_timeout_s),
                };
                let options = engine_options(&model)?;
                let summary = cluster::run_coordinator_until(
                    inputs,
                    settings,
                    move |addr, token| {
                        let local: SocketAddr = ([127, 0, 0, 1], addr.port()).into();
                        cluster::spawn_local_workers(1, local, token, client_tls, move |_| {
                            CandleEngine::load(&model_path, &options).map_err(|e| e.to_string())
                        })
                    },
                    interrupt,
                )
                .await?;
                Ok(finish_run(&summary, report).await)
            } else {
                let engine =
                    tokio::task::spawn_blocking(move || load_engine(&model_path, &model)).await??;
                let opts = WorkerOptions {
                    coordinator: topo.coordinator,
                    token,
                    tls: client_tls,
                    name: cluster::worker_name(topo.rank as usize),
                    device: engine.fingerprint().device.clone(),
                    run_id: String::new(),
                    connect_timeout: Duration::from_secs(600),
                    reconnect_timeout: Duration::from_secs(reconnect_timeout_s),
                };
                let summary = run_worker(engine, opts, interrupt).await?;
                Ok(worker_code(&summary))
            }
        }
        Command::TlsInit { dir, hosts, days } => {
            let written = stageb::certs::write_job_certificates(&dir, &hosts, days)?;
            for path in written {
                println!("{}", path.display());
            }
            Ok(exit::OK)
        }
        Command::Validate { config } => validate(&config),
        Command::Generate {
            model,
            prompt_file,
            system_file,
            candidates,
            seed,
            temperature,
            top_p,
            repetition_penalty,
            max_new_tokens,
            unconstrained,
            json,
            model_args,
        } => {
            let user = std::fs::read_to_string(&prompt_file)
                .with_context(|| format!("reading {}", prompt_file.display()))?;
            let mut messages = Vec::new();
            if let Some(f) = system_file {
                messages.push(ChatMessage::system(
                    std::fs::read_to_string(&f)
                        .with_context(|| format!("reading {}", f.display()))?,
                ));
            }
            messages.push(ChatMessage::user(user));
            let seeds: Vec<u64> = (0..candidates)
                .map(|s| stageb_shared::seed::candidate_seed(seed, 0, "generate", 0, s))
                .collect();
            let request = RolloutRequest {
                messages,
                decodes: vec![DecodeRequest {
                    decode_index: 0,
                    temperature,
                    top_p,
                    repetition_penalty,
                    max_new_tokens,
                    seeds,
                }],
                constrained: !unconstrained,
            };
            let mut engine = load_engine(&model, &model_args)?;
            let out = engine
                .rollout(&request)
                .map_err(|e| anyhow!("{e} [{}]", e.code()))?;
            let fingerprint = engine.fingerprint().clone();
            for c in &out.candidates {
                let parsed = stageb_shared::contract::parse(&c.text);
                if json {
                    let row = serde_json::json!({
                        "sample_index": c.sample_index,
                        "seed": c.seed,
                        "text": c.text,
                        "format_ok": parsed.is_ok(),
                        "verdict": parsed.as_ref().ok().map(|p| p.verdict),
                        "reason": parsed.as_ref().ok().map(|p| p.reason.clone()),
                        "violation": parsed.as_ref().err().map(|v| v.code.code()),
                        "prompt_tokens": out.prompt_tokens,
                        "completion_tokens": c.completion_tokens,
                        "finish_reason": c.finish.as_str(),
                        "model_fingerprint": fingerprint,
                    });
                    println!("{row}");
                } else {
                    let status = match &parsed {
                        Ok(_) => "ok".to_string(),
                        Err(v) => format!("MALFORMED {}", v.code.code()),
                    };
                    println!(
                        "--- candidate {} (seed {}, {} tokens, {status})\n{}",
                        c.sample_index, c.seed, c.completion_tokens, c.text
                    );
                }
            }
            if !json {
                eprintln!(
                    "prompt {} tokens, prefill {:.2}s, decode {:.2}s, model {}",
                    out.prompt_tokens,
                    out.prefill_us as f64 / 1e6,
                    out.decode_us as f64 / 1e6,
                    fingerprint.id()
                );
            }
            Ok(exit::OK)
        }
        Command::Audit { run_dir, json } => {
            let report = stageb_inspect::audit::audit(&run_dir);
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                for v in &report.violations {
                    println!("{v}");
                }
                println!(
                    "audited {}: {} tickets, {} epochs, {} selections, {} trajectories, {} reflection cycles: {}",
                    run_dir.display(),
                    report.tickets,
                    report.epochs,
                    report.selections,
                    report.trajectories,
                    report.reflection_cycles,
                    if report.ok() {
                        "OK".to_string()
                    } else {
                        format!("{} violations", report.violations.len())
                    }
                );
            }
            Ok(if report.ok() {
                exit::OK
            } else {
                exit::AUDIT_FAILED
            })
        }
        Command::Report {
            run_dir,
            out,
            audit,
        } => {
            let options = stageb_inspect::report::Options {
                out,
                audit: match audit {
                    AuditChoice::Auto => stageb_inspect::report::AuditMode::Auto,
                    AuditChoice::Always => stageb_inspect::report::AuditMode::Always,
                    AuditChoice::Never => stageb_inspect::report::AuditMode::Never,
                },
            };
            let path = tokio::task::spawn_blocking(move || {
                stageb_inspect::report::write(&run_dir, &options)
            })
            .await??;
            println!("{}", path.display());
            Ok(exit::OK)
        }
    }
}

/// `stageb validate`: config, Stage-A inputs, guidance section, model file; runs nothing.
/// The lengths a run of `inputs` would plan with, and every config value it would lower.
fn print_effective_limits(
    inputs: &stageb_coordinator::run::RunInputs,
    context: Option<stageb_shared::limits::RunContext>,
) {
    let Some(context) = context else {
        println!(
            "note: cannot read the model's context here; the first worker to register states it"
        );
        return;
    };
    let limits = stageb_shared::limits::EffectiveLimits::fit(&inputs.config, context);
    println!(
        "context: {} tokens (from the {}); rollouts generate at most {:?} tokens, reflection \
         {} tokens after a prompt of at most {}",
        limits.context,
        match limits.context_source {
            ContextSource::Model => "model file",
            ContextSource::Config => "config's model.max_model_len",
            ContextSource::FirstWorker => "first worker",
        },
        limits.rollout_max_new_tokens,
        limits.reflection_max_new_tokens,
        limits.reflection_prompt_budget()
    );
    for a in &limits.adjusted {
        println!(
            "warning: {} asks for {} tokens, the run uses {}: {}",
            a.key, a.asked, a.used, a.why
        );
    }
}

fn validate(config: &Path) -> Result<u8> {
    let inputs = cluster::prepare_inputs(config, "validate")?;
    let cfg = &inputs.config;
    stageb_coordinator::guidance::load_mission_section(
        &cfg.guidance.path,
        &inputs.ingested.mission,
    )?;
    let model = Path::new(&cfg.model.model_name_or_path);
    if !model.exists() {
        return Err(InputError::new(
            ErrorCode::FileNotFound,
            model.display().to_string(),
            None,
            "model file not found (run scripts/fetch-model.sh for the demo model)",
        )
        .into());
    }
    for prompt in [
        &cfg.reflection.decision_prompt_path,
        &cfg.reflection.ops_prompt_path,
    ]
    .into_iter()
    .flatten()
    {
        let text = std::fs::read_to_string(prompt).map_err(|e| {
            InputError::new(
                ErrorCode::FileNotFound,
                prompt.display().to_string(),
                None,
                format!("cannot read prompt: {e}"),
            )
        })?;
        if text.trim().is_empty() {
            return Err(InputError::new(
                ErrorCode::EmptyFile,
                prompt.display().to_string(),
                None,
                "prompt file is empty",
            )
            .into());
        }
    }
    // Decided before saying ok: a length the model cannot hold is an input error.
    let context = cluster::run_context(&inputs, cluster::declared_context(model))?;
    for n in &inputs.notices {
        println!("warning: {n}");
    }
    println!(
        "ok: mission {}, {} tickets, {} candidates per ticket, {} epochs, model {}",
        inputs.ingested.mission,
        inputs.ingested.tickets.len(),
        cfg.candidates_per_ticket(),
        cfg.runner.epochs,
        model.display()
    );
    print_effective_limits(&inputs, context);
    // What a start would do with the run directory (a plain start there would be refused).
    let dir = stageb_coordinator::run::run_dir(cfg, &inputs.ingested.mission)?;
    if dir
        .join(stageb_coordinator::artifacts::files::MANIFEST)
        .exists()
    {
        // The journal only holds what was answered since the last step checkpoint.
        let since = if dir
            .join(stageb_coordinator::run::checkpoint::CHECKPOINT_FILE)
            .exists()
        {
            " since its last step checkpoint"
        } else {
            ""
        };
        match stageb_coordinator::run::start::plan(&inputs, StartMode::Resume) {
            Ok(plan) => println!(
                "note: {} holds a run; start with --resume to continue it ({} answers journaled{since}) or --overwrite to replace it",
                dir.display(),
                plan.replay.len()
            ),
            Err(e) => println!(
                "note: {} holds a run that cannot be resumed ({e}); start with --overwrite to replace it",
                dir.display()
            ),
        }
    }
    Ok(exit::OK)
}
