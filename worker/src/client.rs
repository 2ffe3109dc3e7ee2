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
//! leases it fenced (another worker has the job: abandon it at the next decode step). How a
//! worker ended ([`WorkerEnd`]) decides its exit code.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageb_shared::auth::{AUTH_HEADER, AuthToken};
use stageb_shared::domain::ChatMessage;
use stageb_shared::observe;
use stageb_shared::pb;
use stageb_shared::tls::ClientTls;
use stageb_shared::wire::MAX_CANDIDATES_PER_JOB;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

use crate::engine::{CancelFlag, DecodeRequest, Engine, GenerateRequest, RolloutRequest};

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
}

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

fn endpoint_url(addr: &str, tls: bool) -> String {
    if addr.starts_with("http://") || addr.starts_with("https://") {
        addr.to_string()
    } else if tls {
        format!("https://{addr}")
    } else {
        format!("http://{addr}")
    }
}

/// The endpoint for `opts`: plaintext, or TLS verified against the configured CA.
fn endpoint(opts: &WorkerOptions) -> Result<Endpoint, WorkerError> {
    let url = endpoint_url(&opts.coordinator, opts.tls.is_some());
    let mut endpoint = Endpoint::from_shared(url)
        .map_err(|_| WorkerError::BadAddress(opts.coordinator.clone()))?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(20));
    let host = endpoint.uri().host().unwrap_or("localhost").to_string();
    match &opts.tls {
        Some(tls) => {
            if endpoint.uri().scheme_str() == Some("http") {
                return Err(WorkerError::Tls {
                    addr: opts.coordinator.clone(),
                    reason: "an http:// address with TLS configured (use https:// or host:port)"
                        .into(),
                });
            }
            endpoint = endpoint
                .tls_config(tls.config(&host))
                .map_err(|e| WorkerError::Tls {
                    addr: opts.coordinator.clone(),
                    reason: e.to_string(),
                })?;
        }
        None => {
            let loopback = host == "localhost"
                || host
                    .trim_matches(|c| c == '[' || c == ']')
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback && opts.token.is_some() {
                tracing::warn!(
                    coordinator = %opts.coordinator,
                    "dialing without TLS: the token crosses the network in clear text (pass --tls-ca)"
                );
            }
        }
    }
    Ok(endpoint)
}

