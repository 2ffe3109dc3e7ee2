//! The loop itself: opening the run ([`RunLoop::prepare`]), waiting for the model's context,
//! then epochs → steps, from the start or from where a checkpoint left the run.

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use stageb_shared::config::RunConfig;
use stageb_shared::domain::Ticket;
use stageb_shared::limits::EffectiveLimits;
use stageb_shared::observe;
use stageb_shared::seed::{derived_seed, shuffled_indices};

use super::boundary::gate_probe;
use super::outputs::{ManifestFacts, write_manifest};
use super::resume::{EpochStart, Opened, open_at_checkpoint, open_fresh, run_identity};
use super::steps_ahead::AheadStats;
use super::{
    EpochRun, PreparedRun, RunError, RunInputs, RunLoop, RunSummary, files, io_err, now_iso,
    step_size,
};
use crate::artifacts::documents::PrefixReuse;
use crate::cluster::dispatch::Dispatch;
use crate::decide::accuracy;
use crate::decide::split::Splits;
use crate::guidance::RepoOptions;
use crate::learn::reflection::{Reflector, ReflectorSettings};
use crate::progress::{Phase, ProgressHandle};
use crate::run::checkpoint::{Checkpoint, CheckpointPolicy, Position};
use crate::run::dir::RunDir;

impl RunLoop {
    /// Prepare `run_dir` (fresh per-run artifacts; guidance reused only when
    /// `guidance.reset_on_rerun` is false and a previous run left one) and the writers. When
    /// the directory continues an earlier attempt at this very run ([`crate::run::start`]),
    /// the run goes on from its last step checkpoint when it left a usable one
    /// ([`crate::run::checkpoint`]), else everything is rewritten from the start, with the
    /// guidance seeded exactly as that attempt seeded it.
    pub fn prepare(
        inputs: RunInputs,
        run_dir: &RunDir,
        dispatch: Dispatch,
        model: crate::cluster::server::ModelPinHandle,
        progress: ProgressHandle,
    ) -> Result<PreparedRun, RunError> {
        let (dir, resuming) = (run_dir.path().to_path_buf(), run_dir.resuming());
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
            reflection,
            guidance_reused,
            initial_guidance_hash,
        } = opened;
        let gate = &inputs.config.reflection.gate;
        let splits = gate.enabled.then(|| {
            let groups = inputs.ingested.tickets.iter().map(|t| t.group_id.as_str());
            Splits::assign(inputs.config.seed, groups, gate)
        });
        Ok(PreparedRun {
            dir,
            dispatch,
            model,
            progress,
            guidance,
            writers,
            reflection,
            guidance_reused,
            initial_guidance_hash,
            resuming,
            limits: None,
            resume_from,
            splits,
            inputs,
        })
    }
}

impl PreparedRun {
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
        let resume_from = self.resume_from.take();
        let run = self.into_loop(&cfg, &tickets);
        run.run(cfg, tickets, resume_from, (started, started_at))
            .await
    }

    /// Writes `manifest.json` before the loop is built (`finished_at` is `None`).
    fn write_manifest(&self, started_at: &str, finished_at: Option<&str>) -> Result<(), RunError> {
        write_manifest(
            &ManifestFacts {
                dir: &self.dir,
                inputs: &self.inputs,
                model: &self.model,
                limits: self.limits.as_ref(),
                guidance_reused: self.guidance_reused,
                initial_guidance_hash: &self.initial_guidance_hash,
                scheduler: &self.dispatch.scheduler,
                resuming: self.resuming,
            },
            started_at,
            finished_at,
        )
    }

    /// The loop, its reflector built for the run's fitted config `cfg` (every call is
    /// planned within the run's context) and the gate split of `tickets`.
    fn into_loop(self, cfg: &RunConfig, tickets: &[Ticket]) -> RunLoop {
        let inputs = self.inputs;
        let reflector = Reflector::new(ReflectorSettings {
            run: cfg,
            mission: &inputs.ingested.mission,
            run_groups: (inputs.ingested.tickets.iter())
                .map(|t| t.group_id.clone())
                .collect(),
            progress: Some(self.progress.clone()),
            guidance_reused: self.guidance_reused,
            gate_probe: gate_probe(self.splits.as_ref(), cfg, tickets),
            opening: self.reflection,
        });
        RunLoop {
            dir: self.dir,
            dispatch: self.dispatch,
            model: self.model,
            progress: self.progress,
            guidance: self.guidance,
            reflector,
            writers: self.writers,
            resuming: self.resuming,
            global_step: 0,
            schedule_step: 0,
            initial_guidance_hash: self.initial_guidance_hash,
            candidates_seen: 0,
            malformed: 0,
            hard_failures: 0,
            prefix_reuse: PrefixReuse::default(),
            steps_ahead: std::collections::VecDeque::new(),
            ahead_stats: AheadStats::default(),
            limits: self.limits,
            epoch_rows: Vec::new(),
            checkpoints: CheckpointPolicy::default(),
            splits: self.splits,
            inputs,
        }
    }

    /// Wait for the run's model and context, fit the config's lengths into the context and
    /// say once what was lowered. The full model fingerprint (and the context, unless known at
    /// start) comes with the first admitted worker; `run` records both in the manifest before
    /// the first job is queued, so whatever work a later `--resume` replays, the manifest
    /// already names the model that did it.
    async fn plan_limits(&mut self) -> Result<EffectiveLimits, RunError> {
        let waited = Instant::now();
        let grace = self.dispatch.worker_grace;
        let context = loop {
            {
                let pin = self.model.lock().unwrap_or_else(|e| e.into_inner());
                if let (Some(_), Some(context)) = (&pin.fingerprint, pin.context) {
                    break context;
                }
            }
            if waited.elapsed() >= grace {
                return Err(RunError::NoWorkers(grace));
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
}

impl RunLoop {
    /// Every epoch, from the start or from where `resume_from` left the run, under the
    /// fitted config `cfg`; then the run-end files.
    async fn run(
        mut self,
        cfg: RunConfig,
        tickets: Vec<Ticket>,
        resume_from: Option<Checkpoint>,
        (started, started_at): (Instant, String),
    ) -> Result<RunSummary, RunError> {
        let total = tickets.len() as u64 * cfg.runner.epochs as u64;
        let mut at = EpochStart::default();
        if let Some(checkpoint) = resume_from {
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

    /// The progress display's totals: tickets and epochs of the whole run, and what a resumed
    /// run finished before its checkpoint (`at`). What reflection has left is the reflector's
    /// to report.
    pub(super) fn plan_progress(&self, cfg: &RunConfig, total: u64, at: &EpochStart) {
        let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        p.total = total;
        p.epochs = cfg.runner.epochs;
        p.epoch = at.epoch;
        p.done = self.global_step;
    }

    /// Rollout steps of one epoch.
    pub(super) fn steps_per_epoch(&self, cfg: &RunConfig) -> u64 {
        self.inputs.ingested.tickets.len().div_ceil(step_size(cfg)) as u64
    }

    /// One epoch, from its start or from the step a checkpoint left it at (`start`).
    pub(super) async fn run_epoch(
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
}
