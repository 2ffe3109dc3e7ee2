//! Waiting for job results on rank 0: the one place that blocks on the scheduler's completion
//! channel, shared by the epoch loop (rollouts) and reflection (one call at a time).
//!
//! Both give up the same way when no worker has been alive for the run's worker grace, so the
//! wait lives here rather than in either of them (reflection must not depend on the run loop
//! that drives it). Results of jobs queued ahead of their turn (the next step's rollouts,
//! leased while reflection runs) are kept until they are asked for: [`Completions::expect`].

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::cluster::scheduler::{Completion, JobId, Scheduler};

/// Why a wait for job results ended without them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WaitError {
    #[error("no worker has been alive for {0:?}; giving up")]
    NoWorkers(Duration),
    #[error("the scheduler stopped delivering results")]
    SchedulerClosed,
}

/// The scheduler's completion channel, and the results that arrived before anyone waited for
/// them (only of jobs announced with [`Completions::expect`]; others are dropped with a
/// warning, as nobody will ask for them).
pub struct Completions {
    rx: mpsc::UnboundedReceiver<Completion>,
    expected: HashSet<JobId>,
    early: HashMap<JobId, Completion>,
}

impl Completions {
    pub fn new(rx: mpsc::UnboundedReceiver<Completion>) -> Self {
        Completions {
            rx,
            expected: HashSet::new(),
            early: HashMap::new(),
        }
    }

    /// Keep the results of `ids` until they are waited for.
    pub fn expect(&mut self, ids: impl IntoIterator<Item = JobId>) {
        self.expected.extend(ids);
    }

    /// Nobody will wait for `ids` any more: drop what arrived of them, and what will.
    pub fn forget(&mut self, ids: &[JobId]) {
        for id in ids {
            self.expected.remove(id);
            self.early.remove(id);
        }
    }

    /// The results already delivered (nobody waiting for them), kept if expected: after this,
    /// [`Completions::peek`] sees every answer that has arrived so far.
    pub fn collect_ready(&mut self) {
        while let Ok(c) = self.rx.try_recv() {
            self.arrived_early(c);
        }
    }

    /// The result of `id`, if it arrived early and is kept; it stays kept.
    pub fn peek(&self, id: JobId) -> Option<&Completion> {
        self.early.get(&id)
    }

    /// A result taken by [`await_any`] that the caller keeps for later: it is expected again
    /// and waits among the early ones.
    pub fn put_back(&mut self, c: Completion) {
        self.expected.insert(c.job);
        self.early.insert(c.job, c);
    }

    /// An early result among `ids`, taken out.
    fn take_early(&mut self, ids: &HashSet<JobId>) -> Option<Completion> {
        let id = *self.early.keys().find(|id| ids.contains(id))?;
        self.expected.remove(&id);
        self.early.remove(&id)
    }

    /// A result nobody is waiting for now: kept if it was expected, else dropped.
    fn arrived_early(&mut self, c: Completion) {
        if self.expected.contains(&c.job) {
            self.early.insert(c.job, c);
        } else {
            tracing::warn!(job = c.job, "completion of a job nobody waits for; dropped");
        }
    }
}

/// Wait for every job in `ids`. Completions of other jobs are kept if expected, else dropped
/// with a warning. Gives up when no worker has been alive for `grace`.
pub async fn await_completions(
    scheduler: &Scheduler,
    completions: &mut Completions,
    ids: &[JobId],
    grace: Duration,
) -> Result<HashMap<JobId, Completion>, WaitError> {
    let mut pending: HashSet<JobId> = ids.iter().copied().collect();
    let mut out = HashMap::with_capacity(ids.len());
    while !pending.is_empty() {
        let next = await_any(scheduler, completions, &pending, grace, &mut |_| {}).await?;
        pending.remove(&next.job);
        out.insert(next.job, next);
    }
    Ok(out)
}

/// The next completion among `ids` (a set: a large step asks once per completion), early
/// ones first. Completions of other jobs are kept if expected, else dropped with a warning.
/// Gives up when no worker has been alive for `grace`. Each second without a completion it
/// counts the live workers and tells `live` (the progress line's count stays true while a
/// step's first results are still being computed).
pub async fn await_any(
    scheduler: &Scheduler,
    completions: &mut Completions,
    ids: &HashSet<JobId>,
    grace: Duration,
    live: &mut dyn FnMut(usize),
) -> Result<Completion, WaitError> {
    if let Some(c) = completions.take_early(ids) {
        return Ok(c);
    }
    let mut lonely_since: Option<Instant> = None;
    loop {
        match tokio::time::timeout(Duration::from_secs(1), completions.rx.recv()).await {
            Ok(Some(c)) if ids.contains(&c.job) => {
                completions.expected.remove(&c.job);
                return Ok(c);
            }
            Ok(Some(c)) => completions.arrived_early(c),
            Ok(None) => return Err(WaitError::SchedulerClosed),
            Err(_) => {
                let n = scheduler.live_workers();
                live(n);
                if n == 0 {
                    let since = *lonely_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= grace {
                        return Err(WaitError::NoWorkers(grace));
                    }
                } else {
                    lonely_since = None;
                }
            }
        }
    }
}
