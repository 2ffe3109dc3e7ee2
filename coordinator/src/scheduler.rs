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
//! The scheduler knows nothing about tickets: callers attach a [`JobId`] and receive
//! [`Completion`]s on a channel, in whatever order workers finish. The run loop restores a
//! deterministic order itself.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use stageb_shared::domain::ChatMessage;
use tokio::sync::{Notify, mpsc};

use crate::journal::{Journal, ReplayCache, payload_digest};

pub type JobId = u64;
pub type LeaseId = u64;

/// The `worker_id` in the provenance of an answer replayed from the journal.
pub const REPLAY_WORKER: &str = "journal-replay";

/// How one group of candidates is decoded, with one seed per sample.
pub use stageb_shared::domain::DecodeGroup as DecodeJob;

/// Serialized (externally tagged) only to digest it: see [`crate::journal::payload_digest`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum JobPayload {
    Rollout {
        messages: Vec<ChatMessage>,
        decodes: Vec<DecodeJob>,
        constrained: bool,
    },
    Generate {
        messages: Vec<ChatMessage>,
        json_schema: Option<String>,
        seed: u64,
        temperature: f32,
        top_p: f32,
        repetition_penalty: f32,
        max_new_tokens: u32,
    },
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CandidateText {
    pub decode_index: u32,
    pub sample_index: u32,
    pub seed: u64,
    pub text: String,
    pub completion_tokens: u32,
    pub finish_reason: String,
}

/// Serialized as a job journal row's `output` (`kind`: `rollout` | `generate`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum JobOutput {
    Rollout {
        candidates: Vec<CandidateText>,
        prompt_tokens: u32,
        prefill_us: u64,
        decode_us: u64,
    },
    Generate {
        text: String,
        prompt_tokens: u32,
        completion_tokens: u32,
        finish_reason: String,
        latency_us: u64,
    },
}

/// A job that could not be run (after retries where retrying makes sense).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFailure {
    pub code: String,
    pub message: String,
}

/// Who produced a result: runtime provenance, excluded from determinism comparisons.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    pub worker_id: String,
    pub lease_id: LeaseId,
    pub attempt: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub job: JobId,
    pub result: Result<JobOutput, JobFailure>,
    pub provenance: Option<Provenance>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitOutcome {
    Accepted,
    Duplicate,
    Fenced,
}

/// What a worker is told to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlSignal {
    Continue,
    Drain,
    Stop,
}

/// Why a submission's content was refused (the lease stays valid only if nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("unknown session")]
    UnknownSession,
    #[error("result does not match the job: {0}")]
    Mismatch(String),
}

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
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            lease_ttl: Duration::from_secs(60),
            max_attempts: 3,
            max_expiries: 6,
            max_text_bytes: 64 * 1024,
        }
    }
}

#[derive(Debug)]
struct JobState {
    payload: JobPayload,
    /// [`payload_digest`] of the payload, when a journal is kept.
    digest: Option<String>,
    /// Leases issued (the `attempt` number recorded with a result).
    attempts: u32,
    /// Errors reported by workers; only these count against `max_attempts`.
    errors: u32,
    /// Leases that expired; they count against `max_expiries` instead.
    expiries: u32,
    done: bool,
}

#[derive(Debug)]
struct LeaseState {
    job: JobId,
    session: String,
    deadline: Instant,
    attempt: u32,
}

#[derive(Debug)]
struct SessionState {
    worker_id: String,
    last_seen: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    next_job: JobId,
    next_lease: LeaseId,
    next_worker: u64,
    queue: VecDeque<JobId>,
    jobs: HashMap<JobId, JobState>,
    leases: HashMap<LeaseId, LeaseState>,
    accepted: HashMap<LeaseId, String>,
    sessions: HashMap<String, SessionState>,
    control: Option<ControlSignal>,
    stats: SchedulerStats,
}

/// Counters for progress reporting and the run summary.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SchedulerStats {
    pub leases_issued: u64,
    pub leases_expired: u64,
    pub submits_accepted: u64,
    pub submits_duplicate: u64,
    pub submits_fenced: u64,
    pub job_errors: u64,
    /// Jobs answered from the journal of an earlier attempt (`--resume`), never leased.
    pub replayed: u64,
}

