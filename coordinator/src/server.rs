//! The coordinator's gRPC service: thin on purpose. Each handler authenticates, decodes the
//! protocol message into scheduler types, calls the [`Scheduler`], and encodes the answer.
//!
//! The server takes an already-bound listener and a shutdown future, so tests bind
//! `127.0.0.1:0` and the run loop decides when serving ends. grpc.health.v1 is served beside
//! the coordinator service without authentication (probes carry no token).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stageb_shared::auth::{AUTH_HEADER, AuthToken};
use stageb_shared::domain::ChatMessage;
use stageb_shared::pb;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

use crate::scheduler::{
    CandidateText, ControlSignal, JobFailure, JobOutput, JobPayload, Scheduler, SubmitError,
    SubmitOutcome,
};

/// Largest message either side may send (prompts, reflection outputs).
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;
/// Longest a Lease long-poll may hold the call.
const MAX_LEASE_WAIT: Duration = Duration::from_secs(30);

/// What the service needs besides the scheduler.
pub struct ServiceConfig {
    pub run_id: String,
    pub token: Option<AuthToken>,
    /// The model fingerprint the run is pinned to; `None` until the first worker registers
    /// (then it is pinned to that worker's).
    pub expected_fingerprint: Option<String>,
    pub heartbeat_interval: Duration,
}

pub struct CoordinatorService {
    scheduler: Arc<Scheduler>,
    run_id: String,
    fingerprint: Arc<Mutex<Option<String>>>,
    heartbeat_interval: Duration,
}

impl CoordinatorService {
    /// The fingerprint the run is pinned to, shared with the run loop (for the manifest).
    pub fn fingerprint_handle(&self) -> Arc<Mutex<Option<String>>> {
        self.fingerprint.clone()
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
    }
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

/// Decode a submission at the edge. The worker's identity claims are ignored: only the lease
/// id is used, and the scheduler maps it to the job itself.
fn decode_result(
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
            prefill_us: r.prefill_us,
            decode_us: r.decode_us,
        })),
        Some(pb::submit_request::Result::Generate(g)) => Ok(Ok(JobOutput::Generate {
            text: g.text,
            prompt_tokens: g.prompt_tokens,
            completion_tokens: g.completion_tokens,
            finish_reason: g.finish_reason,
            latency_us: g.latency_us,
        })),
        Some(pb::submit_request::Result::Error(e)) => {
            if e.code.is_empty() || e.code.len() > 64 {
                return Err(Status::invalid_argument("job error needs a short code"));
            }
            Ok(Err(JobFailure {
                code: e.code,
                message: e.message.chars().take(2000).collect(),
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
        if !req.run_id.is_empty() && req.run_id != self.run_id {
            return Err(Status::permission_denied(
                "this coordinator serves a different run",
            ));
        }
        let worker = req
            .worker
            .ok_or_else(|| Status::invalid_argument("worker info is required"))?;
        if worker.model_fingerprint.is_empty() {
            return Err(Status::invalid_argument("model fingerprint is required"));
        }
        {
            let mut pinned = self.fingerprint.lock().unwrap_or_else(|e| e.into_inner());
            match pinned.as_deref() {
                Some(fp) if fp != worker.model_fingerprint => {
                    tracing::warn!(worker = %worker.name, "refusing a worker with a different model fingerprint");
                    return Err(Status::failed_precondition(format!(
                        "model fingerprint mismatch: the run uses {fp}, the worker has {}",
                        worker.model_fingerprint
                    )));
                }
                Some(_) => {}
                None => *pinned = Some(worker.model_fingerprint.clone()),
            }
        }
        let (worker_id, session) = self.scheduler.register(&worker.name);
        tracing::info!(worker_id = %worker_id, name = %worker.name, device = %worker.device, "worker registered");
        Ok(Response::new(pb::RegisterResponse {
            worker_id,
            session,
            run_id: self.run_id.clone(),
            heartbeat_interval_ms: self.heartbeat_interval.as_millis() as u32,
            lease_ttl_ms: self.scheduler.config().lease_ttl.as_millis() as u32,
        }))
    }

    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        let req = request.into_inner();
        let wait = Duration::from_millis(req.wait_ms as u64).min(MAX_LEASE_WAIT);
        let max = (req.max_jobs as usize).clamp(1, 16);
        let (jobs, control) = self
            .scheduler
            .lease(&req.session, max, wait)
            .await
            .map_err(session_error)?;
        Ok(Response::new(pb::LeaseResponse {
            jobs: jobs
                .into_iter()
                .map(|(id, p)| payload_to_pb(id, p))
                .collect(),
            control: control_to_pb(control),
        }))
    }

    async fn submit(
        &self,
        request: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        let req = request.into_inner();
        let result = decode_result(req.result)?;
        let outcome = self
            .scheduler
            .submit(&req.session, req.lease_id, result)
            .map_err(session_error)?;
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
        let (fenced, control) = self
            .scheduler
            .heartbeat(&req.session, &req.lease_ids)
            .map_err(session_error)?;
        Ok(Response::new(pb::HeartbeatResponse {
            control: control_to_pb(control),
            fenced_lease_ids: fenced,
        }))
    }
}

/// Checks `authorization: Bearer <token>` in constant time when the run has a token.
#[derive(Clone)]
pub struct AuthInterceptor {
    token: Option<AuthToken>,
}

impl tonic::service::Interceptor for AuthInterceptor {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else {
            return Ok(request);
        };
        let presented = request
            .metadata()
            .get(AUTH_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if token.matches_bearer(presented) {
            Ok(request)
        } else {
            // Generic on purpose: say nothing about what was wrong.
            Err(Status::unauthenticated("missing or invalid token"))
        }
    }
}

/// Build the service for `scheduler` (kept separate from serving so the run loop can hold the
/// fingerprint handle).
pub fn build_service(scheduler: Arc<Scheduler>, config: &ServiceConfig) -> CoordinatorService {
    CoordinatorService {
        scheduler,
        run_id: config.run_id.clone(),
        fingerprint: Arc::new(Mutex::new(config.expected_fingerprint.clone())),
        heartbeat_interval: config.heartbeat_interval,
    }
}

/// Serve the coordinator and health services on `listener` until `shutdown` resolves. Also
/// runs the lease reaper.
pub async fn serve(
    listener: TcpListener,
    service: CoordinatorService,
    token: Option<AuthToken>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let scheduler = service.scheduler.clone();
    let reap_every =
        (scheduler.config().lease_ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(2));
    let reaper = tokio::spawn(async move {
        let mut tick = tokio::time::interval(reap_every);
        loop {
            tick.tick().await;
            scheduler.reap_expired();
        }
    });
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<pb::coordinator_server::CoordinatorServer<CoordinatorService>>()
        .await;
    let svc = pb::coordinator_server::CoordinatorServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let svc = tonic::service::interceptor::InterceptedService::new(svc, AuthInterceptor { token });
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(health_service)
        .add_service(svc)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await;
    reaper.abort();
    result
}

/// Bind `addr`, refusing a non-loopback address without a token.
pub async fn bind(addr: SocketAddr, token: Option<&AuthToken>) -> Result<TcpListener, BindError> {
    stageb_shared::auth::check_listen_policy(&addr, token)?;
    TcpListener::bind(addr)
        .await
        .map_err(|source| BindError::Io { addr, source })
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
