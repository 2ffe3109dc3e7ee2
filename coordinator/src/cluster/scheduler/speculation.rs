//! Straggler speculation: when an idle worker finds the queue empty and a lease has run much
//! longer than jobs of its kind usually take, the scheduler leases the same job to the idle
//! worker as well. The first accepted answer wins and the other lease is fenced (its worker
//! cancels the job at its next decode step, and a late result is refused).
//!
//! This never changes a byte of the artifacts: a job's answer is a function of the seeds in
//! its payload, so either copy answers the same; only runtime provenance (which worker, which
//! lease) differs, and that is excluded from every comparison. What it changes is the tail: a
//! step no longer waits for its slowest worker (a throttled GPU, a noisy neighbour, a paused
//! process) when another one sits idle.
//!
//! The rule, kept deliberately simple: at most one extra copy per job; only when the queue is
//! empty (speculation never delays first attempts); only past `multiple × median` of the last
//! [`WINDOW`] accepted jobs of the same kind (rollouts and reflection generations differ by
//! orders of magnitude), and never before `min_age`.
//!
//! A second trigger needs no timed jobs: a lease whose reported progress has stood still for
//! half the bound at which it would be revoked ([`super::liveness`]) is a straggler too, from
//! the run's first job on (counted apart as `speculative_leases_no_progress`).

use std::collections::VecDeque;
use std::time::Duration;

/// Accepted jobs per kind the median is taken over.
pub const WINDOW: usize = 64;
/// Accepted jobs of a kind needed before its median is trusted.
pub const MIN_SAMPLES: usize = 3;

/// When a lease counts as a straggler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculationConfig {
    /// A lease older than this multiple of its kind's median job time is a straggler; 0 turns
    /// speculation off.
    pub multiple: u32,
    /// Never speculate on a lease younger than this.
    pub min_age: Duration,
}

impl SpeculationConfig {
    pub const OFF: SpeculationConfig = SpeculationConfig {
        multiple: 0,
        min_age: Duration::ZERO,
    };

    pub fn enabled(&self) -> bool {
        self.multiple > 0
    }
}

impl Default for SpeculationConfig {
    /// Three medians, at least two seconds: a real job takes seconds, so this only fires on a
    /// worker that is several times slower than the rest.
    fn default() -> Self {
        SpeculationConfig {
            multiple: 3,
            min_age: Duration::from_secs(2),
        }
    }
}

/// The two kinds of job, timed apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    Rollout,
    Generate,
}

/// Recent accepted job times of one kind, with their median kept current.
#[derive(Debug, Default)]
struct Window {
    times: VecDeque<Duration>,
    /// Recomputed when a time is recorded (once per accepted job), not when asked: idle
    /// `Lease` calls ask far more often than jobs complete.
    median: Option<Duration>,
}

impl Window {
    fn record(&mut self, took: Duration) {
        if self.times.len() == WINDOW {
            self.times.pop_front();
        }
        self.times.push_back(took);
        self.median = (self.times.len() >= MIN_SAMPLES).then(|| {
            let mut sorted: Vec<Duration> = self.times.iter().copied().collect();
            sorted.sort_unstable();
            sorted[sorted.len() / 2]
        });
    }
}

/// Recent accepted job times, per kind.
#[derive(Debug, Default)]
pub struct JobTimes {
    rollout: Window,
    generate: Window,
}

impl JobTimes {
    fn of(&self, kind: JobKind) -> &Window {
        match kind {
            JobKind::Rollout => &self.rollout,
            JobKind::Generate => &self.generate,
        }
    }

    pub fn record(&mut self, kind: JobKind, took: Duration) {
        match kind {
            JobKind::Rollout => self.rollout.record(took),
            JobKind::Generate => self.generate.record(took),
        }
    }

    /// The median of the kind's recent jobs, once there are enough of them.
    pub fn median(&self, kind: JobKind) -> Option<Duration> {
        self.of(kind).median
    }

    /// How old a lease of `kind` must be to count as a straggler (`None`: not yet known).
    pub fn threshold(&self, kind: JobKind, config: &SpeculationConfig) -> Option<Duration> {
        if !config.enabled() {
            return None;
        }
        let median = self.median(kind)?;
        Some((median * config.multiple).max(config.min_age))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_threshold_waits_for_enough_samples_and_respects_the_floor() {
        let config = SpeculationConfig {
            multiple: 3,
            min_age: 100 * MS,
        };
        let mut times = JobTimes::default();
        times.record(JobKind::Rollout, 10 * MS);
        times.record(JobKind::Rollout, 50 * MS);
        assert_eq!(times.threshold(JobKind::Rollout, &config), None);
        times.record(JobKind::Rollout, 40 * MS);
        // Median 40 ms × 3 = 120 ms, above the floor.
        assert_eq!(times.threshold(JobKind::Rollout, &config), Some(120 * MS));
        assert_eq!(
            times.threshold(JobKind::Generate, &config),
            None,
            "kinds are timed apart"
        );
        let fast = SpeculationConfig {
            multiple: 1,
            ..config
        };
        assert_eq!(times.threshold(JobKind::Rollout, &fast), Some(100 * MS));
        assert_eq!(
            times.threshold(JobKind::Rollout, &SpeculationConfig::OFF),
            None
        );
    }

    #[test]
    fn the_median_follows_the_recent_window() {
        let mut times = JobTimes::default();
        for _ in 0..WINDOW {
            times.record(JobKind::Generate, 1000 * MS);
        }
        for _ in 0..WINDOW / 2 + 1 {
            times.record(JobKind::Generate, 10 * MS);
        }
        assert_eq!(times.median(JobKind::Generate), Some(10 * MS));
    }
}
