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

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;
use stageb_shared::SCHEMA_VERSION;
use stageb_shared::config::{ConfigNotice, RunConfig};
use stageb_shared::contract;
use stageb_shared::digest;
use stageb_shared::domain::Ticket;
use stageb_shared::ingest::Ingested;
use stageb_shared::limits::EffectiveLimits;
use stageb_shared::observe;
use stageb_shared::seed::{candidate_seed, derived_seed, shuffled_indices};
use tokio::sync::mpsc;

use crate::artifacts::{JsonlWriter, write_json_atomic};
use crate::cluster::completions::{WaitError, await_any};
use crate::cluster::scheduler::{
    Completion, DecodeJob, JobFailure, JobId, JobOutput, JobPayload, Provenance, Scheduler,
};
use crate::decide::accuracy;
use crate::decide::eligibility;
use crate::decide::selection::{self, Selection, VoteCandidate};
use crate::decide::signals;
use crate::guidance::{GuidanceError, GuidanceRepo, RepoOptions};
use crate::learn::reflection::{GradientRecord, ReflectionError, Reflector, TicketOutcome};
use crate::run::checkpoint::{Checkpoint, CheckpointPolicy, Position};

pub mod checkpoint;
mod prefix_reuse;
pub mod rollout_prompt;
pub mod start;
use prefix_reuse::PrefixReuse;

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
    pub config_path: PathBuf,
    pub config_sha256: String,
    pub notices: Vec<ConfigNotice>,
    pub ingested: Ingested,
    /// Shown in the manifest (`embedded` or `cluster`).
    pub mode: String,
}

/// Live view for the progress display.
#[derive(Debug, Clone, Default)]
pub struct ProgressSnapshot {
    pub epoch: u32,
    pub epochs: u32,
    pub done: u64,
    pub total: u64,
    pub candidates: u64,
    pub live_workers: usize,
}

/// Shared with the progress reporter.
pub type ProgressHandle = Arc<Mutex<ProgressSnapshot>>;

/// What a run produced, also written as `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub schema_version: u32,
    pub mission: String,
    pub run_dir: PathBuf,
    pub tickets: usize,
    pub epochs: u32,
    pub candidates: u64,
    pub malformed_candidates: u64,
    pub hard_failures: u64,
    pub epoch_accuracy: Vec<serde_json::Value>,
    pub guidance_step: u64,
    pub guidance_hash: String,
    pub need_review: usize,
    pub reflection_cycles: u64,
    /// Run-level warnings a user must not miss (e.g. an epoch in which no decision pass
    /// parsed: the guidance could not learn anything then).
    pub warnings: Vec<String>,
    pub runtime: serde_json::Value,
}

struct Writers {
    trajectories: JsonlWriter,
    selections: JsonlWriter,
    metrics: JsonlWriter,
    failures: JsonlWriter,
}

impl Writers {
    /// Opens the four files with `open`: fresh ([`JsonlWriter::create`]) or appended to after
    /// a checkpoint ([`JsonlWriter::open_resume`]).
    fn open(dir: &Path, open: fn(&Path) -> io::Result<JsonlWriter>) -> Result<Self, RunError> {
        let open = |name: &str| {
            let p = dir.join(name);
            open(&p).map_err(|source| RunError::Io { path: p, source })
        };
        Ok(Writers {
            trajectories: open(files::TRAJECTORIES)?,
            selections: open(files::SELECTIONS)?,
            metrics: open(files::METRICS)?,
            failures: open(files::FAILURE_MALFORMED)?,
        })
    }

    fn sync(&mut self) -> io::Result<()> {
        self.trajectories.sync()?;
        self.selections.sync()?;
        self.metrics.sync()?;
        self.failures.sync()
    }
}

/// Where a row was produced: excluded from determinism comparisons.
fn runtime_json(p: Option<&Provenance>, extra: serde_json::Value) -> serde_json::Value {
    let mut v = match p {
        Some(p) => json!({"worker_id": p.worker_id, "lease_id": p.lease_id, "attempt": p.attempt}),
        None => json!({}),
    };
    if let (Some(obj), Some(more)) = (v.as_object_mut(), extra.as_object()) {
        for (k, val) in more {
            obj.insert(k.clone(), val.clone());
        }
    }
    v
}

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

