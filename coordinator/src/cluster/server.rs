//! The coordinator's gRPC service: thin on purpose. Each handler authenticates, decodes the
//! protocol message into scheduler types, calls the [`Scheduler`], and encodes the answer.
//!
//! The server takes an already-bound listener and a shutdown future, so tests bind
//! `127.0.0.1:0` and the run loop decides when serving ends. Connections pass the gate in
//! [`crate::cluster::edge`] first (cap, preface deadline, forced close after the shutdown grace).
//! `grpc.health.v1` `Check` is served beside the coordinator service without authentication
//! (probes carry no token), with a 1 KiB request cap; `Watch` is not served (an open watch
//! stream would be one more thing a stranger could hold open).
//!
//! Nothing a worker sends is trusted: every string has a cap ([`stageb_shared::wire`]), is
//! escaped before it reaches a log line, and counters are bounded before they are added up
//! ([`crate::cluster::scheduler`]).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stageb_shared::auth::{AUTH_HEADER, AuthToken, Transport};
use stageb_shared::domain::ChatMessage;
use stageb_shared::pb;
use stageb_shared::tls::ServerTls;
use stageb_shared::wire::{self, log_safe};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::cluster::edge::{self, ConnectionCount, EdgeLimits, EdgeShutdown};
use crate::cluster::slots::{ChargeCalls, Slots, StrangerUsage};

use crate::cluster::scheduler::{
    CandidateText, ControlSignal, JobFailure, JobOutput, JobPayload, LeaseProgress, Scheduler,
    SubmitError, SubmitOutcome,
};

pub use crate::cluster::edge::MAX_MESSAGE_BYTES;
/// Longest a Lease long-poll may hold the call.
const MAX_LEASE_WAIT: Duration = Duration::from_secs(30);
/// Largest encoded `Register`, `Lease` or `Heartbeat` request: only `Submit` carries bulk.
pub const MAX_CONTROL_MESSAGE_BYTES: usize = 64 * 1024;

pub use crate::cluster::model_pin::{ModelPin, ModelPinHandle, PinRefusal, weights_of};

/// What the service needs besides the scheduler.
pub struct ServiceConfig {
    pub run_id: String,
    pub token: Option<AuthToken>,
    /// Which model the run accepts.
    pub model: ModelPin,
    pub heartbeat_interval: Duration,
}

pub struct CoordinatorService {
    scheduler: Arc<Scheduler>,
    run_id: String,
    model: ModelPinHandle,
    heartbeat_interval: Duration,
}

impl CoordinatorService {
    /// The model pin, shared with the run loop (for the manifest).
    pub fn model_handle(&self) -> ModelPinHandle {
        self.model.clone()
    }
}

fn control_to_pb(c: ControlSignal) -> i32 {
    match c {
        ControlSignal::Continue => pb::Control::Continue as i32,
        ControlSignal::Drain => pb::Control::Drain as i32,
        ControlSignal::Stop => pb::Control::Stop as i32,
    }
}

fn session_error(e: SubmitError) -> Status {
    match e {
        SubmitError::UnknownSession => {
            Status::unauthenticated("unknown or expired session; register again")
        }
        SubmitError::Mismatch(m) => Status::invalid_argument(m),
        SubmitError::Exhausted(m) => Status::resource_exhausted(m),
    }
}

/// Refuse a control RPC whose encoded size exceeds [`MAX_CONTROL_MESSAGE_BYTES`].
fn check_control_size(message: &impl prost::Message) -> Result<(), Status> {
    let len = message.encoded_len();
    if len > MAX_CONTROL_MESSAGE_BYTES {
        return Err(Status::resource_exhausted(format!(
            "request of {len} bytes exceeds {MAX_CONTROL_MESSAGE_BYTES}"
        )));
    }
    Ok(())
}

