//! How long heartbeats may keep one lease. A heartbeat extends a lease by a TTL, but never past
//! its lifetime, counted from when it was issued: a peer that takes leases and only heartbeats
//! cannot hold their jobs for ever (straggler speculation needs completed jobs to measure
//! against, so it cannot help before the first ones). At the end of its lifetime a lease
//! expires like any other: its worker is told to drop the job, and the job goes back to the
//! queue (and counts against `max_expiries`).
//!
//! The bound is generous for honest work: before jobs of a kind have been timed, `cold`
//! (30 minutes: a long reflection call of a large model on a CPU still fits); afterwards
//! `multiple` × the kind's median job time, never below `floor`.

use std::time::Duration;

use super::speculation::{JobKind, JobTimes};

/// The lifetime rule (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLifetime {
    /// Before enough jobs of the lease's kind completed to know their median.
    pub cold: Duration,
    /// Once the median is known: this many medians…
    pub multiple: u32,
    /// …but at least this long.
    pub floor: Duration,
}

impl Default for LeaseLifetime {
    fn default() -> Self {
        LeaseLifetime {
            cold: Duration::from_secs(30 * 60),
            multiple: 20,
            floor: Duration::from_secs(5 * 60),
        }
    }
}

impl LeaseLifetime {
    /// The lifetime of a lease of `kind` now; never shorter than one lease TTL.
    pub fn of(&self, kind: JobKind, times: &JobTimes, ttl: Duration) -> Duration {
        let measured = times
            .median(kind)
            .map(|median| (median * self.multiple).max(self.floor));
        measured.unwrap_or(self.cold).max(ttl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn cold_until_the_kind_is_timed_then_a_multiple_of_its_median_above_the_floor() {
        let rule = LeaseLifetime::default();
        let mut times = JobTimes::default();
        assert_eq!(rule.of(JobKind::Generate, &times, 60 * S), 30 * 60 * S);
        for _ in 0..3 {
            times.record(JobKind::Generate, 60 * S);
        }
        assert_eq!(rule.of(JobKind::Generate, &times, 60 * S), 20 * 60 * S);
        for _ in 0..3 {
            times.record(JobKind::Rollout, S);
        }
        assert_eq!(rule.of(JobKind::Rollout, &times, 60 * S), 5 * 60 * S);
        assert_eq!(rule.of(JobKind::Rollout, &times, 600 * S), 600 * S);
    }
}
