//! What reflection carries from one step to the next, as the step checkpoint stores it
//! ([`crate::run::checkpoint`]). Everything here is decided by the run's inputs and the model's
//! answers; what the config or the run's context sets (prompts, limits, run groups) is not
//! stored but set again when a resumed run is prepared, exactly as the first attempt set it.
//!
//! The need-review rows are not stored either: they are the rows of `need_review_queue.jsonl`,
//! which a resume has just cut back to the checkpoint's length, so they are read back from
//! there. They grow with the whole run (most of it, when the budget routes every candidate),
//! and a checkpoint holding them would grow with all work done instead of the epoch's.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};
use stageb_shared::domain::TicketKey;

use super::budget::{CallBudget, ChangeCap};
use super::{GradientRecord, ReflectionError, Reflector, io_err};
use crate::artifacts::{files, read_jsonl};
use crate::learn::feedback::FeedbackLedger;
use crate::learn::need_review::NeedReviewRow;
use crate::learn::predictions::Predictions;
use crate::learn::rejected_memory::RejectedMemory;

/// The reflector's state at a step boundary: the part of [`Reflector`] a checkpoint carries. The
/// reflector holds it as one field, so a new piece of state cannot be left out of checkpoints.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReflectorState {
    pub(super) epoch: u32,
    pub(super) pending: Vec<GradientRecord>,
    pub(super) retry: BTreeMap<u32, Vec<GradientRecord>>,
    pub(super) retry_counts: HashMap<TicketKey, u32>,
    /// Model calls this epoch, against `reflection.max_calls_per_epoch`.
    pub(super) calls_epoch: CallBudget,
    /// Reflections applied this epoch, against `reflection.change_cap_per_epoch`.
    pub(super) applied_epoch: ChangeCap,
    pub(super) cycles: u64,
    pub(super) arrivals: u64,
    pub(super) last_applied: Option<String>,
    pub(super) feedback: FeedbackLedger,
    /// Decision passes of this epoch that ran (at least one call) and that parsed.
    pub(super) decisions_epoch: (u32, u32),
    /// Warnings for `summary.json`.
    pub(super) run_warnings: Vec<String>,
    /// Rejected edits remembered (with `reflection.gate`; empty, and left out, without it).
    #[serde(default, skip_serializing_if = "RejectedMemory::is_empty")]
    pub(super) rejected: RejectedMemory,
    /// Claims of applied ops not settled yet (with `reflection.gate`; left out while empty).
    #[serde(default, skip_serializing_if = "Predictions::is_empty")]
    pub(super) predictions: Predictions,
}

impl Reflector {
    /// The state a resumed run needs to continue after the current step boundary.
    pub fn state(&self) -> ReflectorState {
        self.state.clone()
    }

    /// Continue from a checkpoint's `state`: the need-review rows are read back from the
    /// queue the caller has cut back to the checkpoint's length.
    pub(super) fn restore(&mut self, state: ReflectorState) -> Result<(), ReflectionError> {
        self.need_review_rows = read_queue(&self.dir)?;
        for row in &self.need_review_rows {
            self.routed
                .entry(row.epoch)
                .or_default()
                .insert(row.ticket_key.clone());
        }
        self.state = state;
        Ok(())
    }

    /// Makes both logs durable (before a checkpoint names their lengths).
    pub fn sync_logs(&mut self) -> std::io::Result<()> {
        self.queue_log.sync()?;
        self.reflection_log.sync()
    }
}

/// The rows of `need_review_queue.jsonl`, as [`Reflector::route`] wrote them.
fn read_queue(dir: &Path) -> Result<Vec<NeedReviewRow>, ReflectionError> {
    let path = dir.join(files::NEED_REVIEW_QUEUE);
    let bad = |e: serde_json::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    read_jsonl(&path)
        .and_then(|rows| {
            rows.into_iter()
                .map(|v| serde_json::from_value(v).map_err(bad))
                .collect()
        })
        .map_err(io_err(&path))
}
