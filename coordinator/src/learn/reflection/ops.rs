//! The ops rounds of a cycle: the ops pass on `L`, validation of what it proposes, and one
//! revision round in which the rejected ops go back with their reasons (validate → revise →
//! validate once more). What comes out is the cycle's accepted and rejected ops. With rejected
//! edits remembered (`learn::rejected_memory`), a remembered edit is refused before validation
//! and never sent back for revision, and the cycle's rejections are remembered at its end.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use stageb_shared::domain::{ChatMessage, TicketKey};
use stageb_shared::observe;
use stageb_shared::reflection_schema::{self, OpsOutput, ProposedOp};

use super::call::Dispatch;
use super::cycle::{CycleEnd, Flow, Learnable};
use super::prompt::shorthand;
use super::row::{CallPass, Proposal, ReflectionRow};
use super::{REVISION_ROUNDS, ReflectionError, Reflector, tailor_ops_schema};
use crate::cluster::scheduler::JobPayload;
use crate::guidance::{GuidanceOp, GuidanceRepo};
use crate::learn::op_check::{
    self, AcceptedOp, OpsContext, OpsValidation, RejectReason, RejectedOp,
};
use crate::learn::rejected_memory::RejectedMemory;

/// Accepted and rejected ops of round `r` are numbered `r × 1000 + position in its proposal`.
pub(super) const ROUND_INDEX_STRIDE: usize = 1000;

/// What every round of a cycle's ops pass works from.
struct OpsInputs<'a> {
    learnable: &'a Learnable,
    guidance: &'a GuidanceRepo,
    schema: Value,
    shorthand: BTreeMap<String, TicketKey>,
    case_summaries: Vec<String>,
    max_ops: Option<usize>,
    /// Rejected edits remembered from earlier cycles, when remembering is on.
    memory: Option<RejectedMemory>,
}

