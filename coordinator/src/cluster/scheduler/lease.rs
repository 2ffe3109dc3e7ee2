//! Handing out work: the long-poll `Lease` takes up to the session's fair share of the queued
//! jobs (the ordinary queue first, then the jobs queued ahead of their turn, then a second copy
//! of a straggler), waiting for work when there is none, and says how long it waited.

use std::time::{Duration, Instant};

use stageb_shared::observe;

use super::{ControlSignal, Inner, JobId, JobPayload, LeaseId, LeaseState, Scheduler, SubmitError};

/// What one lease call got.
#[derive(Debug)]
pub struct Leased {
    pub jobs: Vec<(LeaseId, JobPayload)>,
    pub control: ControlSignal,
    /// How long the call was held waiting for work it could take: zero when it found some at
    /// once, so a worker (or a benchmark) can tell idle time from the cost of the call itself.
    pub waited_for_work: Duration,
}

impl Scheduler {
    /// Take up to `max_jobs` queued jobs for `session`, waiting up to `wait` for one to appear.
    /// A session takes no more than its [`fair share`](Self::fair_share) of the work.
    pub async fn lease(
        &self,
        session: &str,
        max_jobs: usize,
        wait: Duration,
    ) -> Result<(Vec<(LeaseId, JobPayload)>, ControlSignal), SubmitError> {
        let leased = self.lease_timed(session, max_jobs, wait).await?;
        Ok((leased.jobs, leased.control))
    }

    /// [`Scheduler::lease`], also saying how long the call was held waiting for work.
    pub async fn lease_timed(
        &self,
        session: &str,
        max_jobs: usize,
        wait: Duration,
    ) -> Result<Leased, SubmitError> {
        let started = Instant::now();
        let deadline = started + wait;
        // Set once the call has found nothing it may take and waits for work.
        let mut waited = false;
        let leased = |jobs, control, waited: bool| Leased {
            jobs,
            control,
            waited_for_work: if waited {
                started.elapsed()
            } else {
                Duration::ZERO
            },
        };
        loop {
            // Register interest before checking, so an enqueue between the check and the
            // wait is not missed.
            let notified = self.work_available.notified();
            {
                let mut g = self.lock();
                let now = Instant::now();
                match g.sessions.get_mut(session) {
                    Some(s) => s.last_seen = now,
                    None => return Err(SubmitError::UnknownSession),
                }
                let control = g.control.unwrap_or(ControlSignal::Continue);
                if control != ControlSignal::Continue {
                    return Ok(leased(Vec::new(), control, waited));
                }
                let mut out = Vec::new();
                let take = max_jobs.max(1).min(self.fair_share(&g, session, now));
                while out.len() < take {
                    let Some(job_id) = g.queue.pop_front().or_else(|| g.ahead.pop_front()) else {
                        break;
                    };
                    if let Some(leased) = self.issue_lease(&mut g, job_id, session, now, false) {
                        out.push(leased);
                    }
                }
                if out.is_empty()
                    && let Some((job_id, stalled)) = self.straggler(&g, session, now)
                    && let Some(leased) = self.issue_lease(&mut g, job_id, session, now, true)
                {
                    g.stats.speculative_leases += 1;
                    g.stats.speculative_leases_no_progress += u64::from(stalled);
                    tracing::info!(
                        job = job_id,
                        lease = leased.0,
                        no_progress = stalled,
                        "straggler: leasing a second copy"
                    );
                    out.push(leased);
                }
                if !out.is_empty() {
                    metrics::counter!(observe::LEASES_ISSUED).increment(out.len() as u64);
                    metrics::histogram!(observe::LEASE_WAIT)
                        .record((wait - deadline.saturating_duration_since(now)).as_secs_f64());
                    return Ok(leased(out, ControlSignal::Continue, waited));
                }
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Ok(leased(Vec::new(), self.control(), waited));
            }
            waited = true;
            let _ = tokio::time::timeout(remaining, notified).await;
        }
    }

    /// Lease `job_id` to `session` (`None` when the job is already done).
    fn issue_lease(
        &self,
        g: &mut Inner,
        job_id: JobId,
        session: &str,
        now: Instant,
        speculative: bool,
    ) -> Option<(LeaseId, JobPayload)> {
        let lease_id = g.next_lease;
        let job = g.jobs.get_mut(&job_id).filter(|j| !j.done)?;
        let payload = job.payload.clone()?;
        job.attempts += 1;
        job.live.push(lease_id);
        job.speculated |= speculative;
        let attempt = job.attempts;
        g.next_lease += 1;
        g.leases.insert(
            lease_id,
            LeaseState {
                job: job_id,
                session: session.to_string(),
                deadline: now + self.config.lease_ttl,
                attempt,
                issued: now,
                speculative,
                at_lifetime: false,
                progress: None,
            },
        );
        g.stats.leases_issued += 1;
        Some((lease_id, payload))
    }
}
