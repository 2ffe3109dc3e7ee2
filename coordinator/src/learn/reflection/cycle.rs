//! One reflection cycle on one batch: budget checks, packing, the decision pass, the ops pass
//! with its revision round, apply, closure, and the `reflection.jsonl` row.

use std::collections::{BTreeMap, BTreeSet};

use stageb_shared::digest::{digest_of, sha256_hex};
use stageb_shared::domain::TicketKey;
use stageb_shared::observe;
use stageb_shared::reflection_schema;

use super::call::Workers;
use super::row::{
    CallPass, CoverageCounts, DecisionRecord, Proposal, ReflectionRow, Routing, RowOpening,
};
use super::{
    GradientRecord, REVISION_ROUNDS, ReflectionError, Reflector, io_err, tailor_decision_schema,
    tailor_ops_schema,
};
use crate::artifacts::files;
use crate::guidance::{GuidanceError, GuidanceRepo, OpEffect, RuleKey};
use crate::learn::need_review::NeedReviewReason;
use crate::learn::op_check::{self, OpsContext, OpsValidation, RejectedOp};

impl Reflector {
    /// One reflection cycle on `batch`.
    pub(super) async fn run_cycle(
        &mut self,
        epoch: u32,
        global_step: u64,
        attempt: u32,
        batch: Vec<GradientRecord>,
        guidance: &mut GuidanceRepo,
        workers: &mut Workers<'_>,
    ) -> Result<(), ReflectionError> {
        let cycle = self.state.cycles;
        let batch_keys: Vec<TicketKey> = batch.iter().map(|r| r.ticket_key.clone()).collect();
        let reflection_id = format!(
            "r{}",
            &sha256_hex(
                format!(
                    "{}|{}|{}|{}",
                    self.run_seed,
                    epoch,
                    cycle,
                    digest_of(&batch_keys)
                )
                .as_bytes()
            )[..12]
        );
        let mut row = ReflectionRow::open(RowOpening {
            epoch,
            global_step,
            reflection_cycle: cycle,
            reflection_id: reflection_id.clone(),
            retry_attempt: attempt,
            batch: batch_keys,
            guidance_step: guidance.step(),
            guidance_hash: guidance.head_hash().to_string(),
        });
        let mut warnings: Vec<String> = Vec::new();

        // Budget before anything: no call left → the whole batch is exhausted.
        if !self.calls_left() {
            warnings.push("budget_exhausted_before_decision".into());
            let routed = self.exhaust_all(&batch, None)?;
            return self.finish_cycle(row, warnings, Routing::BudgetExhausted(routed), guidance);
        }

        // No change can be applied any more this epoch: no model call is spent on the batch,
        // and its tickets are routed with their own reason (they used up no budget).
        if self.change_cap_reached() {
            warnings.push("epoch_change_cap_reached".into());
            let mut routed = Vec::with_capacity(batch.len());
            for r in &batch {
                routed.push(r.ticket_key.clone());
                self.route(r, NeedReviewReason::ChangeCapReached, None, None)?;
            }
            return self.finish_cycle(row, warnings, Routing::ChangeCapReached(routed), guidance);
        }

        // Pack whole cases under the token budget, highest priority first; at least one case.
        let mut ordered = batch;
        ordered.sort_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then(a.order.cmp(&b.order))
                .then(a.ticket_key.cmp(&b.ticket_key))
        });
        let (kept, dropped) = self.pack(&ordered, guidance);
        if !dropped.is_empty() {
            warnings.push(format!("dropped_by_token_budget={}", dropped.len()));
            // Re-batched uncharged: they never reached a model.
            row.dropped_by_token_budget =
                Some(dropped.iter().map(|r| r.ticket_key.clone()).collect());
        }
        let shorthand: BTreeMap<String, TicketKey> = kept
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("第{}组", i + 1), r.ticket_key.clone()))
            .collect();
        let kept_keys: BTreeSet<TicketKey> = kept.iter().map(|r| r.ticket_key.clone()).collect();

        // Decision pass.
        let decision_prompt = self.decision_messages(&kept, guidance, cycle);
        let decision_schema = tailor_decision_schema(&kept_keys, self.config.max_new_tokens);
        let decision = self
            .call_json(
                &mut row,
                CallPass::Decision,
                decision_prompt,
                &decision_schema,
                workers,
                reflection_schema::parse_decision,
            )
            .await?;
        self.state.decisions_epoch.0 += 1;
        if decision.is_some() {
            self.state.decisions_epoch.1 += 1;
        }
        let Some(decision) = decision else {
            warnings.push("decision_error".into());
            self.requeue_uncharged(attempt, dropped);
            let routed = self.retry_or_route(kept, Some(&reflection_id))?;
            return self.finish_cycle(row, warnings, Routing::BudgetExhausted(routed), guidance);
        };
        let resolved =
            op_check::resolve_ids(&decision.no_evidence_group_ids, &shorthand, &kept_keys);
        if !resolved.unknown.is_empty() {
            warnings.push(format!("unknown_ids={}", resolved.unknown.len()));
        }
        let stop: BTreeSet<TicketKey> = resolved.keys.iter().cloned().collect();
        let mut learnable_records = Vec::new();
        for r in kept {
            if stop.contains(&r.ticket_key) {
                // Stop-gradient: routed, feedback dropped, excluded from everything after.
                self.route(
                    &r,
                    NeedReviewReason::ReflectionNoEvidenceAfterGt,
                    Some(&reflection_id),
                    Some(decision.decision_analysis.clone()),
                )?;
            } else {
                learnable_records.push(r);
            }
        }
        let learnable: BTreeSet<TicketKey> = learnable_records
            .iter()
            .map(|r| r.ticket_key.clone())
            .collect();
        row.stop_gradient = Some(stop);
        row.learnable = Some(learnable.clone());
        row.decision = Some(DecisionRecord {
            no_evidence_group_ids: decision.no_evidence_group_ids,
            resolved: resolved.keys,
            unknown_ids: resolved.unknown,
            decision_analysis: decision.decision_analysis,
        });
        self.requeue_uncharged(attempt, dropped);
        if learnable_records.is_empty() {
            return self.finish_cycle(
                row,
                warnings,
                Routing::BudgetExhausted(Vec::new()),
                guidance,
            );
        }
        if !self.calls_left() {
            warnings.push("budget_exhausted_before_ops".into());
            let routed = self.exhaust_all(&learnable_records, Some(&reflection_id))?;
            return self.finish_cycle(row, warnings, Routing::BudgetExhausted(routed), guidance);
        }

        // Ops pass on L only, then validation, then one revision round for rejected ops.
        let l_shorthand: BTreeMap<String, TicketKey> = learnable_records
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("第{}组", i + 1), r.ticket_key.clone()))
            .collect();
        let max_ops = self.config.max_operations.map(|m| m as usize);
        let ops_schema = tailor_ops_schema(
            max_ops.unwrap_or(8),
            &learnable,
            guidance,
            self.config.max_new_tokens,
        );
        let case_summaries: Vec<String> = learnable_records
            .iter()
            .flat_map(|r| r.summaries.iter().map(|(_, s)| s.clone()))
            .collect();
        let mut validation = OpsValidation::default();
        let mut proposals: Vec<Proposal> = Vec::new();
        let mut revision: Option<Vec<RejectedOp>> = None;
        for round in 0..=REVISION_ROUNDS {
            if round > 0 && (revision.as_ref().is_none_or(Vec::is_empty) || !self.calls_left()) {
                break;
            }
            let messages =
                self.ops_messages(&learnable_records, guidance, cycle, revision.as_deref());
            let pass = if round == 0 {
                CallPass::Ops
            } else {
                CallPass::OpsRevision
            };
            let out = self
                .call_json(
                    &mut row,
                    pass,
                    messages,
                    &ops_schema,
                    workers,
                    reflection_schema::parse_ops,
                )
                .await?;
            let Some(ops_out) = out else {
                warnings.push(format!("{}_error", pass.as_str()));
                break;
            };
            proposals.push(Proposal {
                round,
                has_evidence: ops_out.has_evidence,
                evidence_analysis: ops_out.evidence_analysis.clone(),
                operations: ops_out.operations.clone(),
                coverage_advisory: ops_out.coverage.clone(),
            });
            // A revision is validated without the cap: repeats of first-round ops are dropped
            // first, and only then does the cap apply to what is genuinely new (otherwise
            // resent repeats would use up the cap and push the corrected op out).
            let remaining_cap = max_ops.map(|m| m.saturating_sub(validation.accepted.len()));
            let ctx = OpsContext {
                learnable: &learnable,
                shorthand: &l_shorthand,
                guidance: guidance.current(),
                max_operations: if round == 0 { remaining_cap } else { None },
                group_ids: &self.run_groups,
                case_summaries: &case_summaries,
            };
            let mut v = op_check::validate_ops(&ops_out.operations, &ctx);
            if round > 0 {
                // A revision is validated on its own; it must not repeat or collide with what
                // the first round already got accepted (one op per key per cycle).
                let taken: BTreeSet<String> = validation
                    .accepted
                    .iter()
                    .flat_map(|a| touched_keys(&a.op))
                    .collect();
                let seen: Vec<String> = validation
                    .accepted
                    .iter()
                    .map(|a| serde_json::to_string(&a.op).unwrap_or_default())
                    .collect();
                let (keep, clash): (Vec<_>, Vec<_>) = v.accepted.into_iter().partition(|a| {
                    !touched_keys(&a.op).iter().any(|k| taken.contains(k))
                        && !seen.contains(&serde_json::to_string(&a.op).unwrap_or_default())
                });
                let cap = remaining_cap.unwrap_or(usize::MAX);
                let (keep, over): (Vec<_>, Vec<_>) =
                    keep.into_iter().enumerate().partition(|(i, _)| *i < cap);
                v.accepted = keep.into_iter().map(|(_, a)| a).collect();
                for (_, a) in over {
                    v.rejected.push(RejectedOp {
                        index: a.index,
                        proposed: ops_out.operations[a.index].clone(),
                        reason: op_check::RejectReason::MaxOperationsExceeded,
                        detail: "reflection.max_operations already reached in this cycle".into(),
                    });
                }
                for a in clash {
                    v.rejected.push(RejectedOp {
                        index: a.index,
                        proposed: ops_out.operations[a.index].clone(),
                        reason: op_check::RejectReason::DuplicateOp,
                        detail:
                            "repeats or touches the same key as an op accepted in the first round"
                                .into(),
                    });
                }
            }
            revision = Some(v.rejected.clone());
            validation
                .accepted
                .extend(v.accepted.into_iter().map(|mut a| {
                    a.index += round as usize * 1000;
                    a
                }));
            validation
                .rejected
                .extend(v.rejected.into_iter().map(|mut r| {
                    r.index += round as usize * 1000;
                    r
                }));
        }
        ::metrics::counter!(observe::REFLECTION_OPS, "outcome" => "rejected")
            .increment(validation.rejected.len() as u64);
        row.proposals = Some(proposals);
        row.accepted_ops = Some(validation.accepted.clone());
        row.rejected_ops = Some(validation.rejected.clone());

        // Apply, unless the epoch's change cap is reached.
        let mut applied = false;
        let mut covered: BTreeSet<TicketKey> = BTreeSet::new();
        if !validation.accepted.is_empty() {
            if self.change_cap_reached() {
                // Unreachable through the check at the cycle's start (one apply per cycle);
                // kept so that the cap never depends on that ordering.
                warnings.push("epoch_change_cap_reached".into());
            } else {
                match guidance.apply(&validation.ops(), &reflection_id) {
                    Ok(outcome) => {
                        applied = true;
                        self.state.applied_epoch += 1;
                        covered = op_check::evidence_covered(&outcome.applied);
                        self.state.last_applied = Some(reflection_id.clone());
                        let removed: Vec<RuleKey> = outcome
                            .applied
                            .iter()
                            .flat_map(|a| {
                                let deleted = (a.effect == OpEffect::Deleted).then_some(a.key);
                                deleted.into_iter().chain(a.merged_away.iter().copied())
                            })
                            .collect();
                        self.state
                            .feedback
                            .on_applied(&outcome.touched_keys, &removed);
                        ::metrics::counter!(observe::REFLECTION_OPS, "outcome" => "applied")
                            .increment(outcome.applied.len() as u64);
                        row.applied_ops = Some(outcome.applied);
                        row.skipped_at_apply = Some(outcome.skipped);
                    }
                    Err(GuidanceError::NothingApplied { .. }) => {
                        warnings.push("apply_failed:nothing_applied".into())
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let covered: BTreeSet<TicketKey> = covered.intersection(&learnable).cloned().collect();
        row.applied = Some(applied);
        row.coverage = Some(CoverageCounts::of(learnable.len(), covered.len()));
        row.covered = Some(covered.clone());

        // Closure: contributors commit their feedback; L \ E (and dropped cases) retry or exhaust.
        let mut hits = Vec::new();
        let mut misses = Vec::new();
        let mut uncovered = Vec::new();
        for r in learnable_records {
            if covered.contains(&r.ticket_key) {
                let keys = self.state.feedback.resolve(&r.feedback.rules);
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
            guidance
                .record_feedback(&hits, &misses)
                .map_err(ReflectionError::from)?;
        }
        if !uncovered.is_empty() {
            warnings.push(format!("uncovered={}", uncovered.len()));
        }
        row.uncovered = Some(uncovered.iter().map(|r| r.ticket_key.clone()).collect());
        let routed = self.retry_or_route(uncovered, Some(&reflection_id))?;
        self.finish_cycle(row, warnings, Routing::BudgetExhausted(routed), guidance)
    }

    pub(super) fn finish_cycle(
        &mut self,
        mut row: ReflectionRow,
        warnings: Vec<String>,
        routing: Routing,
        guidance: &GuidanceRepo,
    ) -> Result<(), ReflectionError> {
        row.warnings = warnings;
        row.close(routing, guidance.step(), guidance.head_hash());
        let path = self.dir.join(files::REFLECTION);
        self.reflection_log.append(&row).map_err(io_err(&path))?;
        self.reflection_log.sync().map_err(io_err(&path))?;
        self.queue_log.sync().map_err(io_err(&path))?;
        self.state.cycles += 1;
        Ok(())
    }
}

/// Every key an op changes: its target and, for a merge, the keys merged away.
fn touched_keys(op: &crate::guidance::GuidanceOp) -> Vec<String> {
    let mut keys: Vec<String> = op.key().map(|k| k.to_string()).into_iter().collect();
    if let crate::guidance::GuidanceOp::Merge { merged_from, .. } = op {
        keys.extend(merged_from.iter().map(|k| k.to_string()));
    }
    keys
}
