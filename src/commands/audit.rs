//! `stageb audit`: re-derive a run's decisions from its artifacts; one line per violation and
//! a summary line (or the report as JSON), exit code 4 when anything is violated.

use anyhow::Result;
use stageb::exit;

use crate::cli::AuditArgs;

pub(crate) fn run(args: AuditArgs) -> Result<u8> {
    let report = stageb_inspect::audit::audit(&args.run_dir);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for v in &report.violations {
            println!("{v}");
        }
        println!(
            "audited {}: {} tickets, {} epochs, {} selections, {} trajectories, {} reflection cycles: {}",
            args.run_dir.display(),
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
