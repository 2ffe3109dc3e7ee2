//! Liveness by progress: a heartbeat proves the worker's process is up, not that its engine
//! still computes. A worker whose engine can tell it reports each lease's progress (forward
//! steps, and where its engine says them, tokens decoded, rows finished and prompt tokens
//! prefilled) with every heartbeat; rank 0 remembers when each lease's progress last moved:
//! when any of its counters grew (a long prefill moves its prompt count alone). A worker that
//! reports steps only (an older one) is judged by its steps.
//!
//! The rule ([`ProgressRule`]):
//! - A lease whose progress has not moved for `multiple` × the longest stall its worker showed
//!   recently (the time between two moves of one lease's progress, over its last
//!   [`STALL_WINDOW`] moves) is revoked. Never sooner than `floor`, nor than two heartbeats
//!   (progress is only seen at heartbeats). Before the worker's pace is known, the bound is
//!   the floor. Defaults: 8 stalls, at least 2 minutes.
//! - Revoking is expiring: the lease is fenced (its id is never honoured again, a late result
//!   is `Fenced`), its job goes back to the front of the queue (and counts against
//!   `max_expiries`), and the worker hears it in its next heartbeat answer, as fenced and as
//!   revoked.
//! - An idle worker may take a second copy of a lease whose progress stood still for half
//!   that bound, before any job was timed (straggler speculation's trigger by progress; see
//!   [`super::speculation`]).
//! - A lease whose worker never reported its progress (an engine that runs one job to its end
//!   in one call, an older worker) is kept by heartbeats alone, up to its lifetime
//!   ([`super::lifetime`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{ControlSignal, Inner, JobId, LeaseId, LeaseState, Revocation, Scheduler, SubmitError};

/// Stalls per session the bound is taken over.
pub const STALL_WINDOW: usize = 16;

/// When a lease that makes no progress is revoked (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgressRule {
    /// The bound is this many of the worker's longest recent stalls; 0 turns the rule off.
    pub multiple: u32,
    /// …never less than this, and all of it before the worker's pace is known.
    pub floor: Duration,
    /// The workers' heartbeat period: the bound is never below two of them.
    pub heartbeat: Duration,
}

impl Default for ProgressRule {
    /// Eight stalls, at least two minutes: a forward step of a large model on a CPU takes
    /// seconds, a hung one never ends.
    fn default() -> Self {
        ProgressRule {
            multiple: 8,
            floor: Duration::from_secs(120),
            heartbeat: Duration::from_secs(5),
        }
    }
}

impl ProgressRule {
    pub const OFF: ProgressRule = ProgressRule {
        multiple: 0,
        floor: Duration::ZERO,
        heartbeat: Duration::ZERO,
    };

    pub fn enabled(&self) -> bool {
        self.multiple > 0
    }

    /// How long a lease of a worker whose longest recent stall is `longest` may make no
    /// progress before it is revoked (`None`: the rule is off).
    pub fn revoke_after(&self, longest: Option<Duration>) -> Option<Duration> {
        if !self.enabled() {
            return None;
        }
        let paced = longest.map_or(Duration::ZERO, |s| s * self.multiple);
        Some(paced.max(self.floor).max(self.heartbeat * 2))
    }

    /// How long such a lease may make no progress before an idle worker may take a copy.
    pub fn speculate_after(&self, longest: Option<Duration>) -> Option<Duration> {
        self.revoke_after(longest).map(|d| d / 2)
    }
}

/// A session's recent stalls: the time between two moves of one lease's progress.
#[derive(Debug, Default)]
pub(super) struct Stalls {
    recent: VecDeque<Duration>,
}

impl Stalls {
    fn record(&mut self, stall: Duration) {
        if self.recent.len() == STALL_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(stall);
    }

    /// The longest recent stall (`None` before the first).
    pub(super) fn longest(&self) -> Option<Duration> {
        self.recent.iter().max().copied()
    }
}