fn payload_to_pb(lease_id: u64, payload: JobPayload) -> pb::Job {
    let messages = |ms: Vec<ChatMessage>| {
        ms.into_iter()
            .map(|m| pb::ChatMessage {
                role: m.role,
                content: m.content,
            })
            .collect::<Vec<_>>()
    };
    let kind = match payload {
        JobPayload::Rollout {
            messages: ms,
            decodes,
            constrained,
        } => pb::job::Kind::Rollout(pb::RolloutJob {
            messages: messages(ms),
            decodes: decodes.into_iter().map(pb::DecodeSpec::from).collect(),
            constrained,
        }),
        JobPayload::Generate {
            messages: ms,
            json_schema,
            seed,
            temperature,
            top_p,
            repetition_penalty,
            max_new_tokens,
        } => pb::job::Kind::Generate(pb::GenerateJob {
            messages: messages(ms),
            json_schema: json_schema.unwrap_or_default(),
            seed,
            temperature,
            top_p,
            repetition_penalty,
            max_new_tokens,
        }),
    };
    pb::Job {
        lease_id,
        kind: Some(kind),
    }
}

/// The batching statistics a submission reports (`batch_steps`, `batch_rows`; zero for an
/// error): runtime facts for `summary.json`, never part of the answer.
fn batch_share(result: &Option<pb::submit_request::Result>) -> (u32, u64) {
    match result {
        Some(pb::submit_request::Result::Rollout(r)) => (r.batch_steps, r.batch_rows),
        Some(pb::submit_request::Result::Generate(g)) => (g.batch_steps, g.batch_rows),
        _ => (0, 0),
    }
}

/// Decode a submission at the edge. The worker's identity claims are ignored: only the lease
/// id is used, and the scheduler maps it to the job itself. Public for the fuzz target that
/// checks it on arbitrary bytes (`fuzz/src/checks/submit_validate.rs`).
pub fn decode_result(
    result: Option<pb::submit_request::Result>,
) -> Result<Result<JobOutput, JobFailure>, Status> {
    match result {
        Some(pb::submit_request::Result::Rollout(r)) => Ok(Ok(JobOutput::Rollout {
            candidates: r
                .candidates
                .into_iter()
                .map(|c| CandidateText {
                    decode_index: c.decode_index,
                    sample_index: c.sample_index,
                    seed: c.seed,
                    text: c.text,
                    completion_tokens: c.completion_tokens,
                    finish_reason: c.finish_reason,
                })
                .collect(),
            prompt_tokens: r.prompt_tokens,
            prefix_tokens: r.prefix_tokens,
            prefill_us: r.prefill_us,
            decode_us: r.decode_us,
        })),
        Some(pb::submit_request::Result::Generate(g)) => Ok(Ok(JobOutput::Generate {
            text: g.text,
            prompt_tokens: g.prompt_tokens,
            prefix_tokens: g.prefix_tokens,
            completion_tokens: g.completion_tokens,
            finish_reason: g.finish_reason,
            latency_us: g.latency_us,
        })),
        Some(pb::submit_request::Result::Error(e)) => {
            if !wire::is_error_code(&e.code) {
                return Err(Status::invalid_argument(
                    "a job error needs a code of 1-64 characters A-Z, 0-9, _",
                ));
            }
            Ok(Err(JobFailure {
                code: e.code,
                message: e
                    .message
                    .chars()
                    .take(wire::MAX_ERROR_MESSAGE_CHARS)
                    .collect(),
            }))
        }
        None => Err(Status::invalid_argument("submission carries no result")),
    }
}

