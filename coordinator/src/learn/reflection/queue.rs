//! Where gradient candidates wait: the pending queue (arrival order) and the retry buckets
//! (batches halve per retry), with each ticket's retries this epoch. [`ReflectionQueue`] owns
//! them: a candidate joins, a due batch leaves, cases no model saw come back uncharged, and a
//! case the cycle could not cover retries while its budget lasts. Routing to need-review is
//! the cycle's ([`super::Reflector`]): the queue says who is out of budget.

use std::collections::{BTreeMap, HashMap};

use stageb_shared::domain::TicketKey;

use super::GradientRecord;

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

/// The reflection queue of an epoch: what is pending, what retries in which round, and how
/// often each ticket was retried.
#[derive(Debug, Clone)]
pub(super) struct ReflectionQueue {
    pending: Vec<GradientRecord>,
    retry: BTreeMap<u32, Vec<GradientRecord>>,
    retry_counts: HashMap<TicketKey, u32>,
    /// Candidates queued so far this epoch (each one's arrival order).
    arrivals: u64,
    /// `reflection.batch_size`.
    batch_size: u32,
    /// `reflection.retry_budget_per_group_per_epoch`.
    retry_budget: u32,
}

/// What a checkpoint stores of the queue, in its order of fields.
pub(super) struct QueueParts {
    pub(super) pending: Vec<GradientRecord>,
    pub(super) retry: BTreeMap<u32, Vec<GradientRecord>>,
    pub(super) retry_counts: HashMap<TicketKey, u32>,
    pub(super) arrivals: u64,
}

impl ReflectionQueue {
    /// The queue of batches of `batch_size`, each ticket retried at most `retry_budget` times
    /// an epoch, holding `parts` (empty for a fresh run).
    pub(super) fn new(batch_size: u32, retry_budget: u32, parts: QueueParts) -> Self {
        ReflectionQueue {
            pending: parts.pending,
            retry: parts.retry,
            retry_counts: parts.retry_counts,
            arrivals: parts.arrivals,
            batch_size,
            retry_budget,
        }
    }

    /// What a checkpoint stores.
    pub(super) fn parts(&self) -> QueueParts {
        QueueParts {
            pending: self.pending.clone(),
            retry: self.retry.clone(),
            retry_counts: self.retry_counts.clone(),
            arrivals: self.arrivals,
        }
    }

    /// A new epoch: nothing waits, nothing was retried.
    pub(super) fn clear(&mut self) {
        self.pending.clear();
        self.retry.clear();
        self.retry_counts.clear();
        self.arrivals = 0;
    }

    /// Cases waiting in the pending queue (they leave in batches of `batch_size`).
    pub(super) fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// `reflection.batch_size`.
    pub(super) fn batch_size(&self) -> u32 {
        self.batch_size
    }

    /// Cycles the retry buckets hold: each bucket's cases in batches of its own size.
    pub(super) fn retry_cycles(&self) -> usize {
        let cycles = |(attempt, bucket): (&u32, &Vec<GradientRecord>)| {
            bucket
                .len()
                .div_ceil(retry_batch_size(self.batch_size, *attempt))
        };
        self.retry.iter().map(cycles).sum()
    }

    /// Queue a candidate, numbered in arrival order.
    pub(super) fn push(&mut self, mut record: GradientRecord) {
        record.order = self.arrivals;
        self.arrivals += 1;
        self.pending.push(record);
    }

    /// The next batch to reflect on, if one is due. Mid-epoch only full batches are taken;
    /// at epoch end (`drain`) everything is, including retries created while draining.
    pub(super) fn next_batch(&mut self, drain: bool) -> Option<(u32, Vec<GradientRecord>)> {
        take_batch(&mut self.pending, &mut self.retry, self.batch_size, drain)
    }

