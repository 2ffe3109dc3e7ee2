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
//!
//! # Layout
//! - this file: the [`Reflector`] and its life over a run (epochs, steps, run end).
//! - `record`: what reflection learns from ([`GradientRecord`], built from a [`TicketOutcome`]).
//! - `queue`: the pending and retry queues, and routing to need-review.
//! - `budget`: the epoch's call budget and change cap (`CallBudget`, `ChangeCap`).
//! - `need_review_log`: `need_review_queue.jsonl`, its rows and the tickets each epoch routed.
//! - `cycle`: one reflection cycle on one batch, as named phases, and how it ended.
//! - `ops`: the cycle's ops pass and revision round, and how their proposals are validated.
//! - `gate`: the gate phase: candidate and parent guidance rolled out on the gate split.
//! - `ablation`: each learned rule left out in turn, on the gate split (every N epochs).
//! - `call`: one model call through the lease mechanism, retried while its JSON does not parse.
//! - `calls_ahead`: the next cycles' likely calls, queued ahead while a cycle runs.
//! - [`row`]: the `reflection.jsonl` row, as the cycle writes it and the report and audit read it.
//! - `prompt`: what the model reads (case texts, packing under the token budget, schemas).
//! - `state`: what a checkpoint carries.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use stageb_shared::config::{LifecycleConfig, ReflectionConfig, RunConfig};
use stageb_shared::domain::TicketKey;
use stageb_shared::limits::EffectiveLimits;

use crate::artifacts::files;
use crate::artifacts::{JsonlWriter, write_json_atomic};
use crate::cluster::completions::{Completions, WaitError};
use crate::cluster::scheduler::Scheduler;
use crate::guidance::{GuidanceError, GuidanceRepo, RuleKey};
use crate::learn::need_review;
use crate::learn::predictions::PredictionCheck;
use crate::progress::ProgressHandle;

mod ablation;
mod budget;
mod call;
mod calls_ahead;
mod cycle;
mod gate;
mod need_review_log;
mod ops;
mod prompt;
mod queue;
mod record;
pub mod row;
mod state;
pub use crate::artifacts::documents::{CallPrefixReuse, CallsAheadStats, GateCost};
pub use ablation::RuleAblation;
use call::Dispatch;
pub use gate::{GateProbe, RolloutPayloadFn, rendered_digest};
use need_review_log::NeedReviewLog;
use prompt::{DECISION_SYSTEM, OPS_SYSTEM};
pub use prompt::{estimate_tokens, tailor_decision_schema, tailor_ops_schema};
pub use queue::retry_batch_size;
pub use record::{CaseCandidate, GradientRecord, TicketOutcome};
pub use row::ReflectionRow;
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

pub use crate::learn::feedback::PendingFeedback;

/// The reflection driver. Owns `need_review_queue.jsonl` and `reflection.jsonl`.
pub struct Reflector {
    dir: PathBuf,
    config: ReflectionConfig,
    lifecycle: Option<LifecycleConfig>,
    run_seed: u64,
    mission: String,
    decision_system: String,
    ops_system: String,
    /// `need_review_queue.jsonl`, its rows and which tickets each epoch routed.
    need_review: NeedReviewLog,
    reflection_log: JsonlWriter,
    /// Everything a checkpoint must carry (buffers, budgets, feedback, counters).
    state: ReflectorState,
    guidance_reused: bool,
    worker_grace: Duration,
    /// Group ids of every ticket of the run: no rule text may name one.
    run_groups: BTreeSet<String>,
    /// `runner.epochs`: the epoch whose routing `need_review.json` shows as the final view.
    final_epoch: u32,
    /// Prefill the workers' prefix caches saved on this attempt's calls (runtime only: not in
    /// [`ReflectorState`], a resumed attempt counts its own).
    prefix_reuse: CallPrefixReuse,
    /// Where each call's cycle and pass are shown (the run's progress state), when set.
    progress: Option<ProgressHandle>,
    /// The gate split and its rollouts (when the gate checks edits or ablates rules), the
    /// outcomes known this epoch and what the gate cost (runtime only).
    gate: gate::Gate,
    /// Calls queued ahead of their cycle (runtime only: a resumed attempt queues its own).
    calls_ahead: calls_ahead::CallsAhead,
}

