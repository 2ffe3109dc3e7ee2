//! The `stageb` binary: parse arguments, set up logging, hand the command to its module, map
//! errors to the documented exit codes (see [`stageb::exit`]).
//!
//! # Layout (the binary's modules; the library's are listed in `lib.rs`)
//! - `cli/`: every flag, as clap types; groups shared by several commands are declared once.
//! - `commands/`: one module per command, each handing the work to the library crates.
//! - this file: `main`, and [`classify`], which maps an error to its exit code.

mod cli;
mod commands;

use std::process::ExitCode;

use clap::Parser;
use stageb::exit;
use stageb::roles::ClusterError;
use stageb_shared::telemetry::{LogFormat, init_tracing};

use cli::Cli;
use commands::{dispatch, json_logs, set_json_logs};

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
        Some(ClusterError::Run(stageb_coordinator::run::RunError::Input(_))) => exit::INPUT_ERROR,
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
        _ if e
            .downcast_ref::<stageb_inspect::compare::CompareError>()
            .is_some() =>
        {
            exit::INPUT_ERROR
        }
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
    set_json_logs(cli.log_format == LogFormat::Json);
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
