//! One step of the loop: its rollouts queued and awaited, its tickets decided in step order
//! (fed to the metrics window and to reflection), then the step boundary's reflection round.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use stageb_shared::observe;

use super::ticket::TicketAt;
use super::{EpochRun, RunError, RunLoop, StepGuidance, io_err};
use crate::cluster::scheduler::{Completion, JobId, JobOutput};
use crate::decide::accuracy;
use crate::decide::split::Split;
use crate::learn::reflection::{GradientRecord, rendered_digest};
use crate::progress::ProgressSnapshot;

impl RunLoop {
    /// One step: its rollouts queued under the step's guidance (or taken from those queued
    /// ahead), the `upcoming` steps' rollouts queued ahead (`runner.pipeline_steps` of them:
    /// workers that run out of this step's jobs take them instead of idling through its last
    /// answers and its decisions), its tickets decided in step order once all have answered,
    /// then the step made durable, the steps ahead checked against the guidance again, and the
    /// step handed to reflection.
    pub(super) async fn run_step(
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
        self.dispatch
            .scheduler
            .sync_journal()
            .map_err(io_err(&self.dir))?;
        self.queue_ahead(run, upcoming);
        self.reflection_round(run.epoch, false).await?;
        ::metrics::gauge!(observe::GUIDANCE_STEP).set(self.guidance.step() as f64);
        Ok(())
    }

    /// One reflection round: every cycle due at a step boundary, or (`drain`) every cycle left
    /// at the epoch's end; timed for the ETA.
    pub(super) async fn reflection_round(
        &mut self,
        epoch: u32,
        drain: bool,
    ) -> Result<(), RunError> {
        self.lock_progress().begin_round(Instant::now());
        let r = self
            .reflector
            .on_step_end(
                epoch,
                self.global_step,
                &mut self.guidance,
                &mut self.dispatch,
                drain,
            )
            .await;
        self.lock_progress().end_round();
        Ok(r?)
    }

    pub(super) fn lock_progress(&self) -> std::sync::MutexGuard<'_, ProgressSnapshot> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides ticket `ti` of the step and feeds its outcome to the epoch's metrics window
    /// (writing a window row when one is due) and to reflection.
    pub(super) fn decide_in_step(
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

    /// Wait until every rollout job in `ids` completed, failing if workers vanish for too long.
    /// Progress counts tickets as their results arrive (a step can be long), not only when the
    /// step is decided.
    pub(super) async fn await_jobs(
        &mut self,
        ids: &[JobId],
    ) -> Result<HashMap<JobId, Completion>, RunError> {
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
            let next = self.dispatch.await_any(&pending, &mut live).await?;
            let mut p = self.lock_progress();
            p.ticket_answered();
            // Counted as results arrive, not when the step is decided (a whole step later),
            // so the displayed rate is real from the first result on.
            if let Ok(JobOutput::Rollout { candidates, .. }) = &next.result {
                p.candidates += candidates.len() as u64;
            }
            // A scan of every session: once a second is plenty for a progress line.
            if live_checked.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                p.live_workers = self.dispatch.scheduler.live_workers();
                live_checked = Some(Instant::now());
            }
            drop(p);
            pending.remove(&next.job);
            out.insert(next.job, next);
        }
        Ok(out)
    }
}
