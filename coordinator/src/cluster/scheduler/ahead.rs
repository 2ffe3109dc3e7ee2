//! Jobs queued ahead of their turn: the run loop queues the next step's rollouts while the
//! current step's reflection runs (`runner.pipeline_steps`). They are leased only when nothing
//! else is queued, so a reflection call never waits behind them; when their step starts they
//! are promoted to the ordinary queue, or withdrawn if the guidance changed under them.

use std::collections::HashSet;

use super::{JobId, JobPayload, Scheduler};

impl Scheduler {
    /// Queue a job ahead of its turn; returns its id. A journaled answer is replayed at once,
    /// as for [`Scheduler::enqueue`].
    pub fn enqueue_ahead(&self, payload: JobPayload) -> JobId {
        self.enqueue_in(payload, true)
    }

    /// The jobs' turn has come: those still waiting go to the back of the ordinary queue, in
    /// their order.
    pub fn promote(&self, ids: &[JobId]) {
        let wanted: HashSet<JobId> = ids.iter().copied().collect();
        let mut g = self.lock();
        let ahead = std::mem::take(&mut g.ahead);
        let (promoted, stay): (Vec<JobId>, Vec<JobId>) =
            ahead.into_iter().partition(|id| wanted.contains(id));
        g.ahead = stay.into();
        g.queue.extend(promoted);
    }

    /// Nobody wants the answers of `ids` any more: jobs not yet answered are dropped from the
    /// queues and their leases fenced (a worker's next heartbeat cancels the work, and a late
    /// submission is refused). Returns how many were withdrawn.
    pub fn withdraw(&self, ids: &[JobId]) -> usize {
        let mut g = self.lock();
        let mut withdrawn: HashSet<JobId> = HashSet::new();
        for id in ids {
            let Some(job) = g.jobs.get_mut(id).filter(|j| !j.done) else {
                continue;
            };
            job.finish();
            let live = std::mem::take(&mut job.live);
            for lease in live {
                g.leases.remove(&lease);
            }
            withdrawn.insert(*id);
        }
        g.queue.retain(|id| !withdrawn.contains(id));
        g.ahead.retain(|id| !withdrawn.contains(id));
        g.stats.jobs_withdrawn += withdrawn.len() as u64;
        withdrawn.len()
    }
}