/// The lease table. Cheap to share (`Arc`), all methods take `&self`.
pub struct Scheduler {
    config: SchedulerConfig,
    inner: Mutex<Inner>,
    work_available: Notify,
    completions: mpsc::UnboundedSender<Completion>,
    /// Where accepted answers are recorded (see [`crate::journal`]).
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
        let digest = self.journal.as_ref().map(|_| payload_digest(&payload));
        let replayed = digest.as_deref().and_then(|d| self.replay.get(d)).cloned();
        let id = {
            let mut g = self.lock();
            let id = g.next_job;
            g.next_job += 1;
            g.jobs.insert(
                id,
                JobState {
                    payload,
                    digest,
                    attempts: 0,
                    errors: 0,
                    expiries: 0,
                    done: replayed.is_some(),
                },
            );
            if replayed.is_some() {
                g.stats.replayed += 1;
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

    /// A new session for a worker. Returns (worker id, session secret).
    pub fn register(&self, name: &str) -> (String, String) {
        tracing::debug!(name, "new worker session");
        let mut g = self.lock();
        let worker_id = format!("w{}", g.next_worker);
        g.next_worker += 1;
        let session = uuid::Uuid::new_v4().simple().to_string();
        g.sessions.insert(
            session.clone(),
            SessionState {
                worker_id: worker_id.clone(),
                last_seen: Instant::now(),
            },
        );
        (worker_id, session)
    }

    pub fn has_session(&self, session: &str) -> bool {
        self.lock().sessions.contains_key(session)
    }

    /// Number of sessions seen within two lease TTLs.
    pub fn live_workers(&self) -> usize {
        let g = self.lock();
        let horizon = self.config.lease_ttl * 2;
        g.sessions
            .values()
            .filter(|s| s.last_seen.elapsed() < horizon)
            .count()
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

    /// Take up to `max_jobs` queued jobs for `session`, waiting up to `wait` for one to appear.
    pub async fn lease(
        &self,
        session: &str,
        max_jobs: usize,
        wait: Duration,
    ) -> Result<(Vec<(LeaseId, JobPayload)>, ControlSignal), SubmitError> {
        let deadline = Instant::now() + wait;
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
                    return Ok((Vec::new(), control));
                }
                let mut out = Vec::new();
                while out.len() < max_jobs.max(1) {
                    let Some(job_id) = g.queue.pop_front() else {
                        break;
                    };
                    let lease_id = g.next_lease;
                    g.next_lease += 1;
                    let (payload, attempt) = match g.jobs.get_mut(&job_id) {
                        Some(j) if !j.done => {
                            j.attempts += 1;
                            (j.payload.clone(), j.attempts)
                        }
                        _ => continue,
                    };
                    g.leases.insert(
                        lease_id,
                        LeaseState {
                            job: job_id,
                            session: session.to_string(),
                            deadline: now + self.config.lease_ttl,
                            attempt,
                        },
                    );
                    g.stats.leases_issued += 1;
                    out.push((lease_id, payload));
                }
                if !out.is_empty() {
                    return Ok((out, ControlSignal::Continue));
                }
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Ok((Vec::new(), self.control()));
            }
            let _ = tokio::time::timeout(remaining, notified).await;
        }
    }

    /// Extend the session's live leases; returns the ids among `lease_ids` that are no longer
    /// valid (the worker should drop that work).
    pub fn heartbeat(
        &self,
        session: &str,
        lease_ids: &[LeaseId],
    ) -> Result<(Vec<LeaseId>, ControlSignal), SubmitError> {
        let mut g = self.lock();
        let now = Instant::now();
        match g.sessions.get_mut(session) {
            Some(s) => s.last_seen = now,
            None => return Err(SubmitError::UnknownSession),
        }
        let ttl = self.config.lease_ttl;
        let mut invalid = Vec::new();
        for id in lease_ids {
            match g.leases.get_mut(id) {
                Some(l) if l.session == session => l.deadline = now + ttl,
                _ => invalid.push(*id),
            }
        }
        let control = g.control.unwrap_or(ControlSignal::Continue);
        Ok((invalid, control))
    }

