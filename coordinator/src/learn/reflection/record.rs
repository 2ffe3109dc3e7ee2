//! What reflection learns from: a gradient candidate as the run loop hands it over
//! ([`TicketOutcome`]) and as it waits in the reflector's queues ([`GradientRecord`]), and
//! `L`, the cases of a cycle left to learn from ([`Learnable`]).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use stageb_shared::domain::{Ticket, TicketKey, Verdict};

use crate::decide::eligibility::Eligibility;
use crate::decide::selection::{Selection, VoteCandidate};
use crate::learn::feedback::PendingFeedback;
use crate::learn::need_review;

/// One ticket's rollout outcome as the run loop decided it: what reflection learns from.
pub struct TicketOutcome {
    pub ticket_index: usize,
    pub selection: Selection,
    pub eligibility: Eligibility,
    pub candidates: Vec<VoteCandidate>,
    /// Raw candidate texts by candidate index (for reflection cases).
    pub raw_texts: Vec<String>,
}

/// One candidate as a reflection case shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CaseCandidate {
    pub candidate_index: u32,
    pub verdict: Option<Verdict>,
    pub reason: String,
}

/// A ticket with learnable signal, waiting for reflection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GradientRecord {
    pub ticket_key: TicketKey,
    pub group_id: String,
    pub mission: String,
    pub gt: Verdict,
    pub summaries: Vec<(String, String)>,
    pub candidates: Vec<CaseCandidate>,
    pub final_verdict: Option<Verdict>,
    pub final_reason: String,
    pub vote_strength: Option<f64>,
    pub low_agreement: bool,
    pub eligibility_reasons: Vec<String>,
    pub priority: u8,
    pub selection: crate::decide::selection::Selection,
    /// Arrival order within the epoch (the tie-break after priority).
    pub order: u64,
    pub feedback: PendingFeedback,
}

impl GradientRecord {
    pub fn from_outcome(ticket: &Ticket, outcome: &TicketOutcome, _epoch: u32) -> Self {
        GradientRecord {
            ticket_key: ticket.key(),
            group_id: ticket.group_id.clone(),
            mission: ticket.mission.clone(),
            gt: ticket.label,
            summaries: ticket.per_image.clone(),
            candidates: outcome
                .candidates
                .iter()
                .map(|c| CaseCandidate {
                    candidate_index: c.candidate_index,
                    verdict: c.verdict,
                    reason: c.reason.clone(),
                })
                .collect(),
            final_verdict: outcome.selection.verdict,
            final_reason: outcome.selection.reason.clone(),
            vote_strength: outcome.selection.vote_strength,
            low_agreement: outcome.selection.low_agreement,
            eligibility_reasons: outcome
                .eligibility
                .reasons
                .iter()
                .map(|r| r.rule_hit().to_string())
                .collect(),
            priority: outcome.eligibility.reflection_priority,
            selection: outcome.selection.clone(),
            order: 0,
            feedback: PendingFeedback {
                rules: Vec::new(),
                label_match: outcome.selection.label_match,
            },
        }
    }

    pub(super) fn identity(&self) -> need_review::TicketIdentity {
        need_review::TicketIdentity {
            ticket_key: self.ticket_key.clone(),
            group_id: self.group_id.clone(),
            mission: self.mission.clone(),
            gt_label: self.gt,
        }
    }
}

/// The ticket keys of `records`, in order.
pub(super) fn keys_of(records: &[GradientRecord]) -> Vec<TicketKey> {
    records.iter().map(|r| r.ticket_key.clone()).collect()
}

/// `L`: the kept cases the decision pass did not stop, in prompt order, and their keys.
pub(super) struct Learnable {
    pub(super) records: Vec<GradientRecord>,
    pub(super) keys: BTreeSet<TicketKey>,
}
