//! `stageb report RUN_DIR`: one self-contained HTML file that shows what a run did.
//!
//! The file opens from a `file://` URL with no network: styles are inline, charts are inline
//! SVG drawn by `plotters`, there is no script, and a Content-Security-Policy forbids every
//! load. Text from artifacts is escaped (model output is untrusted).
//!
//! # Layout
//! - `load.rs`: tolerant readers (a missing or damaged artifact becomes a note, never an error).
//! - `identity.rs`, `outcomes.rs`, `reflection.rs`, `review.rs`, `guidance.rs`,
//!   `throughput.rs`: one streaming pass per artifact (rank 0's row types where it has them,
//!   `stageb_coordinator::artifacts`), aggregated into per-epoch counters and capped lists, so
//!   a run of 100k tickets gives a report of the same size as a run of 100.
//! - `charts.rs`: the SVG charts. `html.rs`: escaping and page building blocks.
//! - `render/`: one function per section; each section has an `id` (`overview`, `accuracy`,
//!   `votes`, `malformed`, `reflection`, `guidance`, `need-review`, `throughput`) so a
//!   script can link to or screenshot it.
//!
//! A directory that is not a run directory is an input error ([`ReportError::RunDir`]); the
//! audit's verdict ([`crate::audit`]) heads the page. The audit holds every row in memory
//! (about 15 times the artifacts' size), so by default ([`AuditMode::Auto`]) a run whose
//! artifacts pass [`AUTO_AUDIT_MAX_BYTES`] is reported without it, and the page says so.

mod charts;
mod guidance;
mod html;
mod identity;
mod load;
mod outcomes;
mod reflection;
mod render;
mod review;
mod throughput;

use std::path::{Path, PathBuf};

use stageb_coordinator::artifacts::files;
use stageb_shared::error::{ErrorCode, InputError};

/// The report's file name in the run directory (`stageb report` and the end of `stageb run`).
pub const REPORT_FILE: &str = "report.html";

/// Most rows a table lists; the rest are counted in a note. Keeps the page light whatever
/// the run's size.
pub(crate) const ROW_CAP: usize = 200;

/// In [`AuditMode::Auto`], runs whose JSONL artifacts are larger than this together are not
/// audited: the audit streams its files but keeps the selections, about 1.4 times the rows'
/// size in memory (210 MB of rows: 283 MB and 16 s). At the end of `stageb run` that memory
/// is rank 0's peak, so the automatic audit stops at about 30k tickets' worth of rows.
pub const AUTO_AUDIT_MAX_BYTES: u64 = 256 << 20;

/// Whether the report runs [`crate::audit::audit`] for its verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AuditMode {
    /// Audit unless the artifacts pass [`AUTO_AUDIT_MAX_BYTES`].
    #[default]
    Auto,
    Always,
    Never,
}

/// How to write a report.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Where to write it; default `RUN_DIR/report.html`.
    pub out: Option<PathBuf>,
    pub audit: AuditMode,
}

/// The audit's verdict, or why there is none.
pub enum AuditOutcome {
    Ran(crate::audit::AuditReport),
    Skipped(String),
}

/// Files whose presence makes a directory a run directory.
const RUN_MARKERS: [&str; 4] = [
    files::MANIFEST,
    files::SELECTIONS,
    files::SUMMARY,
    stageb_coordinator::guidance::GUIDANCE_FILE,
];

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The directory is missing or holds no run (bad input: exit code 2).
    #[error(transparent)]
    RunDir(InputError),
    #[error("cannot write the report to {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Everything the report shows, aggregated from one run directory.
pub struct RunData {
    pub run_dir: PathBuf,
    pub audit: AuditOutcome,
    pub identity: identity::Identity,
    pub outcomes: outcomes::Outcomes,
    pub reflection: reflection::Reflection,
    pub review: review::NeedReview,
    pub guidance: guidance::GuidanceTimeline,
    pub compute: throughput::Compute,
}

