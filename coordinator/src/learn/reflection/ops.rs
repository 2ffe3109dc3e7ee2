//! What the ops rounds of a cycle work from and how their proposals are validated: the ops
//! pass on `L` and one revision round in which the rejected ops go back with their reasons
//! (validate → revise → validate once more; the rounds themselves run in `cycle`). With
//! rejected edits remembered (`learn::rejected_memory`), a remembered edit is refused before
//! validation and never sent back for revision.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use stageb_shared::domain::{ChatMessage, TicketKey};
use stageb_shared::reflection_schema::{OpsOutput, ProposedOp};

use super::prompt::{Prompts, shorthand};
use super::record::Learnable;
use super::row::Proposal;
use crate::guidance::{GuidanceOp, GuidanceRepo};
use crate::learn::op_check::{
    self, AcceptedOp, OpsContext, OpsValidation, RejectReason, RejectedOp,
};
use crate::learn::rejected_memory::RejectedMemory;

/// Accepted and rejected ops of round `r` are numbered `r × 1000 + position in its proposal`.
pub(super) const ROUND_INDEX_STRIDE: usize = 1000;

/// What every round of a cycle's ops pass works from.
pub(super) struct OpsInputs<'a> {
    pub(super) learnable: &'a Learnable,
    pub(super) guidance: &'a GuidanceRepo,
    pub(super) schema: Value,
    shorthand: BTreeMap<String, TicketKey>,
    case_summaries: Vec<String>,
    max_ops: Option<usize>,
    /// Rejected edits remembered from earlier cycles, when remembering is on.
    pub(super) memory: Option<RejectedMemory>,
}

impl<'a> OpsInputs<'a> {
    /// The inputs of the ops pass on `learnable` under `guidance`: at most `max_ops` ops,
    /// `memory` the rejected edits remembered (when remembering is on).
    pub(super) fn new(
        learnable: &'a Learnable,
        guidance: &'a GuidanceRepo,
        prompts: &Prompts,
        max_ops: Option<usize>,
        memory: Option<RejectedMemory>,
    ) -> Self {
        OpsInputs {
            learnable,
            guidance,
            schema: prompts.ops_schema(max_ops.unwrap_or(8), &learnable.keys, guidance),
            shorthand: shorthand(&learnable.records),
            case_summaries: learnable
                .records
                .iter()
                .flat_map(|r| r.summaries.iter().map(|(_, s)| s.clone()))
                .collect(),
            max_ops,
            memory,
        }
    }

    /// A round's messages: the cases of `L`, and for a revision the ops rejected last round.
    pub(super) fn messages(
        &self,
        prompts: &Prompts,
        cycle: u64,
        revision: Option<&[RejectedOp]>,
    ) -> Vec<ChatMessage> {
        let cases = &self.learnable.records;
        let memory = self.memory.as_ref();
        prompts.ops_messages(cases, self.guidance, cycle, revision, memory)
    }
}

impl OpsInputs<'_> {
    /// The validator's context (with the whole `max_operations` cap).
    pub(super) fn context<'a>(&'a self, group_ids: &'a BTreeSet<String>) -> OpsContext<'a> {
        OpsContext {
            learnable: &self.learnable.keys,
            shorthand: &self.shorthand,
            guidance: self.guidance.current(),
            max_operations: self.max_ops,
            group_ids,
            case_summaries: &self.case_summaries,
        }
    }
}

/// One round's answer, as the row logs it.
pub(super) fn proposal(round: u32, out: &OpsOutput) -> Proposal {
    Proposal {
        round,
        has_evidence: out.has_evidence,
        evidence_analysis: out.evidence_analysis.clone(),
        operations: out.operations.clone(),
        coverage_advisory: out.coverage.clone(),
    }
}

