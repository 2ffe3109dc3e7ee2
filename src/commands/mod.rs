//! What each command does, once its flags are parsed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use stageb::cluster::{self, ClusterError, CoordinatorSettings, StartMode};
use stageb::exit;
use stageb_shared::auth::AuthToken;
use stageb_shared::domain::ChatMessage;
use stageb_shared::error::{ErrorCode, InputError};
use stageb_worker::client::{WorkerOptions, run_worker};
use stageb_worker::engine::{
    CandleEngine, DecodeRequest, DeviceSpec, Engine, EngineOptions, RolloutRequest,
};

use crate::cli::{AuditChoice, Command, ModelArgs, ReportArgs};

mod validate;

pub(crate) fn engine_options(args: &ModelArgs) -> Result<EngineOptions> {
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

pub(crate) fn load_engine(model: &Path, args: &ModelArgs) -> Result<CandleEngine> {
    let options = engine_options(args)?;
    Ok(load_model(model, &options)?)
}

/// Load a model, reporting a missing or unloadable file as bad input (exit code 2) with a
/// stable code: at startup the model file is the user's input like any other.
pub(crate) fn load_model(
    model: &Path,
    options: &EngineOptions,
) -> Result<CandleEngine, InputError> {
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

/// Whether logs are JSON lines: then the closing lines (the run's outcome, the error) are
/// JSON events too, so a log shipper never meets a plain-text line.
pub(crate) static JSON_LOGS: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

pub(crate) fn json_logs() -> bool {
    JSON_LOGS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The end of a completed run on rank 0: the report beside the artifacts (unless
/// `--no-report`), then the outcome line and exit code. A report that cannot be written is a
/// warning: the run itself is complete and its artifacts are on disk.
pub(crate) async fn finish_run(
    summary: &stageb_coordinator::run::RunSummary,
    report: ReportArgs,
) -> u8 {
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

pub(crate) fn summary_code(summary: &stageb_coordinator::run::RunSummary) -> u8 {
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
pub(crate) fn worker_code(summary: &stageb_worker::client::WorkerSummary) -> u8 {
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
pub(crate) fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
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

pub(crate) async fn dispatch(command: Command) -> Result<u8> {
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
        Command::Validate { config } => validate::validate(&config),
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
