//! What each command does once its flags are parsed, one module per command. Each hands the
//! work to the library crates and returns the exit code; errors go back to `main`, which maps
//! them to theirs.
//!
//! - `run.rs`, `coordinator.rs`, `worker.rs`, `launch.rs`: the roles (`launch` picks rank 0's
//!   or a worker's from the environment and reuses the other two's steps).
//! - `tls_init.rs`, `validate.rs`, `generate.rs`, `audit.rs`, `report.rs`, `compare.rs`: the
//!   one-shot commands.
//! - `probe.rs`: the hidden diagnostics of the GPU check.
//! - `outcome.rs`: the closing line and exit code of a run or a worker.
//! - this file: [`dispatch`] and [`shutdown_signal`].

use anyhow::Result;

use crate::cli::Command;

mod audit;
mod compare;
mod coordinator;
mod generate;
mod launch;
mod outcome;
mod probe;
mod report;
mod run;
mod tls_init;
mod validate;
mod worker;

pub(crate) use outcome::{json_logs, set_json_logs};

/// Run `command`; `Ok` holds its exit code.
pub(crate) async fn dispatch(command: Command) -> Result<u8> {
    match command {
        Command::Run(args) => run::run(args).await,
        Command::Coordinator(args) => coordinator::run(args).await,
        Command::Worker(args) => worker::run(args).await,
        Command::Launch(args) => launch::run(args).await,
        Command::TlsInit(args) => tls_init::run(args),
        Command::Validate(args) => validate::run(&args.config),
        Command::Generate(args) => generate::run(args),
        Command::Audit(args) => audit::run(args),
        Command::Report(args) => report::run(args).await,
        Command::Compare(args) => compare::run(args),
        Command::Probe(args) => probe::run(args),
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