/// [`validate_round`] on the ops of the proposal that are not remembered rejections; those are
/// refused as `already_rejected` (indices stay those of the whole proposal).
pub(super) fn validate_remembering(
    round: u32,
    proposed: &[ProposedOp],
    so_far: &OpsValidation,
    base: OpsContext<'_>,
    memory: Option<&RejectedMemory>,
) -> OpsValidation {
    let Some(memory) = memory.filter(|m| !m.is_empty()) else {
        return validate_round(round, proposed, so_far, base);
    };
    let (known, fresh): (Vec<usize>, Vec<usize>) =
        (0..proposed.len()).partition(|i| memory.find(&proposed[*i]).is_some());
    let fresh_ops: Vec<ProposedOp> = fresh.iter().map(|i| proposed[*i].clone()).collect();
    let mut v = validate_round(round, &fresh_ops, so_far, base);
    v.accepted.iter_mut().for_each(|a| a.index = fresh[a.index]);
    v.rejected.iter_mut().for_each(|r| r.index = fresh[r.index]);
    for i in known {
        let earlier = memory.find(&proposed[i]).expect("partitioned on it");
        v.rejected.push(RejectedOp {
            index: i,
            proposed: proposed[i].clone(),
            reason: RejectReason::AlreadyRejected,
            detail: format!(
                "the same edit was rejected in reflection cycle {} ({})",
                earlier.cycle, earlier.reason
            ),
        });
    }
    v.rejected.sort_by_key(|r| r.index);
    v
}

/// Validate one round's proposal against what earlier rounds got accepted. The ops pass is
/// validated under what is left of `max_operations`. A revision is validated on its own and
/// without the cap: it must not repeat or collide with what the first round already got
/// accepted (one op per key per cycle), so repeats are rejected first, and only then does the
/// cap apply to what is genuinely new (otherwise resent repeats would use up the cap and push
/// the corrected op out).
fn validate_round(
    round: u32,
    proposed: &[ProposedOp],
    so_far: &OpsValidation,
    base: OpsContext<'_>,
) -> OpsValidation {
    let remaining_cap = base
        .max_operations
        .map(|m| m.saturating_sub(so_far.accepted.len()));
    let ctx = OpsContext {
        max_operations: if round == 0 { remaining_cap } else { None },
        ..base
    };
    let mut v = op_check::validate_ops(proposed, &ctx);
    if round > 0 {
        let (fresh, clash) = split_repeats(v.accepted, &so_far.accepted);
        let cap = remaining_cap.unwrap_or(usize::MAX);
        let (keep, over): (Vec<_>, Vec<_>) =
            fresh.into_iter().enumerate().partition(|(i, _)| *i < cap);
        v.accepted = keep.into_iter().map(|(_, a)| a).collect();
        let reject = |a: AcceptedOp, reason, detail: &str| RejectedOp {
            index: a.index,
            proposed: proposed[a.index].clone(),
            reason,
            detail: detail.into(),
        };
        for (_, a) in over {
            let detail = "reflection.max_operations already reached in this cycle";
            v.rejected
                .push(reject(a, RejectReason::MaxOperationsExceeded, detail));
        }
        for a in clash {
            let detail = "repeats or touches the same key as an op accepted in the first round";
            v.rejected
                .push(reject(a, RejectReason::DuplicateOp, detail));
        }
    }
    v
}

/// A revision's accepted ops split into the new ones and those that repeat, or touch a key of,
/// an op accepted earlier in the cycle.
fn split_repeats(
    accepted: Vec<AcceptedOp>,
    earlier: &[AcceptedOp],
) -> (Vec<AcceptedOp>, Vec<AcceptedOp>) {
    let taken: BTreeSet<String> = earlier.iter().flat_map(|a| touched_keys(&a.op)).collect();
    let seen: Vec<String> = earlier.iter().map(|a| op_text(&a.op)).collect();
    accepted.into_iter().partition(|a| {
        !touched_keys(&a.op).iter().any(|k| taken.contains(k)) && !seen.contains(&op_text(&a.op))
    })
}

fn op_text(op: &GuidanceOp) -> String {
    serde_json::to_string(op).unwrap_or_default()
}

/// Every key an op changes: its target and, for a merge, the keys merged away.
fn touched_keys(op: &GuidanceOp) -> Vec<String> {
    let mut keys: Vec<String> = op.key().map(|k| k.to_string()).into_iter().collect();
    if let GuidanceOp::Merge { merged_from, .. } = op {
        keys.extend(merged_from.iter().map(|k| k.to_string()));
    }
    keys
}

/// Round `round`'s verdict joins the cycle's, its indices numbered by round.
pub(super) fn absorb(validation: &mut OpsValidation, round_verdict: OpsValidation, round: u32) {
    let offset = round as usize * ROUND_INDEX_STRIDE;
    validation
        .accepted
        .extend(round_verdict.accepted.into_iter().map(|mut a| {
            a.index += offset;
            a
        }));
    validation
        .rejected
        .extend(round_verdict.rejected.into_iter().map(|mut r| {
            r.index += offset;
            r
        }));
}
