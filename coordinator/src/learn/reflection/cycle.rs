//! One reflection cycle on one batch, as named phases:
//!
//! guard → pack → decision pass → ops rounds (validated by `ops.rs`) → gate (`gate.rs`) →
//! apply → closure, then close.
//!
//! Each phase either hands the next one its input ([`Flow::Next`]) or ends the cycle
//! ([`Flow::End`]) with a [`CycleEnd`] that names how it ended; whichever way it ended, `close`
//! writes the cycle's `reflection.jsonl` row once. The phases fill in the row as they go.

use std::collections::BTreeSet;

use stageb_shared::digest::{digest_of, sha256_hex};
use stageb_shared::domain::TicketKey;
use stageb_shared::observe;
use stageb_shared::reflection_schema::{self, DecisionOutput};

use super::ops::{OpsInputs, absorb, proposal, validate_remembering};
use super::prompt::shorthand;
use super::record::{Learnable, keys_of};
use super::row::{
    CallPass, CoverageCounts, DecisionRecord, Proposal, ReflectionRow, Routing, RowOpening,
};
use super::{GradientRecord, REVISION_ROUNDS, ReflectionError, Reflector};
use crate::cluster::dispatch::Dispatch;
use crate::guidance::{ApplyOutcome, GuidanceError, GuidanceRepo, OpEffect, RuleKey};
use crate::learn::need_review::{NeedReviewReason, RoutingPoint};
use crate::learn::op_check::{self, OpsValidation, RejectReason, RejectedOp};
use crate::learn::predictions::Prediction;

/// How a cycle ended: every early exit is one of these, and so is the normal end. Each names
/// the tickets it routed to need-review (the row's `routing`).
pub(super) enum CycleEnd {
    /// No call was left before the decision pass: the whole batch went to need-review.
    BudgetSpentBeforeDecision(Vec<TicketKey>),
    /// The epoch's change cap was reached: no call was spent, the batch went to need-review.
    ChangeCapReached(Vec<TicketKey>),
    /// The decision pass produced no usable answer: the kept cases retry or went to need-review.
    DecisionFailed(Vec<TicketKey>),
    /// Every kept case was stop-gradient: nothing was left for the ops pass.
    NothingLearnable,
    /// No call was left for the ops pass: the learnable cases went to need-review.
    BudgetSpentBeforeOps(Vec<TicketKey>),
    /// The ops pass ran, applied or not: the uncovered cases retry or went to need-review.
    Closed(Vec<TicketKey>),
}

impl CycleEnd {
    fn routing(self) -> Routing {
        match self {
            CycleEnd::ChangeCapReached(keys) => Routing::ChangeCapReached(keys),
            CycleEnd::NothingLearnable => Routing::BudgetExhausted(Vec::new()),
            CycleEnd::BudgetSpentBeforeDecision(keys)
            | CycleEnd::DecisionFailed(keys)
            | CycleEnd::BudgetSpentBeforeOps(keys)
            | CycleEnd::Closed(keys) => Routing::BudgetExhausted(keys),
        }
    }
}

/// What a phase hands on: the next phase's input, or the end of the cycle.
pub(super) enum Flow<T> {
    Next(T),
    End(CycleEnd),
}

/// A decision answer applied to the kept cases: the ids it named, resolved against them, the
/// cases it stopped (in prompt order) and `L`, the rest.
pub(super) struct StopSplit {
    pub(super) resolved: op_check::ResolvedIds,
    pub(super) stopped: Vec<GradientRecord>,
    pub(super) learnable: Learnable,
}

/// Which kept cases `decision` stops (its no-evidence ids, resolved against the batch), and
/// `L`. Pure: the cycle routes the stopped ones, calls queued ahead plan the ops pass on `L`.
pub(super) fn split_stop_gradient(
    kept: Vec<GradientRecord>,
    kept_keys: &BTreeSet<TicketKey>,
    decision: &DecisionOutput,
) -> StopSplit {
    let resolved = op_check::resolve_ids(
        &decision.no_evidence_group_ids,
        &shorthand(&kept),
        kept_keys,
    );
    let stop: BTreeSet<&TicketKey> = resolved.keys.iter().collect();
    let (stopped, records): (Vec<_>, Vec<_>) =
        kept.into_iter().partition(|r| stop.contains(&r.ticket_key));
    let keys = records.iter().map(|r| r.ticket_key.clone()).collect();
    StopSplit {
        resolved,
        stopped,
        learnable: Learnable { records, keys },
    }
}