#[tonic::async_trait]
impl pb::coordinator_server::Coordinator for CoordinatorService {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let req = request.into_inner();
        check_control_size(&req)?;
        wire::check_len("run_id", &req.run_id, wire::MAX_RUN_ID_BYTES)?;
        if !req.run_id.is_empty() && req.run_id != self.run_id {
            return Err(Status::permission_denied(
                "this coordinator serves a different run",
            ));
        }
        let worker = req
            .worker
            .ok_or_else(|| Status::invalid_argument("worker info is required"))?;
        wire::check_len("worker name", &worker.name, wire::MAX_WORKER_NAME_BYTES)?;
        wire::check_len("device", &worker.device, wire::MAX_DEVICE_BYTES)?;
        wire::check_len("version", &worker.version, wire::MAX_VERSION_BYTES)?;
        wire::check_len(
            "model fingerprint",
            &worker.model_fingerprint,
            wire::MAX_FINGERPRINT_BYTES,
        )?;
        if worker.model_fingerprint.is_empty() {
            return Err(Status::invalid_argument("model fingerprint is required"));
        }
        let name = log_safe(&worker.name);
        let run_context = {
            let mut pin = self.model.lock().unwrap_or_else(|e| e.into_inner());
            let first = pin.fingerprint.is_none();
            match pin.admit(&worker.model_fingerprint, worker.max_context) {
                Ok(()) => {}
                Err(PinRefusal::NotYet(m)) => return Err(Status::unavailable(m)),
                Err(PinRefusal::Refused(refusal)) => {
                    tracing::warn!(worker = %name, presented = %log_safe(short(&worker.model_fingerprint)), context = worker.max_context, %refusal, "refusing a worker");
                    return Err(Status::failed_precondition(refusal));
                }
            }
            if first {
                tracing::info!(worker = %name, pinned_by = pin.pinned_by, numerics_pinned_by = pin.numerics_pinned_by, fingerprint = %log_safe(&worker.model_fingerprint), "run model pinned");
            }
            pin.context.map(|c| c.tokens).unwrap_or(0)
        };
        wire::check_len(
            "previous session",
            &req.previous_session,
            wire::MAX_SESSION_BYTES,
        )?;
        let (worker_id, session, fenced) = self
            .scheduler
            .register_replacing(&req.previous_session)
            .map_err(session_error)?;
        if !fenced.is_empty() {
            tracing::warn!(worker_id = %worker_id, name = %name, fenced = ?fenced, "worker registered again: its old session's leases fenced, their jobs re-queued");
        }
        tracing::info!(worker_id = %worker_id, name = %name, device = %log_safe(&worker.device), "worker registered");
        Ok(Response::new(pb::RegisterResponse {
            worker_id,
            session,
            run_id: self.run_id.clone(),
            heartbeat_interval_ms: self.heartbeat_interval.as_millis().min(u32::MAX as u128) as u32,
            lease_ttl_ms: self
                .scheduler
                .config()
                .lease_ttl
                .as_millis()
                .min(u32::MAX as u128) as u32,
            max_context: run_context,
        }))
    }

    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        let req = request.into_inner();
        check_control_size(&req)?;
        wire::check_len("session", &req.session, wire::MAX_SESSION_BYTES)?;
        let wait = Duration::from_millis(req.wait_ms as u64).min(MAX_LEASE_WAIT);
        let max = req.max_jobs.clamp(1, wire::MAX_JOBS_PER_LEASE) as usize;
        let leased = self
            .scheduler
            .lease_timed(&req.session, max, wait)
            .await
            .map_err(session_error)?;
        Ok(Response::new(pb::LeaseResponse {
            jobs: leased
                .jobs
                .into_iter()
                .map(|(id, p)| payload_to_pb(id, p))
                .collect(),
            control: control_to_pb(leased.control),
            waited_for_work_us: leased.waited_for_work.as_micros() as u64,
        }))
    }

    async fn submit(
        &self,
        request: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        let req = request.into_inner();
        wire::check_len("session", &req.session, wire::MAX_SESSION_BYTES)?;
        let (steps, rows) = batch_share(&req.result);
        let result = decode_result(req.result)?;
        let outcome = self
            .scheduler
            .submit(&req.session, req.lease_id, result)
            .map_err(session_error)?;
        if outcome == SubmitOutcome::Accepted {
            self.scheduler.note_batching(steps, rows);
        }
        let status = match outcome {
            SubmitOutcome::Accepted => pb::SubmitStatus::Accepted,
            SubmitOutcome::Duplicate => pb::SubmitStatus::Duplicate,
            SubmitOutcome::Fenced => pb::SubmitStatus::Fenced,
        };
        Ok(Response::new(pb::SubmitResponse {
            status: status as i32,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let req = request.into_inner();
        check_control_size(&req)?;
        wire::check_len("session", &req.session, wire::MAX_SESSION_BYTES)?;
        if req.lease_ids.len() > wire::MAX_HEARTBEAT_LEASES
            || req.progress.len() > wire::MAX_HEARTBEAT_LEASES
        {
            return Err(Status::invalid_argument(format!(
                "a heartbeat names at most {} leases",
                wire::MAX_HEARTBEAT_LEASES
            )));
        }
        let progress: Vec<(u64, LeaseProgress)> = req
            .progress
            .iter()
            .map(|p| {
                let counts = LeaseProgress {
                    steps: p.steps,
                    tokens: p.tokens,
                    rows_finished: p.rows_finished,
                    prompt_done: p.prompt_done,
                };
                (p.lease_id, counts)
            })
            .collect();
        let answer = self
            .scheduler
            .heartbeat_with(&req.session, &req.lease_ids, &progress)
            .map_err(session_error)?;
        Ok(Response::new(pb::HeartbeatResponse {
            control: control_to_pb(answer.control),
            fenced_lease_ids: answer.invalid,
            revoked_lease_ids: answer.revoked,
        }))
    }
}

/// Checks `authorization: Bearer <token>` in constant time when the run has a token, and
/// marks the connection of a call that passes as authenticated ([`Slots`]: it is then never
/// closed to make room for a stranger's, and no longer charged for what it sends).
#[derive(Clone)]
pub struct AuthInterceptor {
    token: Option<AuthToken>,
    slots: Slots,
}

impl AuthInterceptor {
    fn admit(&self, request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(peer) = request.remote_addr() {
            self.slots.mark_authenticated(peer);
        }
        Ok(request)
    }
}

impl tonic::service::Interceptor for AuthInterceptor {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else {
            return self.admit(request);
        };
        let presented = request
            .metadata()
            .get(AUTH_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if token.matches_bearer(presented) {
            self.admit(request)
        } else {
            // Generic on purpose: say nothing about what was wrong.
            Err(Status::unauthenticated("missing or invalid token"))
        }
    }
}

/// The first characters of a fingerprint, enough to tell two apart in a log line.
fn short(fingerprint: &str) -> &str {
    let end = fingerprint
        .char_indices()
        .nth(16)
        .map_or(fingerprint.len(), |(i, _)| i);
    &fingerprint[..end]
}

/// Build the service for `scheduler` (kept separate from serving so the run loop can hold the
/// model pin).
pub fn build_service(scheduler: Arc<Scheduler>, config: &ServiceConfig) -> CoordinatorService {
    CoordinatorService {
        scheduler,
        run_id: config.run_id.clone(),
        model: Arc::new(Mutex::new(config.model.clone())),
        heartbeat_interval: config.heartbeat_interval,
    }
}

/// `grpc.health.v1` for probes: `Check` answers for the whole server (`""`) and the
/// coordinator service, `NOT_SERVING` once shutdown begins; `Watch` is refused.
struct HealthService {
    serving: Arc<AtomicBool>,
}

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = request.into_inner().service;
        let coordinator = <pb::coordinator_server::CoordinatorServer<CoordinatorService> as tonic::server::NamedService>::NAME;
        if !service.is_empty() && service != coordinator {
            return Err(Status::not_found("unknown service"));
        }
        let status = if self.serving.load(Ordering::Acquire) {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        Ok(Response::new(HealthCheckResponse {
            status: status as i32,
        }))
    }

    type WatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

    async fn watch(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("Watch is not served; poll Check"))
    }
}

