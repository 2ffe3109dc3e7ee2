//! The epoch loop on rank 0: schedule each step's rollouts, turn results into decisions in a
//! fixed order, write every artifact, and hand gradient candidates to reflection at step
//! boundaries.
//!
//! # Determinism
//! Each epoch's ticket order is a seeded shuffle; steps are fixed-size slices of it
//! ([`step_size`]: defined by ticket count, never by how many workers exist). All rollouts of a
//! step use the guidance version current when the step starts. Workers finish in any order,
//! but results are processed and written in step order, and every candidate's seed is derived
//! from `(run seed, epoch, ticket key, decode index, sample index)`. Rows therefore come out
//! byte-identical with 1 or N workers; only the `runtime` object (which worker, which lease,
//! how long) differs, and it is the one thing determinism checks drop.
//!
//! # Files
//! - `mod.rs` (here): the loop: [`RunLoop::run`] → epochs → steps → tickets, and waiting for a
//!   step's jobs.
//! - `ticket.rs`: one ticket decided and its rows written (selection, trajectories, failures).
//! - `outputs.rs`: the JSONL writers, `manifest.json` and `summary.json`.
//! - `steps_ahead.rs`: the next steps' rollouts, queued ahead while a step's reflection runs.
//! - [`rollout_prompt`]: a ticket's rollout job (prompt and seeds).
//! - [`checkpoint`] and `resume.rs`: the step checkpoint, and opening a run from its start or
//!   from a checkpoint; [`start`]: fresh, `--overwrite` or `--resume`.
//!
//! The row types themselves are [`crate::artifacts::rows`] and [`crate::artifacts::documents`].

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stageb_shared::config::{ConfigNotice, RunConfig};
use stageb_shared::domain::Ticket;
use stageb_shared::ingest::Ingested;
use stageb_shared::limits::EffectiveLimits;
use stageb_shared::observe;
use stageb_shared::seed::{derived_seed, shuffled_indices};
use tokio::sync::mpsc;

use crate::cluster::completions::{Completions, WaitError, await_any};
use crate::cluster::scheduler::{Completion, JobId, JobOutput, Scheduler};
use crate::decide::accuracy;
use crate::decide::split::{Split, Splits};
use crate::guidance::{GuidanceError, GuidanceRepo, RepoOptions};
use crate::learn::reflection::{
    GateProbe, GradientRecord, ReflectionError, Reflector, ReflectorSettings, RunContext,
    rendered_digest,
};
use crate::progress::Phase;
use crate::run::checkpoint::{Checkpoint, CheckpointPolicy, Position};

pub mod checkpoint;
mod outputs;
pub mod rollout_prompt;
pub mod start;
pub mod steps_ahead;
mod ticket;
use crate::artifacts::documents::PrefixReuse;
pub use crate::artifacts::documents::RunSummary;
use outputs::Writers;
pub use rollout_prompt::rollout_payload;
use steps_ahead::AheadStats;
use ticket::TicketAt;

/// Ranks of the reference deployment (one 8-GPU node). A step is
/// `per_rank_rollout_batch_size × REFERENCE_RANKS` tickets whatever the actual number of
/// workers, so a run's decisions never depend on how many workers served it.
pub const REFERENCE_RANKS: u32 = 8;

/// Tickets per step for a config.
pub fn step_size(config: &RunConfig) -> usize {
    (config.runner.per_rank_rollout_batch_size.max(1) * REFERENCE_RANKS) as usize
}

