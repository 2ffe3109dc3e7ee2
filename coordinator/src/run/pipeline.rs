//! Rollouts queued ahead (`runner.pipeline_steps: 1`): while a step's reflection runs, the next
//! step's rollouts are already queued under the guidance of that moment, so workers with room
//! compute them instead of idling. When the step starts, its queued jobs are used if the
//! guidance it renders is still the one they ran under (a rollout's answer depends only on its
//! payload: the prompt, which holds the guidance, and seeds derived from the ticket), else they
//! are withdrawn (their leases fenced) and queued again. Artifacts never depend on it;
//! `summary.json` `runtime.pipeline` counts what was queued ahead, used and discarded.

use serde::{Deserialize, Serialize};

use super::rollout_prompt::rollout_payload;
use super::{EpochRun, RunLoop};
use crate::cluster::scheduler::JobId;

/// A step's rollouts queued ahead, and the guidance they were built with.
pub(super) struct Ahead {
    guidance: Vec<(String, String)>,
    jobs: Vec<(JobId, usize)>,
}

/// `summary.json` `runtime.pipeline`: steps and rollout jobs queued ahead in this attempt, and
/// what became of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PipelineStats {
    pub steps_ahead: u64,
    /// Steps whose guidance had not changed: their jobs were used as queued.
    pub steps_used: u64,
    /// Steps whose guidance changed: their jobs were withdrawn and queued again.
    pub steps_discarded: u64,
    pub jobs_ahead: u64,
    pub jobs_used: u64,
    pub jobs_discarded: u64,
}

impl RunLoop {
    /// The rollout jobs of `step` under the current guidance, with their ticket indices: the
    /// ones queued ahead when their guidance still holds, else new ones.
    pub(super) fn queue_step(&mut self, run: &EpochRun<'_>, step: &[usize]) -> Vec<(JobId, usize)> {
        let guidance = self.guidance.render_for_prompt();
        if let Some(ahead) = self.ahead.take() {
            let ids: Vec<JobId> = ahead.jobs.iter().map(|(j, _)| *j).collect();
            let tickets: Vec<usize> = ahead.jobs.iter().map(|(_, t)| *t).collect();
            if ahead.guidance == guidance && tickets == step {
                self.scheduler.promote(&ids);
                self.pipeline.steps_used += 1;
                self.pipeline.jobs_used += ids.len() as u64;
                return ahead.jobs;
            }
            self.scheduler.withdraw(&ids);
            self.completions.forget(&ids);
            self.pipeline.steps_discarded += 1;
            self.pipeline.jobs_discarded += ids.len() as u64;
        }
        self.enqueue_step(run, step, &guidance, false)
    }

    /// Queue `next`'s rollouts ahead, under the guidance as it stands (before this step's
    /// reflection), when the config asks for it.
    pub(super) fn queue_ahead(&mut self, run: &EpochRun<'_>, next: &[usize]) {
        if run.cfg.runner.pipeline_steps == 0 || next.is_empty() {
            return;
        }
        let guidance = self.guidance.render_for_prompt();
        let jobs = self.enqueue_step(run, next, &guidance, true);
        self.completions.expect(jobs.iter().map(|(j, _)| *j));
        self.pipeline.steps_ahead += 1;
        self.pipeline.jobs_ahead += jobs.len() as u64;
        self.ahead = Some(Ahead { guidance, jobs });
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
                    self.scheduler.enqueue_ahead(payload)
                } else {
                    self.scheduler.enqueue(payload)
                };
                (job, ti)
            })
            .collect()
    }
}