/// The rank-0 run loop.
pub struct RunLoop {
    inputs: RunInputs,
    dir: PathBuf,
    scheduler: Arc<Scheduler>,
    completions: mpsc::UnboundedReceiver<Completion>,
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
    /// The token limits the run plans with, once its context is known.
    limits: Option<EffectiveLimits>,
    /// Epoch rows of the finished epochs (the summary's `epoch_accuracy`).
    epoch_rows: Vec<serde_json::Value>,
    /// Where a resumed run continues, taken by [`RunLoop::run`].
    resume_from: Option<Checkpoint>,
    checkpoints: CheckpointPolicy,
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
        let opened = match &resume_from {
            Some(checkpoint) => open_at_checkpoint(&dir, &inputs, checkpoint, options)?,
            None => open_fresh(&dir, &inputs, resuming, options)?,
        };
        let Opened {
            guidance,
            writers,
            mut reflector,
            reuse,
            initial_guidance_hash,
        } = opened;
        reflector.set_run_groups(
            inputs
                .ingested
                .tickets
                .iter()
                .map(|t| t.group_id.clone())
                .collect(),
        );
        Ok(RunLoop {
            dir,
            scheduler,
            completions,
            model,
            progress,
            guidance,
            reflector,
            writers,
            worker_grace: Duration::from_secs(600),
            resuming,
            global_step: 0,
            schedule_step: 0,
            initial_guidance_hash,
            candidates_seen: 0,
            malformed: 0,
            hard_failures: 0,
            prefix_reuse: PrefixReuse::default(),
            limits: None,
            epoch_rows: Vec::new(),
            resume_from,
            checkpoints: CheckpointPolicy::default(),
            inputs,
        })
        .map(|mut r| {
            r.reflector.set_guidance_reused(reuse);
            r
        })
    }

    pub fn run_dir(&self) -> &Path {
        &self.dir
    }

    /// How long to wait without any live worker before giving up.
    pub fn with_worker_grace(mut self, grace: Duration) -> Self {
        self.worker_grace = grace;
        self.reflector.set_worker_grace(grace);
        self
    }

    fn write_manifest(&self, started_at: &str, finished_at: Option<&str>) -> Result<(), RunError> {
        let cfg = &self.inputs.config;
        let model = self.model.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let manifest = json!({
            "schema_version": SCHEMA_VERSION,
            "stageb_version": env!("CARGO_PKG_VERSION"),
            "mission": self.inputs.ingested.mission,
            "mode": self.inputs.mode,
            "config_path": self.inputs.config_path,
            "config_sha256": self.inputs.config_sha256,
            "config": cfg,
            "config_notices": self.inputs.notices,
            "input_digests": self.inputs.ingested.input_digests,
            "tickets_digest": digest::digest_of(&self.inputs.ingested.tickets),
            "tickets": self.inputs.ingested.tickets.len(),
            "model": {"path": cfg.model.model_name_or_path, "fingerprint": model.fingerprint},
            // The lengths every call was planned with (the config above is kept as written).
            "effective_limits": self.limits,
            "seeds": {"run_seed": cfg.seed, "candidate_seed": "sha256(stageb/candidate-seed/v1, run seed, epoch, ticket key, decode index, sample index)"},
            "schedule": {"step_size": step_size(cfg), "reference_ranks": REFERENCE_RANKS, "epochs": cfg.runner.epochs},
            "guidance": {
                "source": cfg.guidance.path,
                "reused_from_previous_run": self.reflector.guidance_reused(),
                "initial_hash": self.initial_guidance_hash,
            },
            // Timing-dependent (workers come and go), hence under `runtime`.
            "runtime": {"started_at": started_at, "finished_at": finished_at, "live_workers": self.scheduler.live_workers(),
                        "resumed": self.resuming, "replayed_answers": self.scheduler.stats().replayed,
                        // Who pinned the model differs between an attempt and its resume.
                        "model_pinned_by": model.pinned_by},
        });
        let path = self.dir.join(files::MANIFEST);
        write_json_atomic(&path, &manifest).map_err(io_err(&path))
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
        let total = tickets.len() as u64 * cfg.runner.epochs as u64;
        {
            let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
            p.total = total;
            p.epochs = cfg.runner.epochs;
        }
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
        self.reflector.finish_run()?;
        let finished_at = now_iso();
        self.write_manifest(&started_at, Some(&finished_at))?;
        let summary = RunSummary {
            schema_version: SCHEMA_VERSION,
            mission: self.inputs.ingested.mission.clone(),
            run_dir: self.dir.clone(),
            tickets: tickets.len(),
            epochs: cfg.runner.epochs,
            candidates: self.candidates_seen,
            malformed_candidates: self.malformed,
            hard_failures: self.hard_failures,
            epoch_accuracy: self.epoch_rows.clone(),
            guidance_step: self.guidance.step(),
            guidance_hash: self.guidance.head_hash().to_string(),
            need_review: self.reflector.need_review_count(),
            reflection_cycles: self.reflector.cycles(),
            warnings: self.reflector.run_warnings().to_vec(),
            runtime: json!({
                "started_at": started_at,
                "finished_at": finished_at,
                "elapsed_seconds": started.elapsed().as_secs_f64(),
                "scheduler": self.scheduler.stats(),
                "prefix_cache": self.prefix_reuse,
            }),
        };
        let path = self.dir.join(files::SUMMARY);
        write_json_atomic(&path, &summary).map_err(io_err(&path))?;
        Ok(summary)
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
        self.reflector.fit_limits(&limits);
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
        let epoch_start = Instant::now();
        let mut window = match start.window {
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
        let mut epoch_step = start.epoch_step;
        let skip = usize::try_from(start.steps_done).unwrap_or(usize::MAX);
        let steps = order.chunks(step_size(cfg)).skip(skip);
        for (steps_done, step) in (start.steps_done + 1..).zip(steps) {
            self.schedule_step += 1;
            self.progress
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .epoch = epoch;
            let guidance_lines = self.guidance.render_for_prompt();
            let guidance_step = self.guidance.step();
            let g0 = self.guidance.current().g0().to_string();
            let mut jobs: Vec<(JobId, usize)> = Vec::with_capacity(step.len());
            for &ti in step {
                let t = &tickets[ti];
                jobs.push((
                    self.scheduler
                        .enqueue(rollout_payload(cfg, epoch, t, &guidance_lines)),
                    ti,
                ));
            }
            let ids: Vec<JobId> = jobs.iter().map(|(j, _)| *j).collect();
            let mut done = self.await_jobs(&ids).await?;
            for (job, ti) in jobs {
                let completion = done
                    .remove(&job)
                    .expect("await_jobs returns every requested job");
                epoch_step += 1;
                self.global_step += 1;
                let at = TicketAt {
                    epoch,
                    epoch_step,
                    guidance_step,
                    ticket: &tickets[ti],
                    cfg,
                };
                let outcome = self.decide_ticket(&at, &g0, ti, completion)?;
                ::metrics::counter!(observe::TICKETS_DECIDED).increment(1);
                let t = &tickets[ti];
                window.push(accuracy::Outcome {
                    ticket_key: t.key(),
                    gt: t.label,
                    verdict: outcome.selection.verdict,
                    in_manual_review: outcome.selection.verdict.is_none(),
                });
                if outcome.eligibility.eligible {
                    self.reflector
                        .add_candidate(GradientRecord::from_outcome(t, &outcome, epoch));
                } else if outcome.selection.verdict.is_some() {
                    self.reflector.add_stable(outcome.selection.label_match);
                }
                if let Some(row) = window.window_row_if_due(self.global_step, epoch_start.elapsed())
                {
                    self.writers
                        .metrics
                        .append(&row)
                        .map_err(io_err(&self.dir))?;
                }
            }
            // Step boundary: make the step durable before guidance may change.
            self.writers.sync().map_err(io_err(&self.dir))?;
            self.scheduler.sync_journal().map_err(io_err(&self.dir))?;
            self.reflector
                .on_step_end(
                    epoch,
                    self.global_step,
                    &mut self.guidance,
                    &self.scheduler,
                    &mut self.completions,
                    false,
                )
                .await?;
            ::metrics::gauge!(observe::GUIDANCE_STEP).set(self.guidance.step() as f64);
            let here = Position {
                epoch,
                steps_done,
                epoch_step,
            };
            self.checkpoint_at(here, Some(&window))?;
        }
        // Epoch end: drain reflection (including retries), then close the epoch's metrics.
        self.reflector
            .on_step_end(
                epoch,
                self.global_step,
                &mut self.guidance,
                &self.scheduler,
                &mut self.completions,
                true,
            )
            .await?;
        let routed = self.reflector.need_review_keys(epoch);
        window.mark_need_review(&routed);
        if let Some(row) = window.partial_row(self.global_step, epoch_start.elapsed()) {
            self.writers
                .metrics
                .append(&row)
                .map_err(io_err(&self.dir))?;
        }
        let epoch_row = window.epoch_row(self.global_step);
        record_epoch_accuracy(epoch, &epoch_row);
        self.writers
            .metrics
            .append(&epoch_row)
            .map_err(io_err(&self.dir))?;
        self.writers.sync().map_err(io_err(&self.dir))?;
        self.reflector.end_epoch(epoch, &mut self.guidance)?;
        Ok(serde_json::to_value(&epoch_row).unwrap_or_default())
    }

    /// Wait until every rollout job in `ids` completed, failing if workers vanish for too long.
    /// Progress counts tickets as their results arrive (a step can be long), not only when the
    /// step is decided.
    async fn await_jobs(&mut self, ids: &[JobId]) -> Result<HashMap<JobId, Completion>, RunError> {
        let mut pending: std::collections::HashSet<JobId> = ids.iter().copied().collect();
        let mut out = HashMap::with_capacity(ids.len());
        let mut live_checked: Option<Instant> = None;
        while !pending.is_empty() {
            let next = await_any(
                &self.scheduler,
                &mut self.completions,
                &pending,
                self.worker_grace,
            )
            .await?;
            let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
            p.done += 1;
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

    /// Parse, vote, override and write one ticket's rows. Pure decisions come from
    /// `selection`, `signals` and `eligibility`; this function only orders and records them.
    fn decide_ticket(
        &mut self,
        at: &TicketAt<'_>,
        g0: &str,
        ticket_index: usize,
        completion: Completion,
    ) -> Result<TicketOutcome, RunError> {
        let ticket = at.ticket;
        let provenance = completion.provenance.clone();
        if let (
            Some(_),
            Ok(JobOutput::Rollout {
                prompt_tokens,
                prefix_tokens,
                ..
            }),
        ) = (&provenance, &completion.result)
        {
            self.prefix_reuse.add(*prompt_tokens, *prefix_tokens);
        }
        let answer = RolloutAnswer::from_result(completion.result);
        let judged = self.judge_candidates(at, answer.texts)?;

        let evidence = signals::extract_mission_evidence(&ticket.per_image, g0);
        let selection = selection::select(
            &judged.vote,
            &evidence,
            ticket.label,
            at.cfg.manual_review.min_verdict_agreement,
        );
        let eligibility = eligibility::assess(&selection, ticket.label);

        self.write_trajectories(judged.rows, &selection, provenance.as_ref(), &answer.timing)?;
        if selection.verdict.is_none() {
            // A hard failure: logged, never routed to need-review (seed 003).
            self.write_hard_failure(at, answer.job_error.as_ref())?;
        }
        let ineligible_reason = match (&answer.job_error, selection.verdict) {
            (Some(f), _) => Some(format!("engine_error:{}", f.code)),
            (None, None) => Some("no_valid_candidates".to_string()),
            _ => None,
        };
        let row = json!({
            "schema_version": SCHEMA_VERSION,
            "group_id": ticket.group_id,
            "mission": ticket.mission,
            "ticket_key": ticket.key(),
            "gt_label": ticket.label,
            "epoch": at.epoch,
            "epoch_step": at.epoch_step,
            "global_step": self.global_step,
            "schedule_step": self.schedule_step,
            "result": selection_result_json(
                &selection,
                at.guidance_step,
                self.reflector.last_applied_reflection(),
                self.reflector.cycles(),
                ineligible_reason,
            ),
            "eligibility": eligibility,
            "guidance_hash": self.guidance.head_hash(),
            "runtime": runtime_json(provenance.as_ref(), json!({})),
        });
        self.writers
            .selections
            .append(&row)
            .map_err(io_err(&self.dir))?;
        Ok(TicketOutcome {
            ticket_index,
            selection,
            eligibility,
            candidates: judged.vote,
            raw_texts: judged.raw_texts,
        })
    }

    /// Parse every candidate in grid order (`candidate_index = decode_index ×
    /// samples_per_decode + sample`): its trajectory row (written once the vote is known), its
    /// vote, and a `failure_malformed` row now when it breaks the contract.
    fn judge_candidates(
        &mut self,
        at: &TicketAt<'_>,
        mut texts: BTreeMap<(u32, u32), CandidateAnswer>,
    ) -> Result<JudgedCandidates, RunError> {
        let (ticket, cfg, key) = (at.ticket, at.cfg, at.ticket.key());
        let spd = cfg.sampler.samples_per_decode;
        let mut judged = JudgedCandidates::default();
        for (d, spec) in cfg.sampler.decode_specs().iter().enumerate() {
            for s in 0..spd {
                let candidate_index = d as u32 * spd + s;
                let Some(answer) = texts.remove(&(d as u32, s)) else {
                    continue;
                };
                let (verdict, reason, violation) = match contract::parse(&answer.text) {
                    Ok(ok) => (Some(ok.verdict), ok.reason, None),
                    Err(v) => (None, String::new(), Some(v)),
                };
                self.candidates_seen += 1;
                ::metrics::counter!(observe::CANDIDATES).increment(1);
                if let Some(v) = &violation {
                    self.malformed += 1;
                    ::metrics::counter!(observe::CANDIDATES_MALFORMED, "code" => v.code.code())
                        .increment(1);
                    tracing::warn!(ticket = %key, candidate_index, code = v.code.code(), "malformed candidate dropped from the vote");
                    let row = json!({
                        "schema_version": SCHEMA_VERSION,
                        "ticket_key": key, "group_id": ticket.group_id, "mission": ticket.mission,
                        "gt_label": ticket.label, "epoch": at.epoch, "global_step": self.global_step,
                        "epoch_step": at.epoch_step, "guidance_step": at.guidance_step,
                        "guidance_hash": self.guidance.head_hash(),
                        "reason": "format_error", "candidate_index": candidate_index, "decode_index": d,
                        "violation": {"code": v.code.code(), "detail": v.detail}, "raw_text": answer.text, "error": null,
                    });
                    self.writers
                        .failures
                        .append(&row)
                        .map_err(io_err(&self.dir))?;
                }
                let seed = candidate_seed(cfg.seed, at.epoch, key.as_str(), d as u32, s);
                judged.rows.push(json!({
                    "schema_version": SCHEMA_VERSION,
                    "group_id": ticket.group_id,
                    "mission": ticket.mission,
                    "ticket_key": key,
                    "gt_label": ticket.label,
                    "epoch": at.epoch,
                    "global_step": self.global_step,
                    "guidance_step": at.guidance_step,
                    "reflection_cycle": self.reflector.cycles(),
                    "result": {
                        "candidate_index": candidate_index,
                        "decode_index": d,
                        "sample_index": s,
                        "decode": {"temperature": spec.temperature, "top_p": spec.top_p, "max_new_tokens": spec.max_new_tokens,
                                   "repetition_penalty": spec.repetition_penalty, "seed": seed},
                        "text": answer.text,
                        "verdict": verdict,
                        "reason": reason,
                        "format_ok": violation.is_none(),
                        "violation": violation.as_ref().map(|v| json!({"code": v.code.code(), "detail": v.detail})),
                        "finish_reason": answer.finish_reason,
                        "completion_tokens": answer.completion_tokens,
                        "label_match": verdict.map(|v| v == ticket.label),
                    },
                }));
                judged.vote.push(VoteCandidate {
                    candidate_index,
                    temperature: spec.temperature,
                    verdict,
                    reason,
                });
                judged.raw_texts.push(answer.text);
            }
        }
        Ok(judged)
    }

    /// Trajectory rows carry the ticket-level signals, as in the original.
    fn write_trajectories(
        &mut self,
        rows: Vec<serde_json::Value>,
        selection: &Selection,
        provenance: Option<&Provenance>,
        timing: &serde_json::Value,
    ) -> Result<(), RunError> {
        for mut row in rows {
            if let Some(result) = row["result"].as_object_mut() {
                result.insert("vote_strength".into(), json!(selection.vote_strength));
                result.insert("low_agreement".into(), json!(selection.low_agreement));
                result.insert(
                    "needs_manual_review".into(),
                    json!(selection.needs_manual_review),
                );
            }
            row["runtime"] = runtime_json(provenance, timing.clone());
            self.writers
                .trajectories
                .append(&row)
                .map_err(io_err(&self.dir))?;
        }
        Ok(())
    }

    /// A ticket without a verdict: its `failure_malformed` row (engine error or no valid
    /// candidate), counted as a hard failure.
    fn write_hard_failure(
        &mut self,
        at: &TicketAt<'_>,
        job_error: Option<&JobFailure>,
    ) -> Result<(), RunError> {
        self.hard_failures += 1;
        let ticket = at.ticket;
        let row = json!({
            "schema_version": SCHEMA_VERSION,
            "ticket_key": ticket.key(), "group_id": ticket.group_id, "mission": ticket.mission,
            "gt_label": ticket.label, "epoch": at.epoch, "global_step": self.global_step,
            "epoch_step": at.epoch_step, "guidance_step": at.guidance_step,
            "guidance_hash": self.guidance.head_hash(),
            "reason": if job_error.is_some() { "engine_error" } else { "no_valid_candidates" },
            "candidate_index": null, "decode_index": null, "violation": null, "raw_text": null,
            "error": job_error.map(|f| json!({"code": f.code, "message": f.message})),
        });
        self.writers
            .failures
            .append(&row)
            .map_err(io_err(&self.dir))
    }
}

/// Where a ticket is decided: its place in the run and the config it runs under.
struct TicketAt<'a> {
    epoch: u32,
    epoch_step: u64,
    guidance_step: u64,
    ticket: &'a Ticket,
    cfg: &'a RunConfig,
}

/// One candidate's answer as the worker sent it.
struct CandidateAnswer {
    text: String,
    completion_tokens: u32,
    finish_reason: String,
}

/// A rollout job's result, unpacked: candidates by (decode, sample), timing, or the job error.
struct RolloutAnswer {
    texts: BTreeMap<(u32, u32), CandidateAnswer>,
    timing: serde_json::Value,
    job_error: Option<JobFailure>,
}

impl RolloutAnswer {
    fn from_result(result: Result<JobOutput, JobFailure>) -> Self {
        let mut answer = RolloutAnswer {
            texts: BTreeMap::new(),
            timing: json!({}),
            job_error: None,
        };
        match result {
            Ok(JobOutput::Rollout {
                candidates,
                prompt_tokens,
                prefix_tokens,
                prefill_us,
                decode_us,
            }) => {
                answer.timing = json!({"prompt_tokens": prompt_tokens, "prefix_tokens": prefix_tokens,
                                       "prefill_us": prefill_us, "decode_us": decode_us});
                for c in candidates {
                    answer.texts.insert(
                        (c.decode_index, c.sample_index),
                        CandidateAnswer {
                            text: c.text,
                            completion_tokens: c.completion_tokens,
                            finish_reason: c.finish_reason,
                        },
                    );
                }
            }
            Ok(JobOutput::Generate { .. }) => {
                answer.job_error = Some(JobFailure {
                    code: "WRONG_RESULT_KIND".into(),
                    message: "a rollout returned a generation".into(),
                })
            }
            Err(f) => answer.job_error = Some(f),
        }
        answer
    }
}

/// The candidates of one ticket, judged by the contract parser.
#[derive(Default)]
struct JudgedCandidates {
    vote: Vec<VoteCandidate>,
    raw_texts: Vec<String>,
    /// Trajectory rows, completed with the vote's signals before they are written.
    rows: Vec<serde_json::Value>,
}

/// The `result` object of a selections row: the original's fields plus stageb's audit fields.
fn selection_result_json(
    selection: &Selection,
    guidance_step: u64,
    reflection_change: Option<String>,
    reflection_cycle: u64,
    ineligible_reason: Option<String>,
) -> serde_json::Value {
    let mut v = serde_json::to_value(selection).unwrap_or_else(|_| json!({}));
    if let Some(obj) = v.as_object_mut() {
        obj.insert("guidance_step".into(), json!(guidance_step));
        obj.insert("reflection_change".into(), json!(reflection_change));
        obj.insert("reflection_cycle".into(), json!(reflection_cycle));
        obj.insert("eligible".into(), json!(ineligible_reason.is_none()));
        obj.insert("ineligible_reason".into(), json!(ineligible_reason));
    }
    v
}

/// The rollout job of one ticket: prompt from the step's guidance, one seed per candidate.
pub fn rollout_payload(
    cfg: &RunConfig,
    epoch: u32,
    ticket: &Ticket,
    guidance: &[(String, String)],
) -> JobPayload {
    let key = ticket.key();
    let decodes = cfg
        .sampler
        .decode_specs()
        .iter()
        .enumerate()
        .map(|(d, spec)| DecodeJob {
            decode_index: d as u32,
            temperature: spec.temperature,
            top_p: spec.top_p,
            repetition_penalty: spec.repetition_penalty,
            max_new_tokens: spec.max_new_tokens,
            seeds: (0..cfg.sampler.samples_per_decode)
                .map(|s| candidate_seed(cfg.seed, epoch, key.as_str(), d as u32, s))
                .collect(),
        })
        .collect();
    JobPayload::Rollout {
        messages: rollout_prompt::rollout_messages(&ticket.mission, guidance, &ticket.per_image),
        decodes,
        constrained: cfg.sampler.constrained,
    }
}

mod resume;
use resume::{EpochStart, Opened, open_at_checkpoint, open_fresh, run_identity};

#[cfg(test)]
mod tests;
