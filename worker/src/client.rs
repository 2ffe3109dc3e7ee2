//! The worker loop: register with rank 0, pull jobs, run them on the engine, hand results
//! back, and keep leases alive with heartbeats.
//!
//! The worker owns no state that matters: everything it needs arrives in a lease and
//! everything it returns is validated by rank 0. If the coordinator forgets the session (it
//! restarted, or this worker was paused past its lease TTL), the worker registers again and
//! carries on, naming its old session so rank 0 fences that session's leases at once.
//!
//! Rank 0's word arrives with every lease and heartbeat: `DRAIN` (it is shutting down: finish
//! the job in hand, take nothing new, leave), `STOP` (the run is over: leave now), and the
//! leases it fenced (another worker has the job: abandon it at the next decode step) or revoked
//! (the job made no progress: the engine looks hung). How a worker ended ([`WorkerEnd`])
//! decides its exit code. Dialing (endpoint, TLS, the connect loop) is the child `dial.rs`;
//! the heartbeat task, which reports each lease's progress, `heartbeat.rs`; the job metrics
//! `metrics.rs`; what a caller may set beyond the options (keepalive, an observer of the
//! calls: the load generator runs this loop with a simulated engine) `hooks.rs`.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageb_shared::auth::{AUTH_HEADER, AuthToken};
use stageb_shared::pb;
use stageb_shared::tls::ClientTls;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use crate::engine::{CancelFlag, Engine, EngineError, Job};
use crate::job_codec::{job_from_pb, result_to_pb};
use crate::pace::Pace;
use crate::runner::{self, Incoming, Outgoing, ProgressCount};
use dial::connect;
use heartbeat::spawn_heartbeat;
pub use hooks::{CallObserver, ClientHooks, DEFAULT_KEEPALIVE};
use metrics::record_job_metrics;

mod dial;
mod heartbeat;
mod hooks;
mod metrics;

/// How a worker reaches its coordinator.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// `host:port`, `http://host:port` or `https://host:port`.
    pub coordinator: String,
    pub token: Option<AuthToken>,
    /// TLS (and the client certificate under mutual TLS); `None` dials plaintext.
    pub tls: Option<ClientTls>,
    /// Human-readable name for logs (`host:pid:rank`).
    pub name: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// Run id to join; empty joins whatever run the coordinator serves.
    pub run_id: String,
    /// How long to keep trying to reach the coordinator before the first registration (rank 0
    /// may still be loading or queued by the scheduler).
    pub connect_timeout: Duration,
    /// How long to keep trying once registered and the coordinator went away: rank 0 is gone
    /// (crashed, preempted, or done), so a worker must give its GPU back soon rather than hold
    /// the allocation for the whole first-contact window.
    pub reconnect_timeout: Duration,
    /// How many jobs the worker holds at once.
    pub limits: JobLimits,
}

/// How many jobs a worker holds at once (leased and not yet submitted): they run in one
/// continuous batch on an engine that batches, one after another otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobLimits {
    /// The most jobs in hand.
    pub max_jobs: usize,
    /// KV-cache bytes the jobs in hand may take together (an upper bound per job, see
    /// `job_kv_bound`): no job is leased past it, except one when nothing is in hand. `None`:
    /// the engine's default for its device ([`Engine::default_kv_budget`]).
    pub kv_cache_bytes: Option<u64>,
}

impl Default for JobLimits {
    fn default() -> Self {
        JobLimits {
            max_jobs: DEFAULT_MAX_JOBS,
            kv_cache_bytes: None,
        }
    }
}

/// Default [`JobLimits::max_jobs`]: the CPU's (`stageb_shared::config::DeviceKind::defaults`,
/// the one table of defaults by device; the CLI takes the placed device's).
pub const DEFAULT_MAX_JOBS: usize =
    stageb_shared::config::DeviceKind::Cpu.defaults().max_jobs as usize;
pub use crate::engine::DEFAULT_KV_CACHE_BYTES;