/// What the run sets once, when it opens the reflector; everything else comes from the
/// run's config.
pub struct ReflectorSettings {
    /// The group ids of every ticket of the run (for the `label_leak` check of rule texts).
    pub run_groups: BTreeSet<String>,
    /// How long reflection calls wait with no live worker before giving up.
    pub worker_grace: Duration,
    /// Where each call's cycle and pass are shown (`reflecting cycle 2 (decision)`).
    pub progress: Option<ProgressHandle>,
    /// A previous run's guidance is continued (`guidance.reset_on_rerun: false`).
    pub guidance_reused: bool,
}

/// What the run learns once its context is known (when the first worker reports the model):
/// the token limits every call is planned within, and the gate split's tickets and rollouts.
pub struct RunContext<'a> {
    pub limits: &'a EffectiveLimits,
    /// `None` when the gate checks no edit and ablates no rule, or has no split.
    pub gate_probe: Option<GateProbe>,
}

impl Reflector {
    /// The reflector of a run: fresh (`resume: None`, its logs start empty) or continuing from
    /// a checkpoint's state (its logs are appended to, the caller having already cut them back
    /// to the checkpoint's lengths, and the need-review rows are read back from the queue).
    /// Calls are queued ahead for `runner.pipeline_cycles` cycles (0: none).
    pub fn open(
        dir: &Path,
        run: &RunConfig,
        mission: &str,
        settings: ReflectorSettings,
        resume: Option<ReflectorState>,
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
        let opener = match resume {
            Some(_) => JsonlWriter::open_resume,
            None => JsonlWriter::create,
        };
        let open = |name: &str| {
            let p = dir.join(name);
            opener(&p).map_err(|source| ReflectionError::Io { path: p, source })
        };
        let mut r = Reflector {
            dir: dir.to_path_buf(),
            config: run.reflection.clone(),
            lifecycle: run.guidance_lifecycle.clone(),
            run_seed: run.seed,
            mission: mission.to_string(),
            decision_system: read_prompt(&run.reflection.decision_prompt_path, DECISION_SYSTEM)?,
            ops_system: read_prompt(&run.reflection.ops_prompt_path, OPS_SYSTEM)?,
            need_review: NeedReviewLog::open(dir, opener)?,
            reflection_log: open(files::REFLECTION)?,
            state: ReflectorState::default(),
            guidance_reused: settings.guidance_reused,
            worker_grace: settings.worker_grace,
            run_groups: settings.run_groups,
            final_epoch: run.runner.epochs,
            prefix_reuse: CallPrefixReuse::default(),
            progress: settings.progress,
            gate: gate::Gate::default(),
            calls_ahead: calls_ahead::CallsAhead::new(run.runner.pipeline_cycles as usize),
        };
        if let Some(state) = resume {
            r.restore(state)?;
        }
        Ok(r)
    }

    /// The run's context, once known: every call is planned within the run's context (the
    /// fitted output length and prompt budget replace the config's, see
    /// [`stageb_shared::limits`]), and the gate phase gets its tickets and rollouts.
    pub fn enter_run(&mut self, context: RunContext<'_>) {
        let limits = context.limits;
        self.config.max_new_tokens = limits.reflection_max_new_tokens;
        self.config.max_reflection_length = limits.reflection_max_prompt_tokens;
        self.config.token_budget = limits.reflection_token_budget;
        self.gate.set_probe(context.gate_probe);
    }

