//! The lease table: which job is queued, which worker session holds which lease, and when a
//! lease stops being valid.
//!
//! Rank 0 is the single arbiter of results (the Spark OutputCommitCoordinator idea): a job is
//! completed by the first valid submission for a lease that is still live and held by the
//! submitting session. Everything else is refused without side effects: a repeat of an
//! accepted lease is `Duplicate`; an expired, foreign or unknown lease is `Fenced`. Expired
//! leases put their job back at the front of the queue. Lease ids are never reused, so a
//! late result can never be mistaken for the current attempt's.
//!
//! A lease ends without an answer (is revoked) for one of four causes, counted apart in the
//! metrics (`cause` of `stageb_leases_expired_total`) and in the summary: its deadline passed
//! with no heartbeat (`expired`), heartbeats kept it to its lifetime (`lifetime`, see
//! [`lifetime`]), its worker registered again (`register`), or its progress stood still too
//! long while heartbeats went on (`no_progress`: the rule by progress, see [`liveness`]: at
//! least `runner.no_progress_floor_ms`, else 8 × the worker's longest recent stall). Each is
//! fenced the same way and puts its job back at the front of the queue.
//!
//! The scheduler knows nothing about tickets: callers attach a [`JobId`] and receive
//! [`Completion`]s on a channel, in whatever order workers finish. The run loop restores a
//! deterministic order itself.
//!
//! Here: the table, leasing, heartbeats, the checklist of a submission and expiry. Beside it:
//! [`job`] (what a job asks and answers), `sessions.rs` (worker sessions), [`result_check`]
//! (an answer fits its job), [`speculation`] (second copies of stragglers), [`liveness`]
//! (revoking leases that make no progress), [`journal`]
//! (accepted answers, for `--resume`), `stats.rs` (the counters), `lease.rs` (the long-poll
//! `Lease`: which queued jobs a call takes), `ahead.rs` (jobs queued ahead of their turn: leased
//! after all others, withdrawn when their answer is no longer wanted).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use stageb_shared::observe;
use tokio::sync::{Notify, mpsc};

mod ahead;
pub mod job;
pub mod journal;
mod lease;
pub mod lifetime;
pub mod liveness;
pub mod result_check;
mod sessions;
pub mod speculation;
mod stats;

pub use job::{
    CandidateText, Completion, ControlSignal, DecodeJob, JobFailure, JobId, JobOutput, JobPayload,
    LeaseId, Provenance, REPLAY_WORKER, SubmitError, SubmitOutcome,
};
use journal::{Journal, ReplayCache, payload_digest};
use result_check::validate_output;
use sessions::SessionState;

pub use lease::Leased;
pub use lifetime::LeaseLifetime;
pub use liveness::{HeartbeatAnswer, LeaseProgress, ProgressRule};
pub use speculation::SpeculationConfig;
use speculation::{JobKind, JobTimes};
pub use stats::SchedulerStats;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub lease_ttl: Duration,
    /// Attempts a job gets when workers report errors for it (deterministic errors such as
    /// PROMPT_TOO_LONG fail at once).
    pub max_attempts: u32,
    /// Expiries a job may cause before it is failed: a job that kills every worker it lands
    /// on must not loop forever.
    pub max_expiries: u32,
    /// Largest accepted candidate text, in bytes.
    pub max_text_bytes: usize,
    /// A session not heard from for this long, and holding no lease, is forgotten (its worker
    /// registers again if it comes back).
    pub session_idle_ttl: Duration,
    /// Most sessions held at once; `Register` beyond it is refused until idle ones expire.
    pub max_sessions: usize,
    /// Straggler speculation (see [`crate::cluster::scheduler::speculation`]).
    pub speculation: SpeculationConfig,
    /// How long heartbeats may keep one lease (see [`crate::cluster::scheduler::lifetime`]).
    pub lease_lifetime: LeaseLifetime,
    /// When a lease whose progress stands still is revoked (see
    /// [`crate::cluster::scheduler::liveness`]).
    pub progress: ProgressRule,
    /// Workers the run was started with (`run --workers N`, the launcher's world size; 0 when
    /// unknown). A lease is capped at a fair share of the work among at least this many
    /// workers, so the first worker to register does not take a whole step that its peers,
    /// still loading their model, would have shared.
    pub expected_workers: usize,
}

