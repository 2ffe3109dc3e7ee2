//! The readers of a finished run directory: `stageb audit` (`stageb_inspect::audit::audit`)
//! and `stageb report` (`stageb_inspect::report::render_with`), over run files anyone with
//! access could have changed.
//!
//! The input is the run's files joined by `\0`, in the order of `FILES` (a missing part is a
//! missing file). Invariants: both readers are deterministic; every violation the audit
//! reports with a line names a line its file has; the report either refuses the directory or
//! renders a page with no `<script` in it (every text from the run is escaped).

use super::support::{fresh_dir, line_count, split_parts};
use stageb_inspect::audit::audit;
use stageb_inspect::report::{AuditMode, render_with};

/// The run files, in the order the input holds them.
const FILES: [&str; 10] = [
    "manifest.json",
    "summary.json",
    "guidance.json",
    "need_review.json",
    "trajectories.jsonl",
    "selections.jsonl",
    "metrics.jsonl",
    "failure_malformed.jsonl",
    "need_review_queue.jsonl",
    "reflection.jsonl",
];

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let dir = fresh_dir("run");
    for (name, bytes) in FILES.iter().zip(split_parts(data, FILES.len())) {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let report = audit(&dir);
    let again = audit(&dir);
    assert_eq!(
        serde_json::to_value(&report).unwrap(),
        serde_json::to_value(&again).unwrap(),
        "the audit is not deterministic"
    );
    for v in &report.violations {
        if let (Some(line), Ok(bytes)) = (v.line, std::fs::read(dir.join(&v.file))) {
            assert!(
                (1..=line_count(&bytes)).contains(&line),
                "{v} names line {line} of {}",
                line_count(&bytes)
            );
        }
    }
    let page = render_with(&dir, AuditMode::Never);
    match (&page, render_with(&dir, AuditMode::Never)) {
        (Ok(a), Ok(b)) => assert_eq!(a, &b, "the report is not deterministic"),
        (Err(_), Err(_)) => {}
        _ => panic!("the report is not deterministic"),
    }
    if let Ok(html) = page {
        assert!(
            !html.to_ascii_lowercase().contains("<script"),
            "a script in the report"
        );
    }
}
