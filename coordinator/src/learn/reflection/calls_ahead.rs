//! Reflection calls queued ahead (`runner.pipeline_cycles: D`). Reflection is a chain: a
//! cycle starts from the guidance the one before it wrote, so its calls run one at a time
//! while workers with room idle. While a cycle runs, the calls the next D cycles will most
//! likely make are queued ahead, built the way those cycles build them from what is known
//! now: the batches the queues would give if nothing but the cases packing leaves out were put
//! back, packed under the current guidance; the decision call of each; and the ops call of
//! each whose decision answer is already in (re-planned as soon as one arrives).
//!
//! A cycle uses a call queued ahead only when it asks for exactly the same job: the digest of
//! the whole payload (messages, schema, seed, sampling parameters) that the job journal keys
//! answers by, and a job's answer depends on nothing else. So artifacts never depend on it; a
//! guess that turns out wrong (the guidance changed, a case was retried, a call failed) only
//! costs the work, and its job is withdrawn (its lease fenced). Calls still queued ahead when
//! a boundary's cycles are done are withdrawn too. `summary.json` `runtime.pipeline` counts
//! the calls queued ahead, used and withdrawn.

use std::collections::{BTreeMap, HashSet};

use super::row::CallPass;
use crate::artifacts::documents::CallsAheadStats;
use crate::cluster::dispatch::Dispatch;
use crate::cluster::scheduler::journal::payload_digest;
use crate::cluster::scheduler::{JobId, JobPayload};

/// One call queued ahead.
struct Queued {
    job: JobId,
    cycle: u64,
    pass: CallPass,
}

/// The calls queued ahead, by payload digest.
pub(super) struct CallsAhead {
    /// Cycles ahead (`runner.pipeline_cycles`); 0 queues nothing.
    depth: usize,
    /// Whether the boundary being reflected on is the epoch's end (its partial batches are due).
    drain: bool,
    queued: BTreeMap<String, Queued>,
    pub(super) stats: CallsAheadStats,
}

impl CallsAhead {
    /// Calls queued ahead for up to `depth` upcoming cycles (0: none).
    pub(super) fn new(depth: usize) -> Self {
        CallsAhead {
            depth,
            drain: false,
            queued: BTreeMap::new(),
            stats: CallsAheadStats::default(),
        }
    }

    /// The job queued ahead for exactly `payload`, taken out of the table (the caller now waits
    /// for it as its own call).
    pub(super) fn take(&mut self, payload: &JobPayload) -> Option<JobId> {
        if self.queued.is_empty() {
            return None;
        }
        let queued = self.queued.remove(&payload_digest(payload))?;
        self.stats.calls_used += 1;
        Some(queued.job)
    }

    /// Decision calls queued ahead whose answer has not arrived: an arrival may let its
    /// cycle's ops call be queued too.
    pub(super) fn decisions_in_flight(&self, dispatch: &Dispatch) -> HashSet<JobId> {
        self.queued
            .values()
            .filter(|q| q.pass == CallPass::Decision)
            .filter(|q| dispatch.completions.peek(q.job).is_none())
            .map(|q| q.job)
            .collect()
    }

    /// Cycles queued ahead (`runner.pipeline_cycles`; 0: none).
    pub(super) fn depth(&self) -> usize {
        self.depth
    }

    /// Whether the boundary being reflected on is the epoch's end.
    pub(super) fn draining(&self) -> bool {
        self.drain
    }

    /// Queue `payload` of `cycle` ahead unless it is queued already; returns its digest and
    /// its job.
    pub(super) fn want(
        &mut self,
        cycle: u64,
        pass: CallPass,
        payload: JobPayload,
        dispatch: &mut Dispatch,
    ) -> (String, JobId) {
        let digest = payload_digest(&payload);
        if let Some(q) = self.queued.get(&digest) {
            return (digest, q.job);
        }
        let job = dispatch.scheduler.enqueue_ahead(payload);
        dispatch.completions.expect([job]);
        self.queued
            .insert(digest.clone(), Queued { job, cycle, pass });
        self.stats.calls_ahead += 1;
        (digest, job)
    }

    /// Withdraw every call for which `unwanted(digest, cycle)` holds.
    pub(super) fn withdraw_where(
        &mut self,
        dispatch: &mut Dispatch,
        unwanted: impl Fn(&str, u64) -> bool,
    ) {
        let mut jobs: Vec<JobId> = Vec::new();
        self.queued.retain(|digest, q| {
            let gone = unwanted(digest, q.cycle);
            if gone {
                jobs.push(q.job);
            }
            !gone
        });
        if jobs.is_empty() {
            return;
        }
        dispatch.completions.collect_ready();
        dispatch.scheduler.withdraw(&jobs);
        dispatch.completions.forget(&jobs);
        self.stats.calls_withdrawn += jobs.len() as u64;
    }

    /// The boundary's cycles are done: nothing queued ahead will be asked for.
    pub(super) fn withdraw_all(&mut self, dispatch: &mut Dispatch) {
        self.withdraw_where(dispatch, |_, _| true);
    }

    /// A boundary's cycles begin; `drain`: it is the epoch's end (partial batches are due).
    pub(super) fn start_boundary(&mut self, drain: bool) {
        self.drain = drain;
    }
}