impl SchedulerConfig {
    /// The defaults with `lease_ttl`, and a session idle TTL to match (three lease TTLs, at
    /// least a minute: long enough for a worker between two long jobs).
    pub fn with_lease_ttl(lease_ttl: Duration) -> Self {
        SchedulerConfig {
            lease_ttl,
            session_idle_ttl: (lease_ttl * 3).max(Duration::from_secs(60)),
            ..SchedulerConfig::default()
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            lease_ttl: Duration::from_secs(60),
            max_attempts: 3,
            max_expiries: 6,
            max_text_bytes: 64 * 1024,
            session_idle_ttl: Duration::from_secs(180),
            max_sessions: 16_384,
            speculation: SpeculationConfig::default(),
            lease_lifetime: LeaseLifetime::default(),
            progress: ProgressRule::default(),
            expected_workers: 0,
        }
    }
}

#[derive(Debug)]
struct JobState {
    /// What workers are sent; dropped once the job is done (a run keeps every job's state,
    /// and the prompts were most of rank 0's memory per ticket).
    payload: Option<JobPayload>,
    kind: JobKind,
    /// [`payload_digest`] of the payload, when a journal is kept.
    digest: Option<String>,
    /// Leases issued (the `attempt` number recorded with a result).
    attempts: u32,
    /// Errors reported by workers; only these count against `max_attempts`.
    errors: u32,
    /// Leases that expired; they count against `max_expiries` instead.
    expiries: u32,
    done: bool,
    /// Live leases of the job: one, or two while a straggler is speculated on.
    live: Vec<LeaseId>,
    /// A speculative copy was leased (at most one per job).
    speculated: bool,
}

impl JobState {
    fn kind(&self) -> JobKind {
        self.kind
    }

    /// The job has its answer (or failed for good): no lease will need its payload again.
    fn finish(&mut self) {
        self.done = true;
        self.payload = None;
    }
}

fn kind_of(payload: &JobPayload) -> JobKind {
    match payload {
        JobPayload::Rollout { .. } => JobKind::Rollout,
        JobPayload::Generate { .. } => JobKind::Generate,
    }
}

/// What a submission needs of its lease once it is checked.
struct LeaseFacts {
    job: JobId,
    attempt: u32,
    issued: Instant,
    speculative: bool,
}

/// Why a submission's lease may not be answered.
enum LeaseRefusal {
    /// The same session's answer was accepted already.
    Duplicate,
    /// Another session's answer was accepted, or the lease is unknown or foreign.
    Fenced,
    /// The lease was past its deadline and is expired now; these jobs failed for good.
    Expired(Vec<JobId>),
}

#[derive(Debug)]
struct LeaseState {
    job: JobId,
    session: String,
    deadline: Instant,
    attempt: u32,
    /// When the lease was issued (job latency, straggler detection).
    issued: Instant,
    /// A second copy of a straggling job.
    speculative: bool,
    /// A heartbeat could not extend the lease by a full TTL: it ends with its lifetime.
    at_lifetime: bool,
    /// Its progress as last reported (`None`: its worker reports none).
    progress: Option<liveness::Seen>,
}

/// Why a lease ends without an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Revocation {
    /// Its deadline passed (no heartbeat in time, or the end of its lifetime).
    Deadline,
    /// Its worker registered again.
    Register,
    /// Its progress stood still too long.
    NoProgress,
}

#[derive(Debug, Default)]
struct Inner {
    next_job: JobId,
    next_lease: LeaseId,
    next_worker: u64,
    queue: VecDeque<JobId>,
    /// Jobs queued ahead of their turn, leased only when `queue` is empty.
    ahead: ahead::AheadQueue,
    jobs: HashMap<JobId, JobState>,
    leases: HashMap<LeaseId, LeaseState>,
    accepted: HashMap<LeaseId, String>,
    /// Leases revoked for making no progress, with their session: its heartbeat is told.
    revoked: HashMap<LeaseId, String>,
    sessions: HashMap<String, SessionState>,
    control: Option<ControlSignal>,
    stats: SchedulerStats,
    /// Recent accepted job times, for straggler detection.
    times: JobTimes,
    /// When worker time was last sampled ([`Scheduler::sample_worker_time`]).
    last_time_sample: Option<Instant>,
}

