//! The page: one function per section, in reading order. Each section says where its numbers
//! come from, and shows a note instead of (or beside) its content when an artifact it reads
//! is missing or damaged.
//!
//! Numbers that tests and scripts check carry `data-metric="NAME"`
//! (e.g. `acc_incl_e1`, `candidates_e2`, `ops_rejected_total`).

mod guidance_view;
mod learning;
mod outcomes;
mod overview;
mod throughput;

use super::RunData;
use super::html::Page;
use super::load::FileStatus;

/// Section ids and their link labels, in page order.
pub const SECTIONS: [(&str, &str); 8] = [
    ("overview", "Overview"),
    ("accuracy", "Accuracy"),
    ("votes", "Vote strength"),
    ("malformed", "Malformed"),
    ("reflection", "Reflection"),
    ("guidance", "Guidance"),
    ("need-review", "Need-review"),
    ("throughput", "Throughput"),
];

pub fn page(data: &RunData) -> String {
    let mission = data
        .identity
        .manifest
        .as_ref()
        .map(|m| m.mission.clone())
        .filter(|m| !m.is_empty())
        .or_else(|| data.guidance.mission.clone())
        .unwrap_or_else(|| "(unknown mission)".into());
    let mut page = Page::new(
        &format!("stageb run report: {mission}"),
        &super::html::run_label(&data.run_dir),
        &SECTIONS,
    );
    overview::render(&mut page, data);
    outcomes::accuracy(&mut page, data);
    outcomes::votes(&mut page, data);
    outcomes::malformed(&mut page, data);
    learning::reflection(&mut page, data);
    guidance_view::render(&mut page, data);
    learning::need_review(&mut page, data);
    throughput::render(&mut page, data);
    page.finish(&format!(
        "Written by stageb {} (`stageb report`). Self-contained: no script, no network.",
        env!("CARGO_PKG_VERSION")
    ))
}

/// Notes for the files a section read that were missing or damaged.
fn file_notes<'a>(page: &mut Page, statuses: impl IntoIterator<Item = &'a FileStatus>) {
    for s in statuses {
        if let Some(note) = s.note() {
            page.note(&note);
        }
    }
}

/// The note under a capped table.
fn left_out_note(page: &mut Page, shown: usize, total: u64, what: &str) {
    if total > shown as u64 {
        page.note(&format!(
            "The first {shown} {what} of {total} are listed; {} are left out to keep the page \
             light (the totals above count all of them).",
            total - shown as u64
        ));
    }
}

/// `Some(n)` as a number, `None` as `—`.
fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "—".to_string(), |v| v.to_string())
}
