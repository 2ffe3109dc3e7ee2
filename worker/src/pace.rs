//! The worker's measured pace: how many jobs it can finish within rank 0's lease TTL. A worker
//! never leases more than that (one job always), so jobs do not sit in a slow worker's hand
//! while faster ones idle, and a job's lease is not kept alive by heartbeats alone for longer
//! than the TTL says a job should take.

use std::time::{Duration, Instant};

/// Seconds per finished job, smoothed; the share of the TTL the jobs in hand may take.
#[derive(Debug)]
pub(crate) struct Pace {
    ttl: Duration,
    secs_per_job: Option<f64>,
    /// When the current interval began: the last job end, or when jobs arrived in an empty hand.
    mark: Option<Instant>,
}

/// Weight of the newest interval in the smoothed seconds per job.
const SMOOTHING: f64 = 0.2;
/// The jobs in hand may take this share of the lease TTL at the measured pace.
const TTL_SHARE: f64 = 0.5;

impl Pace {
    /// A pace under a lease TTL of `ttl` (zero: rank 0 did not say, and nothing is capped).
    pub(crate) fn new(ttl: Duration) -> Self {
        Pace {
            ttl,
            secs_per_job: None,
            mark: None,
        }
    }

    /// Jobs were handed to the engine at `now`.
    pub(crate) fn busy(&mut self, now: Instant) {
        self.mark.get_or_insert(now);
    }

    /// A job finished at `now`, `left` jobs are still in hand.
    pub(crate) fn job_ended(&mut self, now: Instant, left: usize) {
        if let Some(mark) = self.mark {
            let secs = now.saturating_duration_since(mark).as_secs_f64();
            self.secs_per_job = Some(match self.secs_per_job {
                Some(s) => s + SMOOTHING * (secs - s),
                None => secs,
            });
        }
        self.mark = (left > 0).then_some(now);
    }

    /// A job was cancelled (it says nothing of the pace), `left` jobs are still in hand.
    pub(crate) fn job_dropped(&mut self, left: usize) {
        if left == 0 {
            self.mark = None;
        }
    }

    /// Jobs that, at the measured pace, finish within the TTL's share: at least one, and no
    /// cap before a job has finished or when the TTL is unknown.
    pub(crate) fn limit(&self) -> usize {
        match self.secs_per_job {
            Some(s) if !self.ttl.is_zero() && s > 0.0 => {
                let n = self.ttl.as_secs_f64() * TTL_SHARE / s;
                (n.floor() as usize).max(1)
            }
            _ => usize::MAX,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended_every(pace: &mut Pace, start: Instant, secs: u64, jobs: u64) -> Instant {
        pace.busy(start);
        let mut now = start;
        for _ in 0..jobs {
            now += Duration::from_secs(secs);
            pace.job_ended(now, 4);
        }
        now
    }

    #[test]
    fn nothing_is_capped_before_a_job_has_finished_or_without_a_ttl() {
        assert_eq!(Pace::new(Duration::from_secs(60)).limit(), usize::MAX);
        let mut unknown = Pace::new(Duration::ZERO);
        ended_every(&mut unknown, Instant::now(), 1, 3);
        assert_eq!(unknown.limit(), usize::MAX);
    }

    #[test]
    fn the_jobs_in_hand_fit_half_the_ttl_at_the_measured_pace() {
        let mut pace = Pace::new(Duration::from_secs(60));
        ended_every(&mut pace, Instant::now(), 2, 5);
        assert_eq!(pace.limit(), 15, "30 s at a job per 2 s");
        let mut slow = Pace::new(Duration::from_secs(60));
        ended_every(&mut slow, Instant::now(), 90, 2);
        assert_eq!(slow.limit(), 1, "one job is always allowed");
    }

    #[test]
    fn idle_time_between_jobs_is_not_counted_as_work() {
        let mut pace = Pace::new(Duration::from_secs(60));
        let start = Instant::now();
        pace.busy(start);
        pace.job_ended(start + Duration::from_secs(3), 0);
        // The hand stayed empty for ten minutes; the next job took 3 s again.
        let later = start + Duration::from_secs(600);
        pace.busy(later);
        pace.job_ended(later + Duration::from_secs(3), 0);
        assert_eq!(pace.limit(), 10);
    }
}
