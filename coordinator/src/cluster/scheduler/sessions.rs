//! Worker sessions: registering (and re-registering, which fences the old session's leases),
//! forgetting idle ones, counting the live ones, and each one's fair share of the work.

use std::collections::HashSet;
use std::time::Instant;

use stageb_shared::observe;

use super::liveness::Stalls;
use super::{Inner, LeaseId, Revocation, Scheduler, SubmitError};

/// A registered worker: its id, when it was last heard from, and its recent pace.
#[derive(Debug)]
pub(super) struct SessionState {
    pub(super) worker_id: String,
    pub(super) last_seen: Instant,
    /// How long its leases' progress stood still between moves, lately.
    pub(super) stalls: Stalls,
}

impl Scheduler {
    /// A new session for a worker. Returns (worker id, session secret), or `Exhausted` when
    /// `max_sessions` sessions are live.
    pub fn register(&self) -> Result<(String, String), SubmitError> {
        self.register_replacing("")
            .map(|(worker, session, _)| (worker, session))
    }

    /// [`Scheduler::register`] for a worker that held `previous` (its old session secret,
    /// which only that worker knows): the old session is retired first and its leases are
    /// fenced at once, their jobs back at the front of the queue, instead of waiting out their
    /// TTL. Whatever the worker was running under the old session it has dropped, or it would
    /// not register again. Returns the ids of the fenced leases as the third element.
    pub fn register_replacing(
        &self,
        previous: &str,
    ) -> Result<(String, String, Vec<LeaseId>), SubmitError> {
        let mut failed = Vec::new();
        let mut g = self.lock();
        let mut fenced: Vec<LeaseId> = Vec::new();
        if !previous.is_empty() && g.sessions.remove(previous).is_some() {
            g.revoked.retain(|_, owner| owner != previous);
            fenced = g
                .leases
                .iter()
                .filter(|(_, l)| l.session == previous)
                .map(|(id, _)| *id)
                .collect();
            // Highest id first, each pushed to the front: the oldest lease's job leads.
            fenced.sort_unstable_by(|a, b| b.cmp(a));
            for id in &fenced {
                self.expire_lease(&mut g, *id, Revocation::Register, &mut failed);
            }
            g.stats.leases_fenced_on_register += fenced.len() as u64;
        }
        let registered = self.register_locked(&mut g);
        drop(g);
        self.after_expiry(failed, !fenced.is_empty());
        registered.map(|(worker, session)| (worker, session, fenced))
    }

    pub(super) fn register_locked(&self, g: &mut Inner) -> Result<(String, String), SubmitError> {
        if g.sessions.len() >= self.config.max_sessions {
            self.forget_idle_sessions(g, Instant::now());
            if g.sessions.len() >= self.config.max_sessions {
                return Err(SubmitError::Exhausted(format!(
                    "too many worker sessions ({}); retry later",
                    g.sessions.len()
                )));
            }
        }
        let worker_id = format!("w{}", g.next_worker);
        g.next_worker += 1;
        let session = uuid::Uuid::new_v4().simple().to_string();
        g.sessions.insert(
            session.clone(),
            SessionState {
                worker_id: worker_id.clone(),
                last_seen: Instant::now(),
                stalls: Stalls::default(),
            },
        );
        Ok((worker_id, session))
    }

    /// Number of sessions held (live or idle but not yet forgotten).
    pub fn sessions(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Forget sessions idle past `session_idle_ttl` that hold no lease.
    pub(super) fn forget_idle_sessions(&self, g: &mut Inner, now: Instant) {
        let ttl = self.config.session_idle_ttl;
        let holding: HashSet<&str> = g.leases.values().map(|l| l.session.as_str()).collect();
        let idle: Vec<String> = g
            .sessions
            .iter()
            .filter(|(id, s)| {
                now.saturating_duration_since(s.last_seen) >= ttl && !holding.contains(id.as_str())
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in idle {
            g.sessions.remove(&id);
            g.revoked.retain(|_, owner| *owner != id);
            g.stats.sessions_expired += 1;
        }
    }

    pub fn has_session(&self, session: &str) -> bool {
        self.lock().sessions.contains_key(session)
    }

    /// Number of sessions seen within two lease TTLs.
    pub fn live_workers(&self) -> usize {
        self.live_count(&self.lock(), Instant::now())
    }

    /// Sessions heard from within two lease TTLs of `now`.
    pub(super) fn live_count(&self, g: &Inner, now: Instant) -> usize {
        let horizon = self.config.lease_ttl * 2;
        g.sessions
            .values()
            .filter(|s| now.saturating_duration_since(s.last_seen) < horizon)
            .count()
    }

    /// Worker time, for the idle fraction (`summary.json` `runtime.workers`): every live
    /// session adds the time since the last sample, and those holding a lease add it to busy
    /// time as well. The reaper samples (every TTL / 4, within [50 ms, 250 ms]), so the
    /// figures are exact to a sample period. Every sample, the first included, sets the
    /// idle-ratio gauge (0 before any worker time is measured, as `summary.json` says), so a
    /// scrape finds it however short the run.
    pub(super) fn sample_worker_time(&self, g: &mut Inner, now: Instant) {
        if let Some(last) = g.last_time_sample.replace(now) {
            self.add_worker_time(g, now, last);
        }
        metrics::gauge!(observe::WORKERS_IDLE_RATIO).set(g.stats.idle_fraction());
    }

    /// Adds the worker time since the sample at `last` (see [`Self::sample_worker_time`]).
    fn add_worker_time(&self, g: &mut Inner, now: Instant, last: Instant) {
        let ms = u64::try_from(now.saturating_duration_since(last).as_millis()).unwrap_or(u64::MAX);
        let live = self.live_count(g, now) as u64;
        let holding: HashSet<&str> = g.leases.values().map(|l| l.session.as_str()).collect();
        let busy = (holding.len() as u64).min(live);
        g.stats.worker_ms = g.stats.worker_ms.saturating_add(ms.saturating_mul(live));
        g.stats.worker_busy_ms = g
            .stats
            .worker_busy_ms
            .saturating_add(ms.saturating_mul(busy));
    }

    /// How many more jobs `session` may lease now: the work outstanding (queued, ahead and leased)
    /// split evenly among the live workers, at least [`super::SchedulerConfig::expected_workers`],
    /// less what the session holds; one when it holds nothing, so no worker idles while
    /// work is queued. A worker batching many jobs then never takes the work of its peers.
    pub(super) fn fair_share(&self, g: &Inner, session: &str, now: Instant) -> usize {
        let workers = self
            .live_count(g, now)
            .max(self.config.expected_workers)
            .max(1);
        let share = (g.queue.len() + g.ahead.len() + g.leases.len()).div_ceil(workers);
        let held = g.leases.values().filter(|l| l.session == session).count();
        if held == 0 {
            share.max(1)
        } else {
            share.saturating_sub(held)
        }
    }
}