/// Read and aggregate `run_dir`.
pub fn collect(run_dir: &Path, audit: AuditMode) -> Result<RunData, ReportError> {
    check_run_dir(run_dir)?;
    let identity = identity::collect(run_dir);
    let summary_rows = identity
        .summary
        .as_ref()
        .map(|s| s.epoch_accuracy.clone())
        .unwrap_or_default();
    Ok(RunData {
        run_dir: run_dir.to_path_buf(),
        audit: run_audit(run_dir, audit),
        outcomes: outcomes::collect(run_dir, &summary_rows),
        identity,
        reflection: reflection::collect(run_dir),
        review: review::collect(run_dir),
        guidance: guidance::collect(run_dir),
        compute: throughput::collect(run_dir),
    })
}

fn run_audit(run_dir: &Path, mode: AuditMode) -> AuditOutcome {
    let bytes = || -> u64 {
        std::fs::read_dir(run_dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".jsonl"))
            .filter_map(|e| e.metadata().ok().map(|m| m.len()))
            .sum()
    };
    match mode {
        AuditMode::Always => AuditOutcome::Ran(crate::audit::audit(run_dir)),
        AuditMode::Never => AuditOutcome::Skipped("not asked for (--audit never)".into()),
        AuditMode::Auto => {
            let size = bytes();
            if size > AUTO_AUDIT_MAX_BYTES {
                AuditOutcome::Skipped(format!(
                    "the artifacts hold {} MiB of rows, more than the {} MiB a report audits \
                     unasked (the audit keeps every row in memory); `stageb report --audit \
                     always` or `stageb audit` runs it",
                    size >> 20,
                    AUTO_AUDIT_MAX_BYTES >> 20
                ))
            } else {
                AuditOutcome::Ran(crate::audit::audit(run_dir))
            }
        }
    }
}

/// The report of `run_dir` as one HTML document (audited per [`AuditMode::Auto`]).
pub fn render(run_dir: &Path) -> Result<String, ReportError> {
    render_with(run_dir, AuditMode::Auto)
}

pub fn render_with(run_dir: &Path, audit: AuditMode) -> Result<String, ReportError> {
    Ok(render::page(&collect(run_dir, audit)?))
}

/// Write the report of `run_dir` and return its path. Written to a temporary file and
/// renamed, so a reader never sees half a report.
pub fn write(run_dir: &Path, options: &Options) -> Result<PathBuf, ReportError> {
    let html = render_with(run_dir, options.audit)?;
    let path = options
        .out
        .clone()
        .unwrap_or_else(|| run_dir.join(REPORT_FILE));
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or(REPORT_FILE),
        std::process::id()
    ));
    let write_err = |source| ReportError::Write {
        path: path.clone(),
        source,
    };
    std::fs::write(&tmp, html).map_err(write_err)?;
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        write_err(e)
    })?;
    Ok(path)
}

/// A run directory exists and holds at least one of the run's own files; otherwise say what
/// the user probably meant (a run directory is `{output.root}/{run_name}/{mission}`).
fn check_run_dir(dir: &Path) -> Result<(), ReportError> {
    let bad = |message: String| {
        ReportError::RunDir(InputError::new(
            ErrorCode::FileNotFound,
            dir.display().to_string(),
            None,
            message,
        ))
    };
    if !dir.is_dir() {
        return Err(bad("no such run directory".into()));
    }
    if RUN_MARKERS.iter().any(|m| dir.join(m).is_file()) {
        return Ok(());
    }
    let mut runs_below: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join(files::MANIFEST).is_file())
        .map(|p| p.display().to_string())
        .collect();
    runs_below.sort();
    let hint = if runs_below.is_empty() {
        String::new()
    } else {
        format!("; run directories below it: {}", runs_below.join(", "))
    };
    Err(bad(format!(
        "not a run directory (no manifest.json, selections.jsonl, summary.json or \
         guidance.json; a run directory is {{output.root}}/{{run_name}}/{{mission}}){hint}"
    )))
}

/// `s` cut to `max` characters, with `…` when cut (whole characters, never a split UTF-8
/// sequence).
pub(crate) fn clip(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &s[..end]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_counts_characters_not_bytes() {
        assert_eq!(clip("挡风板安装", 3), "挡风板…");
        assert_eq!(clip("abc", 3), "abc");
        assert_eq!(clip("", 0), "");
    }

    #[test]
    fn escaping_covers_markup_and_quotes() {
        assert_eq!(
            html::esc(r#"<script>alert("x&'y")</script>"#),
            "&lt;script&gt;alert(&quot;x&amp;&#39;y&quot;)&lt;/script&gt;"
        );
    }
}