    /// Accept, or refuse, the result of a lease.
    pub fn submit(
        &self,
        session: &str,
        lease_id: LeaseId,
        result: Result<JobOutput, JobFailure>,
    ) -> Result<SubmitOutcome, SubmitError> {
        let mut journal_digest = None;
        let completion = {
            let mut g = self.lock();
            let worker_id = match g.sessions.get_mut(session) {
                Some(s) => {
                    s.last_seen = Instant::now();
                    s.worker_id.clone()
                }
                None => return Err(SubmitError::UnknownSession),
            };
            if let Some(owner) = g.accepted.get(&lease_id) {
                if owner == session {
                    g.stats.submits_duplicate += 1;
                    return Ok(SubmitOutcome::Duplicate);
                }
                g.stats.submits_fenced += 1;
                return Ok(SubmitOutcome::Fenced);
            }
            let Some(lease) = g.leases.get(&lease_id) else {
                g.stats.submits_fenced += 1;
                return Ok(SubmitOutcome::Fenced);
            };
            if lease.session != session {
                g.stats.submits_fenced += 1;
                return Ok(SubmitOutcome::Fenced);
            }
            let job_id = lease.job;
            let attempt = lease.attempt;
            let job = g
                .jobs
                .get(&job_id)
                .expect("a live lease always has its job");
            if let Ok(output) = &result {
                validate_output(&job.payload, output, self.config.max_text_bytes)
                    .map_err(SubmitError::Mismatch)?;
            }
            g.leases.remove(&lease_id);
            g.accepted.insert(lease_id, session.to_string());
            let provenance = Some(Provenance {
                worker_id,
                lease_id,
                attempt,
            });
            match result {
                Ok(output) => {
                    let job = g.jobs.get_mut(&job_id).expect("job exists");
                    job.done = true;
                    journal_digest = job.digest.clone();
                    g.stats.submits_accepted += 1;
                    Completion {
                        job: job_id,
                        result: Ok(output),
                        provenance,
                    }
                }
                Err(failure) => {
                    g.stats.job_errors += 1;
                    let deterministic =
                        failure.code == "PROMPT_TOO_LONG" || failure.code == "INVALID_REQUEST";
                    let job = g.jobs.get_mut(&job_id).expect("job exists");
                    job.errors += 1;
                    if !deterministic && job.errors < self.config.max_attempts {
                        tracing::warn!(job = job_id, code = %failure.code, "worker reported an error; re-queueing");
                        g.queue.push_front(job_id);
                        drop(g);
                        self.work_available.notify_waiters();
                        return Ok(SubmitOutcome::Accepted);
                    }
                    job.done = true;
                    Completion {
                        job: job_id,
                        result: Err(failure),
                        provenance,
                    }
                }
            }
        };
        // Journaled (outside the table's lock) before the run loop can act on the answer.
        if let (Some(journal), Some(digest), Ok(output)) =
            (&self.journal, &journal_digest, &completion.result)
        {
            journal.record(digest, output);
        }
        let _ = self.completions.send(completion);
        Ok(SubmitOutcome::Accepted)
    }

