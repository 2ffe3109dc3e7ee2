//! The learning loop on rank 0: batches of gradient candidates go through a decision pass
//! (who is unlearnable even after seeing the label → need-review) and an ops pass on the
//! learnable rest `L` (validated guidance edits), with closure `L == E` enforced by bounded,
//! reflection-only retries.
//!
//! Deterministic phase first (seed 002): which tickets are reflected on, in what batches and
//! order, is decided by rank 0 alone; the model is called only when a batch exists, and every
//! model output is cross-checked: ids are resolved against the batch, every op is validated
//! ([`crate::learn::op_check`]), and coverage `E` is computed from the ops that were actually *applied*,
//! never from the model's own `coverage` or `has_evidence` (which are logged only).
//!
//! Budgets: each ticket gets `1 + retry_budget_per_group_per_epoch` cycles per epoch (retry
//! batches halve: 16 → 8 → 4), the epoch gets `max_calls_per_epoch` model calls, and a call
//! whose output is not valid JSON is retried with a new seed (up to [`JSON_RETRIES`]) before it
//! costs any ticket its budget. Rejected ops go back once with their reasons (validate–revise,
//! seed 001) and then stay rejected.
//!
//! need-review is non-sticky: routing is recorded per epoch and every epoch decides afresh.
//! Stop-gradient tickets never reach the ops pass, evidence, or hit/miss feedback.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use stageb_shared::SCHEMA_VERSION;
use stageb_shared::config::{LifecycleConfig, ReflectionConfig, RunConfig};
use stageb_shared::digest::{digest_of, sha256_hex};
use stageb_shared::domain::{ChatMessage, Ticket, TicketKey, Verdict};
use stageb_shared::limits::EffectiveLimits;
use stageb_shared::observe;
use stageb_shared::reflection_schema;
use stageb_shared::seed::derived_seed;
use stageb_shared::text;
use tokio::sync::mpsc;

use crate::artifacts::files;
use crate::artifacts::{JsonlWriter, write_json_atomic};
use crate::cluster::completions::{WaitError, await_completions};
use crate::cluster::scheduler::{Completion, JobOutput, JobPayload, Scheduler};
use crate::decide::eligibility::Eligibility;
use crate::decide::selection::{Selection, VoteCandidate};
use crate::guidance::{GuidanceError, GuidanceRepo, OpEffect, RuleKey};
use crate::learn::need_review::{self, NeedReviewReason, NeedReviewRow};
use crate::learn::op_check::{self, OpsContext, OpsValidation, RejectedOp};

mod prompt;
mod state;
use prompt::{DECISION_SYSTEM, OPS_SYSTEM, REJECTED_OP_CHARS, case_text, header_text};
pub use prompt::{estimate_tokens, tailor_decision_schema, tailor_ops_schema};
pub use state::ReflectorState;

