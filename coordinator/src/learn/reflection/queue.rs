//! Where gradient candidates wait and where they leave: the pending queue and the retry
//! buckets (batches halve per retry), and routing to need-review. The epoch's call budget and
//! change cap are compared here through their own types (`budget`).

use std::collections::BTreeMap;

use stageb_shared::domain::TicketKey;

use super::{GradientRecord, ReflectionError, Reflector};
use crate::guidance::GuidanceRepo;
use crate::learn::need_review::{self, NeedReviewReason};

/// Batch size of retry round `attempt` (16 → 8 → 4 …, never below 1).
pub fn retry_batch_size(batch_size: u32, attempt: u32) -> usize {
    ((batch_size as usize) >> attempt.min(31)).max(1)
}

/// Take the next due batch from `pending` and the `retry` buckets (with its retry attempt).
/// Mid-epoch only full batches are taken; at epoch end (`drain`) everything is.
fn take_batch(
    pending: &mut Vec<GradientRecord>,
    retry: &mut BTreeMap<u32, Vec<GradientRecord>>,
    batch_size: u32,
    drain: bool,
) -> Option<(u32, Vec<GradientRecord>)> {
    let size = batch_size.max(1) as usize;
    if pending.len() >= size || (drain && !pending.is_empty()) {
        let n = size.min(pending.len());
        return Some((0, pending.drain(..n).collect()));
    }
    let attempts: Vec<u32> = retry.keys().copied().collect();
    for attempt in attempts {
        let bucket = retry.get_mut(&attempt).expect("listed above");
        bucket.sort_by(|a, b| a.ticket_key.cmp(&b.ticket_key));
        let want = retry_batch_size(batch_size, attempt);
        if bucket.len() >= want || (drain && !bucket.is_empty()) {
            let n = want.min(bucket.len());
            let batch: Vec<_> = bucket.drain(..n).collect();
            if bucket.is_empty() {
                retry.remove(&attempt);
            }
            return Some((attempt, batch));
        }
    }
    None
}

/// Cases of a batch of retry round `attempt` that no model saw go back to the queue they came
/// from: `pending` in arrival order (round 0), else their retry bucket.
fn put_back(
    pending: &mut Vec<GradientRecord>,
    retry: &mut BTreeMap<u32, Vec<GradientRecord>>,
    attempt: u32,
    records: Vec<GradientRecord>,
) {
    if records.is_empty() {
        return;
    }
    if attempt == 0 {
        pending.extend(records);
        pending.sort_by_key(|r| r.order);
    } else {
        retry.entry(attempt).or_default().extend(records);
    }
}

impl Reflector {
    /// The next batch to reflect on, if one is due. Mid-epoch only full batches are taken;
    /// at epoch end (`drain`) everything is, including retries created while draining.
    pub(super) fn next_batch(&mut self, drain: bool) -> Option<(u32, Vec<GradientRecord>)> {
        let state = &mut self.state;
        take_batch(
            &mut state.pending,
            &mut state.retry,
            self.config.batch_size,
            drain,
        )
    }

    /// The cases the next `n` cycles would send, packed under `guidance`, if no cycle put
    /// anything back but the cases its packing leaves out (nothing retried): the guess that
    /// calls queued ahead are built from.
    pub(super) fn upcoming_cases(
        &self,
        drain: bool,
        n: usize,
        guidance: &GuidanceRepo,
    ) -> Vec<Vec<GradientRecord>> {
        // Only the head of the pending queue can be due within `n` batches (a batch takes at
        // most `size` from it, net of the cases its packing puts back).
        let batch_size = self.config.batch_size;
        let head = self
            .state
            .pending
            .len()
            .min(n.saturating_mul(batch_size.max(1) as usize));
        let mut pending = self.state.pending[..head].to_vec();
        let mut retry = self.state.retry.clone();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some((attempt, batch)) = take_batch(&mut pending, &mut retry, batch_size, drain)
            else {
                break;
            };
            let (kept, dropped) = self.pack_cases(batch, guidance);
            put_back(&mut pending, &mut retry, attempt, dropped);
            out.push(kept);
        }
        out
    }

    pub(super) fn route(
        &mut self,
        record: &GradientRecord,
        reason: NeedReviewReason,
        reflection_id: Option<&str>,
        note: Option<String>,
    ) -> Result<(), ReflectionError> {
        let at = need_review::RoutingPoint {
            epoch: self.state.epoch,
            reflection_cycle: self.state.cycles,
            reflection_id: reflection_id.map(str::to_string),
        };
        self.need_review.route(record, reason, &at, note)
    }

    /// Route every record to need-review `budget_exhausted` (the epoch's call budget is spent).
    pub(super) fn exhaust_all(
        &mut self,
        records: &[GradientRecord],
        reflection_id: Option<&str>,
    ) -> Result<Vec<TicketKey>, ReflectionError> {
        let mut routed = Vec::with_capacity(records.len());
        for r in records {
            routed.push(r.ticket_key.clone());
            self.route(r, NeedReviewReason::BudgetExhausted, reflection_id, None)?;
        }
        Ok(routed)
    }

    /// `L \ E` and dropped cases: retried with a smaller batch while budget remains, else
    /// need-review `budget_exhausted`. Returns the keys routed.
    pub(super) fn retry_or_route(
        &mut self,
        records: Vec<GradientRecord>,
        reflection_id: Option<&str>,
    ) -> Result<Vec<TicketKey>, ReflectionError> {
        let mut routed = Vec::new();
        let mut records = records;
        records.sort_by(|a, b| a.ticket_key.cmp(&b.ticket_key));
        for r in records {
            let count = self
                .state
                .retry_counts
                .entry(r.ticket_key.clone())
                .or_insert(0);
            *count += 1;
            let count = *count;
            if count <= self.config.retry_budget_per_group_per_epoch {
                self.state.retry.entry(count).or_default().push(r);
            } else {
                routed.push(r.ticket_key.clone());
                self.route(&r, NeedReviewReason::BudgetExhausted, reflection_id, None)?;
            }
        }
        Ok(routed)
    }

    /// Cases dropped by the token budget never reached a model: they go back to the queue
    /// they came from (arrival order kept) without being charged a retry.
    pub(super) fn requeue_uncharged(&mut self, attempt: u32, records: Vec<GradientRecord>) {
        let state = &mut self.state;
        put_back(&mut state.pending, &mut state.retry, attempt, records);
    }

    /// Has the epoch applied `change_cap_per_epoch` reflections already?
    pub(super) fn change_cap_reached(&self) -> bool {
        self.state
            .applied_epoch
            .reached(self.config.change_cap_per_epoch)
    }

    pub(super) fn calls_left(&self) -> bool {
        self.state.calls_epoch.left(self.config.max_calls_per_epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn retry_batches_halve_and_never_reach_zero() {
        // The original's _batch_size_for_retry behaviour.
        assert_eq!(retry_batch_size(32, 0), 32);
        assert_eq!(retry_batch_size(32, 1), 16);
        assert_eq!(retry_batch_size(32, 2), 8);
        assert_eq!(retry_batch_size(3, 2), 1);
    }
}
