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
//! The [`Reflector`] is a composition of parts, each owning its state and its invariants:
//! - this file: the [`Reflector`], built once by [`Reflector::new`] from [`ReflectorSettings`],
//!   and its life over a run (epochs, steps, run end).
//! - `record`: what reflection learns from ([`GradientRecord`], built from a [`TicketOutcome`]).
//! - `queue`: the pending and retry queues (`ReflectionQueue`).
//! - `budget`: the epoch's call budget and change cap (`EpochBudget`).
//! - `logs`: `reflection.jsonl` and the need-review queue ([`ReflectionLogs`]);
//!   `need_review_log`: the queue, its rows and the tickets each epoch routed.
//! - `cycle`: one reflection cycle on one batch, as named phases, and how it ended.
//! - `ops`: what the ops rounds work from, and how their proposals are validated.
//! - `gate`: the gate (`Gate`): candidate and parent guidance rolled out on the gate split.
//! - `ablation`: each learned rule left out in turn, on the gate split (every N epochs).
//! - `call`: one model call through the lease mechanism, retried while its JSON does not parse
//!   (`Calls`), and the planning of calls queued ahead.
//! - `calls_ahead`: the table of calls queued ahead while a cycle runs.
//! - [`row`]: the `reflection.jsonl` row, as the cycle writes it and the report and audit read it.
//! - `prompt`: what the model reads (case texts, packing under the token budget, schemas).
//! - `state`: what a checkpoint carries.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use stageb_shared::config::{LifecycleConfig, ReflectionConfig, RunConfig};
use stageb_shared::domain::TicketKey;

use crate::cluster::completions::WaitError;
use crate::cluster::dispatch::Dispatch;
use crate::guidance::{GuidanceError, GuidanceRepo, RuleKey};
use crate::learn::feedback::FeedbackLedger;
use crate::learn::predictions::{PredictionCheck, Predictions};
use crate::learn::rejected_memory::RejectedMemory;
use crate::progress::{ProgressHandle, ProgressSnapshot, ReflectionWork};

mod ablation;
mod budget;
mod call;
mod calls_ahead;
mod cycle;
mod gate;
mod logs;
mod need_review_log;
mod ops;
mod prompt;
mod queue;
mod record;
pub mod row;
mod state;
pub use crate::artifacts::documents::{CallPrefixReuse, CallsAheadStats, GateCost};
pub use ablation::RuleAblation;
use budget::EpochBudget;
use call::Calls;
use gate::Gate;
pub use gate::{GateProbe, RolloutPayloadFn, rendered_digest};
pub use logs::ReflectionLogs;
use prompt::Prompts;
pub use prompt::SystemPrompts;
pub use prompt::{estimate_tokens, tailor_decision_schema, tailor_ops_schema};
pub use queue::retry_batch_size;
use queue::{QueueParts, ReflectionQueue};
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

/// The reflection driver: a composition of the parts that own its state. Owns
/// `need_review_queue.jsonl` and `reflection.jsonl` (through its logs).
pub struct Reflector {
    /// `reflection.*`, its lengths fitted to the model's context.
    config: ReflectionConfig,
    lifecycle: Option<LifecycleConfig>,
    run_seed: u64,
    mission: String,
    guidance_reused: bool,
    /// Group ids of every ticket of the run: no rule text may name one.
    run_groups: BTreeSet<String>,
    /// `runner.epochs`: the epoch whose routing `need_review.json` shows as the final view.
    final_epoch: u32,
    /// How many rejected edits are remembered (`reflection.gate.remember_rejected` with the
    /// gate on; 0: none).
    remember_cap: usize,
    prompts: Prompts,
    logs: ReflectionLogs,
    queue: ReflectionQueue,
    budget: EpochBudget,
    gate: Gate,
    calls: Calls,
    feedback: FeedbackLedger,
    predictions: Predictions,
    rejected: RejectedMemory,
    epoch: u32,
    cycles: u64,
    last_applied: Option<String>,
    /// Decision passes of this epoch that ran (at least one call) and that parsed.
    decisions_epoch: (u32, u32),
    /// Warnings for `summary.json`, in the order they arose.
    run_warnings: Vec<String>,
}

