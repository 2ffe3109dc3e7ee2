//! The scheduler's counters (`summary.json` `runtime.scheduler`), and the batching claims of
//! accepted answers summed into them.

use stageb_shared::wire;

use super::Scheduler;

/// Counters for progress reporting and the run summary (`summary.json` `runtime.scheduler`;
/// a summary written before a counter existed reads it as 0).
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SchedulerStats {
    pub leases_issued: u64,
    pub leases_expired: u64,
    pub submits_accepted: u64,
    pub submits_duplicate: u64,
    pub submits_fenced: u64,
    pub job_errors: u64,
    /// Jobs answered from the journal of an earlier attempt (`--resume`), never leased.
    pub replayed: u64,
    /// Sessions forgotten after `session_idle_ttl` without a call.
    pub sessions_expired: u64,
    /// Leases fenced because their worker registered again (a subset of `leases_expired`).
    pub leases_fenced_on_register: u64,
    /// Second copies leased for straggling jobs.
    pub speculative_leases: u64,
    /// The part of `speculative_leases` leased because the original made no progress (before
    /// it was slow by the job times; see [`crate::cluster::scheduler::liveness`]).
    pub speculative_leases_no_progress: u64,
    /// Jobs whose speculative copy answered first.
    pub speculation_wins: u64,
    /// Leases fenced because the other copy of their job answered first.
    pub leases_fenced_by_speculation: u64,
    /// Jobs withdrawn before their answer was accepted (queued ahead under a guidance that
    /// then changed); their leases were fenced.
    pub jobs_withdrawn: u64,
    /// Leases that reached their lifetime while heartbeats kept them (a subset of
    /// `leases_expired`; see [`crate::cluster::scheduler::lifetime`]).
    pub leases_past_lifetime: u64,
    /// Leases revoked because their reported progress stood still too long while heartbeats
    /// went on (a subset of `leases_expired`; see [`crate::cluster::scheduler::liveness`]).
    pub leases_revoked_no_progress: u64,
    /// Continuous batching, summed over accepted answers: the forward steps each job took
    /// part in, and the rows those steps computed (see [`Scheduler::note_batching`]).
    pub batch_job_steps: u64,
    pub batch_rows: u64,
    /// Live worker time, summed over workers, in milliseconds (sampled by the reaper).
    pub worker_ms: u64,
    /// The part of `worker_ms` in which the worker held at least one lease.
    pub worker_busy_ms: u64,
}

impl SchedulerStats {
    /// `1 - busy / live` worker time: 0 before any worker time was measured.
    pub fn idle_fraction(&self) -> f64 {
        let (all, busy) = (self.worker_ms, self.worker_busy_ms.min(self.worker_ms));
        if all == 0 {
            0.0
        } else {
            1.0 - busy as f64 / all as f64
        }
    }
}

impl Scheduler {
    /// Counts an accepted answer's batching statistics: `steps` forward steps that computed
    /// `rows` rows in all. A worker's claim, so one past what a step can hold
    /// ([`wire::MAX_JOBS_PER_LEASE`] jobs of [`wire::MAX_CANDIDATES_PER_JOB`] rows) is left
    /// out rather than skewing the mean.
    pub fn note_batching(&self, steps: u32, rows: u64) {
        let most = u64::from(steps)
            * u64::from(wire::MAX_JOBS_PER_LEASE)
            * wire::MAX_CANDIDATES_PER_JOB as u64;
        if steps == 0 || rows < u64::from(steps) || rows > most {
            return;
        }
        let mut g = self.lock();
        g.stats.batch_job_steps += u64::from(steps);
        g.stats.batch_rows += rows;
    }
}
