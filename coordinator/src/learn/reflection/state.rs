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

use serde::{Deserialize, Serialize};
use stageb_shared::domain::TicketKey;

use super::GradientRecord;
use super::budget::{CallBudget, ChangeCap};
use crate::learn::feedback::FeedbackLedger;
use crate::learn::predictions::Predictions;
use crate::learn::rejected_memory::RejectedMemory;

/// The reflector's state at a step boundary: the part of [`super::Reflector`] a checkpoint carries. The
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