    /// The cases the next `n` cycles would send, packed by `pack` (kept, left out), if no
    /// cycle put anything back but the cases its packing leaves out (nothing retried): the
    /// guess that calls queued ahead are built from.
    pub(super) fn upcoming(
        &self,
        drain: bool,
        n: usize,
        pack: impl Fn(Vec<GradientRecord>) -> (Vec<GradientRecord>, Vec<GradientRecord>),
    ) -> Vec<Vec<GradientRecord>> {
        // Only the head of the pending queue can be due within `n` batches (a batch takes at
        // most `size` from it, net of the cases its packing puts back).
        let batch_size = self.batch_size;
        let head = self
            .pending
            .len()
            .min(n.saturating_mul(batch_size.max(1) as usize));
        let mut pending = self.pending[..head].to_vec();
        let mut retry = self.retry.clone();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some((attempt, batch)) = take_batch(&mut pending, &mut retry, batch_size, drain)
            else {
                break;
            };
            let (kept, dropped) = pack(batch);
            put_back(&mut pending, &mut retry, attempt, dropped);
            out.push(kept);
        }
        out
    }

    /// Cases dropped by the token budget never reached a model: they go back to the queue
    /// they came from (arrival order kept) without being charged a retry.
    pub(super) fn requeue_uncharged(&mut self, attempt: u32, records: Vec<GradientRecord>) {
        put_back(&mut self.pending, &mut self.retry, attempt, records);
    }

    /// `L \ E` and dropped cases, in key order: each is charged a retry and retried with a
    /// smaller batch while its budget lasts. Returns those out of budget, in key order (the
    /// caller routes them to need-review).
    pub(super) fn retry_or_give_up(
        &mut self,
        mut records: Vec<GradientRecord>,
    ) -> Vec<GradientRecord> {
        let mut given_up = Vec::new();
        records.sort_by(|a, b| a.ticket_key.cmp(&b.ticket_key));
        for r in records {
            let count = self.retry_counts.entry(r.ticket_key.clone()).or_insert(0);
            *count += 1;
            let count = *count;
            if count <= self.retry_budget {
                self.retry.entry(count).or_default().push(r);
            } else {
                given_up.push(r);
            }
        }
        given_up
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::selection::Selection;
    use crate::learn::feedback::PendingFeedback;
    use stageb_shared::domain::Verdict;

    fn record(group: &str) -> GradientRecord {
        GradientRecord {
            ticket_key: TicketKey::new(group, Verdict::Fail),
            group_id: group.into(),
            mission: "m".into(),
            gt: Verdict::Fail,
            summaries: vec![],
            candidates: vec![],
            final_verdict: None,
            final_reason: String::new(),
            vote_strength: None,
            low_agreement: false,
            eligibility_reasons: vec![],
            priority: 0,
            selection: Selection::default(),
            order: 0,
            feedback: PendingFeedback::default(),
        }
    }

    fn empty() -> QueueParts {
        QueueParts {
            pending: vec![],
            retry: BTreeMap::new(),
            retry_counts: HashMap::new(),
            arrivals: 0,
        }
    }

    fn groups(records: &[GradientRecord]) -> Vec<&str> {
        records.iter().map(|r| r.group_id.as_str()).collect()
    }

    #[test]
    fn mid_epoch_only_full_batches_leave_and_the_epoch_end_drains_the_rest() {
        let mut q = ReflectionQueue::new(2, 1, empty());
        for g in ["a", "b", "c"] {
            q.push(record(g));
        }
        let (attempt, batch) = q.next_batch(false).expect("a full batch");
        assert_eq!((attempt, groups(&batch)), (0, vec!["a", "b"]));
        assert!(q.next_batch(false).is_none(), "one case is not a batch");
        let (_, rest) = q.next_batch(true).expect("drained");
        assert_eq!(groups(&rest), vec!["c"]);
        assert_eq!(rest[0].order, 2, "numbered in arrival order");
    }

    #[test]
    fn cases_no_model_saw_go_back_in_arrival_order_without_a_retry_charged() {
        let mut q = ReflectionQueue::new(2, 0, empty());
        for g in ["a", "b", "c"] {
            q.push(record(g));
        }
        let (attempt, mut batch) = q.next_batch(false).unwrap();
        let dropped = vec![batch.pop().unwrap()];
        q.requeue_uncharged(attempt, dropped);
        let (_, next) = q.next_batch(false).unwrap();
        assert_eq!(groups(&next), vec!["b", "c"]);
        assert!(q.parts().retry_counts.is_empty());
    }

    #[test]
    fn a_case_retries_while_its_budget_lasts_then_is_given_up() {
        let mut q = ReflectionQueue::new(4, 1, empty());
        let given_up = q.retry_or_give_up(vec![record("b"), record("a")]);
        assert!(given_up.is_empty(), "each has one retry");
        let (attempt, batch) = q.next_batch(true).unwrap();
        assert_eq!((attempt, groups(&batch)), (1, vec!["a", "b"]));
        let given_up = q.retry_or_give_up(batch);
        assert_eq!(
            groups(&given_up),
            vec!["a", "b"],
            "out of budget, in key order"
        );
        q.clear();
        assert!(
            q.retry_or_give_up(vec![record("a")]).is_empty(),
            "a new epoch"
        );
    }

    #[test]
    fn each_retry_bucket_holds_cycles_of_its_own_batch_size() {
        let mut q = ReflectionQueue::new(4, 2, empty());
        q.push(record("p"));
        let first: Vec<_> = ["a", "b", "c"].map(record).into();
        assert!(q.retry_or_give_up(first).is_empty());
        assert_eq!(q.retry_cycles(), 2, "3 cases in retry batches of 2");
        let (_, batch) = q.next_batch(true).expect("the pending case");
        assert_eq!(groups(&batch), vec!["p"]);
        let (_, batch) = q.next_batch(true).expect("a retry batch");
        assert!(q.retry_or_give_up(batch).is_empty());
        assert_eq!(
            q.retry_cycles(),
            1 + 2,
            "1 left at size 2, 2 more at size 1"
        );
        assert_eq!((q.pending_len(), q.batch_size()), (0, 4));
    }

    #[test]
    pub(super) fn retry_batches_halve_and_never_reach_zero() {
        // The original's _batch_size_for_retry behaviour.
        assert_eq!(retry_batch_size(32, 0), 32);
        assert_eq!(retry_batch_size(32, 1), 16);
        assert_eq!(retry_batch_size(32, 2), 8);
        assert_eq!(retry_batch_size(3, 2), 1);
    }
}
