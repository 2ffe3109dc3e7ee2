//! How a command ends: the closing line (plain text, or a JSON event when logs are JSON) and
//! the documented exit code ([`stageb::exit`]) of a completed run or a worker.

use std::sync::atomic::{AtomicBool, Ordering};

use stageb::exit;
use stageb_coordinator::run::RunSummary;
use stageb_worker::client::{WorkerEnd, WorkerSummary};

use crate::cli::ReportArgs;

/// Whether logs are JSON lines: then the closing lines (the run's outcome, the error) are
/// JSON events too, so a log shipper never meets a plain-text line.
static JSON_LOGS: AtomicBool = AtomicBool::new(false);

/// Set once, by `main`, from `--log-format`.
pub(crate) fn set_json_logs(json: bool) {
    JSON_LOGS.store(json, Ordering::Relaxed);
}

pub(crate) fn json_logs() -> bool {
    JSON_LOGS.load(Ordering::Relaxed)
}

/// The end of a completed run on rank 0: the report beside the artifacts (unless
/// `--no-report`), then the outcome line and exit code. A report that cannot be written is a
/// warning: the run itself is complete and its artifacts are on disk.
pub(crate) async fn finish_run(summary: &RunSummary, report: ReportArgs) -> u8 {
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

/// The outcome line of a completed run, and its exit code.
fn summary_code(summary: &RunSummary) -> u8 {
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
pub(crate) fn worker_code(summary: &WorkerSummary) -> u8 {
    tracing::info!(
        jobs = summary.jobs_done,
        failed = summary.jobs_failed,
        cancelled = summary.jobs_cancelled,
        revoked = summary.leases_revoked,
        end = ?summary.end,
        "worker finished"
    );
    match summary.end {
        WorkerEnd::RunOver => exit::OK,
        WorkerEnd::Drained | WorkerEnd::Interrupted => exit::INTERRUPTED,
    }
}