pub use crate::artifacts::files;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot write artifacts under {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(transparent)]
    Guidance(#[from] GuidanceError),
    /// Bad input met while opening the run (e.g. an artifact that fails its seal on resume).
    #[error(transparent)]
    Input(#[from] stageb_shared::error::InputError),
    #[error("the mission name `{0}` cannot be used as a directory name")]
    BadMission(String),
    #[error("no worker has been alive for {0:?}; giving up")]
    NoWorkers(Duration),
    #[error("the scheduler stopped delivering results")]
    SchedulerClosed,
    #[error(transparent)]
    Reflection(ReflectionError),
}

impl From<WaitError> for RunError {
    fn from(e: WaitError) -> Self {
        match e {
            WaitError::NoWorkers(grace) => RunError::NoWorkers(grace),
            WaitError::SchedulerClosed => RunError::SchedulerClosed,
        }
    }
}

/// Reflection's failures as the run reports them: a guidance or wait failure is the same
/// whichever part of the loop met it (bad guidance input stays an input error, exit 2).
impl From<ReflectionError> for RunError {
    fn from(e: ReflectionError) -> Self {
        match e {
            ReflectionError::Guidance(g) => RunError::Guidance(g),
            ReflectionError::Wait(w) => w.into(),
            other => RunError::Reflection(other),
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> RunError + '_ {
    move |source| RunError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `{output.root}/{run_name}/{mission}/`, refusing names that would escape the root.
pub fn run_dir(config: &RunConfig, mission: &str) -> Result<PathBuf, RunError> {
    let bad = |s: &str| {
        s.is_empty()
            || s == "."
            || s == ".."
            || s.contains('/')
            || s.contains('\\')
            || s.contains('\0')
    };
    if bad(mission) {
        return Err(RunError::BadMission(mission.to_string()));
    }
    if bad(&config.output.run_name) {
        return Err(RunError::BadMission(config.output.run_name.clone()));
    }
    Ok(config
        .output
        .root
        .join(&config.output.run_name)
        .join(mission))
}

/// Everything the loop needs, prepared by the caller.
pub struct RunInputs {
    /// With paths resolved.
    pub config: RunConfig,
    /// The same config with its paths as the file wrote them: what the manifest records (with
    /// `config`'s values otherwise), so the same config run from two checkouts records the
    /// same.
    pub config_as_written: RunConfig,
    /// As given, relative to the working directory when it lies inside it.
    pub config_path: PathBuf,
    pub config_sha256: String,
    pub notices: Vec<ConfigNotice>,
    pub ingested: Ingested,
    /// Shown in the manifest (`embedded` or `cluster`).
    pub mode: String,
    /// The device-tuned settings in force (`--max-jobs`, `runner.pipeline_*`) and where each
    /// came from, once rank 0 decided them at start (the manifest's `runtime.tuning`).
    pub tuning: Option<stageb_shared::config::Tuning>,
}

pub use crate::progress::{ProgressHandle, ProgressSnapshot};

/// The Prometheus gauges of a finished epoch's accuracy (need-review counted wrong, and left
/// out), labelled by epoch: a run has few epochs, so the label set stays small.
fn record_epoch_accuracy(epoch: u32, row: &accuracy::MetricsRow) {
    for (review, counts) in [
        ("included", &row.include_manual_review),
        ("excluded", &row.exclude_manual_review),
    ] {
        ::metrics::gauge!(observe::EPOCH_ACCURACY, "epoch" => epoch.to_string(), "review" => review)
            .set(counts.acc);
    }
}

fn now_iso() -> String {
    crate::guidance::utc_now_iso()
}

/// The guidance a step's rollouts run under: its step, its `G0` (for the vote's overrides) and,
/// with the gate on, the digest of its rendering (under which gate outcomes are kept).
struct StepGuidance {
    step: u64,
    g0: String,
    digest: Option<String>,
}

/// An epoch under way: which one, its tickets and config, its metrics window so far, when it
/// started, and how many of its tickets were decided.
struct EpochRun<'a> {
    epoch: u32,
    tickets: &'a [Ticket],
    cfg: &'a RunConfig,
    window: accuracy::Accumulator,
    started: Instant,
    epoch_step: u64,
}

/// The rank-0 run loop.
pub struct RunLoop {
    inputs: RunInputs,
    dir: PathBuf,
    scheduler: Arc<Scheduler>,
    completions: Completions,
    model: crate::cluster::server::ModelPinHandle,
    progress: ProgressHandle,
    guidance: GuidanceRepo,
    reflector: Reflector,
    writers: Writers,
    worker_grace: Duration,
    /// Continuing an earlier attempt (shown in the manifest's `runtime`).
    resuming: bool,
    /// Tickets decided so far, across epochs (the original's `global_step`).
    global_step: u64,
    /// Schedule steps started so far, across epochs (guidance is fixed within one).
    schedule_step: u64,
    initial_guidance_hash: String,
    candidates_seen: u64,
    malformed: u64,
    hard_failures: u64,
    /// Prompt prefill the workers' prefix caches saved (`runtime.prefix_cache`).
    prefix_reuse: PrefixReuse,
    /// The next steps' rollouts (up to `runner.pipeline_steps`, in order), queued ahead while
    /// this step's reflection runs.
    steps_ahead: std::collections::VecDeque<steps_ahead::StepAhead>,
    /// What was queued ahead and what became of it (`runtime.pipeline`).
    ahead_stats: AheadStats,
    /// The token limits the run plans with, once its context is known.
    limits: Option<EffectiveLimits>,
    /// Epoch rows of the finished epochs (the summary's `epoch_accuracy`).
    epoch_rows: Vec<serde_json::Value>,
    /// Where a resumed run continues, taken by [`RunLoop::run`].
    resume_from: Option<Checkpoint>,
    checkpoints: CheckpointPolicy,
    /// The held-out splits, when `reflection.gate` is on.
    splits: Option<Splits>,
}

impl RunLoop {
    /// Prepare the run directory (fresh per-run artifacts; guidance reused only when
    /// `guidance.reset_on_rerun` is false and a previous run left one) and the writers.
    /// `resuming`: an earlier attempt at this very run is being continued
    /// ([`crate::run::start`]): from its last step checkpoint when it left a usable one
    /// ([`crate::run::checkpoint`]), else everything is rewritten from the start, with the guidance
    /// seeded exactly as that attempt seeded it.
    pub fn prepare(
        inputs: RunInputs,
        resuming: bool,
        scheduler: Arc<Scheduler>,
        completions: mpsc::UnboundedReceiver<Completion>,
        model: crate::cluster::server::ModelPinHandle,
        progress: ProgressHandle,
        worker_grace: Duration,
    ) -> Result<Self, RunError> {
        let dir = run_dir(&inputs.config, &inputs.ingested.mission)?;
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        // End-of-run files of an earlier run (overwritten or resumed) would describe other
        // artifacts than the ones this run is writing; they reappear when this run completes.
        for name in [files::SUMMARY, files::NEED_REVIEW] {
            let path = dir.join(name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(RunError::Io { path, source: e }),
            }
        }
        let options = RepoOptions {
            retention: inputs.config.guidance.retention.max(1) as usize,
            ..RepoOptions::default()
        };
        let resume_from = resuming
            .then(|| Checkpoint::load(&dir, &run_identity(&inputs)))
            .flatten();
        let settings = ReflectorSettings {
            run_groups: (inputs.ingested.tickets.iter())
                .map(|t| t.group_id.clone())
                .collect(),
            worker_grace,
            progress: Some(progress.clone()),
            guidance_reused: false,
        };
        let opened = match &resume_from {
            Some(checkpoint) => open_at_checkpoint(&dir, &inputs, checkpoint, options, settings)?,
            None => open_fresh(&dir, &inputs, resuming, options, settings)?,
        };
        let Opened {
            guidance,
            writers,
            reflector,
            initial_guidance_hash,
        } = opened;
        let gate = &inputs.config.reflection.gate;
        let splits = gate.enabled.then(|| {
            let groups = inputs.ingested.tickets.iter().map(|t| t.group_id.as_str());
            Splits::assign(inputs.config.seed, groups, gate)
        });
        Ok(RunLoop {
            dir,
            scheduler,
            completions: Completions::new(completions),
            model,
            progress,
            guidance,
            reflector,
            writers,
            worker_grace,
            resuming,
            global_step: 0,
            schedule_step: 0,
            initial_guidance_hash,
            candidates_seen: 0,
            malformed: 0,
            hard_failures: 0,
            prefix_reuse: PrefixReuse::default(),
            steps_ahead: std::collections::VecDeque::new(),
            ahead_stats: AheadStats::default(),
            limits: None,
            epoch_rows: Vec::new(),
            resume_from,
            checkpoints: CheckpointPolicy::default(),
            splits,
            inputs,
        })
    }

    pub fn run_dir(&self) -> &Path {
        &self.dir
    }

    /// Run every epoch. Returns the summary (also written as `summary.json`).
    pub async fn run(mut self) -> Result<RunSummary, RunError> {
        let started = Instant::now();
        let started_at = now_iso();
        self.write_manifest(&started_at, None)?;
        let limits = self.plan_limits().await?;
        self.write_manifest(&started_at, None)?;
        let cfg = limits.apply(&self.inputs.config);
        let tickets = self.inputs.ingested.tickets.clone();
        let gate_probe = self.gate_probe(&cfg, &tickets);
        self.reflector.enter_run(RunContext {
            limits: &limits,
            gate_probe,
        });
        let total = tickets.len() as u64 * cfg.runner.epochs as u64;
        let mut at = EpochStart::default();
        if let Some(checkpoint) = self.resume_from.take() {
            self.restore_counters(&checkpoint.counters);
            at = EpochStart {
                epoch: checkpoint.position.epoch,
                steps_done: checkpoint.position.steps_done,
                epoch_step: checkpoint.position.epoch_step,
                window: checkpoint.window,
            };
        }
        self.plan_progress(&cfg, total, &at);
        for epoch in at.epoch..=cfg.runner.epochs {
            let start = std::mem::take(&mut at);
            let row = self.run_epoch(epoch, &tickets, &cfg, start).await?;
            self.epoch_rows.push(row);
            let next = Position {
                epoch: epoch + 1,
                steps_done: 0,
                epoch_step: 0,
            };
            self.checkpoint_at(next, None)?;
        }
        crate::progress::enter(&self.progress, Phase::Writing);
        self.reflector.finish_run()?;
        let finished_at = now_iso();
        self.write_manifest(&started_at, Some(&finished_at))?;
        let summary = self.write_summary(cfg.runner.epochs, started, started_at, finished_at);
        crate::progress::enter(&self.progress, Phase::Done);
        summary
    }

    /// The progress display's totals: tickets and reflection rounds of the whole run, and
    /// what a resumed run finished before its checkpoint (`at`).
    fn plan_progress(&self, cfg: &RunConfig, total: u64, at: &EpochStart) {
        let steps = self.steps_per_epoch(cfg);
        let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        p.total = total;
        p.epochs = cfg.runner.epochs;
        p.done = self.global_step;
        p.timing.rounds_total = u64::from(cfg.runner.epochs) * (steps + 1);
        p.timing.rounds_done = u64::from(at.epoch.saturating_sub(1)) * (steps + 1) + at.steps_done;
    }

    /// Rollout steps of one epoch.
    fn steps_per_epoch(&self, cfg: &RunConfig) -> u64 {
        self.inputs.ingested.tickets.len().div_ceil(step_size(cfg)) as u64
    }

    /// Wait for the run's model and context, fit the config's lengths into the context and
    /// say once what was lowered. The full model fingerprint (and the context, unless known at
    /// start) comes with the first admitted worker; `run` records both in the manifest before
    /// the first job is queued, so whatever work a later `--resume` replays, the manifest
    /// already names the model that did it.
    async fn plan_limits(&mut self) -> Result<EffectiveLimits, RunError> {
        let waited = Instant::now();
        let context = loop {
            {
                let pin = self.model.lock().unwrap_or_else(|e| e.into_inner());
                if let (Some(_), Some(context)) = (&pin.fingerprint, pin.context) {
                    break context;
                }
            }
            if waited.elapsed() >= self.worker_grace {
                return Err(RunError::NoWorkers(self.worker_grace));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let limits = EffectiveLimits::fit(&self.inputs.config, context);
        for a in &limits.adjusted {
            tracing::warn!(key = %a.key, asked = a.asked, used = a.used, why = %a.why, "config value lowered to fit the model's context");
        }
        tracing::info!(
            context = limits.context,
            context_from = ?limits.context_source,
            rollout_max_new_tokens = ?limits.rollout_max_new_tokens,
            reflection_max_new_tokens = limits.reflection_max_new_tokens,
            reflection_prompt_tokens = limits.reflection_prompt_budget(),
            "effective limits"
        );
        self.limits = Some(limits.clone());
        Ok(limits)
    }

    /// One epoch, from its start or from the step a checkpoint left it at (`start`).
    async fn run_epoch(
        &mut self,
        epoch: u32,
        tickets: &[Ticket],
        cfg: &RunConfig,
        start: EpochStart,
    ) -> Result<serde_json::Value, RunError> {
        let order = shuffled_indices(
            tickets.len(),
            derived_seed(cfg.seed, "epoch-order", &[&epoch.to_le_bytes()]),
        );
        let started = Instant::now();
        let window = match start.window {
            Some(window) => window,
            None => {
                // The reflector's epoch state comes with a mid-epoch checkpoint's window.
                self.reflector.start_epoch(epoch);
                accuracy::Accumulator::new(epoch, cfg.runner.logging_steps.max(1) as u64)
                    .with_epoch_size(tickets.len())
            }
        };
        ::metrics::gauge!(observe::EPOCH).set(epoch);
        ::metrics::gauge!(observe::GUIDANCE_STEP).set(self.guidance.step() as f64);
        let mut run = EpochRun {
            epoch,
            tickets,
            cfg,
            window,
            started,
            epoch_step: start.epoch_step,
        };
        let skip = usize::try_from(start.steps_done).unwrap_or(usize::MAX);
        let n_steps = self.steps_per_epoch(cfg);
        let steps: Vec<&[usize]> = order.chunks(step_size(cfg)).skip(skip).collect();
        for (i, (steps_done, step)) in (start.steps_done + 1..).zip(&steps).enumerate() {
            let phase = Phase::Rollouts {
                step: steps_done,
                steps: n_steps,
            };
            crate::progress::enter(&self.progress, phase);
            self.run_step(&mut run, step, &steps[i + 1..]).await?;
            let here = Position {
                epoch,
                steps_done,
                epoch_step: run.epoch_step,
            };
            self.checkpoint_at(here, Some(&run.window))?;
        }
        self.close_epoch(run).await
    }

    /// One step: its rollouts queued under the step's guidance (or taken from those queued
    /// ahead), the `upcoming` steps' rollouts queued ahead (`runner.pipeline_steps` of them:
    /// workers that run out of this step's jobs take them instead of idling through its last
    /// answers and its decisions), its tickets decided in step order once all have answered,
    /// then the step made durable, the steps ahead checked against the guidance again, and the
    /// step handed to reflection.
    async fn run_step(
        &mut self,
        run: &mut EpochRun<'_>,
        step: &[usize],
        upcoming: &[&[usize]],
    ) -> Result<(), RunError> {
        self.schedule_step += 1;
        self.progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .epoch = run.epoch;
        let under = StepGuidance {
            step: self.guidance.step(),
            g0: self.guidance.current().g0().to_string(),
            // Gate outcomes of this step are kept for the gate phase under this digest.
            digest: self
                .splits
                .is_some()
                .then(|| rendered_digest(&self.guidance.render_for_prompt())),
        };
        let jobs = self.queue_step(run, step);
        self.queue_ahead(run, upcoming);
        let ids: Vec<JobId> = jobs.iter().map(|(j, _)| *j).collect();
        self.lock_progress().begin_rollouts(Instant::now());
        let mut done = self.await_jobs(&ids).await?;
        self.lock_progress().end_rollouts(Instant::now());
        for (job, ti) in jobs {
            let completion = done
                .remove(&job)
                .expect("await_jobs returns every requested job");
            self.decide_in_step(run, &under, ti, completion)?;
        }
        // Step boundary: make the step durable before guidance may change.
        self.writers.sync().map_err(io_err(&self.dir))?;
        self.scheduler.sync_journal().map_err(io_err(&self.dir))?;
        self.queue_ahead(run, upcoming);
        self.reflection_round(run.epoch, false).await?;
        ::metrics::gauge!(observe::GUIDANCE_STEP).set(self.guidance.step() as f64);
        Ok(())
    }

    /// One reflection round: every cycle due at a step boundary, or (`drain`) every cycle left
    /// at the epoch's end; timed for the ETA.
    async fn reflection_round(&mut self, epoch: u32, drain: bool) -> Result<(), RunError> {
        self.lock_progress().begin_round(Instant::now());
        let r = self
            .reflector
            .on_step_end(
                epoch,
                self.global_step,
                &mut self.guidance,
                &self.scheduler,
                &mut self.completions,
                drain,
            )
            .await;
        self.lock_progress().end_round(Instant::now());
        Ok(r?)
    }

    fn lock_progress(&self) -> std::sync::MutexGuard<'_, ProgressSnapshot> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides ticket `ti` of the step and feeds its outcome to the epoch's metrics window
    /// (writing a window row when one is due) and to reflection.
    fn decide_in_step(
        &mut self,
        run: &mut EpochRun<'_>,
        under: &StepGuidance,
        ti: usize,
        completion: Completion,
    ) -> Result<(), RunError> {
        run.epoch_step += 1;
        self.global_step += 1;
        let t = &run.tickets[ti];
        let at = TicketAt {
            epoch: run.epoch,
            epoch_step: run.epoch_step,
            guidance_step: under.step,
            ticket: t,
            cfg: run.cfg,
        };
        let outcome = self.decide_ticket(&at, &under.g0, ti, completion)?;
        ::metrics::counter!(observe::TICKETS_DECIDED).increment(1);
        let split = self.split_of(&t.group_id);
        run.window.push(accuracy::Outcome {
            ticket_key: t.key(),
            gt: t.label,
            verdict: outcome.selection.verdict,
            in_manual_review: outcome.selection.verdict.is_none(),
            split,
        });
        if self.splits.is_some() {
            let correct = outcome.selection.verdict.is_some() && outcome.selection.label_match;
            self.reflector.note_decided(&t.key(), run.epoch, correct);
            if let (Some(Split::Gate), Some(digest)) = (split, &under.digest) {
                let (key, digest) = (t.key(), digest.clone());
                self.reflector
                    .note_gate_outcome(run.epoch, key, digest, correct);
            }
        }
        if split.is_some_and(Split::held_out) {
            // Held out: decided and counted, never a gradient candidate nor rule feedback.
        } else if outcome.eligibility.eligible {
            self.reflector
                .add_candidate(GradientRecord::from_outcome(t, &outcome, run.epoch));
        } else if outcome.selection.verdict.is_some() {
            self.reflector.add_stable(outcome.selection.label_match);
        }
        match run
            .window
            .window_row_if_due(self.global_step, run.started.elapsed())
        {
            Some(row) => self.append_metrics(&row),
            None => Ok(()),
        }
    }

    /// Epoch end: drain reflection (including retries), then close the epoch's metrics with
    /// the tickets reflection routed to need-review. Returns the epoch row.
    async fn close_epoch(&mut self, run: EpochRun<'_>) -> Result<serde_json::Value, RunError> {
        let EpochRun {
            epoch,
            mut window,
            started,
            ..
        } = run;
        self.reflection_round(epoch, true).await?;
        crate::progress::enter(&self.progress, Phase::Writing);
        let routed = self.reflector.need_review_keys(epoch);
        window.mark_need_review(&routed);
        if let Some(row) = window.partial_row(self.global_step, started.elapsed()) {
            self.append_metrics(&row)?;
        }
        let mut epoch_row = window.epoch_row(self.global_step);
        epoch_row.ablation = self.ablation(epoch).await?;
        let settled = self
            .reflector
            .take_settled_predictions(&mut self.guidance)?;
        let settled: Vec<serde_json::Value> = settled
            .iter()
            .filter_map(|p| serde_json::to_value(p).ok())
            .collect();
        epoch_row.predictions = (!settled.is_empty()).then_some(settled);
        record_epoch_accuracy(epoch, &epoch_row);
        self.append_metrics(&epoch_row)?;
        self.writers.sync().map_err(io_err(&self.dir))?;
        self.reflector.end_epoch(epoch, &mut self.guidance)?;
        Ok(serde_json::to_value(&epoch_row).unwrap_or_default())
    }

    /// The epoch's rule ablation, when one is due and the guidance has learned rules.
    async fn ablation(&mut self, epoch: u32) -> Result<Option<Vec<serde_json::Value>>, RunError> {
        if !self.reflector.ablation_due(epoch) {
            return Ok(None);
        }
        let rules = self
            .reflector
            .ablate(
                epoch,
                &self.guidance,
                &self.scheduler,
                &mut self.completions,
            )
            .await?;
        let rows: Vec<serde_json::Value> = rules
            .iter()
            .filter_map(|r| serde_json::to_value(r).ok())
            .collect();
        Ok((!rows.is_empty()).then_some(rows))
    }

    /// The gate split's tickets and rollouts for the reflector's gate phase and rule ablation,
    /// when the gate checks edits or ablates rules.
    fn gate_probe(&self, cfg: &RunConfig, tickets: &[Ticket]) -> Option<GateProbe> {
        let splits = self.splits.as_ref()?;
        let gate = &cfg.reflection.gate;
        if !gate.check_edits && gate.ablation_every == 0 {
            return None;
        }
        let gate: Vec<Ticket> = tickets
            .iter()
            .filter(|t| splits.of(&t.group_id) == Split::Gate)
            .cloned()
            .collect();
        if gate.is_empty() {
            tracing::warn!(
                "reflection.gate: the gate split holds no group (gate_fraction × groups rounds to 0): no edit is checked and no rule ablated"
            );
        }
        Some(GateProbe {
            tickets: gate,
            config: cfg.clone(),
            payload: rollout_prompt::rollout_payload,
        })
    }

    /// The ticket group's split, when `reflection.gate` is on.
    fn split_of(&self, group_id: &str) -> Option<Split> {
        self.splits.as_ref().map(|s| s.of(group_id))
    }

    fn append_metrics(&mut self, row: &accuracy::MetricsRow) -> Result<(), RunError> {
        self.writers.metrics.append(row).map_err(io_err(&self.dir))
    }

    /// Wait until every rollout job in `ids` completed, failing if workers vanish for too long.
    /// Progress counts tickets as their results arrive (a step can be long), not only when the
    /// step is decided.
    async fn await_jobs(&mut self, ids: &[JobId]) -> Result<HashMap<JobId, Completion>, RunError> {
        let mut pending: std::collections::HashSet<JobId> = ids.iter().copied().collect();
        let mut out = HashMap::with_capacity(ids.len());
        let mut live_checked: Option<Instant> = None;
        let progress = self.progress.clone();
        let mut live = move |n: usize| {
            progress
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .live_workers = n;
        };
        while !pending.is_empty() {
            let next = await_any(
                &self.scheduler,
                &mut self.completions,
                &pending,
                self.worker_grace,
                &mut live,
            )
            .await?;
            let mut p = self.lock_progress();
            p.ticket_answered();
            // Counted as results arrive, not when the step is decided (a whole step later),
            // so the displayed rate is real from the first result on.
            if let Ok(JobOutput::Rollout { candidates, .. }) = &next.result {
                p.candidates += candidates.len() as u64;
            }
            // A scan of every session: once a second is plenty for a progress line.
            if live_checked.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                p.live_workers = self.scheduler.live_workers();
                live_checked = Some(Instant::now());
            }
            drop(p);
            pending.remove(&next.job);
            out.insert(next.job, next);
        }
        Ok(out)
    }
}

mod resume;
use resume::{EpochStart, Opened, open_at_checkpoint, open_fresh, run_identity};

#[cfg(test)]
mod tests;
