//! `stageb compare`: is a run's output the reference run's, aside runtime fields? One line per
//! artifact and a verdict line (or one JSON object), exit 0 when identical, 1 when not. The
//! rules are `stageb_inspect::compare`'s.

use anyhow::Result;
use stageb::exit;
use stageb_inspect::compare::compare_runs;

use crate::cli::CompareArgs;

/// Exit code when the runs differ.
const DIFFERENT: u8 = 1;

pub(crate) fn run(args: CompareArgs) -> Result<u8> {
    let comparison = compare_runs(&args.reference, &args.run)?;
    if args.json {
        println!("{}", comparison.summary_json());
    } else {
        if !comparison.only_in_reference.is_empty() || !comparison.only_in_run.is_empty() {
            println!(
                "files differ: only in the reference {:?}, only in the run {:?}",
                comparison.only_in_reference, comparison.only_in_run
            );
        }
        for file in &comparison.files {
            match &file.difference {
                Some(d) => println!("DIFFERENT {d}"),
                None => println!("same      {}", file.name),
            }
        }
        println!(
            "selection rows: {} ({} lost, {} duplicated)",
            comparison.selection_rows, comparison.rows_lost, comparison.rows_duplicated
        );
        println!(
            "artifacts: {}",
            if comparison.identical() {
                "identical (runtime fields aside)"
            } else {
                "DIFFERENT"
            }
        );
    }
    Ok(if comparison.identical() {
        exit::OK
    } else {
        DIFFERENT
    })
}