/// The lease table. Cheap to share (`Arc`), all methods take `&self`.
pub struct Scheduler {
    config: SchedulerConfig,
    inner: Mutex<Inner>,
    work_available: Notify,
    completions: mpsc::UnboundedSender<Completion>,
    /// Where accepted answers are recorded (see [`crate::cluster::scheduler::journal`]).
    journal: Option<Journal>,
    /// Answers of an earlier attempt at this run, served instead of leasing.
    replay: ReplayCache,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> (Self, mpsc::UnboundedReceiver<Completion>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let s = Scheduler {
            config,
            inner: Mutex::new(Inner {
                next_job: 1,
                next_lease: 1,
                next_worker: 1,
                ..Default::default()
            }),
            work_available: Notify::new(),
            completions: tx,
            journal: None,
            replay: ReplayCache::default(),
        };
        (s, rx)
    }

    /// Record accepted answers in `journal`, and answer jobs found in `replay` at once.
    pub fn with_journal(mut self, journal: Journal, replay: ReplayCache) -> Self {
        self.journal = Some(journal);
        self.replay = replay;
        self
    }

    /// Makes the journal durable up to now (a no-op without one).
    pub fn sync_journal(&self) -> std::io::Result<()> {
        match &self.journal {
            Some(j) => j.sync(),
            None => Ok(()),
        }
    }

    /// The journal's size on disk (0 without one).
    pub fn journal_bytes(&self) -> u64 {
        self.journal.as_ref().map_or(0, Journal::bytes)
    }