    /// Expire leases past their deadline: fence their ids and re-queue their jobs at the front.
    /// Returns how many expired. Called periodically by the server.
    pub fn reap_expired(&self) -> usize {
        let mut failed = Vec::new();
        let n = {
            let mut g = self.lock();
            let now = Instant::now();
            let expired: Vec<LeaseId> = g
                .leases
                .iter()
                .filter(|(_, l)| l.deadline <= now)
                .map(|(id, _)| *id)
                .collect();
            let mut expired_sorted = expired.clone();
            expired_sorted.sort_unstable();
            for id in expired_sorted.iter().rev() {
                let lease = g.leases.remove(id).expect("listed above");
                g.stats.leases_expired += 1;
                let max_expiries = self.config.max_expiries;
                let job = g.jobs.get_mut(&lease.job).expect("a lease's job exists");
                job.expiries += 1;
                if job.expiries >= max_expiries {
                    job.done = true;
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
            expired.len()
        };
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
        if n > 0 {
            self.work_available.notify_waiters();
        }
        n
    }
}

/// Rank 0 trusts nothing a worker says about identity or shape: a rollout must return exactly
/// one candidate per requested (decode, sample) with the seed it was given.
fn validate_output(
    payload: &JobPayload,
    output: &JobOutput,
    max_text_bytes: usize,
) -> Result<(), String> {
    match (payload, output) {
        (JobPayload::Rollout { decodes, .. }, JobOutput::Rollout { candidates, .. }) => {
            let expected: usize = decodes.iter().map(|d| d.seeds.len()).sum();
            if candidates.len() != expected {
                return Err(format!(
                    "expected {expected} candidates, got {}",
                    candidates.len()
                ));
            }
            let mut seen = HashSet::new();
            for c in candidates {
                let decode = decodes
                    .iter()
                    .find(|d| d.decode_index == c.decode_index)
                    .ok_or_else(|| format!("unknown decode index {}", c.decode_index))?;
                let seed = decode
                    .seeds
                    .get(c.sample_index as usize)
                    .ok_or_else(|| format!("unknown sample index {}", c.sample_index))?;
                if *seed != c.seed {
                    return Err(format!(
                        "candidate ({}, {}) has the wrong seed",
                        c.decode_index, c.sample_index
                    ));
                }
                if !seen.insert((c.decode_index, c.sample_index)) {
                    return Err(format!(
                        "candidate ({}, {}) returned twice",
                        c.decode_index, c.sample_index
                    ));
                }
                if c.text.len() > max_text_bytes {
                    return Err(format!(
                        "candidate text of {} bytes exceeds {max_text_bytes}",
                        c.text.len()
                    ));
                }
            }
            Ok(())
        }
        (JobPayload::Generate { .. }, JobOutput::Generate { text, .. }) => {
            if text.len() > max_text_bytes * 4 {
                return Err(format!(
                    "generated text of {} bytes is too long",
                    text.len()
                ));
            }
            Ok(())
        }
        _ => Err("result kind does not match the job kind".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rollout_job(seeds: Vec<u64>) -> JobPayload {
        JobPayload::Rollout {
            messages: vec![ChatMessage::user("x")],
            decodes: vec![DecodeJob {
                decode_index: 0,
                temperature: 0.7,
                top_p: 0.9,
                repetition_penalty: 1.0,
                max_new_tokens: 8,
                seeds,
            }],
            constrained: true,
        }
    }

    fn output_for(seeds: &[u64]) -> JobOutput {
        JobOutput::Rollout {
            candidates: seeds
                .iter()
                .enumerate()
                .map(|(i, s)| CandidateText {
                    decode_index: 0,
                    sample_index: i as u32,
                    seed: *s,
                    text: "Verdict: 通过\nReason: ok".into(),
                    completion_tokens: 5,
                    finish_reason: "stop".into(),
                })
                .collect(),
            prompt_tokens: 10,
            prefill_us: 1,
            decode_us: 1,
        }
    }

    fn scheduler(ttl_ms: u64) -> (Scheduler, mpsc::UnboundedReceiver<Completion>) {
        Scheduler::new(SchedulerConfig {
            lease_ttl: Duration::from_millis(ttl_ms),
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn first_valid_submit_wins_and_a_repeat_is_a_duplicate() {
        let (s, mut rx) = scheduler(10_000);
        let job = s.enqueue(rollout_job(vec![1, 2]));
        let (_, session) = s.register("a");
        let (leases, _) = s.lease(&session, 1, Duration::ZERO).await.unwrap();
        let lease = leases[0].0;
        assert_eq!(
            s.submit(&session, lease, Ok(output_for(&[1, 2]))).unwrap(),
            SubmitOutcome::Accepted
        );
        assert_eq!(
            s.submit(&session, lease, Ok(output_for(&[1, 2]))).unwrap(),
            SubmitOutcome::Duplicate
        );
        let c = rx.try_recv().unwrap();
        assert_eq!(c.job, job);
        assert!(
            rx.try_recv().is_err(),
            "a duplicate must not produce a second completion"
        );
    }

    #[tokio::test]
    async fn a_lease_held_by_another_session_is_fenced_and_not_completed() {
        let (s, mut rx) = scheduler(10_000);
        s.enqueue(rollout_job(vec![1]));
        let (_, holder) = s.register("holder");
        let (_, thief) = s.register("thief");
        let (leases, _) = s.lease(&holder, 1, Duration::ZERO).await.unwrap();
        assert_eq!(
            s.submit(&thief, leases[0].0, Ok(output_for(&[1]))).unwrap(),
            SubmitOutcome::Fenced
        );
        assert_eq!(
            s.submit(&thief, 999, Ok(output_for(&[1]))).unwrap(),
            SubmitOutcome::Fenced
        );
        assert!(rx.try_recv().is_err());
        assert_eq!(
            s.submit(&holder, leases[0].0, Ok(output_for(&[1])))
                .unwrap(),
            SubmitOutcome::Accepted
        );
    }

    #[tokio::test]
    async fn an_expired_lease_is_fenced_and_its_job_re_leased() {
        let (s, mut rx) = scheduler(20);
        s.enqueue(rollout_job(vec![1]));
        let (_, dead) = s.register("dead");
        let (_, alive) = s.register("alive");
        let (first, _) = s.lease(&dead, 1, Duration::ZERO).await.unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(s.reap_expired(), 1);
        let (second, _) = s.lease(&alive, 1, Duration::ZERO).await.unwrap();
        assert_eq!(second.len(), 1);
        assert_ne!(first[0].0, second[0].0, "lease ids are never reused");
        // The late result of the dead worker is refused; the live one completes the job once.
        assert_eq!(
            s.submit(&dead, first[0].0, Ok(output_for(&[1]))).unwrap(),
            SubmitOutcome::Fenced
        );
        assert_eq!(
            s.submit(&alive, second[0].0, Ok(output_for(&[1]))).unwrap(),
            SubmitOutcome::Accepted
        );
        let c = rx.try_recv().unwrap();
        assert_eq!(c.provenance.unwrap().attempt, 2);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn heartbeats_keep_a_lease_alive() {
        let (s, _rx) = scheduler(60);
        s.enqueue(rollout_job(vec![1]));
        let (_, w) = s.register("w");
        let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(30)).await;
            let (invalid, _) = s.heartbeat(&w, &[leases[0].0]).unwrap();
            assert!(invalid.is_empty());
            assert_eq!(s.reap_expired(), 0);
        }
    }

    #[tokio::test]
    async fn a_result_with_the_wrong_shape_is_refused_and_the_lease_stays() {
        let (s, mut rx) = scheduler(10_000);
        s.enqueue(rollout_job(vec![1, 2]));
        let (_, w) = s.register("w");
        let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
        assert!(matches!(
            s.submit(&w, leases[0].0, Ok(output_for(&[1]))),
            Err(SubmitError::Mismatch(_))
        ));
        assert!(matches!(
            s.submit(&w, leases[0].0, Ok(output_for(&[1, 3]))),
            Err(SubmitError::Mismatch(_))
        ));
        assert!(rx.try_recv().is_err());
        assert_eq!(
            s.submit(&w, leases[0].0, Ok(output_for(&[1, 2]))).unwrap(),
            SubmitOutcome::Accepted
        );
    }

    #[tokio::test]
    async fn unknown_sessions_are_refused() {
        let (s, _rx) = scheduler(10_000);
        assert!(matches!(
            s.lease("nope", 1, Duration::ZERO).await,
            Err(SubmitError::UnknownSession)
        ));
        assert!(matches!(
            s.heartbeat("nope", &[]),
            Err(SubmitError::UnknownSession)
        ));
    }

    #[tokio::test]
    async fn worker_errors_are_retried_then_reported() {
        let (s, mut rx) = scheduler(10_000);
        s.enqueue(rollout_job(vec![1]));
        let (_, w) = s.register("w");
        for _ in 0..3 {
            let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
            let err = JobFailure {
                code: "ENGINE_ERROR".into(),
                message: "boom".into(),
            };
            assert_eq!(
                s.submit(&w, leases[0].0, Err(err)).unwrap(),
                SubmitOutcome::Accepted
            );
        }
        let c = rx.try_recv().unwrap();
        assert_eq!(c.result.unwrap_err().code, "ENGINE_ERROR");
        let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
        assert!(leases.is_empty());
    }
}