/// Default [`WorkerOptions::reconnect_timeout`].
pub const DEFAULT_RECONNECT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("invalid coordinator address `{0}`")]
    BadAddress(String),
    #[error("cannot reach the coordinator at {addr} after {waited:?}: {last}")]
    Unreachable {
        addr: String,
        waited: Duration,
        last: String,
    },
    #[error("the coordinator refused this worker: {0}")]
    Refused(String),
    #[error("TLS setup for {addr} failed: {reason}")]
    Tls { addr: String, reason: String },
}

/// What a worker did, for its exit log, and why it stopped.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WorkerSummary {
    pub jobs_done: u64,
    pub jobs_failed: u64,
    /// Jobs abandoned mid-run: their lease was fenced, or the run ended under them.
    pub jobs_cancelled: u64,
    /// Leases rank 0 revoked because their job made no progress (the engine looked hung).
    pub leases_revoked: u64,
    pub registrations: u64,
    pub end: WorkerEnd,
}

#[derive(Clone)]
struct BearerInterceptor(Option<String>);

impl tonic::service::Interceptor for BearerInterceptor {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            let value = v
                .parse()
                .map_err(|_| Status::internal("token is not a valid header value"))?;
            request.metadata_mut().insert(AUTH_HEADER, value);
        }
        Ok(request)
    }
}

type Client = pb::coordinator_client::CoordinatorClient<
    tonic::service::interceptor::InterceptedService<Channel, BearerInterceptor>,
>;

struct Session {
    id: String,
    worker_id: String,
    heartbeat: Duration,
    /// Rank 0's lease TTL (zero from a coordinator that does not say).
    lease_ttl: Duration,
    /// The run's context in tokens (0 from a coordinator that does not say).
    max_context: u32,
}

/// Register with rank 0; `previous_session` (empty at first) lets it fence the old
/// session's leases at once.
async fn register(
    client: &mut Client,
    opts: &WorkerOptions,
    fingerprint: &str,
    max_context: u32,
    previous_session: &str,
) -> Result<Session, Status> {
    let resp = client
        .register(pb::RegisterRequest {
            run_id: opts.run_id.clone(),
            previous_session: previous_session.to_string(),
            worker: Some(pb::WorkerInfo {
                name: opts.name.clone(),
                device: opts.device.clone(),
                model_fingerprint: fingerprint.to_string(),
                capacity: 1,
                version: env!("CARGO_PKG_VERSION").to_string(),
                max_context,
            }),
        })
        .await?
        .into_inner();
    Ok(Session {
        id: resp.session,
        worker_id: resp.worker_id,
        heartbeat: Duration::from_millis(resp.heartbeat_interval_ms.max(100) as u64),
        lease_ttl: Duration::from_millis(resp.lease_ttl_ms.into()),
        max_context: resp.max_context,
    })
}

/// Why a worker's loop ended.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum WorkerEnd {
    /// Rank 0 said the run is over (heartbeat or lease `CONTROL_STOP`).
    #[default]
    RunOver,
    /// Rank 0 is draining (it was interrupted): this worker finished what it held and left.
    /// The run is not over; a resumed rank 0 will want workers again.
    Drained,
    /// This worker's own shutdown signal (SIGTERM/SIGINT): it finished the job in hand first.
    Interrupted,
}

/// How one session ended.
enum SessionEnd {
    Finished(WorkerEnd),
    /// The coordinator forgot the session or a call failed: register again.
    Lost,
}

/// One lease in hand: its job's cancel flag, and its progress where the engine batches.
struct Held {
    cancel: CancelFlag,
    progress: Option<ProgressCount>,
}

/// What the job loop and the heartbeat task of one session share.
struct SessionShared {
    /// Leases in hand, reported with every heartbeat.
    held: Mutex<BTreeMap<u64, Held>>,
    /// Jobs finished by this worker: the progress counter rank 0 sees with every heartbeat.
    finished: AtomicU64,
    /// The strongest control rank 0 sent in a heartbeat: 0 continue, 1 drain, 2 stop.
    directive: AtomicU8,
    /// Leases rank 0 revoked for making no progress, this session.
    revoked: AtomicU64,
    /// A lease was revoked for making no progress and the engine has given no job back since:
    /// lease nothing new.
    stuck: AtomicBool,
    observer: Arc<dyn CallObserver>,
}