/// Extra attempts (new seed each) for a reflection call whose output is not valid JSON.
pub const JSON_RETRIES: u32 = 2;
/// Revision rounds for rejected ops (validate → revise → validate once more).
pub const REVISION_ROUNDS: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ReflectionError {
    #[error("cannot write reflection artifacts under {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the prompt file {path}: {source}")]
    PromptFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the prompt file {path} is empty")]
    EmptyPrompt { path: PathBuf },
    #[error(transparent)]
    Guidance(#[from] GuidanceError),
    #[error(transparent)]
    Wait(#[from] WaitError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ReflectionError + '_ {
    move |source| ReflectionError::Io {
        path: path.to_path_buf(),
        source,
    }
}

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

pub use crate::learn::feedback::PendingFeedback;

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

    fn identity(&self) -> need_review::TicketIdentity {
        need_review::TicketIdentity {
            ticket_key: self.ticket_key.clone(),
            group_id: self.group_id.clone(),
            mission: self.mission.clone(),
            gt_label: self.gt,
        }
    }
}

/// Token usage and latency of one model call, for `reflection.jsonl`.
#[derive(Debug, Clone, Serialize)]
struct CallRecord {
    pass: &'static str,
    attempt: u32,
    seed: u64,
    ok: bool,
    parse_error: Option<Value>,
    raw_output: String,
    prompt_tokens: u32,
    completion_tokens: u32,
    finish_reason: String,
    runtime: Value,
}

/// Batch size of retry round `attempt` (16 → 8 → 4 …, never below 1).
pub fn retry_batch_size(batch_size: u32, attempt: u32) -> usize {
    ((batch_size as usize) >> attempt.min(31)).max(1)
}

/// The reflection driver. Owns `need_review_queue.jsonl` and `reflection.jsonl`.
pub struct Reflector {
    dir: PathBuf,
    config: ReflectionConfig,
    lifecycle: Option<LifecycleConfig>,
    run_seed: u64,
    mission: String,
    decision_system: String,
    ops_system: String,
    queue_log: JsonlWriter,
    reflection_log: JsonlWriter,
    need_review_rows: Vec<NeedReviewRow>,
    routed: BTreeMap<u32, BTreeSet<TicketKey>>,
    /// Everything a checkpoint must carry (buffers, budgets, feedback, counters).
    state: ReflectorState,
    guidance_reused: bool,
    worker_grace: Duration,
    /// Group ids of every ticket of the run: no rule text may name one.
    run_groups: BTreeSet<String>,
    /// `runner.epochs`: the epoch whose routing `need_review.json` shows as the final view.
    final_epoch: u32,
}

impl Reflector {
    /// A fresh reflector; its logs start empty.
    pub fn create(dir: &Path, run: &RunConfig, mission: &str) -> Result<Self, ReflectionError> {
        Reflector::build(dir, run, mission, JsonlWriter::create)
    }

    /// A reflector at the start of a run, its logs opened with `open` (fresh or appended to).
    fn build(
        dir: &Path,
        run: &RunConfig,
        mission: &str,
        open: fn(&Path) -> std::io::Result<JsonlWriter>,
    ) -> Result<Self, ReflectionError> {
        let read_prompt = |p: &Option<PathBuf>, builtin: &str| -> Result<String, ReflectionError> {
            match p {
                Some(path) => {
                    let text = std::fs::read_to_string(path).map_err(|source| {
                        ReflectionError::PromptFile {
                            path: path.clone(),
                            source,
                        }
                    })?;
                    if text.trim().is_empty() {
                        return Err(ReflectionError::EmptyPrompt { path: path.clone() });
                    }
                    Ok(text)
                }
                None => Ok(builtin.to_string()),
            }
        };
        let open = |name: &str| {
            let p = dir.join(name);
            open(&p).map_err(|source| ReflectionError::Io { path: p, source })
        };
        Ok(Reflector {
            dir: dir.to_path_buf(),
            config: run.reflection.clone(),
            lifecycle: run.guidance_lifecycle.clone(),
            run_seed: run.seed,
            mission: mission.to_string(),
            decision_system: read_prompt(&run.reflection.decision_prompt_path, DECISION_SYSTEM)?,
            ops_system: read_prompt(&run.reflection.ops_prompt_path, OPS_SYSTEM)?,
            queue_log: open(files::NEED_REVIEW_QUEUE)?,
            reflection_log: open(files::REFLECTION)?,
            need_review_rows: Vec::new(),
            routed: BTreeMap::new(),
            state: ReflectorState::default(),
            guidance_reused: false,
            worker_grace: Duration::from_secs(600),
            run_groups: BTreeSet::new(),
            final_epoch: run.runner.epochs,
        })
    }

    /// Plan every call within the run's context: the fitted output length and prompt budget
    /// replace the config's (see [`stageb_shared::limits`]).
    pub fn fit_limits(&mut self, limits: &EffectiveLimits) {
        self.config.max_new_tokens = limits.reflection_max_new_tokens;
        self.config.max_reflection_length = limits.reflection_max_prompt_tokens;
        self.config.token_budget = limits.reflection_token_budget;
    }

    /// How long reflection calls wait with no live worker before giving up.
    pub fn set_worker_grace(&mut self, grace: Duration) {
        self.worker_grace = grace;
    }

    /// The group ids of every ticket of the run (for the `label_leak` check of rule texts).
    pub fn set_run_groups(&mut self, groups: BTreeSet<String>) {
        self.run_groups = groups;
    }

    pub fn set_guidance_reused(&mut self, reused: bool) {
        self.guidance_reused = reused;
    }

    pub fn guidance_reused(&self) -> bool {
        self.guidance_reused
    }

    /// Reflection cycles run so far (every processed batch counts, applied or not).
    pub fn cycles(&self) -> u64 {
        self.state.cycles
    }

    /// The id of the last reflection that changed guidance.
    pub fn last_applied_reflection(&self) -> Option<String> {
        self.state.last_applied.clone()
    }

    pub fn need_review_count(&self) -> usize {
        self.need_review_rows.len()
    }

    /// Tickets routed to need-review during `epoch`.
    pub fn need_review_keys(&self, epoch: u32) -> BTreeSet<TicketKey> {
        self.routed.get(&epoch).cloned().unwrap_or_default()
    }

    /// Reset the per-epoch state: need-review is decided afresh every epoch.
    pub fn start_epoch(&mut self, epoch: u32) {
        self.state.epoch = epoch;
        self.state.pending.clear();
        self.state.retry.clear();
        self.state.retry_counts.clear();
        self.state.calls_epoch = 0;
        self.state.applied_epoch = 0;
        self.state.decisions_epoch = (0, 0);
        self.state.arrivals = 0;
    }

    /// Record a decided ticket that is *not* a gradient candidate: its feedback on the rules
    /// of the last applied reflection is immediate (it agreed with its label).
    pub fn add_stable(&mut self, label_match: bool) {
        self.state.feedback.credit_stable(label_match);
    }

    /// Queue a gradient candidate; its feedback is buffered until reflection decides.
    pub fn add_candidate(&mut self, mut record: GradientRecord) {
        record.order = self.state.arrivals;
        self.state.arrivals += 1;
        record.feedback.rules = self.state.feedback.owed_now();
        self.state.pending.push(record);
    }

    /// The next batch to reflect on, if one is due. Mid-epoch only full batches are taken;
    /// at epoch end (`drain`) everything is, including retries created while draining.
    fn next_batch(&mut self, drain: bool) -> Option<(u32, Vec<GradientRecord>)> {
        let size = self.config.batch_size.max(1) as usize;
        if self.state.pending.len() >= size || (drain && !self.state.pending.is_empty()) {
            let n = size.min(self.state.pending.len());
            return Some((0, self.state.pending.drain(..n).collect()));
        }
        let attempts: Vec<u32> = self.state.retry.keys().copied().collect();
        for attempt in attempts {
            let bucket = self.state.retry.get_mut(&attempt).expect("listed above");
            bucket.sort_by(|a, b| a.ticket_key.cmp(&b.ticket_key));
            let want = retry_batch_size(self.config.batch_size, attempt);
            if bucket.len() >= want || (drain && !bucket.is_empty()) {
                let n = want.min(bucket.len());
                let batch: Vec<_> = bucket.drain(..n).collect();
                if bucket.is_empty() {
                    self.state.retry.remove(&attempt);
                }
                return Some((attempt, batch));
            }
        }
        None
    }

    /// Called at every step boundary (and with `drain` at epoch end): commit buffered
    /// feedback, then run every due reflection cycle.
    pub async fn on_step_end(
        &mut self,
        epoch: u32,
        global_step: u64,
        guidance: &mut GuidanceRepo,
        scheduler: &Scheduler,
        completions: &mut mpsc::UnboundedReceiver<Completion>,
        drain: bool,
    ) -> Result<(), ReflectionError> {
        self.flush_immediate_feedback(guidance)?;
        while let Some((attempt, batch)) = self.next_batch(drain) {
            self.run_cycle(
                epoch,
                global_step,
                attempt,
                batch,
                guidance,
                scheduler,
                completions,
            )
            .await?;
        }
        Ok(())
    }

    fn flush_immediate_feedback(
        &mut self,
        guidance: &mut GuidanceRepo,
    ) -> Result<(), ReflectionError> {
        let (hits, misses) = self.state.feedback.take_immediate();
        if hits.is_empty() && misses.is_empty() {
            return Ok(());
        }
        guidance
            .record_feedback(&hits, &misses)
            .map_err(ReflectionError::from)?;
        Ok(())
    }

    fn route(
        &mut self,
        record: &GradientRecord,
        reason: NeedReviewReason,
        reflection_id: Option<&str>,
        note: Option<String>,
    ) -> Result<(), ReflectionError> {
        let at = need_review::RoutingPoint {
            epoch: self.state.epoch,
            reflection_cycle: self.state.cycles,
            reflection_id: reflection_id.map(str::to_string),
        };
        let row =
            NeedReviewRow::from_selection(&record.identity(), &record.selection, reason, &at, note);
        let path = self.dir.join(files::NEED_REVIEW_QUEUE);
        self.queue_log.append(&row).map_err(io_err(&path))?;
        self.routed
            .entry(self.state.epoch)
            .or_default()
            .insert(record.ticket_key.clone());
        self.need_review_rows.push(row);
        Ok(())
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
        let mut routed = Vec::new();
        let mut records = records;
        records.sort_by(|a, b| a.ticket_key.cmp(&b.ticket_key));
        for r in records {
            let count = self
                .state
                .retry_counts
                .entry(r.ticket_key.clone())
                .or_insert(0);
            *count += 1;
            let count = *count;
            if count <= self.config.retry_budget_per_group_per_epoch {
                self.state.retry.entry(count).or_default().push(r);
            } else {
                routed.push(r.ticket_key.clone());
                self.route(&r, NeedReviewReason::BudgetExhausted, reflection_id, None)?;
            }
        }
        Ok(routed)
    }

    /// Cases dropped by the token budget never reached a model: they go back to the queue
    /// they came from (arrival order kept) without being charged a retry.
    fn requeue_uncharged(&mut self, attempt: u32, records: Vec<GradientRecord>) {
        if records.is_empty() {
            return;
        }
        if attempt == 0 {
            self.state.pending.extend(records);
            self.state.pending.sort_by_key(|r| r.order);
        } else {
            self.state.retry.entry(attempt).or_default().extend(records);
        }
    }

    /// Has the epoch applied `change_cap_per_epoch` reflections already?
    fn change_cap_reached(&self) -> bool {
        self.config
            .change_cap_per_epoch
            .is_some_and(|cap| self.state.applied_epoch >= cap)
    }

    fn calls_left(&self) -> bool {
        self.config
            .max_calls_per_epoch
            .is_none_or(|cap| self.state.calls_epoch < cap)
    }

    /// One reflection cycle on `batch`.
    #[allow(clippy::too_many_arguments)]
    async fn run_cycle(
        &mut self,
        epoch: u32,
        global_step: u64,
        attempt: u32,
        batch: Vec<GradientRecord>,
        guidance: &mut GuidanceRepo,
        scheduler: &Scheduler,
        completions: &mut mpsc::UnboundedReceiver<Completion>,
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
        let step_before = guidance.step();
        let hash_before = guidance.head_hash().to_string();
        let mut row = json!({
            "schema_version": SCHEMA_VERSION,
            "epoch": epoch,
            "global_step": global_step,
            "reflection_cycle": cycle,
            "reflection_id": reflection_id,
            "retry_attempt": attempt,
            "batch": batch_keys,
            "guidance_step_before": step_before,
            "guidance_hash_before": hash_before,
        });
        let mut warnings: Vec<String> = Vec::new();
        let mut calls: Vec<CallRecord> = Vec::new();

        // Budget before anything: no call left → the whole batch is exhausted.
        if !self.calls_left() {
            warnings.push("budget_exhausted_before_decision".into());
            let routed = self.exhaust_all(&batch, None)?;
            return self.finish_cycle(
                row,
                warnings,
                calls,
                json!({"budget_exhausted": routed}),
                guidance,
            );
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
            return self.finish_cycle(
                row,
                warnings,
                calls,
                json!({"change_cap_reached": routed}),
                guidance,
            );
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
            row["dropped_by_token_budget"] = json!(
                dropped
                    .iter()
                    .map(|r| r.ticket_key.clone())
                    .collect::<Vec<_>>()
            );
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
                epoch,
                cycle,
                "decision",
                decision_prompt,
                &decision_schema,
                scheduler,
                completions,
                &mut calls,
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
            return self.finish_cycle(
                row,
                warnings,
                calls,
                json!({"budget_exhausted": routed}),
                guidance,
            );
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
        row["stop_gradient"] = json!(stop);
        row["learnable"] = json!(learnable);
        row["decision"] = json!({"no_evidence_group_ids": decision.no_evidence_group_ids, "resolved": resolved.keys,
                                 "unknown_ids": resolved.unknown, "decision_analysis": decision.decision_analysis});
        self.requeue_uncharged(attempt, dropped);
        if learnable_records.is_empty() {
            return self.finish_cycle(
                row,
                warnings,
                calls,
                json!({"budget_exhausted": []}),
                guidance,
            );
        }
        if !self.calls_left() {
            warnings.push("budget_exhausted_before_ops".into());
            let routed = self.exhaust_all(&learnable_records, Some(&reflection_id))?;
            return self.finish_cycle(
                row,
                warnings,
                calls,
                json!({"budget_exhausted": routed}),
                guidance,
            );
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
        let mut proposals: Vec<Value> = Vec::new();
        let mut revision: Option<Vec<RejectedOp>> = None;
        for round in 0..=REVISION_ROUNDS {
            if round > 0 && (revision.as_ref().is_none_or(Vec::is_empty) || !self.calls_left()) {
                break;
            }
            let messages =
                self.ops_messages(&learnable_records, guidance, cycle, revision.as_deref());
            let pass = if round == 0 { "ops" } else { "ops_revision" };
            let out = self
                .call_json(
                    epoch,
                    cycle,
                    pass,
                    messages,
                    &ops_schema,
                    scheduler,
                    completions,
                    &mut calls,
                    reflection_schema::parse_ops,
                )
                .await?;
            let Some(ops_out) = out else {
                warnings.push(format!("{pass}_error"));
                break;
            };
            proposals.push(json!({"round": round, "has_evidence": ops_out.has_evidence,
                                  "evidence_analysis": ops_out.evidence_analysis, "operations": ops_out.operations,
                                  "coverage_advisory": ops_out.coverage}));
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
        row["proposals"] = json!(proposals);
        row["accepted_ops"] = json!(validation.accepted);
        row["rejected_ops"] = json!(validation.rejected);

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
                        row["applied_ops"] = json!(outcome.applied);
                        row["skipped_at_apply"] = json!(outcome.skipped);
                    }
                    Err(GuidanceError::NothingApplied { .. }) => {
                        warnings.push("apply_failed:nothing_applied".into())
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let covered: BTreeSet<TicketKey> = covered.intersection(&learnable).cloned().collect();
        row["applied"] = json!(applied);
        row["covered"] = json!(covered);
        row["coverage"] = json!({"learnable": learnable.len(), "covered": covered.len(),
                                 "ratio": if learnable.is_empty() { 0.0 } else { covered.len() as f64 / learnable.len() as f64 }});

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
        row["uncovered"] = json!(
            uncovered
                .iter()
                .map(|r| r.ticket_key.clone())
                .collect::<Vec<_>>()
        );
        let routed = self.retry_or_route(uncovered, Some(&reflection_id))?;
        self.finish_cycle(
            row,
            warnings,
            calls,
            json!({"budget_exhausted": routed}),
            guidance,
        )
    }

    fn finish_cycle(
        &mut self,
        mut row: Value,
        warnings: Vec<String>,
        calls: Vec<CallRecord>,
        routing: Value,
        guidance: &GuidanceRepo,
    ) -> Result<(), ReflectionError> {
        row["warnings"] = json!(warnings);
        row["routing"] = routing;
        row["guidance_step_after"] = json!(guidance.step());
        row["guidance_hash_after"] = json!(guidance.head_hash());
        // Worker-reported counts: summed wide (the scheduler bounds each one, see
        // `result_check::MAX_REPORTED_TOKENS`), so no run can overflow them.
        let prompt_tokens: u64 = calls.iter().map(|c| u64::from(c.prompt_tokens)).sum();
        let completion_tokens: u64 = calls.iter().map(|c| u64::from(c.completion_tokens)).sum();
        row["token_usage"] = json!({"calls": calls.len(), "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens});
        row["calls"] = json!(calls);
        if row.get("applied").is_none() {
            row["applied"] = json!(false);
        }
        let path = self.dir.join(files::REFLECTION);
        self.reflection_log.append(&row).map_err(io_err(&path))?;
        self.reflection_log.sync().map_err(io_err(&path))?;
        self.queue_log.sync().map_err(io_err(&path))?;
        self.state.cycles += 1;
        Ok(())
    }

    /// Run one JSON-mode generation through the lease mechanism, retrying with a new seed when
    /// the output does not parse. `None` when every attempt failed or the budget ran out.
    #[allow(clippy::too_many_arguments)]
    async fn call_json<T>(
        &mut self,
        epoch: u32,
        cycle: u64,
        pass: &'static str,
        messages: Vec<ChatMessage>,
        schema: &Value,
        scheduler: &Scheduler,
        completions: &mut mpsc::UnboundedReceiver<Completion>,
        calls: &mut Vec<CallRecord>,
        parse: impl Fn(&str) -> Result<T, reflection_schema::ReflectionParseError>,
    ) -> Result<Option<T>, ReflectionError> {
        for attempt in 0..=JSON_RETRIES {
            if !self.calls_left() {
                return Ok(None);
            }
            self.state.calls_epoch += 1;
            let seed = derived_seed(
                self.run_seed,
                "reflection-call",
                &[
                    &epoch.to_le_bytes(),
                    &cycle.to_le_bytes(),
                    pass.as_bytes(),
                    &attempt.to_le_bytes(),
                ],
            );
            let job = scheduler.enqueue(JobPayload::Generate {
                messages: messages.clone(),
                json_schema: Some(schema.to_string()),
                seed,
                temperature: self.config.temperature,
                top_p: self.config.top_p,
                repetition_penalty: self.config.repetition_penalty,
                max_new_tokens: self.config.max_new_tokens,
            });
            let mut done =
                await_completions(scheduler, completions, &[job], self.worker_grace).await?;
            let completion = done.remove(&job).expect("awaited");
            let runtime = match &completion.provenance {
                Some(p) => {
                    json!({"worker_id": p.worker_id, "lease_id": p.lease_id, "attempt": p.attempt})
                }
                None => json!({}),
            };
            match completion.result {
                Ok(JobOutput::Generate {
                    text,
                    prompt_tokens,
                    completion_tokens,
                    finish_reason,
                    latency_us,
                }) => {
                    let parsed = parse(&text);
                    let outcome = if parsed.is_ok() {
                        "parsed"
                    } else {
                        "unparseable"
                    };
                    ::metrics::counter!(observe::REFLECTION_CALLS, "pass" => pass, "outcome" => outcome)
                        .increment(1);
                    let mut runtime = runtime;
                    runtime["latency_us"] = json!(latency_us);
                    calls.push(CallRecord {
                        pass,
                        attempt,
                        seed,
                        ok: parsed.is_ok(),
                        parse_error: parsed
                            .as_ref()
                            .err()
                            .map(|e| serde_json::to_value(e).unwrap_or(json!(e.to_string()))),
                        raw_output: text,
                        prompt_tokens,
                        completion_tokens,
                        finish_reason,
                        runtime,
                    });
                    if let Ok(v) = parsed {
                        return Ok(Some(v));
                    }
                }
                Ok(JobOutput::Rollout { .. }) => {
                    calls.push(failed_call(
                        pass,
                        attempt,
                        seed,
                        "WRONG_RESULT_KIND",
                        "a generation returned a rollout",
                        runtime,
                    ));
                }
                Err(f) => {
                    ::metrics::counter!(observe::REFLECTION_CALLS, "pass" => pass, "outcome" => "failed")
                        .increment(1);
                    calls.push(failed_call(
                        pass, attempt, seed, &f.code, &f.message, runtime,
                    ));
                    // Deterministic failures (an over-long prompt) do not improve with a new seed.
                    if f.code == "PROMPT_TOO_LONG" || f.code == "INVALID_REQUEST" {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(None)
    }

    /// What a reflection prompt may hold (bytes bound tokens from above): the fitted
    /// `min(token_budget, max_reflection_length)`, so that `prompt + max_new_tokens ≤ context`.
    fn prompt_budget(&self) -> usize {
        self.config
            .token_budget
            .min(self.config.max_reflection_length) as usize
    }

    /// Split `ordered` into cases that fit the token budget and cases dropped whole.
    fn pack(
        &self,
        ordered: &[GradientRecord],
        guidance: &GuidanceRepo,
    ) -> (Vec<GradientRecord>, Vec<GradientRecord>) {
        let budget = self.prompt_budget();
        // Both passes see the same cases; budget for the longer of the two system prompts.
        let system = self.decision_system.len().max(self.ops_system.len());
        let base = system
            + estimate_tokens("")
            + estimate_tokens(&header_text(&self.mission, guidance, 0, 0));
        let mut used = base;
        let mut kept = Vec::new();
        let mut dropped = Vec::new();
        for (i, r) in ordered.iter().enumerate() {
            let cost = estimate_tokens(&case_text(i + 1, r, true));
            if kept.is_empty() || used + cost <= budget {
                used += cost;
                kept.push(r.clone());
            } else {
                dropped.push(r.clone());
            }
        }
        (kept, dropped)
    }

    fn decision_messages(
        &self,
        cases: &[GradientRecord],
        guidance: &GuidanceRepo,
        cycle: u64,
    ) -> Vec<ChatMessage> {
        let mut user = header_text(&self.mission, guidance, cycle, cases.len());
        for (i, r) in cases.iter().enumerate() {
            user.push_str(&case_text(i + 1, r, true));
        }
        user.push_str("\n请输出 JSON。");
        vec![
            ChatMessage::system(self.decision_system.clone()),
            ChatMessage::user(user),
        ]
    }

    fn ops_messages(
        &self,
        cases: &[GradientRecord],
        guidance: &GuidanceRepo,
        cycle: u64,
        rejected: Option<&[RejectedOp]>,
    ) -> Vec<ChatMessage> {
        let mut user = header_text(&self.mission, guidance, cycle, cases.len());
        for (i, r) in cases.iter().enumerate() {
            user.push_str(&case_text(i + 1, r, true));
        }
        if let Some(rejected) = rejected.filter(|r| !r.is_empty()) {
            user.push_str(
                "\n以下操作被拒绝。只需给出按原因修正后的这些操作，不要重复已接受的操作：\n",
            );
            // The packed cases fit the prompt budget; the rejected ops (a hostile model can
            // make them long) get what is left, each line capped, the rest left out.
            let budget = self.prompt_budget();
            let mut used = self.ops_system.len() + estimate_tokens(&user) + estimate_tokens("");
            for r in rejected {
                let op = serde_json::to_string(&r.proposed).unwrap_or_default();
                let line = format!(
                    "- {} → 拒绝原因: {} ({})\n",
                    text::truncate_chars(&op, REJECTED_OP_CHARS),
                    r.reason.code(),
                    text::truncate_chars(&r.detail, REJECTED_OP_CHARS)
                );
                if used + line.len() > budget {
                    break;
                }
                used += line.len();
                user.push_str(&line);
            }
        }
        user.push_str("\n请输出 JSON。");
        vec![
            ChatMessage::system(self.ops_system.clone()),
            ChatMessage::user(user),
        ]
    }

    /// Epoch end: optional lifecycle cleanup; buffered feedback of undecided tickets is
    /// discarded (it never became a contributor).
    pub fn end_epoch(
        &mut self,
        epoch: u32,
        guidance: &mut GuidanceRepo,
    ) -> Result<(), ReflectionError> {
        let (ran, parsed) = self.state.decisions_epoch;
        if ran > 0 && parsed == 0 {
            // No configuration may make every reflection call fail silently.
            let warning = format!(
                "epoch {epoch}: none of {ran} decision passes produced a usable answer; the \
                 guidance could not learn (see the calls in reflection.jsonl: PROMPT_TOO_LONG \
                 means reflection.token_budget/max_new_tokens exceed the model's context)"
            );
            tracing::error!("{warning}");
            self.state.run_warnings.push(warning);
        }
        self.flush_immediate_feedback(guidance)?;
        if let Some(lc) = &self.lifecycle
            && lc.enable_auto_cleanup
        {
            let removed = guidance
                .cleanup_low_confidence(
                    lc.confidence_drop_threshold,
                    lc.min_miss_before_drop as u64,
                )
                .map_err(ReflectionError::from)?;
            if !removed.is_empty() {
                tracing::info!(?removed, "lifecycle cleanup removed low-confidence rules");
                self.state.feedback.on_removed(&removed);
            }
        }
        Ok(())
    }

    /// Warnings for `summary.json`, in the order they arose.
    pub fn run_warnings(&self) -> &[String] {
        &self.state.run_warnings
    }

    /// Run end: write `need_review.json` (deterministic aggregation of every epoch's rows).
    pub fn finish_run(&mut self) -> Result<(), ReflectionError> {
        let summary =
            need_review::aggregate(&self.mission, &self.need_review_rows, self.final_epoch);
        let path = self.dir.join(files::NEED_REVIEW);
        write_json_atomic(&path, &summary).map_err(|source| ReflectionError::Io { path, source })
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

fn failed_call(
    pass: &'static str,
    attempt: u32,
    seed: u64,
    code: &str,
    message: &str,
    runtime: Value,
) -> CallRecord {
    CallRecord {
        pass,
        attempt,
        seed,
        ok: false,
        parse_error: Some(json!({"code": code, "message": message})),
        raw_output: String::new(),
        prompt_tokens: 0,
        completion_tokens: 0,
        finish_reason: String::new(),
        runtime,
    }
}

#[cfg(test)]
mod tests {
    use super::prompt::TEMPLATE_TOKENS;
    use super::*;

    #[test]
    fn retry_batches_halve_and_never_reach_zero() {
        // The original's _batch_size_for_retry behaviour.
        assert_eq!(retry_batch_size(32, 0), 32);
        assert_eq!(retry_batch_size(32, 1), 16);
        assert_eq!(retry_batch_size(32, 2), 8);
        assert_eq!(retry_batch_size(3, 2), 1);
    }

    #[test]
    fn token_estimate_is_an_upper_bound_for_byte_level_tokenizers() {
        // 通过 is 4 tokens for SmolLM2 and 6 bytes: the estimate never undercounts.
        assert!(estimate_tokens("通过") >= 4);
        assert_eq!(estimate_tokens(""), TEMPLATE_TOKENS);
    }
}
