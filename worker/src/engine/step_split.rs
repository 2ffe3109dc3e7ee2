//! Where an engine's decode steps spend their time, summed since it was loaded
//! ([`StepSplit`]): sampling the rows' tokens on the host, issuing the forward call, waiting
//! for the device to finish it, reading the logits back, and prefill chunks; with the device
//! operations the candle backend's decode steps issued
//! ([`transformer::ops`](super::transformer::ops)). `stageb probe rollout` reports the
//! difference across a pass, per step.

use std::time::Duration;

/// Totals over an engine's steps (see the module docs).
///
/// `forward_issued` ends when the forward call returns: on the CPU the work is done by then,
/// on CUDA only queued; `forward_done` is the wait for the device after it
/// (`Device::synchronize`, nothing on the CPU). On the CPU fast path a prefill chunk and the
/// decode rows share one forward call: such a call's time counts as prefill.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepSplit {
    /// Steps whose forward call decoded rows.
    pub decode_steps: u64,
    /// Prefill chunks run.
    pub prefill_steps: u64,
    pub sampling: Duration,
    pub forward_issued: Duration,
    pub forward_done: Duration,
    pub readback: Duration,
    pub prefill: Duration,
    /// Device operations the decode steps issued, forward and readback (the candle backend;
    /// `None` on the CPU fast path, which issues none).
    pub host_ops: Option<u64>,
    /// Draft tokens the rows were fed, and how many of them they took (the CPU fast path's
    /// speculative feeding, `model_engine/draft.rs`).
    pub drafts_fed: u64,
    pub drafts_taken: u64,
}

impl StepSplit {
    /// What was added since `earlier` (an earlier value of the same engine's totals).
    pub fn since(&self, earlier: &StepSplit) -> StepSplit {
        StepSplit {
            decode_steps: self.decode_steps - earlier.decode_steps,
            prefill_steps: self.prefill_steps - earlier.prefill_steps,
            sampling: self.sampling.saturating_sub(earlier.sampling),
            forward_issued: self.forward_issued.saturating_sub(earlier.forward_issued),
            forward_done: self.forward_done.saturating_sub(earlier.forward_done),
            readback: self.readback.saturating_sub(earlier.readback),
            prefill: self.prefill.saturating_sub(earlier.prefill),
            host_ops: self
                .host_ops
                .map(|n| n - earlier.host_ops.unwrap_or_default()),
            drafts_fed: self.drafts_fed - earlier.drafts_fed,
            drafts_taken: self.drafts_taken - earlier.drafts_taken,
        }
    }

    /// Device operations per decode step, where counted.
    pub fn host_ops_per_step(&self) -> Option<f64> {
        let n = self.host_ops?;
        (self.decode_steps > 0).then(|| n as f64 / self.decode_steps as f64)
    }

    /// Counts `n` device operations of a decode step.
    pub(crate) fn add_ops(&mut self, n: u64) {
        self.host_ops = Some(self.host_ops.unwrap_or_default() + n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_counts_the_steps_and_operations_between() {
        let a = StepSplit {
            decode_steps: 2,
            sampling: Duration::from_millis(3),
            ..StepSplit::default()
        };
        let mut b = StepSplit {
            decode_steps: 6,
            sampling: Duration::from_millis(11),
            ..a
        };
        b.add_ops(400);
        let d = b.since(&a);
        assert_eq!(d.decode_steps, 4);
        assert_eq!(d.sampling, Duration::from_millis(8));
        assert_eq!(d.host_ops_per_step(), Some(100.0));
        assert_eq!(a.since(&a).host_ops_per_step(), None, "not counted");
    }
}
