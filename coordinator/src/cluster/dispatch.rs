//! Where a run's jobs go and how their answers come back: the scheduler that leases them to
//! workers, the channel their answers arrive on, and the run's worker grace (how long waiting
//! goes on with no live worker before the run gives up). The run loop owns one; reflection
//! borrows it for its calls and gate rollouts, so every wait reads the same grace.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::cluster::completions::{Completions, WaitError, await_any, await_completions};
use crate::cluster::scheduler::{Completion, JobId, Scheduler};

/// The scheduler, the completions channel and the worker grace of one run.
pub struct Dispatch {
    pub scheduler: Arc<Scheduler>,
    pub completions: Completions,
    /// How long a wait goes on with no live worker before it gives up
    /// ([`WaitError::NoWorkers`]). Defined here only: every wait of the run reads it.
    pub worker_grace: Duration,
}

impl Dispatch {
    /// The dispatch of a run: `completions` is the scheduler's answer channel, `grace` the
    /// run's worker grace.
    pub fn new(
        scheduler: Arc<Scheduler>,
        completions: mpsc::UnboundedReceiver<Completion>,
        grace: Duration,
    ) -> Self {
        Dispatch {
            scheduler,
            completions: Completions::new(completions),
            worker_grace: grace,
        }
    }

    /// The next answer among `ids`; `live` is told the live worker count while it waits.
    pub async fn await_any(
        &mut self,
        ids: &HashSet<JobId>,
        live: &mut dyn FnMut(usize),
    ) -> Result<Completion, WaitError> {
        let grace = self.worker_grace;
        await_any(&self.scheduler, &mut self.completions, ids, grace, live).await
    }

    /// Every answer of `ids`.
    pub async fn await_all(
        &mut self,
        ids: &[JobId],
    ) -> Result<HashMap<JobId, Completion>, WaitError> {
        let grace = self.worker_grace;
        await_completions(&self.scheduler, &mut self.completions, ids, grace).await
    }
}
