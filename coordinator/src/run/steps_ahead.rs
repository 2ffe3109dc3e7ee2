//! Rollouts queued ahead (`runner.pipeline_steps: D`): from the moment a step's own rollouts
//! are queued, through its last answers, its decisions and its reflection, the next D steps'
//! rollouts are queued too under the guidance of that moment, so workers with room compute
//! them instead of idling. When a step starts, its queued jobs are used if the
//! guidance it renders is still the one they ran under (a rollout's answer depends only on its
//! payload: the prompt, which holds the guidance, and seeds derived from the ticket), else they
//! are withdrawn (their leases fenced) and queued again. At each boundary the steps already
//! queued under an older guidance are queued again under the current one (the best guess of
//! what their step will render). Never past the epoch's end. Artifacts never depend on it;
//! `summary.json` `runtime.pipeline` counts what was queued ahead, used and discarded (with
//! the reflection calls queued ahead, `learn::reflection`'s `ahead`).

use super::rollout_prompt::rollout_payload;
use super::{EpochRun, RunLoop};
pub use crate::artifacts::documents::AheadStats;
use crate::cluster::scheduler::JobId;

/// A step's rollouts queued ahead, and the guidance they were built with.
pub(super) struct StepAhead {
    guidance: Vec<(String, String)>,
    jobs: Vec<(JobId, usize)>,
}

impl StepAhead {
    fn ids(&self) -> Vec<JobId> {
        self.jobs.iter().map(|(j, _)| *j).collect()
    }

    fn tickets(&self) -> Vec<usize> {
        self.jobs.iter().map(|(_, t)| *t).collect()
    }
}

impl RunLoop {
    /// The rollout jobs of `step` under the current guidance, with their ticket indices: the
    /// ones queued ahead when their guidance still holds, else new ones.
    pub(super) fn queue_step(&mut self, run: &EpochRun<'_>, step: &[usize]) -> Vec<(JobId, usize)> {
        let guidance = self.guidance.render_for_prompt();
        if let Some(ahead) = self.steps_ahead.pop_front() {
            if ahead.guidance == guidance && ahead.tickets() == step {
                let ids = ahead.ids();
                self.dispatch.scheduler.promote(&ids);
                self.ahead_stats.steps_used += 1;
                self.ahead_stats.jobs_used += ids.len() as u64;
                return ahead.jobs;
            }
            self.discard(&ahead);
            if ahead.tickets() != step {
                // Not this step's (cannot happen in a run that queues in order): start afresh.
                for later in std::mem::take(&mut self.steps_ahead) {
                    self.discard(&later);
                }
            }
        }
        self.enqueue_step(run, step, &guidance, false)
    }

    /// Queue the `upcoming` steps' rollouts ahead (the next D of the epoch, in order) under the
    /// guidance as it stands (at the step's start, and again before its reflection), when the
    /// config asks for it:
    /// steps queued at an earlier boundary under another guidance are queued again (with
    /// every step after them), the others stay, and the steps not yet queued are added.
    pub(super) fn queue_ahead(&mut self, run: &EpochRun<'_>, upcoming: &[&[usize]]) {
        let depth = run.cfg.runner.pipeline_steps as usize;
        let guidance = self.guidance.render_for_prompt();
        let mut queued = std::mem::take(&mut self.steps_ahead).into_iter();
        // Once one step is queued again, the later ones are too, so the scheduler's queue of
        // jobs ahead keeps the steps in their order.
        let mut kept = true;
        let wanted = upcoming.iter().take(depth).take_while(|s| !s.is_empty());
        for step in wanted {
            match queued.next() {
                Some(a) if kept && a.tickets() == *step && a.guidance == guidance => {
                    self.steps_ahead.push_back(a);
                    continue;
                }
                Some(stale) => self.discard(&stale),
                None => {}
            }
            kept = false;
            let jobs = self.enqueue_step(run, step, &guidance, true);
            self.dispatch
                .completions
                .expect(jobs.iter().map(|(j, _)| *j));
            self.ahead_stats.steps_ahead += 1;
            self.ahead_stats.jobs_ahead += jobs.len() as u64;
            self.steps_ahead.push_back(StepAhead {
                guidance: guidance.clone(),
                jobs,
            });
        }
        // Queued beyond what is wanted now (never, in a run that queues in order): withdrawn.
        for extra in queued {
            self.discard(&extra);
        }
    }

    /// Withdraw a step queued ahead: its jobs dropped or fenced, their completions forgotten.
    fn discard(&mut self, ahead: &StepAhead) {
        let ids = ahead.ids();
        self.dispatch.scheduler.withdraw(&ids);
        self.dispatch.completions.forget(&ids);
        self.ahead_stats.steps_discarded += 1;
        self.ahead_stats.jobs_discarded += ids.len() as u64;
    }

    /// Queue one rollout job per ticket of `step` under `guidance`, in the ordinary queue or
    /// (`ahead`) ahead of its turn; returns each job with its ticket index.
    fn enqueue_step(
        &self,
        run: &EpochRun<'_>,
        step: &[usize],
        guidance: &[(String, String)],
        ahead: bool,
    ) -> Vec<(JobId, usize)> {
        step.iter()
            .map(|&ti| {
                let payload = rollout_payload(run.cfg, run.epoch, &run.tickets[ti], guidance);
                let job = if ahead {
                    self.dispatch.scheduler.enqueue_ahead(payload)
                } else {
                    self.dispatch.scheduler.enqueue(payload)
                };
                (job, ti)
            })
            .collect()
    }
}