async fn connect(opts: &WorkerOptions, window: Duration) -> Result<Client, WorkerError> {
    let endpoint = endpoint(opts)?;
    let start = Instant::now();
    let mut backoff = Duration::from_millis(100);
    loop {
        match endpoint.connect().await {
            Ok(channel) => {
                let interceptor = BearerInterceptor(opts.token.as_ref().map(AuthToken::bearer));
                return Ok(pb::coordinator_client::CoordinatorClient::with_interceptor(
                    channel,
                    interceptor,
                )
                .max_decoding_message_size(8 * 1024 * 1024)
                .max_encoding_message_size(8 * 1024 * 1024));
            }
            Err(e) => {
                if start.elapsed() >= window {
                    return Err(WorkerError::Unreachable {
                        addr: opts.coordinator.clone(),
                        waited: start.elapsed(),
                        last: e.to_string(),
                    });
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

struct Session {
    id: String,
    worker_id: String,
    heartbeat: Duration,
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
        max_context: resp.max_context,
    })
}

fn messages(ms: Vec<pb::ChatMessage>) -> Vec<ChatMessage> {
    ms.into_iter()
        .map(|m| ChatMessage {
            role: m.role,
            content: m.content,
        })
        .collect()
}

/// Run one job on the engine (on a blocking thread) and encode its result.
async fn run_job<E: Engine + 'static>(
    engine: &Arc<Mutex<E>>,
    kind: pb::job::Kind,
) -> pb::submit_request::Result {
    let engine = engine.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let mut engine = engine.lock().unwrap_or_else(|e| e.into_inner());
        match kind {
            pb::job::Kind::Rollout(job) => {
                let asked: usize = job.decodes.iter().map(|d| d.seeds.len()).sum();
                if asked > MAX_CANDIDATES_PER_JOB {
                    // Refused before the engine allocates a row per candidate (issue 26, item 5).
                    return pb::submit_request::Result::Error(pb::JobError {
                        code: "INVALID_REQUEST".into(),
                        message: format!(
                            "a rollout job asks for {asked} candidates; a worker decodes at most {MAX_CANDIDATES_PER_JOB} per job"
                        ),
                    });
                }
                let request = RolloutRequest {
                    messages: messages(job.messages),
                    decodes: job.decodes.into_iter().map(DecodeRequest::from).collect(),
                    constrained: job.constrained,
                };
                match engine.rollout(&request) {
                    Ok(out) => pb::submit_request::Result::Rollout(pb::RolloutResult {
                        candidates: out
                            .candidates
                            .into_iter()
                            .map(|c| pb::Candidate {
                                decode_index: c.decode_index,
                                sample_index: c.sample_index,
                                seed: c.seed,
                                text: c.text,
                                completion_tokens: c.completion_tokens,
                                finish_reason: c.finish.as_str().to_string(),
                            })
                            .collect(),
                        prompt_tokens: out.prompt_tokens,
                        prefix_tokens: out.prefix_tokens,
                        prefill_us: out.prefill_us,
                        decode_us: out.decode_us,
                    }),
                    Err(e) => pb::submit_request::Result::Error(pb::JobError {
                        code: e.code().into(),
                        message: e.to_string(),
                    }),
                }
            }
            pb::job::Kind::Generate(job) => {
                let json_schema = if job.json_schema.is_empty() {
                    None
                } else {
                    match serde_json::from_str(&job.json_schema) {
                        Ok(v) => Some(v),
                        Err(e) => {
                            return pb::submit_request::Result::Error(pb::JobError {
                                code: "INVALID_REQUEST".into(),
                                message: format!("json_schema is not JSON: {e}"),
                            });
                        }
                    }
                };
                let request = GenerateRequest {
                    messages: messages(job.messages),
                    json_schema,
                    seed: job.seed,
                    temperature: job.temperature,
                    top_p: job.top_p,
                    repetition_penalty: job.repetition_penalty,
                    max_new_tokens: job.max_new_tokens,
                };
                match engine.generate(&request) {
                    Ok(out) => pb::submit_request::Result::Generate(pb::GenerateResult {
                        text: out.text,
                        prompt_tokens: out.prompt_tokens,
                        completion_tokens: out.completion_tokens,
                        finish_reason: out.finish.as_str().to_string(),
                        latency_us: out.latency_us,
                    }),
                    Err(e) => pb::submit_request::Result::Error(pb::JobError {
                        code: e.code().into(),
                        message: e.to_string(),
                    }),
                }
            }
        }
    })
    .await;
    joined.unwrap_or_else(|e| {
        pb::submit_request::Result::Error(pb::JobError {
            code: "ENGINE_ERROR".into(),
            message: format!("engine panicked: {e}"),
        })
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

/// What the job loop and the heartbeat task of one session share.
struct SessionShared {
    /// Leases in hand, reported with every heartbeat.
    held: Mutex<BTreeSet<u64>>,
    /// Jobs finished by this worker: the progress counter rank 0 sees with every heartbeat.
    finished: AtomicU64,
    /// The strongest control rank 0 sent in a heartbeat: 0 continue, 1 drain, 2 stop.
    directive: AtomicU8,
}

impl SessionShared {
    fn held(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
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
    mut engine: E,
    opts: WorkerOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<WorkerSummary, WorkerError> {
    let fingerprint = engine.fingerprint().id();
    let max_context = engine.max_context();
    let cancel = CancelFlag::default();
    engine.set_cancel(cancel.clone());
    let engine = Arc::new(Mutex::new(engine));
    let mut summary = WorkerSummary::default();
    let mut previous_session = String::new();
    tokio::pin!(shutdown);
    loop {
        let window = if summary.registrations == 0 {
            opts.connect_timeout
        } else {
            opts.reconnect_timeout
        };
        let mut client = tokio::select! {
            c = connect(&opts, window) => c?,
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
            &cancel,
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
                tracing::info!("session lost; reconnecting");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Heartbeats beside the job loop: they keep the leases in hand alive, and carry rank 0's
/// word back: a fenced lease cancels its job at the next decode step, `STOP` cancels whatever
/// runs, `DRAIN` lets it finish.
fn spawn_heartbeat(
    mut client: Client,
    session: &Session,
    shared: Arc<SessionShared>,
    cancel: CancelFlag,
) -> tokio::task::JoinHandle<()> {
    let session_id = session.id.clone();
    let every = session.heartbeat;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let lease_ids: Vec<u64> = shared.held().iter().copied().collect();
            let response = client
                .heartbeat(pb::HeartbeatRequest {
                    session: session_id.clone(),
                    lease_ids,
                    jobs_done: shared.finished.load(Ordering::Relaxed),
                })
                .await;
            let Ok(response) = response.map(|r| r.into_inner()) else {
                continue;
            };
            let control = pb::Control::try_from(response.control).unwrap_or(pb::Control::Continue);
            shared.note_control(control);
            let fenced_in_hand = {
                let held = shared.held();
                response.fenced_lease_ids.iter().any(|id| held.contains(id))
            };
            if fenced_in_hand {
                tracing::warn!(fenced = ?response.fenced_lease_ids, "rank 0 fenced a lease in hand: abandoning its job");
                cancel.cancel();
            } else if control == pb::Control::Stop {
                cancel.cancel();
            }
        }
    })
}

/// Lease, run and submit jobs under one session until it ends.
async fn serve_session<E: Engine + 'static, F: Future<Output = ()>>(
    client: &Client,
    session: &Session,
    engine: &Arc<Mutex<E>>,
    cancel: &CancelFlag,
    summary: &mut WorkerSummary,
    shutdown: &mut std::pin::Pin<&mut F>,
) -> SessionEnd {
    let mut client = client.clone();
    let shared = Arc::new(SessionShared {
        held: Mutex::default(),
        finished: AtomicU64::new(summary.jobs_done + summary.jobs_failed),
        directive: AtomicU8::new(0),
    });
    let heartbeat = spawn_heartbeat(client.clone(), session, shared.clone(), cancel.clone());
    let ended = loop {
        if let Some(end) = shared.asked_end() {
            break SessionEnd::Finished(end);
        }
        let lease = pb::LeaseRequest {
            session: session.id.clone(),
            max_jobs: 1,
            wait_ms: 5_000,
        };
        let response = tokio::select! {
            r = client.lease(lease) => r,
            _ = shutdown.as_mut() => break SessionEnd::Finished(WorkerEnd::Interrupted),
        };
        let response = match response {
            Ok(r) => r.into_inner(),
            Err(status) => {
                if status.code() != Code::Unauthenticated {
                    tracing::warn!(code = ?status.code(), "lease failed: {}", status.message());
                }
                break SessionEnd::Lost;
            }
        };
        let control = pb::Control::try_from(response.control).unwrap_or(pb::Control::Continue);
        shared.note_control(control);
        for job in response.jobs {
            let Some(kind) = job.kind else { continue };
            shared.held().insert(job.lease_id);
            cancel.reset();
            tracing::debug!(lease = job.lease_id, "job leased");
            let started = Instant::now();
            let result = run_job(engine, kind).await;
            let (kv_bytes, prefix_bytes) = {
                let e = engine.lock().unwrap_or_else(|e| e.into_inner());
                (e.last_kv_cache_bytes(), e.prefix_cache_bytes())
            };
            record_job_metrics(&result, started.elapsed(), kv_bytes, prefix_bytes);
            let cancelled =
                matches!(&result, pb::submit_request::Result::Error(e) if e.code == "CANCELLED");
            if cancelled {
                shared.held().remove(&job.lease_id);
                summary.jobs_cancelled += 1;
                tracing::info!(
                    lease = job.lease_id,
                    "job cancelled before it finished; not submitted"
                );
                continue;
            }
            submit(&mut client, session, job.lease_id, result, summary, &shared).await;
        }
    };
    heartbeat.abort();
    ended
}

/// The worker's Prometheus metrics for one job (see [`stageb_shared::observe`]).
/// `prefix_bytes`: what the engine's prefix store holds, `None` when it has none.
fn record_job_metrics(
    result: &pb::submit_request::Result,
    took: Duration,
    kv_bytes: u64,
    prefix_bytes: Option<u64>,
) {
    use pb::submit_request::Result as R;
    let (kind, outcome) = match result {
        R::Rollout(_) => ("rollout", "ok"),
        R::Generate(_) => ("generate", "ok"),
        R::Error(e) if e.code == "CANCELLED" => ("any", "cancelled"),
        R::Error(_) => ("any", "error"),
    };
    metrics::counter!(observe::WORKER_JOBS, "kind" => kind, "outcome" => outcome).increment(1);
    metrics::histogram!(observe::WORKER_JOB_DURATION, "kind" => kind).record(took.as_secs_f64());
    let rate = |tokens: u64, us: u64| (us > 0).then(|| tokens as f64 * 1e6 / us as f64);
    match result {
        R::Rollout(r) => {
            let decoded: u64 = r
                .candidates
                .iter()
                .map(|c| c.completion_tokens as u64)
                .sum();
            // Reused prefix tokens were not prefilled: neither counted nor in the rate.
            let prefilled = u64::from(r.prompt_tokens.saturating_sub(r.prefix_tokens));
            metrics::counter!(observe::WORKER_PREFILL_TOKENS).increment(prefilled);
            metrics::counter!(observe::WORKER_DECODE_TOKENS).increment(decoded);
            if prefix_bytes.is_some() {
                metrics::counter!(observe::WORKER_PREFIX_LOOKUPS).increment(1);
                if r.prefix_tokens > 0 {
                    metrics::counter!(observe::WORKER_PREFIX_HITS).increment(1);
                }
                metrics::counter!(observe::WORKER_PREFILL_SAVED)
                    .increment(u64::from(r.prefix_tokens));
            }
            if let Some(v) = rate(prefilled, r.prefill_us) {
                metrics::gauge!(observe::WORKER_PREFILL_RATE).set(v);
            }
            if let Some(v) = rate(decoded, r.decode_us) {
                metrics::gauge!(observe::WORKER_DECODE_RATE).set(v);
            }
        }
        R::Generate(g) => {
            metrics::counter!(observe::WORKER_PREFILL_TOKENS).increment(g.prompt_tokens as u64);
            metrics::counter!(observe::WORKER_DECODE_TOKENS).increment(g.completion_tokens as u64);
        }
        R::Error(_) => {}
    }
    if kv_bytes > 0 {
        metrics::gauge!(observe::WORKER_KV_CACHE).set(kv_bytes as f64);
    }
    if let Some(b) = prefix_bytes {
        metrics::gauge!(observe::WORKER_PREFIX_CACHE).set(b as f64);
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{
        EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    };

    /// An engine that must never be reached.
    struct Untouchable(ModelFingerprint);

    impl Engine for Untouchable {
        fn fingerprint(&self) -> &ModelFingerprint {
            &self.0
        }
        fn rollout(&mut self, _: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
            panic!("the engine was asked to decode an oversized job")
        }
        fn generate(&mut self, _: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
            panic!("not a generate job")
        }
    }

    /// Issue 26, item 5: a coordinator sending 100k seeds in one decode made the worker abort
    /// on allocation. The job is refused with a coded error before the engine sees it.
    #[tokio::test]
    async fn regression_a_job_with_100k_seeds_is_refused_before_the_engine() {
        let engine = Arc::new(Mutex::new(Untouchable(ModelFingerprint {
            weights_sha256: String::new(),
            candle_version: String::new(),
            dtype: String::new(),
            device: "cpu".into(),
            architecture: "llama".into(),
        })));
        let job = pb::RolloutJob {
            messages: vec![],
            decodes: vec![pb::DecodeSpec {
                seeds: (0..100_000).collect(),
                ..Default::default()
            }],
            constrained: true,
        };
        match run_job(&engine, pb::job::Kind::Rollout(job)).await {
            pb::submit_request::Result::Error(e) => {
                assert_eq!(e.code, "INVALID_REQUEST");
                assert!(e.message.contains("100000 candidates"), "{}", e.message);
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}
