//! Jobs queued ahead of their turn: the run loop queues the next steps' rollouts while the
//! current step's reflection runs (`runner.pipeline_steps`), and reflection queues the next
//! cycles' calls (`runner.pipeline_cycles`). They are leased only when nothing else is queued,
//! so a call due now never waits behind them; among them the reflection calls go first, since
//! the steps queued ahead cannot start before the boundary's chain of calls is done (calls
//! ahead behind thousands of rollouts left that chain waiting for them). When their turn comes
//! they are promoted to the ordinary queue, or withdrawn if the guidance changed under them.

use std::collections::{HashSet, VecDeque};

use super::{JobId, JobKind, JobPayload, Scheduler};

/// The jobs queued ahead of their turn, in the order they are leased: reflection calls first,
/// then rollouts, each in the order queued.
#[derive(Debug, Default)]
pub(super) struct AheadQueue {
    calls: VecDeque<JobId>,
    rollouts: VecDeque<JobId>,
}

impl AheadQueue {
    pub(super) fn push(&mut self, id: JobId, kind: JobKind) {
        match kind {
            JobKind::Generate => self.calls.push_back(id),
            JobKind::Rollout => self.rollouts.push_back(id),
        }
    }

    pub(super) fn pop_front(&mut self) -> Option<JobId> {
        self.calls.pop_front().or_else(|| self.rollouts.pop_front())
    }

    pub(super) fn len(&self) -> usize {
        self.calls.len() + self.rollouts.len()
    }

    pub(super) fn retain(&mut self, keep: impl Fn(&JobId) -> bool) {
        self.calls.retain(&keep);
        self.rollouts.retain(&keep);
    }

    /// Take the jobs in `wanted` out, in lease order.
    fn take(&mut self, wanted: &HashSet<JobId>) -> Vec<JobId> {
        let mut taken = Vec::new();
        for queue in [&mut self.calls, &mut self.rollouts] {
            queue.retain(|id| {
                let hit = wanted.contains(id);
                if hit {
                    taken.push(*id);
                }
                !hit
            });
        }
        taken
    }
}

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
        let promoted = g.ahead.take(&wanted);
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
