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

use std::collections::{BTreeMap, BTreeSet, HashSet};

use stageb_shared::reflection_schema;

use super::call::Dispatch;
use super::cycle::split_stop_gradient;
use super::row::CallPass;
use super::{GradientRecord, Reflector};
use crate::artifacts::documents::CallsAheadStats;
use crate::cluster::scheduler::journal::payload_digest;
use crate::cluster::scheduler::{JobId, JobOutput, JobPayload};
use crate::guidance::GuidanceRepo;
use stageb_shared::domain::TicketKey;

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
    pub(super) fn decisions_in_flight(&self, dispatch: &Dispatch<'_>) -> HashSet<JobId> {
        self.queued
            .values()
            .filter(|q| q.pass == CallPass::Decision)
            .filter(|q| dispatch.completions.peek(q.job).is_none())
            .map(|q| q.job)
            .collect()
    }

    /// Queue `payload` of `cycle` ahead unless it is queued already; returns its digest and
    /// its job.
    fn want(
        &mut self,
        cycle: u64,
        pass: CallPass,
        payload: JobPayload,
        dispatch: &mut Dispatch<'_>,
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

    /// Withdraw every call for which `unwanted` holds.
    fn withdraw_where(
        &mut self,
        dispatch: &mut Dispatch<'_>,
        unwanted: impl Fn(&str, &Queued) -> bool,
    ) {
        let mut jobs: Vec<JobId> = Vec::new();
        self.queued.retain(|digest, q| {
            let gone = unwanted(digest, q);
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
    pub(super) fn withdraw_all(&mut self, dispatch: &mut Dispatch<'_>) {
        self.withdraw_where(dispatch, |_, _| true);
    }

    /// A boundary's cycles begin; `drain`: it is the epoch's end (partial batches are due).
    pub(super) fn start_boundary(&mut self, drain: bool) {
        self.drain = drain;
    }
}

impl Reflector {
    /// Queue ahead the calls the next cycles will most likely make (see the module header);
    /// calls queued for cycles now past, or for upcoming cycles under another guess, are
    /// withdrawn. The current cycle's own calls are left as they are.
    pub(super) fn plan_calls_ahead(
        &mut self,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch<'_>,
    ) {
        if self.calls_ahead.depth == 0 {
            return;
        }
        dispatch.completions.collect_ready();
        let current = self.state.cycles;
        let mut wanted: BTreeSet<String> = BTreeSet::new();
        // Only the cycles the budget lets call are guessed (once it is spent, a boundary's
        // remaining cycles route their cases without a call: nothing to guess).
        let depth = (0..self.calls_ahead.depth)
            .take_while(|&j| self.cycle_ahead_gets_calls(j))
            .count();
        let upcoming = self.upcoming_cases(self.calls_ahead.drain, depth, guidance);
        for (j, kept) in upcoming.into_iter().enumerate() {
            let cycle = current + 1 + j as u64;
            self.queue_likely_calls(cycle, kept, guidance, dispatch, &mut wanted);
        }
        self.calls_ahead.withdraw_where(dispatch, |digest, q| {
            q.cycle < current || (q.cycle > current && !wanted.contains(digest))
        });
    }

    /// Whether upcoming cycle `j` (0: the next) is likely to get its calls: the epoch's change
    /// cap is not reached and the call budget covers this cycle's two calls and theirs.
    fn cycle_ahead_gets_calls(&self, j: usize) -> bool {
        if self.change_cap_reached() {
            return false;
        }
        self.state
            .calls_epoch
            .covers_cycle_ahead(self.config.max_calls_per_epoch, j)
    }

    /// Queue the decision call `cycle` would make on its packed cases `kept`, and its ops call
    /// when the decision's answer (queued ahead before) is in and leaves cases to learn from;
    /// their digests go into `wanted`.
    fn queue_likely_calls(
        &mut self,
        cycle: u64,
        kept: Vec<GradientRecord>,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch<'_>,
        wanted: &mut BTreeSet<String>,
    ) {
        let kept_keys: BTreeSet<TicketKey> = kept.iter().map(|r| r.ticket_key.clone()).collect();
        let (messages, schema) = self.decision_prompt(&kept, &kept_keys, guidance, cycle);
        let seed = self.call_seed(self.state.epoch, cycle, CallPass::Decision, 0);
        let decision = self.call_payload(&messages, &schema, seed);
        let (digest, job) = self
            .calls_ahead
            .want(cycle, CallPass::Decision, decision, dispatch);
        wanted.insert(digest);
        let answer = dispatch
            .completions
            .peek(job)
            .and_then(|c| match &c.result {
                Ok(JobOutput::Generate { text, .. }) => {
                    reflection_schema::parse_decision(text).ok()
                }
                _ => None,
            });
        let Some(decision) = answer else {
            return;
        };
        let learnable = split_stop_gradient(kept, &kept_keys, &decision).learnable;
        if learnable.records.is_empty() {
            return;
        }
        let ops = self.first_ops_payload(&learnable, guidance, cycle);
        wanted.insert(self.calls_ahead.want(cycle, CallPass::Ops, ops, dispatch).0);
    }
}