    /// The calls queued ahead in this attempt, and what became of them.
    pub fn calls_ahead(&self) -> &CallsAheadStats {
        &self.calls_ahead.stats
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

    /// Prefill the workers' prefix caches saved on this attempt's reflection calls.
    pub fn prefix_reuse(&self) -> &CallPrefixReuse {
        &self.prefix_reuse
    }

    pub fn need_review_count(&self) -> usize {
        self.need_review.rows().len()
    }

    /// Tickets routed to need-review during `epoch`.
    pub fn need_review_keys(&self, epoch: u32) -> BTreeSet<TicketKey> {
        self.need_review.keys(epoch)
    }

    /// Reset the per-epoch state: need-review is decided afresh every epoch.
    pub fn start_epoch(&mut self, epoch: u32) {
        self.state.epoch = epoch;
        self.state.pending.clear();
        self.state.retry.clear();
        self.state.retry_counts.clear();
        self.state.calls_epoch = Default::default();
        self.state.applied_epoch = Default::default();
        self.state.decisions_epoch = (0, 0);
        self.state.arrivals = 0;
    }

    /// Record a decided ticket that is *not* a gradient candidate: its feedback on the rules
    /// of the last applied reflection is immediate (it agreed with its label).
    pub fn add_stable(&mut self, label_match: bool) {
        self.state.feedback.credit_stable(label_match);
    }

    /// A train ticket was decided in `epoch` (`correct`: its verdict matches its label): it
    /// settles the claims earlier ops made on it.
    pub fn note_decided(&mut self, key: &TicketKey, epoch: u32, correct: bool) {
        self.state.predictions.note(key, epoch, correct);
    }

    /// The predictions settled so far, taken out (for the epoch row); each op's hits and
    /// misses are added to its rule's lifecycle counters (`claims_hit`, `claims_missed`), where
    /// repeated failures make the rule a cleanup candidate at the end of the epoch.
    pub fn take_settled_predictions(
        &mut self,
        guidance: &mut GuidanceRepo,
    ) -> Result<Vec<PredictionCheck>, ReflectionError> {
        let settled = self.state.predictions.take_settled();
        let claims: Vec<(RuleKey, u64, u64)> = settled
            .iter()
            .filter_map(|p| {
                let key = p.key.parse::<RuleKey>().ok()?;
                Some((key, p.hits as u64, (p.claimed - p.hits) as u64))
            })
            .collect();
        guidance.record_claims(&claims)?;
        Ok(settled)
    }

    /// Queue a gradient candidate; its feedback is buffered until reflection decides.
    pub fn add_candidate(&mut self, mut record: GradientRecord) {
        record.order = self.state.arrivals;
        self.state.arrivals += 1;
        record.feedback.rules = self.state.feedback.owed_now();
        self.state.pending.push(record);
    }

    /// Called at every step boundary (and with `drain` at epoch end): commit buffered
    /// feedback, then run every due reflection cycle, then sync the rows they wrote.
    pub async fn on_step_end(
        &mut self,
        epoch: u32,
        global_step: u64,
        guidance: &mut GuidanceRepo,
        scheduler: &Scheduler,
        completions: &mut Completions,
        drain: bool,
    ) -> Result<(), ReflectionError> {
        self.flush_immediate_feedback(guidance)?;
        let mut dispatch = Dispatch {
            scheduler,
            completions,
        };
        self.calls_ahead.start_boundary(drain);
        let done = self
            .run_due_cycles(epoch, global_step, guidance, &mut dispatch, drain)
            .await;
        self.calls_ahead.withdraw_all(&mut dispatch);
        done?;
        let path = self.dir.join(files::REFLECTION);
        self.sync_logs().map_err(io_err(&path))
    }

    /// Every cycle due at this boundary, one after the other (each queues the next ones'
    /// likely calls ahead once it has packed its batch).
    async fn run_due_cycles(
        &mut self,
        epoch: u32,
        global_step: u64,
        guidance: &mut GuidanceRepo,
        dispatch: &mut Dispatch<'_>,
        drain: bool,
    ) -> Result<(), ReflectionError> {
        while let Some((attempt, batch)) = self.next_batch(drain) {
            self.run_cycle(epoch, global_step, attempt, batch, guidance, dispatch)
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

    /// The state a resumed run needs to continue after the current step boundary.
    pub fn state(&self) -> ReflectorState {
        self.state.clone()
    }

    /// Continue from a checkpoint's `state`: the need-review rows are read back from the
    /// queue the caller has cut back to the checkpoint's length.
    fn restore(&mut self, state: ReflectorState) -> Result<(), ReflectionError> {
        self.need_review.read_back()?;
        self.state = state;
        Ok(())
    }

    /// Makes both logs durable (before a checkpoint names their lengths).
    pub fn sync_logs(&mut self) -> std::io::Result<()> {
        self.need_review.sync()?;
        self.reflection_log.sync()
    }

    /// Warnings for `summary.json`, in the order they arose.
    pub fn run_warnings(&self) -> &[String] {
        &self.state.run_warnings
    }

    /// Run end: write `need_review.json` (deterministic aggregation of every epoch's rows).
    pub fn finish_run(&mut self) -> Result<(), ReflectionError> {
        let summary =
            need_review::aggregate(&self.mission, self.need_review.rows(), self.final_epoch);
        let path = self.dir.join(files::NEED_REVIEW);
        write_json_atomic(&path, &summary).map_err(|source| ReflectionError::Io { path, source })
    }
}