/// What the run opens for reflection before the model's context is known, so that a bad
/// prompt file or an unreadable log is refused at once: the system prompts read, the logs
/// opened, and a checkpoint's state when the run resumes from one.
pub struct ReflectionOpening {
    pub prompts: SystemPrompts,
    pub logs: ReflectionLogs,
    pub resume: Option<ReflectorState>,
}

impl ReflectionOpening {
    /// Reads the prompts of `config`, then opens the logs under `dir`: fresh (`resume: None`,
    /// they start empty) or continuing from a checkpoint's state (appended to, the caller
    /// having already cut them back to the checkpoint's lengths).
    pub fn open(
        dir: &Path,
        config: &ReflectionConfig,
        resume: Option<ReflectorState>,
    ) -> Result<Self, ReflectionError> {
        let prompts = SystemPrompts::read(config)?;
        let logs = ReflectionLogs::open(dir, resume.is_some())?;
        Ok(ReflectionOpening {
            prompts,
            logs,
            resume,
        })
    }
}

/// Everything a reflector is built from, once the run's context is known.
pub struct ReflectorSettings<'a> {
    /// The run's config, its lengths fitted to the model's context (see
    /// [`stageb_shared::limits`]): every call is planned within them.
    pub run: &'a RunConfig,
    pub mission: &'a str,
    /// The group ids of every ticket of the run (for the `label_leak` check of rule texts).
    pub run_groups: BTreeSet<String>,
    /// Where each call's cycle and pass are shown (`reflecting cycle 2 (decision)`).
    pub progress: Option<ProgressHandle>,
    /// A previous run's guidance is continued (`guidance.reset_on_rerun: false`).
    pub guidance_reused: bool,
    /// The gate split's tickets and rollouts; `None` when the gate checks no edit and
    /// ablates no rule, or has no split.
    pub gate_probe: Option<GateProbe>,
    /// The prompts, logs and checkpoint state opened with the run.
    pub opening: ReflectionOpening,
}

impl Reflector {
    /// The reflector of a run: fresh, or continuing from the opening's checkpoint state.
    /// Calls are queued ahead for `runner.pipeline_cycles` cycles (0: none).
    pub fn new(settings: ReflectorSettings<'_>) -> Self {
        let ReflectorSettings {
            run,
            mission,
            run_groups,
            progress,
            guidance_reused,
            gate_probe,
            opening,
        } = settings;
        let config = run.reflection.clone();
        let state = opening.resume.unwrap_or_default();
        let caps = (config.max_calls_per_epoch, config.change_cap_per_epoch);
        let gate = config.gate;
        let queue = QueueParts {
            pending: state.pending,
            retry: state.retry,
            retry_counts: state.retry_counts,
            arrivals: state.arrivals,
        };
        let pipeline_cycles = run.runner.pipeline_cycles as usize;
        let reflector = Reflector {
            lifecycle: run.guidance_lifecycle.clone(),
            run_seed: run.seed,
            mission: mission.to_string(),
            guidance_reused,
            run_groups,
            final_epoch: run.runner.epochs,
            remember_cap: if gate.enabled {
                gate.remember_rejected as usize
            } else {
                0
            },
            prompts: Prompts::new(mission, opening.prompts, &config),
            logs: opening.logs,
            queue: ReflectionQueue::new(
                config.batch_size,
                config.retry_budget_per_group_per_epoch,
                queue,
            ),
            budget: EpochBudget::new(caps, state.calls_epoch, state.applied_epoch),
            gate: Gate::new(gate, gate_probe, run.seed, progress.clone()),
            calls: Calls::new(&config, run.seed, pipeline_cycles, progress),
            feedback: state.feedback,
            predictions: state.predictions,
            rejected: state.rejected,
            epoch: state.epoch,
            cycles: state.cycles,
            last_applied: state.last_applied,
            decisions_epoch: state.decisions_epoch,
            run_warnings: state.run_warnings,
            config,
        };
        reflector.report(|_| {});
        reflector
    }

