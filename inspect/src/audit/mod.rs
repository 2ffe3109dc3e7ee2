//! `stageb audit RUN_DIR`: re-derive what rank 0 decided from the raw rows and check every
//! invariant the artifacts promise. Used by users after a run and by the end-to-end tests.
//!
//! Checks (each violation is reported with the file and, where there is one, the line):
//! - every JSONL file parses line by line and ends with a newline; rows carry `schema_version`
//!   and read as rank 0's row types (a `reflection.jsonl` row as `ReflectionRow`);
//! - exactly one selection row per ticket per epoch, for every ticket of the run;
//! - one trajectory row per candidate (`candidates_per_ticket` per ticket per epoch), each one's
//!   `format_ok`/`verdict`/`reason` equal to what the contract parser says of its raw `text`;
//! - every malformed candidate has its `failure_malformed.jsonl` row and vice versa;
//! - selections re-derived from the trajectories (vote counts, vote strength, the vote's
//!   verdict, `label_match` against the final verdict) and eligibility from the row's signals;
//! - `metrics.jsonl` epoch rows recomputed from `selections.jsonl` and the need-review queue;
//! - `need_review.json` equal to the aggregation of `need_review_queue.jsonl`;
//! - reflection: learnable ∩ stop-gradient = ∅, every applied op's evidence ⊆ that cycle's
//!   learnable set (so no stop-gradient key is ever evidence), `covered` = the applied ops'
//!   evidence ∩ learnable (a skipped or unapplied op covers nothing), no accepted rule text and
//!   no rule of the final guidance names a group id of the run or a label suffix;
//! - the guidance hash chain verifies and `S*` rules are unchanged from the seed;
//! - held-out splits (`reflection.gate`): each selection row's split is the seeded one, and no
//!   gate or final ticket reached reflection or the need-review queue, and each epoch row's
//!   checked predictions are recomputed from the ops applied before (`splits.rs`);
//! - integrity (runs with a key, `artifacts::seal`): every JSONL file matches its seal, with
//!   nothing after it, and every journal row its own `mac`: an edit made after rank 0 wrote a
//!   row (an answer, a candidate text, an explanation, a reflection output) is found.

//!
//! The files are streamed row by row (`rows.rs`) and only the facts the checks compare are kept
//! (`decisions.rs`, `learning.rs`), so a large run is audited in a fraction of its size in memory.

mod decisions;
mod learning;
mod rows;
mod splits;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;
use stageb_coordinator::artifacts::documents::Manifest;
use stageb_coordinator::artifacts::files;
use stageb_coordinator::cluster::scheduler::journal::JOURNAL_FILE;
use stageb_shared::config::RunConfig;
use stageb_shared::domain::Verdict;

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    pub check: &'static str,
    pub file: String,
    pub line: Option<usize>,
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(l) => write!(f, "[{}] {}:{}: {}", self.check, self.file, l, self.detail),
            None => write!(f, "[{}] {}: {}", self.check, self.file, self.detail),
        }
    }
}

/// What the audit looked at and what it found.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AuditReport {
    pub run_dir: PathBuf,
    pub epochs: u32,
    pub tickets: usize,
    pub selections: usize,
    pub trajectories: usize,
    pub reflection_cycles: usize,
    pub violations: Vec<Violation>,
}

impl AuditReport {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    fn fail(
        &mut self,
        check: &'static str,
        file: &str,
        line: Option<usize>,
        detail: impl Into<String>,
    ) {
        self.violations.push(Violation {
            check,
            file: file.to_string(),
            line,
            detail: detail.into(),
        });
    }
}

/// Every JSONL file against its seal, and every journal row against its mac (only for runs
/// that have a key: runs written before seals have none).
fn check_seals(report: &mut AuditReport, dir: &Path) {
    use stageb_coordinator::artifacts::seal;
    let key = match seal::key_for(dir) {
        Ok(Some(key)) => key,
        Ok(None) => return,
        Err(e) => return report.fail("integrity", "integrity/key", None, e.to_string()),
    };
    let names = match seal::sealed_files(dir) {
        Ok(names) => names,
        Err(e) => return report.fail("integrity", ".", None, e.to_string()),
    };
    for name in names {
        let len = fs::metadata(dir.join(&name)).map_or(0, |m| m.len());
        match seal::verify_file(dir, &name) {
            Ok(Some(sealed)) if sealed < len => report.fail(
                "integrity",
                &name,
                None,
                format!("{} bytes after the last seal ({sealed} bytes): written after rank 0's last sync", len - sealed),
            ),
            Ok(_) => {}
            Err(e) => report.fail("integrity", &name, None, e.to_string()),
        }
    }
    let journal = fs::read_to_string(dir.join(JOURNAL_FILE)).unwrap_or_default();
    for (i, line) in journal.lines().enumerate() {
        if seal::check_row_mac(&key, line).is_none() {
            report.fail(
                "integrity",
                JOURNAL_FILE,
                Some(i + 1),
                "the row does not match its mac: changed after rank 0 wrote it",
            );
        }
    }
}

fn verdict_of(v: &Value) -> Option<Verdict> {
    serde_json::from_value(v.clone()).ok()
}

/// What the manifest says about the run.
pub struct RunFacts {
    config: RunConfig,
    tickets: usize,
    mission: String,
}

impl RunFacts {
    fn load(report: &mut AuditReport, dir: &Path) -> Option<RunFacts> {
        let manifest: Option<Manifest> = fs::read(dir.join(files::MANIFEST))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let Some(manifest) = manifest else {
            report.fail("manifest", files::MANIFEST, None, "missing or not JSON");
            return None;
        };
        let Some(config) = manifest.run_config() else {
            report.fail(
                "manifest",
                files::MANIFEST,
                None,
                "no readable resolved config",
            );
            return None;
        };
        Some(RunFacts {
            tickets: manifest.tickets,
            mission: manifest.mission,
            config,
        })
    }
}

/// Audit a run directory (`{output.root}/{run_name}/{mission}`).
pub fn audit(dir: &Path) -> AuditReport {
    let mut report = AuditReport {
        run_dir: dir.to_path_buf(),
        ..Default::default()
    };
    let Some(run) = RunFacts::load(&mut report, dir) else {
        return report;
    };
    check_seals(&mut report, dir);
    report.tickets = run.tickets;
    report.epochs = run.config.runner.epochs;

    let selections = decisions::read_selections(&mut report, dir, &run);
    let candidates = decisions::read_trajectories(&mut report, dir);
    decisions::rederive_selections(&mut report, &run, &selections, &candidates);
    decisions::check_failure_rows(&mut report, dir, &candidates);
    drop(candidates);

    let held_out = splits::check_assignment(&mut report, &run, &selections);
    let queue = learning::check_need_review(&mut report, dir, &run);
    let gate = &run.config.reflection.gate;
    let claims = splits::check_reflection_rows(&mut report, dir, &held_out, &queue, gate);
    learning::check_metrics(&mut report, dir, &selections, &queue, &claims);
    let group_ids: BTreeSet<String> = selections
        .values()
        .flat_map(|by_key| by_key.values())
        .filter_map(|s| s.group_id.clone())
        .collect();
    let any_applied = learning::check_reflections(&mut report, dir, &group_ids);
    learning::check_guidance(&mut report, dir, &run, &group_ids, any_applied);
    report
}
