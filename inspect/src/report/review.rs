//! The need-review queue (`need_review_queue.jsonl`): counts per epoch and reason code, and
//! the rows of each epoch up to [`super::ROW_CAP`], so the report can list what is still in
//! review when the run ends (need-review is per epoch: the final epoch's rows are the open
//! queue, earlier epochs are history).
//!
//! The queue rather than `need_review.json`: it streams, and `stageb audit` checks that the
//! aggregate equals it.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use serde::Deserialize;
use stageb_coordinator::artifacts::files;

use super::load::{FileStatus, stream_jsonl};
use super::outcomes::bump;
use super::{ROW_CAP, clip};

/// Longest reason or note shown, in characters.
const TEXT_CAP: usize = 300;

#[derive(Deserialize)]
struct QueueRow {
    #[serde(default)]
    ticket_key: String,
    #[serde(default)]
    gt_label: Option<String>,
    #[serde(default)]
    pred_verdict: Option<String>,
    #[serde(default)]
    pred_reason: Option<String>,
    #[serde(default)]
    reason_code: String,
    epoch: u32,
    #[serde(default)]
    reflection_cycle: Option<u64>,
    #[serde(default)]
    reflection_id: Option<String>,
    #[serde(default)]
    uncertainty_note: Option<String>,
}

/// One queue row, clipped for display.
#[derive(Debug, Clone)]
pub struct ReviewRow {
    pub ticket_key: String,
    pub gt_label: String,
    pub pred_verdict: String,
    pub pred_reason: String,
    pub reason_code: String,
    pub reflection_cycle: Option<u64>,
    pub reflection_id: String,
    pub uncertainty_note: String,
}

#[derive(Debug, Clone, Default)]
pub struct EpochReview {
    pub rows: u64,
    pub tickets: u64,
    pub by_code: BTreeMap<String, u64>,
    /// The epoch's first [`ROW_CAP`] rows, in file order.
    pub shown: Vec<ReviewRow>,
}

#[derive(Debug, Clone, Default)]
pub struct NeedReview {
    pub per_epoch: BTreeMap<u32, EpochReview>,
    pub total_rows: u64,
    pub distinct_tickets: u64,
    pub file: FileStatus,
}

pub fn collect(dir: &Path) -> NeedReview {
    let mut out = NeedReview::default();
    let mut all = HashSet::new();
    let mut per_epoch: BTreeMap<u32, HashSet<String>> = BTreeMap::new();
    out.file = stream_jsonl::<QueueRow>(dir, files::NEED_REVIEW_QUEUE, |row| {
        out.total_rows += 1;
        let e = out.per_epoch.entry(row.epoch).or_default();
        e.rows += 1;
        bump(&mut e.by_code, &row.reason_code);
        if per_epoch
            .entry(row.epoch)
            .or_default()
            .insert(row.ticket_key.clone())
        {
            e.tickets += 1;
        }
        all.insert(row.ticket_key.clone());
        if e.shown.len() < ROW_CAP {
            e.shown.push(view(row));
        }
    });
    out.distinct_tickets = all.len() as u64;
    out
}

fn view(row: QueueRow) -> ReviewRow {
    let text = |s: Option<String>| clip(s.as_deref().unwrap_or(""), TEXT_CAP);
    ReviewRow {
        ticket_key: clip(&row.ticket_key, 120),
        gt_label: clip(row.gt_label.as_deref().unwrap_or(""), 20),
        pred_verdict: clip(row.pred_verdict.as_deref().unwrap_or("—"), 20),
        reason_code: clip(&row.reason_code, 60),
        reflection_cycle: row.reflection_cycle,
        reflection_id: clip(row.reflection_id.as_deref().unwrap_or(""), 40),
        pred_reason: text(row.pred_reason),
        uncertainty_note: text(row.uncertainty_note),
    }
}
