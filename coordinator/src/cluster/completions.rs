//! Waiting for job results on rank 0: the one place that blocks on the scheduler's completion
//! channel, shared by the epoch loop (rollouts) and reflection (one call at a time).
//!
//! Both give up the same way when no worker has been alive for the run's worker grace, so the
//! wait lives here rather than in either of them (reflection must not depend on the run loop
//! that drives it).

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

/// Wait for every job in `ids`. Completions of other jobs are unexpected here and dropped with
/// a warning. Gives up when no worker has been alive for `grace`.
pub async fn await_completions(
    scheduler: &Scheduler,
    completions: &mut mpsc::UnboundedReceiver<Completion>,
    ids: &[JobId],
    grace: Duration,
) -> Result<HashMap<JobId, Completion>, WaitError> {
    let mut pending: HashSet<JobId> = ids.iter().copied().collect();
    let mut out = HashMap::with_capacity(ids.len());
    while !pending.is_empty() {
        let next = await_any(scheduler, completions, &pending, grace).await?;
        pending.remove(&next.job);
        out.insert(next.job, next);
    }
    Ok(out)
}

/// The next completion among `ids` (a set: a large step asks once per completion). Completions
/// of other jobs are unexpected here and dropped with a warning. Gives up when no worker has
/// been alive for `grace`.
pub(crate) async fn await_any(
    scheduler: &Scheduler,
    completions: &mut mpsc::UnboundedReceiver<Completion>,
    ids: &HashSet<JobId>,
    grace: Duration,
) -> Result<Completion, WaitError> {
    let mut lonely_since: Option<Instant> = None;
    loop {
        match tokio::time::timeout(Duration::from_secs(1), completions.recv()).await {
            Ok(Some(c)) if ids.contains(&c.job) => return Ok(c),
            Ok(Some(c)) => {
                tracing::warn!(job = c.job, "completion of a job nobody waits for; dropped")
            }
            Ok(None) => return Err(WaitError::SchedulerClosed),
            Err(_) => {
                if scheduler.live_workers() == 0 {
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