/// One lease's progress as a worker reports it: counters that only grow while its job runs.
/// A worker that does not count one leaves it at 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseProgress {
    /// Forward steps the job has been through.
    pub steps: u64,
    /// Tokens its rows decoded, all rows together.
    pub tokens: u64,
    /// Its rows that ended.
    pub rows_finished: u32,
    /// Prompt tokens in its KV cache (prefilled or reused).
    pub prompt_done: u32,
}

impl LeaseProgress {
    /// Steps alone, as an older worker reports them.
    pub fn steps(steps: u64) -> Self {
        LeaseProgress {
            steps,
            ..Self::default()
        }
    }

    /// Whether any counter is past the same counter of `than`.
    fn beyond(&self, than: &LeaseProgress) -> bool {
        self.steps > than.steps
            || self.tokens > than.tokens
            || self.rows_finished > than.rows_finished
            || self.prompt_done > than.prompt_done
    }

    /// Each counter's highest of the two: a count that went backwards is not taken back.
    fn highest(&self, other: &LeaseProgress) -> LeaseProgress {
        LeaseProgress {
            steps: self.steps.max(other.steps),
            tokens: self.tokens.max(other.tokens),
            rows_finished: self.rows_finished.max(other.rows_finished),
            prompt_done: self.prompt_done.max(other.prompt_done),
        }
    }
}

/// One lease's progress as rank 0 last saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
    /// The highest of each counter reported so far.
    counts: LeaseProgress,
    /// When a counter last grew (the lease's issue time while none has).
    moved_at: Instant,
}

/// What a heartbeat gets back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatAnswer {
    /// The listed leases that are no longer valid: the worker drops their work.
    pub invalid: Vec<LeaseId>,
    /// The part of `invalid` revoked for making no progress.
    pub revoked: Vec<LeaseId>,
    pub control: ControlSignal,
}

impl Scheduler {
    /// Extend the session's live leases after noting their `progress` (lease id, counters);
    /// revoke those of its leases whose progress stood still too long. A lease past its
    /// deadline is never revived.
    pub fn heartbeat_with(
        &self,
        session: &str,
        lease_ids: &[LeaseId],
        progress: &[(LeaseId, LeaseProgress)],
    ) -> Result<HeartbeatAnswer, SubmitError> {
        let mut g = self.lock();
        let now = Instant::now();
        match g.sessions.get_mut(session) {
            Some(s) => s.last_seen = now,
            None => return Err(SubmitError::UnknownSession),
        }
        for &(id, counts) in progress {
            Self::note_progress(&mut g, session, id, counts, now);
        }
        let mut failed = Vec::new();
        let revoked_now = self.revoke_stalled(&mut g, now, Some((session, lease_ids)), &mut failed);
        let ttl = self.config.lease_ttl;
        let mut invalid = Vec::new();
        for id in lease_ids {
            let end = self.lifetime_end(&g, *id);
            match g.leases.get_mut(id) {
                // A heartbeat never revives a lease past its deadline (that job may already
                // be promised to the next worker), nor extends it past its lifetime.
                Some(l) if l.session == session && l.deadline > now => {
                    l.deadline = (now + ttl).min(end.unwrap_or(now + ttl));
                    l.at_lifetime |= l.deadline < now + ttl;
                }
                Some(l) if l.session == session => {
                    self.expire_lease(&mut g, *id, Revocation::Deadline, &mut failed);
                    invalid.push(*id);
                }
                _ => invalid.push(*id),
            }
        }
        let revoked: Vec<LeaseId> = invalid
            .iter()
            .copied()
            .filter(|id| g.revoked.get(id).is_some_and(|s| s == session))
            .collect();
        // The session is told while it lists the lease; once it has dropped the lease, the
        // note goes (the map would otherwise grow with every revocation of a long run).
        g.revoked
            .retain(|id, owner| owner != session || lease_ids.contains(id));
        let control = g.control.unwrap_or(ControlSignal::Continue);
        drop(g);
        self.after_expiry(failed, !invalid.is_empty() || revoked_now > 0);
        Ok(HeartbeatAnswer {
            invalid,
            revoked,
            control,
        })
    }