/// How the server meets the network: who may call, over what, within which limits.
#[derive(Clone, Default)]
pub struct EdgeConfig {
    pub token: Option<AuthToken>,
    pub tls: Option<ServerTls>,
    pub limits: EdgeLimits,
    /// Live connection count (read it to report or test the cap).
    pub connections: ConnectionCount,
    /// What unauthenticated connections hold (read it to report or test their budget).
    pub strangers: StrangerUsage,
}

impl EdgeConfig {
    /// The transport security this edge provides (for the listen policy).
    pub fn transport(&self) -> Transport {
        match &self.tls {
            None => Transport::Plaintext,
            Some(t) if t.is_mutual() => Transport::MutualTls,
            Some(_) => Transport::Tls,
        }
    }
}

/// Serve the coordinator and health services on `listener` until `shutdown` resolves, then
/// for at most the shutdown grace: connections still open after it are aborted, so a client
/// can never keep rank 0 from exiting. Also runs the lease reaper.
pub async fn serve(
    listener: TcpListener,
    service: CoordinatorService,
    edge: EdgeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let limits = edge.limits.clone();
    let scheduler = service.scheduler.clone();
    // Also where stragglers are noticed (`Scheduler::reap_expired`): at most 250 ms late.
    let reap_every = (scheduler.config().lease_ttl / 4)
        .clamp(Duration::from_millis(50), Duration::from_millis(250));
    let reaper = tokio::spawn(async move {
        let mut tick = tokio::time::interval(reap_every);
        loop {
            tick.tick().await;
            scheduler.reap_expired();
        }
    });
    let serving = Arc::new(AtomicBool::new(true));
    let health = HealthServer::new(HealthService {
        serving: serving.clone(),
    })
    .max_decoding_message_size(limits.health_message_bytes)
    .max_encoding_message_size(limits.health_message_bytes);
    let svc = pb::coordinator_server::CoordinatorServer::new(service)
        .max_decoding_message_size(limits.coordinator_message_bytes)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let slots = Slots::new(limits.slot_caps(), edge.strangers.clone());
    let svc = tonic::service::interceptor::InterceptedService::new(
        svc,
        AuthInterceptor {
            token: edge.token.clone(),
            slots: slots.clone(),
        },
    );
    // Calls a stranger opens are charged to its connection (the interceptor runs first).
    let health = ChargeCalls::new(health, slots.clone());
    let svc = ChargeCalls::new(svc, slots.clone());
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .max_concurrent_streams(limits.max_concurrent_streams)
        .timeout(limits.request_timeout)
        .http2_max_header_list_size(limits.max_header_list_bytes)
        .initial_stream_window_size(limits.stream_window_bytes)
        .initial_connection_window_size(limits.connection_window_bytes)
        .http2_max_pending_accept_reset_streams(Some(32))
        .tcp_nodelay(true);
    if let Some(tls) = &edge.tls {
        builder = builder.tls_config(tls.config())?;
    }
    let signals = EdgeShutdown::default();
    let incoming = edge::gated_incoming(
        listener,
        &limits,
        edge.tls.is_some(),
        signals.clone(),
        edge.connections.clone(),
        slots,
    );
    let stop_accepting = signals.stop_accepting.clone();
    let server = builder
        .add_service(health)
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, async move {
            shutdown.await;
            serving.store(false, Ordering::Release);
            stop_accepting.cancel();
        });
    tokio::pin!(server);
    let grace_over = async {
        signals.stop_accepting.cancelled().await;
        tokio::time::sleep(limits.shutdown_grace).await;
    };
    let result = tokio::select! {
        r = &mut server => r,
        _ = grace_over => {
            tracing::warn!(
                open = edge.connections.get(),
                grace = ?limits.shutdown_grace,
                "connections still open after the shutdown grace; closing them"
            );
            signals.force_close.cancel();
            match tokio::time::timeout(Duration::from_secs(2), &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!("the server did not stop after closing its connections; leaving it");
                    Ok(())
                }
            }
        }
    };
    reaper.abort();
    result
}

/// Bind `addr` under the listen policy (loopback, or a long enough token, or mutual TLS).
/// Returns the listener and the warnings to log at start.
pub async fn bind(
    addr: SocketAddr,
    token: Option<&AuthToken>,
    transport: Transport,
) -> Result<(TcpListener, Vec<String>), BindError> {
    let warnings = stageb_shared::auth::check_listen_policy(&addr, token, transport)?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| BindError::Io { addr, source })?;
    Ok((listener, warnings))
}

#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error(transparent)]
    Policy(#[from] stageb_shared::auth::AuthError),
    #[error("cannot listen on {addr}: {source}")]
    Io {
        addr: SocketAddr,
        source: std::io::Error,
    },
}