impl Reflector {
    /// One reflection cycle on `batch`: its phases, then its row.
    pub(super) async fn run_cycle(
        &mut self,
        epoch: u32,
        global_step: u64,
        attempt: u32,
        batch: Vec<GradientRecord>,
        guidance: &mut GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<(), ReflectionError> {
        let mut row = self.open_row(epoch, global_step, attempt, &batch, guidance);
        let end = self.phases(&mut row, batch, guidance, dispatch).await?;
        self.close(row, end, guidance)
    }

    /// The phases in order, until one ends the cycle.
    async fn phases(
        &mut self,
        row: &mut ReflectionRow,
        batch: Vec<GradientRecord>,
        guidance: &mut GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<CycleEnd, ReflectionError> {
        let batch = match self.guard(row, batch)? {
            Flow::Next(batch) => batch,
            Flow::End(end) => return Ok(end),
        };
        let kept = self.pack(row, batch, guidance);
        // The queues now hold what the next cycles will take (this batch's dropped cases are
        // back): the time to queue their likely calls ahead.
        self.plan_calls_ahead(guidance, dispatch);
        let learnable = match self.decision_pass(row, kept, guidance, dispatch).await? {
            Flow::Next(learnable) => learnable,
            Flow::End(end) => return Ok(end),
        };
        let validation = match self.ops_rounds(row, &learnable, guidance, dispatch).await? {
            Flow::Next(validation) => validation,
            Flow::End(end) => return Ok(end),
        };
        let validation = self.gate_phase(row, validation, guidance, dispatch).await?;
        let covered = self.apply(row, &validation, &learnable.keys, guidance)?;
        self.closure(row, learnable, &covered, guidance)
    }

    /// The row's opening: the cycle's number and id (from the run seed, epoch, cycle and batch
    /// keys) and the guidance it starts from.
    fn open_row(
        &self,
        epoch: u32,
        global_step: u64,
        attempt: u32,
        batch: &[GradientRecord],
        guidance: &GuidanceRepo,
    ) -> ReflectionRow {
        let cycle = self.cycles;
        let batch_keys = keys_of(batch);
        let seed_text = format!(
            "{}|{}|{}|{}",
            self.run_seed,
            epoch,
            cycle,
            digest_of(&batch_keys)
        );
        ReflectionRow::open(RowOpening {
            epoch,
            global_step,
            reflection_cycle: cycle,
            reflection_id: format!("r{}", &sha256_hex(seed_text.as_bytes())[..12]),
            retry_attempt: attempt,
            batch: batch_keys,
            guidance_step: guidance.step(),
            guidance_hash: guidance.head_hash().to_string(),
        })
    }

    /// Guard: a cycle needs a call left and room under the epoch's change cap; without either
    /// the whole batch goes to need-review and no call is made.
    fn guard(
        &mut self,
        row: &mut ReflectionRow,
        batch: Vec<GradientRecord>,
    ) -> Result<Flow<Vec<GradientRecord>>, ReflectionError> {
        if !self.budget.calls_left() {
            row.warnings.push("budget_exhausted_before_decision".into());
            let routed = self.exhaust_all(&batch, None)?;
            return Ok(Flow::End(CycleEnd::BudgetSpentBeforeDecision(routed)));
        }
        // No change can be applied any more this epoch: no model call is spent on the batch,
        // and its tickets are routed with their own reason (they used up no budget).
        if self.budget.change_cap_reached() {
            row.warnings.push("epoch_change_cap_reached".into());
            for r in &batch {
                self.route(r, NeedReviewReason::ChangeCapReached, None, None)?;
            }
            return Ok(Flow::End(CycleEnd::ChangeCapReached(keys_of(&batch))));
        }
        Ok(Flow::Next(batch))
    }

    /// Pack: whole cases under the token budget, highest priority first; at least one case.
    /// The cases left out go back to the queue they came from, uncharged (they never reach a
    /// model), whatever the decision pass then makes of the kept ones.
    fn pack(
        &mut self,
        row: &mut ReflectionRow,
        batch: Vec<GradientRecord>,
        guidance: &GuidanceRepo,
    ) -> Vec<GradientRecord> {
        let (kept, dropped) = self.prompts.pack(batch, guidance);
        if !dropped.is_empty() {
            row.warnings
                .push(format!("dropped_by_token_budget={}", dropped.len()));
            row.dropped_by_token_budget = Some(keys_of(&dropped));
            self.queue.requeue_uncharged(row.retry_attempt, dropped);
        }
        kept
    }

    /// Decision pass: which kept cases are unlearnable even with their label (stop-gradient);
    /// the others are `L`.
    async fn decision_pass(
        &mut self,
        row: &mut ReflectionRow,
        kept: Vec<GradientRecord>,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<Flow<Learnable>, ReflectionError> {
        let kept_keys: BTreeSet<TicketKey> = kept.iter().map(|r| r.ticket_key.clone()).collect();
        let cycle = row.reflection_cycle;
        let (messages, schema) = self.prompts.decision(&kept, &kept_keys, guidance, cycle);
        let parse = reflection_schema::parse_decision;
        let decision = self
            .call_json(
                row,
                CallPass::Decision,
                (messages, &schema),
                guidance,
                dispatch,
                parse,
            )
            .await?;
        self.decisions_epoch.0 += 1;
        if decision.is_some() {
            self.decisions_epoch.1 += 1;
        }
        let Some(decision) = decision else {
            row.warnings.push("decision_error".into());
            let routed = self.retry_or_route(kept, Some(&row.reflection_id))?;
            return Ok(Flow::End(CycleEnd::DecisionFailed(routed)));
        };
        let learnable = self.stop_gradient(row, kept, &kept_keys, decision)?;
        if learnable.records.is_empty() {
            return Ok(Flow::End(CycleEnd::NothingLearnable));
        }
        Ok(Flow::Next(learnable))
    }

    /// The decision's stop-gradient cases go to need-review (their feedback dropped, excluded
    /// from everything after); the rest are `L`. The row gets the decision and the split.
    fn stop_gradient(
        &mut self,
        row: &mut ReflectionRow,
        kept: Vec<GradientRecord>,
        kept_keys: &BTreeSet<TicketKey>,
        decision: DecisionOutput,
    ) -> Result<Learnable, ReflectionError> {
        let split = split_stop_gradient(kept, kept_keys, &decision);
        if !split.resolved.unknown.is_empty() {
            row.warnings
                .push(format!("unknown_ids={}", split.resolved.unknown.len()));
        }
        for r in &split.stopped {
            let note = Some(decision.decision_analysis.clone());
            let reason = NeedReviewReason::ReflectionNoEvidenceAfterGt;
            self.route(r, reason, Some(&row.reflection_id), note)?;
        }
        row.stop_gradient = Some(split.resolved.keys.iter().cloned().collect());
        row.learnable = Some(split.learnable.keys.clone());
        row.decision = Some(DecisionRecord {
            no_evidence_group_ids: decision.no_evidence_group_ids,
            resolved: split.resolved.keys,
            unknown_ids: split.resolved.unknown,
            decision_analysis: decision.decision_analysis,
        });
        Ok(split.learnable)
    }

    /// Apply: the accepted ops become one guidance version, unless the epoch's change cap is
    /// reached. Returns `E`: the evidence of the ops actually applied, within `L`.
    fn apply(
        &mut self,
        row: &mut ReflectionRow,
        validation: &OpsValidation,
        learnable: &BTreeSet<TicketKey>,
        guidance: &mut GuidanceRepo,
    ) -> Result<BTreeSet<TicketKey>, ReflectionError> {
        let mut applied = false;
        let mut covered = BTreeSet::new();
        if !validation.accepted.is_empty() {
            if self.budget.change_cap_reached() {
                // Unreachable through the check at the cycle's start (one apply per cycle);
                // kept so that the cap never depends on that ordering.
                row.warnings.push("epoch_change_cap_reached".into());
            } else {
                match guidance.apply(&validation.ops(), &row.reflection_id) {
                    Ok(outcome) => {
                        applied = true;
                        covered = op_check::evidence_covered(&outcome.applied);
                        self.track_predictions(row, validation, &outcome.applied);
                        self.record_applied(row, outcome);
                    }
                    Err(GuidanceError::NothingApplied { .. }) => {
                        row.warnings.push("apply_failed:nothing_applied".into())
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let covered: BTreeSet<TicketKey> = covered.intersection(learnable).cloned().collect();
        row.applied = Some(applied);
        row.covered = Some(covered.clone());
        row.coverage = Some(CoverageCounts::of(learnable.len(), covered.len()));
        Ok(covered)
    }

    /// The claims (`expected_flips`) of the ops that were applied, to be settled in later
    /// epochs. `applied[i].index` is the op's position among the accepted ones.
    fn track_predictions(
        &mut self,
        row: &ReflectionRow,
        validation: &OpsValidation,
        applied: &[crate::guidance::AppliedOp],
    ) {
        for a in applied {
            let Some(accepted) = validation.accepted.get(a.index) else {
                continue;
            };
            self.predictions.add(Prediction {
                reflection_id: row.reflection_id.clone(),
                epoch: row.epoch,
                key: a.key.to_string(),
                op: a.op.clone(),
                claimed: accepted.expected_flips.clone(),
                hits: Vec::new(),
                misses: Vec::new(),
            });
        }
    }

    /// A guidance version was written: it counts against the epoch's cap, its rules owe
    /// feedback from now on, and the row lists what was applied and what was skipped.
    fn record_applied(&mut self, row: &mut ReflectionRow, outcome: ApplyOutcome) {
        self.budget.count_applied();
        self.last_applied = Some(row.reflection_id.clone());
        let removed: Vec<RuleKey> = outcome
            .applied
            .iter()
            .flat_map(|a| {
                let deleted = (a.effect == OpEffect::Deleted).then_some(a.key);
                deleted.into_iter().chain(a.merged_away.iter().copied())
            })
            .collect();
        self.feedback.on_applied(&outcome.touched_keys, &removed);
        ::metrics::counter!(observe::REFLECTION_OPS, "outcome" => "applied")
            .increment(outcome.applied.len() as u64);
        row.applied_ops = Some(outcome.applied);
        row.skipped_at_apply = Some(outcome.skipped);
    }

    /// Closure: the covered cases (`E`) commit their buffered feedback; `L \ E` retry with a
    /// smaller batch while they have budget, else go to need-review.
    fn closure(
        &mut self,
        row: &mut ReflectionRow,
        learnable: Learnable,
        covered: &BTreeSet<TicketKey>,
        guidance: &mut GuidanceRepo,
    ) -> Result<CycleEnd, ReflectionError> {
        let mut hits = Vec::new();
        let mut misses = Vec::new();
        let mut uncovered = Vec::new();
        for r in learnable.records {
            if covered.contains(&r.ticket_key) {
                let keys = self.feedback.resolve(&r.feedback.rules);
                if r.feedback.label_match {
                    hits.extend(keys);
                } else {
                    misses.extend(keys);
                }
            } else {
                uncovered.push(r);
            }
        }
        if !hits.is_empty() || !misses.is_empty() {
            guidance.record_feedback(&hits, &misses)?;
        }
        if !uncovered.is_empty() {
            row.warnings.push(format!("uncovered={}", uncovered.len()));
        }
        row.uncovered = Some(keys_of(&uncovered));
        let routed = self.retry_or_route(uncovered, Some(&row.reflection_id))?;
        Ok(CycleEnd::Closed(routed))
    }

    /// Close: the row gets its routing and closing keys and is appended; the cycle counts.
    /// A cycle that changed the guidance (written durably by `apply`) syncs its row and the
    /// queue of routed tickets at once, so the row that explains a guidance step is never lost
    /// while the step stands; the others are synced with the boundary's last cycle
    /// ([`Reflector::on_step_end`]): a boundary of hundreds of cycles with the call budget spent
    /// no longer pays six syncs per cycle on rank 0's critical path.
    fn close(
        &mut self,
        mut row: ReflectionRow,
        end: CycleEnd,
        guidance: &GuidanceRepo,
    ) -> Result<(), ReflectionError> {
        row.close(end.routing(), guidance.step(), guidance.head_hash());
        self.logs.append(&row)?;
        if row.applied == Some(true) {
            self.logs.sync_named()?;
        }
        self.cycles += 1;
        Ok(())
    }

    /// Ops rounds: the ops pass on `L` and its revision round. They need a call left; without
    /// one `L` goes to need-review. The cycle's rejections are remembered at their end.
    async fn ops_rounds(
        &mut self,
        row: &mut ReflectionRow,
        learnable: &Learnable,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<Flow<OpsValidation>, ReflectionError> {
        if !self.budget.calls_left() {
            row.warnings.push("budget_exhausted_before_ops".into());
            let routed = self.exhaust_all(&learnable.records, Some(&row.reflection_id))?;
            return Ok(Flow::End(CycleEnd::BudgetSpentBeforeOps(routed)));
        }
        let inputs = self.ops_inputs(learnable, guidance);
        let mut validation = OpsValidation::default();
        let mut proposals: Vec<Proposal> = Vec::new();
        let mut revision: Option<Vec<RejectedOp>> = None;
        for round in 0..=REVISION_ROUNDS {
            let nothing_to_revise = revision.as_ref().is_none_or(Vec::is_empty);
            if round > 0 && (nothing_to_revise || !self.budget.calls_left()) {
                break;
            }
            let revise = revision.as_deref();
            let answer = self
                .ops_round(row, round, &inputs, revise, &validation, dispatch)
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
        self.remember(&validation.rejected, row.reflection_cycle);
        ::metrics::counter!(observe::REFLECTION_OPS, "outcome" => "rejected")
            .increment(validation.rejected.len() as u64);
        row.proposals = Some(proposals);
        row.accepted_ops = Some(validation.accepted.clone());
        row.rejected_ops = Some(validation.rejected.clone());
        Ok(Flow::Next(validation))
    }

    /// What the ops rounds on `learnable` work from.
    pub(super) fn ops_inputs<'a>(
        &self,
        learnable: &'a Learnable,
        guidance: &'a GuidanceRepo,
    ) -> OpsInputs<'a> {
        let max_ops = self.config.max_operations.map(|m| m as usize);
        let memory = (self.remember_cap > 0).then(|| self.rejected.clone());
        OpsInputs::new(learnable, guidance, &self.prompts, max_ops, memory)
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
        dispatch: &mut Dispatch,
    ) -> Result<Option<(Proposal, OpsValidation)>, ReflectionError> {
        let messages = inputs.messages(&self.prompts, row.reflection_cycle, revision);
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

    /// The gate phase, while the epoch's change cap leaves room: the ops it refuses are
    /// remembered like other rejected edits.
    async fn gate_phase(
        &mut self,
        row: &mut ReflectionRow,
        validation: OpsValidation,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<OpsValidation, ReflectionError> {
        if self.budget.change_cap_reached() {
            return Ok(validation);
        }
        let (validation, refused) = self.gate.check(row, validation, guidance, dispatch).await?;
        self.remember(&refused, row.reflection_cycle);
        Ok(validation)
    }

    /// Remember `rejected` (of `cycle`), when rejected edits are remembered.
    fn remember(&mut self, rejected: &[RejectedOp], cycle: u64) {
        if self.remember_cap > 0 {
            self.rejected.remember(rejected, cycle, self.remember_cap);
        }
    }

    fn route(
        &mut self,
        record: &GradientRecord,
        reason: NeedReviewReason,
        reflection_id: Option<&str>,
        note: Option<String>,
    ) -> Result<(), ReflectionError> {
        let at = RoutingPoint {
            epoch: self.epoch,
            reflection_cycle: self.cycles,
            reflection_id: reflection_id.map(str::to_string),
        };
        self.logs.route(record, reason, &at, note)
    }

    /// Route every record to need-review `budget_exhausted` (the epoch's call budget is spent).
    fn exhaust_all(
        &mut self,
        records: &[GradientRecord],
        reflection_id: Option<&str>,
    ) -> Result<Vec<TicketKey>, ReflectionError> {
        let mut routed = Vec::with_capacity(records.len());
        for r in records {
            routed.push(r.ticket_key.clone());
            self.route(r, NeedReviewReason::BudgetExhausted, reflection_id, None)?;
        }
        Ok(routed)
    }

    /// `L \ E` and dropped cases: retried with a smaller batch while budget remains, else
    /// need-review `budget_exhausted`. Returns the keys routed.
    fn retry_or_route(
        &mut self,
        records: Vec<GradientRecord>,
        reflection_id: Option<&str>,
    ) -> Result<Vec<TicketKey>, ReflectionError> {
        let given_up = self.queue.retry_or_give_up(records);
        self.exhaust_all(&given_up, reflection_id)
    }
}