    /// Empties the journal once a checkpoint covers every answer in it (see
    /// [`crate::run::checkpoint`]; a no-op without one).
    pub fn restart_journal(&self) -> std::io::Result<()> {
        match &self.journal {
            Some(j) => j.restart(),
            None => Ok(()),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock means a panic inside a critical section; the table is still
        // consistent (every section is short and infallible), so keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queue a job; returns its id.
    pub fn enqueue(&self, payload: JobPayload) -> JobId {
        self.enqueue_in(payload, false)
    }

    /// Queue a job at the back of the queue, or (`ahead`) of the queue of jobs ahead of their
    /// turn; returns its id.
    fn enqueue_in(&self, payload: JobPayload, ahead: bool) -> JobId {
        let digest = self.journal.as_ref().map(|_| payload_digest(&payload));
        let replayed = digest.as_deref().and_then(|d| self.replay.get(d)).cloned();
        let id = {
            let mut g = self.lock();
            let id = g.next_job;
            g.next_job += 1;
            let kind = kind_of(&payload);
            g.jobs.insert(
                id,
                JobState {
                    kind,
                    // A replayed job is done at once: nothing will be leased.
                    payload: replayed.is_none().then_some(payload),
                    digest,
                    attempts: 0,
                    errors: 0,
                    expiries: 0,
                    done: replayed.is_some(),
                    live: Vec::new(),
                    speculated: false,
                },
            );
            if replayed.is_some() {
                g.stats.replayed += 1;
            } else if ahead {
                g.ahead.push(id, kind);
            } else {
                g.queue.push_back(id);
            }
            id
        };
        match replayed {
            Some(output) => {
                let _ = self.completions.send(Completion {
                    job: id,
                    result: Ok(output),
                    provenance: Some(Provenance {
                        worker_id: REPLAY_WORKER.to_string(),
                        lease_id: 0,
                        attempt: 0,
                    }),
                });
            }
            None => self.work_available.notify_waiters(),
        }
        id
    }

    pub fn stats(&self) -> SchedulerStats {
        self.lock().stats.clone()
    }

    pub fn set_control(&self, control: ControlSignal) {
        self.lock().control = Some(control);
        self.work_available.notify_waiters();
    }

    pub fn control(&self) -> ControlSignal {
        self.lock().control.unwrap_or(ControlSignal::Continue)
    }

    /// Leases issued and not yet answered, expired or fenced: the jobs workers are running.
    pub fn in_flight(&self) -> usize {
        self.lock().leases.len()
    }

    /// The oldest straggling job `session` could take a second copy of: its only lease is held
    /// by another session and is older than the threshold of its kind, or made no progress
    /// for the shorter bound of [`liveness`] (`session` empty: any). With the job, whether
    /// only its want of progress made it one.
    fn straggler(&self, g: &Inner, session: &str, now: Instant) -> Option<(JobId, bool)> {
        let config = &self.config.speculation;
        if !config.enabled() {
            return None;
        }
        g.leases
            .values()
            .filter(|l| l.session != session)
            .filter_map(|l| {
                let job = g.jobs.get(&l.job)?;
                if job.done || job.speculated || job.live.len() != 1 {
                    return None;
                }
                let age = now.saturating_duration_since(l.issued);
                let slow = g
                    .times
                    .threshold(job.kind(), config)
                    .is_some_and(|t| age >= t);
                let stalled = !slow && self.stalled_for_copy(g, l, now);
                (slow || stalled).then_some((age, l.job, stalled))
            })
            .max()
            .map(|(_, job, stalled)| (job, stalled))
    }

    /// Extend the session's live leases; returns the ids among `lease_ids` that are no longer
    /// valid (the worker should drop that work). [`Scheduler::heartbeat_with`] without
    /// progress.
    pub fn heartbeat(
        &self,
        session: &str,
        lease_ids: &[LeaseId],
    ) -> Result<(Vec<LeaseId>, ControlSignal), SubmitError> {
        let answer = self.heartbeat_with(session, lease_ids, &[])?;
        Ok((answer.invalid, answer.control))
    }

    /// When lease `id` reaches the end of its lifetime (`None`: no such lease).
    fn lifetime_end(&self, g: &Inner, id: LeaseId) -> Option<Instant> {
        let lease = g.leases.get(&id)?;
        let kind = g.jobs.get(&lease.job)?.kind();
        let config = &self.config;
        Some(lease.issued + config.lease_lifetime.of(kind, &g.times, config.lease_ttl))
    }

    /// Accept, or refuse, the result of a lease.
    pub fn submit(
        &self,
        session: &str,
        lease_id: LeaseId,
        result: Result<JobOutput, JobFailure>,
    ) -> Result<SubmitOutcome, SubmitError> {
        let outcome = self.submit_checked(session, lease_id, result);
        if let Ok(SubmitOutcome::Fenced) = outcome {
            metrics::counter!(observe::SUBMITS_FENCED).increment(1);
        }
        outcome
    }

    /// The checklist of a submission: the session is known; the lease was not answered yet,
    /// is this session's and is live; the output fits its job. Then the lease is settled:
    /// an answer completes the job, an error retries it or fails it for good.
    fn submit_checked(
        &self,
        session: &str,
        lease_id: LeaseId,
        result: Result<JobOutput, JobFailure>,
    ) -> Result<SubmitOutcome, SubmitError> {
        let mut g = self.lock();
        let worker_id = match g.sessions.get_mut(session) {
            Some(s) => {
                s.last_seen = Instant::now();
                s.worker_id.clone()
            }
            None => return Err(SubmitError::UnknownSession),
        };
        let lease = match self.check_lease(&mut g, session, lease_id) {
            Ok(lease) => lease,
            Err(LeaseRefusal::Duplicate) => return Ok(SubmitOutcome::Duplicate),
            Err(LeaseRefusal::Fenced) => return Ok(SubmitOutcome::Fenced),
            Err(LeaseRefusal::Expired(failed)) => {
                drop(g);
                self.after_expiry(failed, true);
                return Ok(SubmitOutcome::Fenced);
            }
        };
        let job = g
            .jobs
            .get(&lease.job)
            .expect("a live lease always has its job");
        if let (Ok(output), Some(payload)) = (&result, &job.payload) {
            validate_output(payload, output, self.config.max_text_bytes)
                .map_err(SubmitError::Mismatch)?;
        }
        Self::take_lease(&mut g, session, lease_id, &lease, result.is_ok());
        let provenance = Some(Provenance {
            worker_id,
            lease_id,
            attempt: lease.attempt,
        });
        let (completion, journal_digest) = match result {
            Ok(output) => Self::settle_answer(&mut g, &lease, output, provenance),
            Err(failure) => match self.settle_failure(&mut g, lease.job, failure, provenance) {
                Some(completion) => (completion, None),
                None => {
                    drop(g);
                    self.work_available.notify_waiters();
                    return Ok(SubmitOutcome::Accepted);
                }
            },
        };
        drop(g);
        // Journaled (outside the table's lock) before the run loop can act on the answer.
        if let (Some(journal), Some(digest), Ok(output)) =
            (&self.journal, &journal_digest, &completion.result)
        {
            journal.record(digest, output);
        }
        let _ = self.completions.send(completion);
        Ok(SubmitOutcome::Accepted)
    }

    /// Whether `lease_id` may be answered by `session`: not answered yet (else a repeat of
    /// this session's answer is `Duplicate`, anyone else's `Fenced`), known, this session's
    /// and live. An expired lease not yet reaped is expired here: the deadline is the
    /// contract, not the reaper.
    fn check_lease(
        &self,
        g: &mut Inner,
        session: &str,
        lease_id: LeaseId,
    ) -> Result<LeaseFacts, LeaseRefusal> {
        if let Some(owner) = g.accepted.get(&lease_id) {
            if owner == session {
                g.stats.submits_duplicate += 1;
                return Err(LeaseRefusal::Duplicate);
            }
            g.stats.submits_fenced += 1;
            return Err(LeaseRefusal::Fenced);
        }
        let Some(lease) = g.leases.get(&lease_id).filter(|l| l.session == session) else {
            g.stats.submits_fenced += 1;
            return Err(LeaseRefusal::Fenced);
        };
        if lease.deadline <= Instant::now() {
            let mut failed = Vec::new();
            self.expire_lease(g, lease_id, Revocation::Deadline, &mut failed);
            g.stats.submits_fenced += 1;
            return Err(LeaseRefusal::Expired(failed));
        }
        Ok(LeaseFacts {
            job: lease.job,
            attempt: lease.attempt,
            issued: lease.issued,
            speculative: lease.speculative,
        })
    }

    /// The lease is answered: counted, timed, and no longer live.
    fn take_lease(g: &mut Inner, session: &str, lease_id: LeaseId, lease: &LeaseFacts, ok: bool) {
        let job = g.jobs.get_mut(&lease.job).expect("job exists");
        let kind = match job.kind() {
            JobKind::Rollout => "rollout",
            JobKind::Generate => "generate",
        };
        metrics::counter!(observe::JOBS_COMPLETED, "kind" => kind, "outcome" => if ok { "ok" } else { "error" })
            .increment(1);
        let took = lease.issued.elapsed();
        metrics::histogram!(observe::JOB_LATENCY, "kind" => kind).record(took.as_secs_f64());
        job.live.retain(|id| *id != lease_id);
        let job_kind = job.kind();
        g.leases.remove(&lease_id);
        g.accepted.insert(lease_id, session.to_string());
        if ok {
            g.times.record(job_kind, took);
        }
    }

    /// An answer completes its job (the other copy of a speculated job is fenced). Returns the
    /// completion and the digest to journal it under.
    fn settle_answer(
        g: &mut Inner,
        lease: &LeaseFacts,
        output: JobOutput,
        provenance: Option<Provenance>,
    ) -> (Completion, Option<String>) {
        let job = g.jobs.get_mut(&lease.job).expect("job exists");
        job.finish();
        let digest = job.digest.clone();
        g.stats.submits_accepted += 1;
        g.stats.speculation_wins += u64::from(lease.speculative);
        Self::fence_other_copies(g, lease.job);
        let completion = Completion {
            job: lease.job,
            result: Ok(output),
            provenance,
        };
        (completion, digest)
    }

    /// A worker's error: the job is re-queued while it has attempts left (unless the error is
    /// deterministic), `None`; else it fails for good and its completion is returned.
    fn settle_failure(
        &self,
        g: &mut Inner,
        job_id: JobId,
        failure: JobFailure,
        provenance: Option<Provenance>,
    ) -> Option<Completion> {
        g.stats.job_errors += 1;
        let deterministic = failure.code == "PROMPT_TOO_LONG" || failure.code == "INVALID_REQUEST";
        let job = g.jobs.get_mut(&job_id).expect("job exists");
        job.errors += 1;
        if !deterministic && job.errors < self.config.max_attempts {
            // The other copy of a speculated job may still answer: no re-queue.
            if job.live.is_empty() {
                tracing::warn!(job = job_id, code = %failure.code, "worker reported an error; re-queueing");
                g.queue.push_front(job_id);
            }
            return None;
        }
        job.finish();
        Self::fence_other_copies(g, job_id);
        Some(Completion {
            job: job_id,
            result: Err(failure),
            provenance,
        })
    }

    /// The job is answered: the other copy of a speculated job loses its lease, so its worker
    /// hears it is fenced (at the next heartbeat) and its late result is refused.
    fn fence_other_copies(g: &mut Inner, job_id: JobId) {
        let others = match g.jobs.get_mut(&job_id) {
            Some(job) => std::mem::take(&mut job.live),
            None => return,
        };
        for id in others {
            g.leases.remove(&id);
            g.stats.leases_fenced_by_speculation += 1;
        }
    }

    /// Expire leases past their deadline: fence their ids and re-queue their jobs at the front.
    /// Also forgets idle sessions. Returns how many leases expired. Called periodically by the
    /// server; `submit` and `heartbeat` check deadlines themselves.
    pub fn reap_expired(&self) -> usize {
        let mut failed = Vec::new();
        let n = {
            let mut g = self.lock();
            let now = Instant::now();
            let mut expired: Vec<LeaseId> = g
                .leases
                .iter()
                .filter(|(_, l)| l.deadline <= now)
                .map(|(id, _)| *id)
                .collect();
            // Highest id first, each pushed to the front: the oldest lease's job leads.
            expired.sort_unstable_by(|a, b| b.cmp(a));
            for id in &expired {
                self.expire_lease(&mut g, *id, Revocation::Deadline, &mut failed);
            }
            let stalled = self.revoke_stalled(&mut g, now, None, &mut failed);
            self.forget_idle_sessions(&mut g, now);
            self.sample_worker_time(&mut g, now);
            metrics::gauge!(observe::QUEUE_DEPTH).set(g.queue.len() as f64);
            metrics::gauge!(observe::JOBS_IN_FLIGHT).set(g.leases.len() as f64);
            let live = self.live_count(&g, now);
            metrics::gauge!(observe::LIVE_WORKERS).set(live as f64);
            // Stragglers appear with time, not with an enqueue: wake the idle `Lease` calls
            // when one has (they would otherwise sleep through it until new work arrives).
            if g.queue.is_empty() && self.straggler(&g, "", now).is_some() {
                self.work_available.notify_waiters();
            }
            expired.len() + stalled
        };
        self.after_expiry(failed, n > 0);
        n
    }

    /// Remove lease `id` as expired (for `why`): its job goes back to the front of the queue,
    /// or fails (into `failed`) once it has expired `max_expiries` times.
    fn expire_lease(&self, g: &mut Inner, id: LeaseId, why: Revocation, failed: &mut Vec<JobId>) {
        let Some(lease) = g.leases.remove(&id) else {
            return;
        };
        g.stats.leases_expired += 1;
        let cause = match why {
            Revocation::Deadline if lease.at_lifetime => {
                g.stats.leases_past_lifetime += 1;
                tracing::warn!(lease = id, job = lease.job, session = %lease.session, "lease reached its lifetime: heartbeats alone do not keep a job");
                "lifetime"
            }
            Revocation::Deadline => "expired",
            Revocation::Register => "register",
            Revocation::NoProgress => {
                g.stats.leases_revoked_no_progress += 1;
                "no_progress"
            }
        };
        metrics::counter!(observe::LEASES_EXPIRED, "cause" => cause).increment(1);
        let Some(job) = g.jobs.get_mut(&lease.job) else {
            return;
        };
        job.live.retain(|l| *l != id);
        if job.done || !job.live.is_empty() {
            // The other copy of a speculated job is still running it.
            return;
        }
        job.expiries += 1;
        if job.expiries >= self.config.max_expiries {
            job.finish();
            failed.push(lease.job);
        } else {
            tracing::warn!(
                lease = id,
                job = lease.job,
                "lease expired; re-queueing its job"
            );
            g.queue.push_front(lease.job);
        }
    }

    /// Report the jobs that failed by expiry and wake lease waiters (outside the lock).
    fn after_expiry(&self, failed: Vec<JobId>, requeued: bool) {
        for job in failed {
            let _ = self.completions.send(Completion {
                job,
                result: Err(JobFailure {
                    code: "LEASE_EXPIRED".into(),
                    message:
                        "the job's lease expired too many times (workers lost while running it)"
                            .into(),
                }),
                provenance: None,
            });
        }
        if requeued {
            self.work_available.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests;