    /// Lease `id` of `session` showed `counts` at `now`: when any counter grew, the stall
    /// since the last move is timed for the session's pace.
    fn note_progress(
        g: &mut Inner,
        session: &str,
        id: LeaseId,
        counts: LeaseProgress,
        now: Instant,
    ) {
        let Some(lease) = g.leases.get_mut(&id).filter(|l| l.session == session) else {
            return;
        };
        let stall = match lease.progress {
            None => {
                let moved = counts.beyond(&LeaseProgress::default());
                lease.progress = Some(Seen {
                    counts,
                    moved_at: if moved { now } else { lease.issued },
                });
                moved.then(|| now.saturating_duration_since(lease.issued))
            }
            Some(seen) if counts.beyond(&seen.counts) => {
                lease.progress = Some(Seen {
                    counts: counts.highest(&seen.counts),
                    moved_at: now,
                });
                Some(now.saturating_duration_since(seen.moved_at))
            }
            // Standing still, or counts going backwards (a worker's claim): nothing moved.
            Some(_) => None,
        };
        if let (Some(stall), Some(s)) = (stall, g.sessions.get_mut(session)) {
            s.stalls.record(stall);
        }
    }

    /// How long `lease` has made no progress, and its bound (`None`: its worker reports no
    /// progress, or the rule is off). `speculate`: the shorter bound of a second copy.
    fn stall_of(
        &self,
        g: &Inner,
        lease: &LeaseState,
        now: Instant,
        speculate: bool,
    ) -> Option<(Duration, Duration)> {
        let seen = lease.progress?;
        let longest = g
            .sessions
            .get(&lease.session)
            .and_then(|s| s.stalls.longest());
        let rule = &self.config.progress;
        let bound = if speculate {
            rule.speculate_after(longest)?
        } else {
            rule.revoke_after(longest)?
        };
        Some((now.saturating_duration_since(seen.moved_at), bound))
    }

    /// Whether an idle worker may take a second copy of `lease` for want of progress.
    pub(super) fn stalled_for_copy(&self, g: &Inner, lease: &LeaseState, now: Instant) -> bool {
        self.stall_of(g, lease, now, true)
            .is_some_and(|(stalled, bound)| stalled >= bound)
    }

    /// Revoke the leases (those a heartbeat of a session lists, or all: the periodic sweep)
    /// whose progress stood still past their bound; returns how many. Their jobs go back to the
    /// front of the queue, or fail into `failed`. A heartbeat looks only at its own leases, not
    /// the whole table: the sweep covers the rest.
    pub(super) fn revoke_stalled(
        &self,
        g: &mut Inner,
        now: Instant,
        listed: Option<(&str, &[LeaseId])>,
        failed: &mut Vec<JobId>,
    ) -> usize {
        if !self.config.progress.enabled() {
            return 0;
        }
        let is_stalled = |l: &LeaseState| {
            self.stall_of(g, l, now, false)
                .is_some_and(|(stalled, bound)| stalled >= bound)
        };
        let mut stalled: Vec<LeaseId> = match listed {
            Some((session, ids)) => ids
                .iter()
                .copied()
                .filter(|id| {
                    g.leases
                        .get(id)
                        .is_some_and(|l| l.session == session && is_stalled(l))
                })
                .collect(),
            None => g
                .leases
                .iter()
                .filter(|(_, l)| is_stalled(l))
                .map(|(id, _)| *id)
                .collect(),
        };
        // Highest id first, each pushed to the front: the oldest lease's job leads.
        stalled.sort_unstable_by(|a, b| b.cmp(a));
        stalled.dedup();
        for id in &stalled {
            if let Some(l) = g.leases.get(id) {
                tracing::warn!(lease = id, job = l.job, session = %l.session, "lease made no progress for too long: revoked, its job leased again");
                let owner = l.session.clone();
                g.revoked.insert(*id, owner);
            }
            self.expire_lease(g, *id, Revocation::NoProgress, failed);
        }
        stalled.len()
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
impl Scheduler {
    /// How many revocations are still waiting to be told to their session.
    pub(crate) fn revoked_notes(&self) -> usize {
        self.lock().revoked.len()
    }
}