    /// Applies `update` to the progress state and tells it what waits for reflection now:
    /// the queue's cases and retry cycles, and the calls the epoch's budget leaves (the ETA
    /// counts the work left from them).
    fn report(&self, update: impl FnOnce(&mut ProgressSnapshot)) {
        let Some(progress) = self.calls.progress() else {
            return;
        };
        let mut p = progress.lock().unwrap_or_else(|e| e.into_inner());
        update(&mut p);
        p.reflection = ReflectionWork {
            pending: self.queue.pending_len() as u64,
            retry_cycles: self.queue.retry_cycles() as u64,
            batch_size: u64::from(self.queue.batch_size()),
            calls_left: self.budget.calls_remaining().map(u64::from),
            calls_per_epoch: self.budget.calls_per_epoch().map(u64::from),
        };
    }

    /// The calls queued ahead in this attempt, and what became of them.
    pub fn calls_ahead(&self) -> &CallsAheadStats {
        &self.calls.ahead.stats
    }

    pub fn guidance_reused(&self) -> bool {
        self.guidance_reused
    }

    /// Reflection cycles run so far (every processed batch counts, applied or not).
    pub fn cycles(&self) -> u64 {
        self.cycles
    }

    /// The id of the last reflection that changed guidance.
    pub fn last_applied_reflection(&self) -> Option<String> {
        self.last_applied.clone()
    }

    /// Prefill the workers' prefix caches saved on this attempt's reflection calls.
    pub fn prefix_reuse(&self) -> &CallPrefixReuse {
        &self.calls.prefix_reuse
    }

    /// What the gate cost this attempt.
    pub fn gate_cost(&self) -> &GateCost {
        &self.gate.cost
    }

    pub fn need_review_count(&self) -> usize {
        self.logs.need_review_count()
    }

    /// Tickets routed to need-review during `epoch`.
    pub fn need_review_keys(&self, epoch: u32) -> BTreeSet<TicketKey> {
        self.logs.need_review_keys(epoch)
    }

    /// Reset the per-epoch state: need-review is decided afresh every epoch.
    pub fn start_epoch(&mut self, epoch: u32) {
        self.epoch = epoch;
        self.queue.clear();
        self.budget.reset();
        self.decisions_epoch = (0, 0);
        self.report(|_| {});
    }

    /// Record a decided ticket that is *not* a gradient candidate: its feedback on the rules
    /// of the last applied reflection is immediate (it agreed with its label).
    pub fn add_stable(&mut self, label_match: bool) {
        self.feedback.credit_stable(label_match);
    }

    /// A train ticket was decided in `epoch` (`correct`: its verdict matches its label): it
    /// settles the claims earlier ops made on it.
    pub fn note_decided(&mut self, key: &TicketKey, epoch: u32, correct: bool) {
        self.predictions.note(key, epoch, correct);
    }

    /// A gate ticket was decided by a step of `epoch` under the guidance rendered as `digest`:
    /// a later gate evaluation of that guidance reuses it.
    pub fn note_gate_outcome(&mut self, epoch: u32, key: TicketKey, digest: String, correct: bool) {
        self.gate.note_outcome(epoch, key, digest, correct);
    }

    /// Whether `epoch`'s end runs the rule ablation: the gate on with tickets, every N-th epoch.
    pub fn ablation_due(&self, epoch: u32) -> bool {
        self.gate.ablation_due(epoch)
    }