impl OpsInputs<'_> {
    /// The validator's context (with the whole `max_operations` cap).
    fn context<'a>(&'a self, group_ids: &'a BTreeSet<String>) -> OpsContext<'a> {
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

impl Reflector {
    /// Ops rounds: the ops pass on `L` and its revision round. They need a call left; without
    /// one `L` goes to need-review.
    pub(super) async fn ops_rounds(
        &mut self,
        row: &mut ReflectionRow,
        learnable: &Learnable,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch<'_>,
    ) -> Result<Flow<OpsValidation>, ReflectionError> {
        if !self.calls_left() {
            row.warnings.push("budget_exhausted_before_ops".into());
            let routed = self.exhaust_all(&learnable.records, Some(&row.reflection_id))?;
            return Ok(Flow::End(CycleEnd::BudgetSpentBeforeOps(routed)));
        }
        let inputs = self.ops_inputs(learnable, guidance);
        let mut validation = OpsValidation::default();
        let mut proposals: Vec<Proposal> = Vec::new();
        let mut revision: Option<Vec<RejectedOp>> = None;
        for round in 0..=REVISION_ROUNDS {
            if round > 0 && (revision.as_ref().is_none_or(Vec::is_empty) || !self.calls_left()) {
                break;
            }
            let answer = self
                .ops_round(
                    row,
                    round,
                    &inputs,
                    revision.as_deref(),
                    &validation,
                    dispatch,
                )
                .await?;
            let Some((proposal, verdict)) = answer else {
                break;
            };
            proposals.push(proposal);
            // A remembered edit is not worth a revision call.
            let revisable = verdict
                .rejected
                .iter()
                .filter(|r| r.reason != RejectReason::AlreadyRejected);
            revision = Some(revisable.cloned().collect());
            absorb(&mut validation, verdict, round);
        }
        let cap = self.remembered_cap();
        if cap > 0 {
            let cycle = row.reflection_cycle;
            self.state
                .rejected
                .remember(&validation.rejected, cycle, cap);
        }
        ::metrics::counter!(observe::REFLECTION_OPS, "outcome" => "rejected")
            .increment(validation.rejected.len() as u64);
        row.proposals = Some(proposals);
        row.accepted_ops = Some(validation.accepted.clone());
        row.rejected_ops = Some(validation.rejected.clone());
        Ok(Flow::Next(validation))
    }

    fn ops_inputs<'a>(
        &self,
        learnable: &'a Learnable,
        guidance: &'a GuidanceRepo,
    ) -> OpsInputs<'a> {
        let max_ops = self.config.max_operations.map(|m| m as usize);
        OpsInputs {
            learnable,
            guidance,
            schema: tailor_ops_schema(
                max_ops.unwrap_or(8),
                &learnable.keys,
                guidance,
                self.config.max_new_tokens,
                self.config.gate.enabled,
            ),
            shorthand: shorthand(&learnable.records),
            case_summaries: learnable
                .records
                .iter()
                .flat_map(|r| r.summaries.iter().map(|(_, s)| s.clone()))
                .collect(),
            max_ops,
            memory: (self.remembered_cap() > 0).then(|| self.state.rejected.clone()),
        }
    }

    /// A round's messages: the cases of `L`, and for a revision the ops rejected last round.
    fn round_messages(
        &self,
        inputs: &OpsInputs<'_>,
        cycle: u64,
        revision: Option<&[RejectedOp]>,
    ) -> Vec<ChatMessage> {
        let cases = &inputs.learnable.records;
        let memory = inputs.memory.as_ref();
        self.ops_messages(cases, inputs.guidance, cycle, revision, memory)
    }

    /// The job of `cycle`'s ops pass on `learnable` (its first attempt), built as
    /// [`Reflector::ops_rounds`] builds it: for a call queued ahead.
    pub(super) fn first_ops_payload(
        &self,
        learnable: &Learnable,
        guidance: &GuidanceRepo,
        cycle: u64,
    ) -> JobPayload {
        let inputs = self.ops_inputs(learnable, guidance);
        let messages = self.round_messages(&inputs, cycle, None);
        let seed = self.call_seed(self.state.epoch, cycle, CallPass::Ops, 0);
        self.call_payload(&messages, &inputs.schema, seed)
    }

    /// How many rejected edits are remembered: `reflection.gate.remember_rejected` with the
    /// gate on, else none.
    pub(super) fn remembered_cap(&self) -> usize {
        let gate = &self.config.gate;
        if gate.enabled {
            gate.remember_rejected as usize
        } else {
            0
        }
    }

    /// One round: the call (with the ops rejected last round, for a revision) and its proposal
    /// validated against the rounds before. `None` when the call gave no usable answer.
    async fn ops_round(
        &mut self,
        row: &mut ReflectionRow,
        round: u32,
        inputs: &OpsInputs<'_>,
        revision: Option<&[RejectedOp]>,
        so_far: &OpsValidation,
        dispatch: &mut Dispatch<'_>,
    ) -> Result<Option<(Proposal, OpsValidation)>, ReflectionError> {
        let messages = self.round_messages(inputs, row.reflection_cycle, revision);
        let pass = if round == 0 {
            CallPass::Ops
        } else {
            CallPass::OpsRevision
        };
        let parse = reflection_schema::parse_ops;
        let (schema, guidance) = (&inputs.schema, inputs.guidance);
        let answer = self
            .call_json(row, pass, (messages, schema), guidance, dispatch, parse)
            .await?;
        let Some(out) = answer else {
            row.warnings.push(format!("{}_error", pass.as_str()));
            return Ok(None);
        };
        let verdict = validate_remembering(
            round,
            &out.operations,
            so_far,
            inputs.context(&self.run_groups),
            inputs.memory.as_ref(),
        );
        Ok(Some((proposal(round, &out), verdict)))
    }
}

/// One round's answer, as the row logs it.
fn proposal(round: u32, out: &OpsOutput) -> Proposal {
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
fn validate_remembering(
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
fn absorb(validation: &mut OpsValidation, round_verdict: OpsValidation, round: u32) {
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