impl SessionShared {
    fn held(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn note_control(&self, control: pb::Control) {
        let level = match control {
            pb::Control::Continue => 0,
            pb::Control::Drain => 1,
            pb::Control::Stop => 2,
        };
        self.directive.fetch_max(level, Ordering::Relaxed);
    }

    /// The end rank 0 asked for, if it asked.
    fn asked_end(&self) -> Option<WorkerEnd> {
        match self.directive.load(Ordering::Relaxed) {
            0 => None,
            1 => Some(WorkerEnd::Drained),
            _ => Some(WorkerEnd::RunOver),
        }
    }
}

/// Pull and run jobs until the coordinator says stop or drain, `shutdown` resolves (the job in
/// hand is finished and submitted first), or the coordinator stays unreachable past the
/// connect window.
pub async fn run_worker<E: Engine + 'static>(
    engine: E,
    opts: WorkerOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<WorkerSummary, WorkerError> {
    run_worker_with(engine, opts, ClientHooks::default(), shutdown).await
}

/// [`run_worker`] with `hooks`: its keepalive, and its observer told of every call.
pub async fn run_worker_with<E: Engine + 'static>(
    engine: E,
    opts: WorkerOptions,
    hooks: ClientHooks,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<WorkerSummary, WorkerError> {
    let fingerprint = engine.fingerprint().id();
    let max_context = engine.max_context();
    let engine = Arc::new(Mutex::new(engine));
    let mut summary = WorkerSummary::default();
    let mut previous_session = String::new();
    tokio::pin!(shutdown);
    // When this attempt to reach rank 0 began (reset once registered): connecting and
    // registering share one window, so a port that accepts connections but never lets this
    // worker register (a plaintext worker at a TLS port) ends it too.
    let mut reach: Option<Instant> = None;
    let mut last_note: Option<Instant> = None;
    loop {
        let window = if summary.registrations == 0 {
            opts.connect_timeout
        } else {
            opts.reconnect_timeout
        };
        let started = *reach.get_or_insert_with(Instant::now);
        let mut client = tokio::select! {
            c = connect(&opts, hooks.keepalive, started, window) => c?,
            _ = &mut shutdown => {
                summary.end = WorkerEnd::Interrupted;
                return Ok(summary);
            }
        };
        let registered = register(
            &mut client,
            &opts,
            &fingerprint,
            max_context,
            &previous_session,
        )
        .await;
        let session = match registered {
            Ok(s) => s,
            Err(status)
                if matches!(
                    status.code(),
                    Code::Unavailable | Code::Unknown | Code::Cancelled
                ) =>
            {
                let last = register_failure(&opts, &status);
                if started.elapsed() >= window {
                    return Err(WorkerError::Unreachable {
                        addr: opts.coordinator.clone(),
                        waited: started.elapsed(),
                        last,
                    });
                }
                if last_note.is_none_or(|t| t.elapsed() >= REGISTER_NOTE_EVERY) {
                    tracing::info!(coordinator = %opts.coordinator, "cannot register yet, retrying for up to {window:?}: {last}");
                    last_note = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            // Rank 0's session table is full: wait for idle sessions to expire.
            Err(status) if status.code() == Code::ResourceExhausted => {
                tracing::warn!("the coordinator is at its session cap; retrying");
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
            Err(status) => return Err(WorkerError::Refused(status.message().to_string())),
        };
        summary.registrations += 1;
        hooks.observer.registered();
        reach = None;
        last_note = None;
        previous_session = session.id.clone();
        if session.max_context > 0 {
            engine
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .limit_context(session.max_context);
        }
        tracing::info!(worker_id = %session.worker_id, context = session.max_context, "registered with the coordinator");
        let ended = serve_session(
            &client,
            &session,
            &engine,
            &opts,
            &hooks,
            &mut summary,
            &mut shutdown,
        )
        .await;
        match ended {
            SessionEnd::Finished(end) => {
                summary.end = end;
                return Ok(summary);
            }
            SessionEnd::Lost => {
                hooks.observer.session_lost();
                tracing::info!("session lost; reconnecting");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Least time between two "cannot register yet" lines.
const REGISTER_NOTE_EVERY: Duration = Duration::from_secs(10);

/// Why a `Register` that reached a socket failed, with a hint where the cause is likely a
/// transport mismatch (this worker dials plaintext, the port may serve TLS).
fn register_failure(opts: &WorkerOptions, status: &Status) -> String {
    let mut why = format!("{:?}: {}", status.code(), status.message());
    if opts.tls.is_none() {
        why.push_str(" (this worker dials without TLS: if the coordinator serves TLS or mutual TLS, pass --tls-ca, and --tls-cert/--tls-key for mutual TLS)");
    }
    why
}

/// The jobs a session holds: what the engine thread runs, and the KV bytes each one takes.
struct InHand {
    to_engine: Option<std::sync::mpsc::Sender<Incoming>>,
    kv: BTreeMap<u64, u64>,
    /// The engine's KV bytes per position and positions per block.
    per_position: u64,
    block: u64,
    /// How many jobs finish within the lease TTL at this worker's pace.
    pace: Pace,
    /// The engine batches: the engine thread counts each job's progress, the heartbeat
    /// reports it.
    counts_steps: bool,
}

impl InHand {
    fn count(&self) -> usize {
        self.kv.len()
    }

    fn kv_bytes(&self) -> u64 {
        self.kv.values().sum()
    }
}

/// Lease, run and submit jobs under one session until it ends. Up to `opts.max_jobs` jobs are
/// held at once, within `opts.kv_cache_bytes`; each result is submitted as its job ends. A
/// session that ends with jobs in hand cancels them (lost) or finishes them first (drained,
/// interrupted, stopped after the engine noticed).
async fn serve_session<E: Engine + 'static, F: Future<Output = ()>>(
    client: &Client,
    session: &Session,
    engine: &Arc<Mutex<E>>,
    opts: &WorkerOptions,
    hooks: &ClientHooks,
    summary: &mut WorkerSummary,
    shutdown: &mut std::pin::Pin<&mut F>,
) -> SessionEnd {
    let mut client = client.clone();
    let shared = Arc::new(SessionShared {
        held: Mutex::default(),
        finished: AtomicU64::new(summary.jobs_done + summary.jobs_failed),
        directive: AtomicU8::new(0),
        revoked: AtomicU64::new(0),
        stuck: AtomicBool::new(false),
        observer: hooks.observer.clone(),
    });
    let heartbeat = spawn_heartbeat(client.clone(), session, shared.clone());
    let (to_engine, inbox) = std::sync::mpsc::channel();
    let (outbox, mut from_engine) = tokio::sync::mpsc::unbounded_channel();
    // An engine that runs one job at a time holds one: a queue here would keep jobs from
    // idle workers.
    let KvSetup {
        per_position,
        block,
        batches,
        budget,
        max_jobs,
    } = kv_setup(engine, opts);
    let eng = engine.clone();
    let thread = tokio::task::spawn_blocking(move || runner::run_engine(eng, inbox, outbox));
    let mut hand = InHand {
        to_engine: Some(to_engine),
        kv: BTreeMap::new(),
        per_position,
        block,
        pace: Pace::new(session.lease_ttl),
        counts_steps: batches,
    };
    let mut ending: Option<SessionEnd> = None;
    let mut interrupted = false;
    loop {
        if ending.is_none() {
            ending = shared.asked_end().map(SessionEnd::Finished);
        }
        while let Ok(out) = from_engine.try_recv() {
            finish_job(&mut client, session, out, &mut hand, summary, &shared).await;
        }
        if ending.is_some() && hand.count() == 0 {
            break;
        }
        let limit = max_jobs.min(hand.pace.limit());
        let room = hand.count() < limit
            && (hand.count() == 0 || hand.kv_bytes() < budget)
            && !shared.stuck.load(Ordering::Relaxed);
        if ending.is_none() && room {
            let lease = pb::LeaseRequest {
                session: session.id.clone(),
                max_jobs: (limit - hand.count()) as u32,
                // Long-poll only with nothing in hand: results must not wait for the lease.
                wait_ms: if hand.count() == 0 { 5_000 } else { 0 },
            };
            let asked = Instant::now();
            let response = tokio::select! {
                r = client.lease(lease) => r,
                _ = shutdown.as_mut(), if !interrupted => {
                    interrupted = true;
                    ending = Some(SessionEnd::Finished(WorkerEnd::Interrupted));
                    continue;
                }
            };
            match response {
                Ok(r) => {
                    let r = r.into_inner();
                    let waited = Duration::from_micros(r.waited_for_work_us);
                    shared
                        .observer
                        .leased(asked.elapsed(), r.jobs.len(), waited);
                    shared.note_control(
                        pb::Control::try_from(r.control).unwrap_or(pb::Control::Continue),
                    );
                    let took_some = !r.jobs.is_empty();
                    hand_over(r.jobs, &mut hand, &shared, budget);
                    shared.observer.holding(hand.count());
                    if took_some || hand.count() == 0 {
                        continue;
                    }
                }
                Err(status) => {
                    if status.code() != Code::Unauthenticated {
                        tracing::warn!(code = ?status.code(), "lease failed: {}", status.message());
                    }
                    // The session is gone: its jobs' results could not be submitted.
                    shared.held().values().for_each(|h| h.cancel.cancel());
                    ending = Some(SessionEnd::Lost);
                    continue;
                }
            }
        }
        // Jobs in hand and no room (or nothing to lease): wait for one to end.
        tokio::select! {
            out = from_engine.recv() => match out {
                Some(out) => finish_job(&mut client, session, out, &mut hand, summary, &shared).await,
                None => break,
            },
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = shutdown.as_mut(), if !interrupted => {
                interrupted = true;
                ending = Some(SessionEnd::Finished(WorkerEnd::Interrupted));
            }
        }
    }
    hand.to_engine = None;
    let _ = thread.await;
    heartbeat.abort();
    summary.leases_revoked += shared.revoked.load(Ordering::Relaxed);
    ending.unwrap_or(SessionEnd::Lost)
}

/// The engine's KV facts for a session.
struct KvSetup {
    /// KV bytes per position.
    per_position: u64,
    /// Positions per KV block (at least 1).
    block: u64,
    /// Whether the engine runs several jobs in one batch.
    batches: bool,
    /// The KV-cache budget the jobs in hand share, in bytes.
    budget: u64,
    /// The most jobs in hand: `--max-jobs` on an engine that batches, else one.
    max_jobs: usize,
}

/// The engine's KV facts for a session, its budget set (`--kv-cache-mib`, else the device's
/// default).
fn kv_setup<E: Engine>(engine: &Mutex<E>, opts: &WorkerOptions) -> KvSetup {
    let mut e = engine.lock().unwrap_or_else(|e| e.into_inner());
    let budget = e.use_kv_budget(opts.limits.kv_cache_bytes);
    let given = opts.limits.kv_cache_bytes.is_some();
    tracing::debug!(budget, given, "KV-cache budget");
    let batches = e.batches();
    KvSetup {
        per_position: e.kv_bytes_per_position(),
        block: e.kv_block_positions().max(1),
        batches,
        budget,
        max_jobs: if batches {
            opts.limits.max_jobs.max(1)
        } else {
            1
        },
    }
}

/// Hands leased jobs to the engine thread, each under its lease id with its own cancel flag.
fn hand_over(jobs: Vec<pb::Job>, hand: &mut InHand, shared: &SessionShared, budget: u64) {
    if !jobs.is_empty() {
        hand.pace.busy(Instant::now());
    }
    for job in jobs {
        let Some(kind) = job.kind else { continue };
        let cancel = CancelFlag::default();
        let progress = ProgressCount::default();
        let held = Held {
            cancel: cancel.clone(),
            progress: hand.counts_steps.then(|| progress.clone()),
        };
        shared.held().insert(job.lease_id, held);
        let job_or_refusal = job_from_pb(kind);
        let kv = job_or_refusal
            .as_ref()
            .map_or(0, |j| job_kv_bound(j, hand.per_position, hand.block));
        if hand.count() > 0 && hand.kv_bytes() + kv > budget {
            tracing::debug!(
                lease = job.lease_id,
                kv,
                "job over the KV budget: runs after others end"
            );
        }
        hand.kv.insert(job.lease_id, kv);
        tracing::debug!(lease = job.lease_id, "job leased");
        let sent = hand.to_engine.as_ref().is_some_and(|tx| {
            tx.send(Incoming {
                key: job.lease_id,
                job: job_or_refusal,
                cancel,
                progress,
            })
            .is_ok()
        });
        if !sent {
            tracing::warn!(lease = job.lease_id, "the engine thread is gone");
        }
    }
}

/// A job ended: metrics, then its result submitted (a cancelled job's is not).
async fn finish_job(
    client: &mut Client,
    session: &Session,
    out: Outgoing,
    hand: &mut InHand,
    summary: &mut WorkerSummary,
    shared: &SessionShared,
) {
    let Some(kv) = hand.kv.remove(&out.key) else {
        return;
    };
    // The engine gave a job back: it is not hung (any more).
    shared.stuck.store(false, Ordering::Relaxed);
    let cancelled = matches!(out.result, Err(EngineError::Cancelled));
    if cancelled {
        hand.pace.job_dropped(hand.count());
    } else {
        hand.pace.job_ended(Instant::now(), hand.count());
    }
    let result = result_to_pb(out.result);
    record_job_metrics(
        &result,
        out.took,
        kv + hand.kv_bytes(),
        out.prefix_bytes,
        hand.count() + 1,
    );
    if cancelled {
        shared.held().remove(&out.key);
        summary.jobs_cancelled += 1;
        shared.observer.cancelled();
        tracing::info!(
            lease = out.key,
            "job cancelled before it finished; not submitted"
        );
        return;
    }
    submit(client, session, out.key, result, summary, shared).await;
}

/// An upper bound of the KV bytes `job` takes at its peak, without tokenizing (the engine
/// thread holds the tokenizer): a byte-level tokenizer makes at most one token per byte, and
/// a chat template adds a few per message; the prompt and each row take whole blocks of
/// `block` positions.
fn job_kv_bound(job: &Job, per_position: u64, block: u64) -> u64 {
    let (messages, rows, max_new) = match job {
        Job::Rollout(r) => (
            &r.messages,
            r.decodes.iter().map(|d| d.seeds.len() as u64).sum(),
            r.decodes
                .iter()
                .map(|d| d.max_new_tokens as u64)
                .max()
                .unwrap_or(0),
        ),
        Job::Generate(g) => (&g.messages, 1, g.max_new_tokens as u64),
    };
    let prompt: u64 = messages.iter().map(|m| m.content.len() as u64 + 16).sum();
    per_position * block * (prompt.div_ceil(block) + rows * max_new.div_ceil(block))
}

/// Hand one result back and count it.
async fn submit(
    client: &mut Client,
    session: &Session,
    lease_id: u64,
    result: pb::submit_request::Result,
    summary: &mut WorkerSummary,
    shared: &SessionShared,
) {
    let failed = matches!(result, pb::submit_request::Result::Error(_));
    let asked = Instant::now();
    let answer = client
        .submit(pb::SubmitRequest {
            session: session.id.clone(),
            lease_id,
            result: Some(result),
        })
        .await;
    shared.held().remove(&lease_id);
    match answer {
        Ok(r) => {
            let status = pb::SubmitStatus::try_from(r.into_inner().status)
                .unwrap_or(pb::SubmitStatus::Unspecified);
            shared.observer.submitted(asked.elapsed(), status);
            if status == pb::SubmitStatus::Fenced {
                tracing::warn!(lease = lease_id, "result fenced: the lease had expired");
            }
            if failed {
                summary.jobs_failed += 1
            } else {
                summary.jobs_done += 1
            }
            shared.finished.fetch_add(1, Ordering::Relaxed);
        }
        Err(status) => tracing::warn!(lease = lease_id, "submit failed: {}", status.message()),
    }
}