    /// Each learned rule of `guidance` left out in turn (key order); empty when none is due
    /// or there is no learned rule.
    pub async fn ablate(
        &mut self,
        epoch: u32,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<Vec<RuleAblation>, ReflectionError> {
        self.gate.ablate(epoch, guidance, dispatch).await
    }

    /// The predictions settled so far, taken out (for the epoch row); each op's hits and
    /// misses are added to its rule's lifecycle counters (`claims_hit`, `claims_missed`), where
    /// repeated failures make the rule a cleanup candidate at the end of the epoch.
    pub fn take_settled_predictions(
        &mut self,
        guidance: &mut GuidanceRepo,
    ) -> Result<Vec<PredictionCheck>, ReflectionError> {
        let settled = self.predictions.take_settled();
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
        record.feedback.rules = self.feedback.owed_now();
        self.queue.push(record);
        self.report(ProgressSnapshot::case_queued);
    }

    /// Called at every step boundary (and with `drain` at epoch end): commit buffered
    /// feedback, then run every due reflection cycle, then sync the rows they wrote.
    pub async fn on_step_end(
        &mut self,
        epoch: u32,
        global_step: u64,
        guidance: &mut GuidanceRepo,
        dispatch: &mut Dispatch,
        drain: bool,
    ) -> Result<(), ReflectionError> {
        self.flush_immediate_feedback(guidance)?;
        self.calls.ahead.start_boundary(drain);
        let done = self
            .run_due_cycles(epoch, global_step, guidance, dispatch, drain)
            .await;
        self.calls.ahead.withdraw_all(dispatch);
        done?;
        self.logs.sync_named()
    }

    /// Every cycle due at this boundary, one after the other (each queues the next ones'
    /// likely calls ahead once it has packed its batch).
    async fn run_due_cycles(
        &mut self,
        epoch: u32,
        global_step: u64,
        guidance: &mut GuidanceRepo,
        dispatch: &mut Dispatch,
        drain: bool,
    ) -> Result<(), ReflectionError> {
        while let Some((attempt, batch)) = self.queue.next_batch(drain) {
            self.report(|p| p.begin_cycle(Instant::now()));
            let done = self
                .run_cycle(epoch, global_step, attempt, batch, guidance, dispatch)
                .await;
            self.report(|p| p.end_cycle(Instant::now()));
            done?;
        }
        Ok(())
    }

    fn flush_immediate_feedback(
        &mut self,
        guidance: &mut GuidanceRepo,
    ) -> Result<(), ReflectionError> {
        let (hits, misses) = self.feedback.take_immediate();
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
        let (ran, parsed) = self.decisions_epoch;
        if ran > 0 && parsed == 0 {
            // No configuration may make every reflection call fail silently.
            let warning = format!(
                "epoch {epoch}: none of {ran} decision passes produced a usable answer; the \
                 guidance could not learn (see the calls in reflection.jsonl: PROMPT_TOO_LONG \
                 means reflection.token_budget/max_new_tokens exceed the model's context)"
            );
            tracing::error!("{warning}");
            self.run_warnings.push(warning);
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
                self.feedback.on_removed(&removed);
            }
        }
        Ok(())
    }

    /// The state a resumed run needs to continue after the current step boundary.
    pub fn state(&self) -> ReflectorState {
        let queue = self.queue.parts();
        let (calls_epoch, applied_epoch) = self.budget.counts();
        ReflectorState {
            epoch: self.epoch,
            pending: queue.pending,
            retry: queue.retry,
            retry_counts: queue.retry_counts,
            calls_epoch,
            applied_epoch,
            cycles: self.cycles,
            arrivals: queue.arrivals,
            last_applied: self.last_applied.clone(),
            feedback: self.feedback.clone(),
            decisions_epoch: self.decisions_epoch,
            run_warnings: self.run_warnings.clone(),
            rejected: self.rejected.clone(),
            predictions: self.predictions.clone(),
        }
    }

    /// Makes both logs durable (before a checkpoint names their lengths).
    pub fn sync_logs(&mut self) -> std::io::Result<()> {
        self.logs.sync()
    }

    /// Warnings for `summary.json`, in the order they arose.
    pub fn run_warnings(&self) -> &[String] {
        &self.run_warnings
    }

    /// Run end: write `need_review.json` (deterministic aggregation of every epoch's rows).
    pub fn finish_run(&mut self) -> Result<(), ReflectionError> {
        self.logs.write_need_review(&self.mission, self.final_epoch)
    }
}
