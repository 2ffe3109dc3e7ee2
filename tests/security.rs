//! Security properties of the coordinator, checked against a real gRPC server on an ephemeral
//! loopback port and, for the listen policy, the real binary. The attacks an independent gRPC
//! client ran against rank 0 are reproduced here, one test each, named after what
//! got through; `tests/edge_attacks.rs` holds the ones that need a separate rank 0 process.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use stageb::roles::{self, LocalPin, LocalStart};
use stageb_coordinator::cluster::scheduler::{DecodeJob, JobPayload, Scheduler, SchedulerConfig};
use stageb_coordinator::cluster::server::{self, EdgeConfig, ModelPin, ServiceConfig};
use stageb_shared::auth::AuthToken;
use stageb_shared::domain::ChatMessage;
use stageb_shared::pb;
use stageb_worker::engine::CANDLE_VERSION;
use stageb_worker::engine::{ModelFingerprint, numerics_known};
use support::{Behaviour, Script, ScriptedEngine, open_service, serve_loopback};
use tonic::Code;
use tonic::metadata::MetadataValue;

struct Served {
    addr: String,
    scheduler: Arc<Scheduler>,
    completions:
        tokio::sync::mpsc::UnboundedReceiver<stageb_coordinator::cluster::scheduler::Completion>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve_with_token(token: Option<AuthToken>) -> Served {
    serve_pinned(token, ModelPin::by_resumed_run("fp-1".into())).await
}

async fn serve_pinned(token: Option<AuthToken>, model: ModelPin) -> Served {
    let (scheduler, completions) = Scheduler::new(SchedulerConfig::default());
    let scheduler = Arc::new(scheduler);
    let service = ServiceConfig {
        token: token.clone(),
        model,
        ..open_service("run-under-test", Duration::from_secs(1))
    };
    let edge = EdgeConfig {
        token,
        ..Default::default()
    };
    let server = serve_loopback(scheduler.clone(), &service, edge).await;
    Served {
        addr: format!("http://{}", server.addr),
        scheduler,
        completions,
        _stop: server.stop,
    }
}

fn register_request(fingerprint: &str) -> pb::RegisterRequest {
    named_register_request("test", fingerprint)
}

fn named_register_request(name: &str, fingerprint: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        run_id: String::new(),
        worker: Some(pb::WorkerInfo {
            name: name.into(),
            device: "cpu".into(),
            model_fingerprint: fingerprint.into(),
            capacity: 1,
            version: "test".into(),
            max_context: 8192,
        }),
        previous_session: String::new(),
    }
}

async fn client(
    addr: &str,
) -> pb::coordinator_client::CoordinatorClient<tonic::transport::Channel> {
    pb::coordinator_client::CoordinatorClient::connect(addr.to_string())
        .await
        .unwrap()
}

fn with_bearer<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert(
        "authorization",
        MetadataValue::try_from(format!("Bearer {token}")).unwrap(),
    );
    r
}

#[tokio::test]
async fn register_without_or_with_a_wrong_token_is_refused() {
    let served = serve_with_token(Some(AuthToken::new("right-token").unwrap())).await;
    let mut c = client(&served.addr).await;
    let none = c.register(register_request("fp-1")).await.unwrap_err();
    assert_eq!(none.code(), Code::Unauthenticated);
    let wrong = c
        .register(with_bearer(register_request("fp-1"), "wrong-token"))
        .await
        .unwrap_err();
    assert_eq!(wrong.code(), Code::Unauthenticated);
    // The refusal says nothing about what was wrong.
    assert_eq!(none.message(), wrong.message());
    let ok = c
        .register(with_bearer(register_request("fp-1"), "right-token"))
        .await
        .unwrap()
        .into_inner();
    assert!(!ok.session.is_empty());
}

#[tokio::test]
async fn a_worker_with_another_model_is_refused() {
    let served = serve_with_token(None).await;
    let mut c = client(&served.addr).await;
    let err = c.register(register_request("fp-other")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
}

/// The run plans every call with its context (here 4096 tokens from the model file): a worker
/// holding less would fail prompts that fit on its peers, so it is refused at Register; one
/// holding more is told the run's context; one that states none is refused.
#[tokio::test]
async fn a_worker_whose_context_is_below_the_runs_is_refused_at_register() {
    use stageb_shared::limits::{ContextSource, RunContext};
    let pin = ModelPin::by_resumed_run("fp-1".into()).with_context(RunContext {
        tokens: 4096,
        source: ContextSource::Model,
    });
    let served = serve_pinned(None, pin).await;
    let mut c = client(&served.addr).await;
    let with_context = |tokens: u32| {
        let mut r = register_request("fp-1");
        r.worker.as_mut().unwrap().max_context = tokens;
        r
    };
    let small = c.register(with_context(1024)).await.unwrap_err();
    assert_eq!(small.code(), Code::FailedPrecondition);
    assert!(small.message().contains("4096"), "{}", small.message());
    let none = c.register(with_context(0)).await.unwrap_err();
    assert_eq!(none.code(), Code::FailedPrecondition);
    let large = c.register(with_context(32768)).await.unwrap().into_inner();
    assert_eq!(
        large.max_context, 4096,
        "the worker keeps to the run's context"
    );
}

#[tokio::test]
async fn a_submit_for_a_lease_the_worker_does_not_hold_is_refused_and_not_written() {
    let mut served = serve_with_token(None).await;
    let mut c = client(&served.addr).await;
    let holder = c
        .register(register_request("fp-1"))
        .await
        .unwrap()
        .into_inner()
        .session;
    let other = c
        .register(register_request("fp-1"))
        .await
        .unwrap()
        .into_inner()
        .session;
    served.scheduler.enqueue(JobPayload::Rollout {
        messages: vec![ChatMessage::user("x")],
        decodes: vec![DecodeJob {
            decode_index: 0,
            temperature: 0.5,
            top_p: 0.9,
            repetition_penalty: 1.0,
            max_new_tokens: 8,
            seeds: vec![7],
        }],
        constrained: true,
    });
    let leased = c
        .lease(pb::LeaseRequest {
            session: holder.clone(),
            max_jobs: 1,
            wait_ms: 1000,
        })
        .await
        .unwrap()
        .into_inner();
    let lease_id = leased.jobs[0].lease_id;
    let result = pb::RolloutResult {
        candidates: vec![pb::Candidate {
            decode_index: 0,
            sample_index: 0,
            seed: 7,
            text: "Verdict: 通过\nReason: 伪造".into(),
            completion_tokens: 5,
            finish_reason: "stop".into(),
        }],
        prompt_tokens: 3,
        prefix_tokens: 0,
        prefill_us: 1,
        decode_us: 1,
        ..Default::default()
    };
    let submit = |session: String, lease_id: u64| pb::SubmitRequest {
        session,
        lease_id,
        result: Some(pb::submit_request::Result::Rollout(result.clone())),
    };
    // Another session's lease, and a lease id that was never issued: both fenced.
    for (session, id) in [
        (other.clone(), lease_id),
        (other.clone(), 9999),
        (holder.clone(), 9999),
    ] {
        let status = c
            .submit(submit(session, id))
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, pb::SubmitStatus::Fenced as i32);
    }
    // An unknown session is not even heard.
    let err = c
        .submit(submit("forged-session".into(), lease_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(
        served.completions.try_recv().is_err(),
        "a refused submit must produce no result"
    );
    // The holder's own submit is accepted exactly once.
    let status = c
        .submit(submit(holder.clone(), lease_id))
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(status, pb::SubmitStatus::Accepted as i32);
    let status = c
        .submit(submit(holder, lease_id))
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(status, pb::SubmitStatus::Duplicate as i32);
    assert!(served.completions.try_recv().is_ok());
    assert!(served.completions.try_recv().is_err());
}

#[tokio::test]
async fn health_is_served_without_a_token() {
    let served = serve_with_token(Some(AuthToken::new("t").unwrap())).await;
    let channel = tonic::transport::Endpoint::from_shared(served.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let resp = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "stageb.v1.Coordinator".into(),
        })
        .await
        .unwrap();
    assert_eq!(
        resp.into_inner().status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

/// `stageb coordinator` on the small demo, listening on all interfaces with `token` (if any)
/// in `STAGEB_TOKEN`: its exit code and stderr.
fn coordinator_off_loopback(token: Option<&str>) -> (Option<i32>, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_stageb"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "coordinator",
            "--config",
            "examples/demo/small/config.yaml",
            "--listen",
            "0.0.0.0:0",
        ])
        .env_remove("STAGEB_TOKEN")
        .env_remove("STAGEB_TOKEN_FILE");
    if let Some(t) = token {
        cmd.env("STAGEB_TOKEN", t);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn listening_off_loopback_without_a_token_is_refused() {
    let (code, stderr) = coordinator_off_loopback(None);
    assert_eq!(code, Some(2), "stderr: {stderr}");
    assert!(stderr.contains("without a token"), "stderr: {stderr}");
}

// --- The edge, attack by attack ---

/// A coordinator with custom edge limits and no token; returns its address, the live
/// connection count, the stop switch and the serving task.
async fn serve_edge(
    limits: stageb_coordinator::cluster::edge::EdgeLimits,
) -> (
    std::net::SocketAddr,
    stageb_coordinator::cluster::edge::ConnectionCount,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) {
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig::default());
    let service = open_service("edge", Duration::from_secs(1));
    let edge = EdgeConfig {
        limits,
        ..Default::default()
    };
    let connections = edge.connections.clone();
    let server = serve_loopback(Arc::new(scheduler), &service, edge).await;
    (server.addr, connections, server.stop, server.task)
}

/// An HTTP/2 connection that completed its handshake and then says nothing more.
async fn idle_h2_connection(
    addr: std::net::SocketAddr,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    (send, driver)
}

async fn health_client(
    addr: &str,
) -> tonic_health::pb::health_client::HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic_health::pb::health_client::HealthClient::new(channel)
}

/// A gRPC length-prefixed frame announcing `len` bytes.
fn grpc_frame_header(len: u32) -> bytes::Bytes {
    let mut frame = vec![0u8];
    frame.extend_from_slice(&len.to_be_bytes());
    bytes::Bytes::from(frame)
}

fn health_check_request(addr: std::net::SocketAddr) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

#[tokio::test]
async fn idle_connections_do_not_keep_rank_0_from_exiting() {
    let limits = stageb_coordinator::cluster::edge::EdgeLimits {
        shutdown_grace: Duration::from_millis(300),
        ..Default::default()
    };
    let (addr, connections, stop, task) = serve_edge(limits).await;
    // Two idle HTTP/2 connections, one half-sent health request and one silent socket.
    let _idle_a = idle_h2_connection(addr).await;
    let (mut send, _idle_b) = idle_h2_connection(addr).await;
    let (_response, mut body) = send
        .send_request(health_check_request(addr), false)
        .unwrap();
    body.send_data(grpc_frame_header(16), false).unwrap();
    let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(connections.get() >= 2, "the idle connections are held");
    let asked = std::time::Instant::now();
    stop.send(()).unwrap();
    let served = tokio::time::timeout(Duration::from_secs(5), task).await;
    assert!(
        served.is_ok(),
        "serve() must return within its grace whatever clients hold open"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "{:?}",
        asked.elapsed()
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the port is closed"
    );
}

#[tokio::test]
async fn a_socket_that_never_speaks_is_closed_at_the_preface_deadline() {
    use tokio::io::AsyncReadExt;
    let limits = stageb_coordinator::cluster::edge::EdgeLimits {
        preface_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let (addr, connections, _stop, _task) = serve_edge(limits).await;
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(3), silent.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "the server closes a silent socket: {read:?}"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(connections.get(), 0, "its slot is given back");
    // Something that is not HTTP/2 at all is closed as soon as it speaks.
    use tokio::io::AsyncWriteExt;
    let mut garbage = tokio::net::TcpStream::connect(addr).await.unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let read = tokio::time::timeout(Duration::from_secs(3), garbage.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
}

/// The token of the edge tests below.
const EDGE_TOKEN: &str = "edge-test-token-0123456789abcdef0123456789";

/// A coordinator with a token and custom edge limits; returns its address and stop switch.
async fn serve_edge_with_token(
    limits: stageb_coordinator::cluster::edge::EdgeLimits,
    token: &AuthToken,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig::default());
    let service = ServiceConfig {
        token: Some(token.clone()),
        model: ModelPin::by_resumed_run("fp-1".into()),
        ..open_service("edge", Duration::from_secs(1))
    };
    let edge = EdgeConfig {
        limits,
        token: Some(token.clone()),
        ..Default::default()
    };
    let server = serve_loopback(Arc::new(scheduler), &service, edge).await;
    (format!("http://{}", server.addr), server.stop)
}

/// A client that registered with [`EDGE_TOKEN`] (its connection is now authenticated).
async fn registered_client(
    addr: &str,
) -> pb::coordinator_client::CoordinatorClient<tonic::transport::Channel> {
    let mut c = client(addr).await;
    c.register(with_bearer(register_request("fp-1"), EDGE_TOKEN))
        .await
        .expect("register");
    c
}

/// Regression: 4,096 connections that sent the HTTP/2 preface and then only
/// answered pings (or stalled ClientHellos under mutual TLS) filled the connection cap; every
/// new Register got UNAVAILABLE and the workers gave up. Connections that have not made an
/// authenticated call are now closed oldest first to make room, and never more of them are
/// held than `max_unauthenticated`; authenticated ones are never closed for a stranger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_without_a_token_cannot_lock_a_worker_out_regression_4096_idle_h2() {
    let token = AuthToken::new(EDGE_TOKEN).unwrap();
    let limits = stageb_coordinator::cluster::edge::EdgeLimits {
        max_connections: 6,
        max_unauthenticated: 4,
        ..Default::default()
    };
    let (addr, _stop) = serve_edge_with_token(limits, &token).await;
    let sock: std::net::SocketAddr = addr.trim_start_matches("http://").parse().unwrap();
    // Strangers fill every slot they may, and more.
    let mut idle = futures_join(sock, 8).await;
    let mut first = registered_client(&addr).await;
    idle.extend(futures_join(sock, 8).await);
    let mut second = registered_client(&addr).await;
    idle.extend(futures_join(sock, 8).await);
    // Both workers' connections survived the floods and still serve calls.
    for c in [&mut first, &mut second] {
        c.register(with_bearer(register_request("fp-1"), EDGE_TOKEN))
            .await
            .expect("an authenticated connection is never closed for a stranger");
    }
    drop(idle);
}

/// Beyond the cap with every held connection authenticated, a new connection is closed at
/// once; when one ends, new ones are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_closes_new_connections_when_every_held_one_is_authenticated() {
    let token = AuthToken::new(EDGE_TOKEN).unwrap();
    let limits = stageb_coordinator::cluster::edge::EdgeLimits {
        max_connections: 3,
        ..Default::default()
    };
    let (addr, _stop) = serve_edge_with_token(limits, &token).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(registered_client(&addr).await);
    }
    // The fourth completes TCP but is closed before HTTP/2 can start: no call gets through.
    let fourth = tokio::time::timeout(Duration::from_secs(3), async {
        let mut health = health_client_result(&addr).await?;
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    assert!(
        !matches!(fourth, Ok(Ok(_))),
        "a connection beyond the cap is refused"
    );
    drop(held);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut health = health_client(&addr).await;
    assert!(
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new()
            })
            .await
            .is_ok(),
        "once connections end, new ones are served"
    );
}

async fn health_client_result(
    addr: &str,
) -> Result<tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>, String> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_string())
        .unwrap()
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(tonic_health::pb::health_client::HealthClient::new(channel))
}

async fn futures_join(
    addr: std::net::SocketAddr,
    n: usize,
) -> Vec<(
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<()>,
)> {
    let mut out = Vec::new();
    for _ in 0..n {
        let (send, driver) = idle_h2_connection(addr).await;
        let send = send.ready().await.unwrap();
        out.push((send, driver));
    }
    out
}

#[tokio::test]
async fn health_watch_is_refused_and_streams_per_connection_are_capped_regression_20000_watch_streams()
 {
    let served = serve_with_token(Some(AuthToken::generate())).await;
    let mut health = health_client(&served.addr).await;
    let watch = health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(watch.code(), Code::Unimplemented);
    // The server advertises its stream cap in SETTINGS; a client cannot exceed it.
    let addr: std::net::SocketAddr = served.addr.trim_start_matches("http://").parse().unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, mut conn) = h2::client::handshake(tcp).await.unwrap();
    let mut send = send.ready().await.unwrap();
    let (response, mut body) = send
        .send_request(health_check_request(addr), false)
        .unwrap();
    let message = prost::Message::encode_to_vec(&tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    });
    body.send_data(grpc_frame_header(message.len() as u32), false)
        .unwrap();
    body.send_data(bytes::Bytes::from(message), true).unwrap();
    tokio::select! {
        r = response => assert_eq!(r.unwrap().status(), 200),
        _ = &mut conn => panic!("connection ended"),
    }
    assert_eq!(conn.max_concurrent_send_streams(), 64);
}

#[tokio::test]
async fn a_large_unauthenticated_health_body_is_refused_after_its_header_regression_4_mib_check_bodies()
 {
    let served = serve_with_token(Some(AuthToken::generate())).await;
    let addr: std::net::SocketAddr = served.addr.trim_start_matches("http://").parse().unwrap();
    let (send, _driver) = idle_h2_connection(addr).await;
    let mut send = send.ready().await.unwrap();
    let (response, mut body) = send
        .send_request(health_check_request(addr), false)
        .unwrap();
    // Announce 4 MiB, send 64 KiB of it and never finish.
    body.send_data(grpc_frame_header(4 << 20), false).unwrap();
    body.send_data(bytes::Bytes::from(vec![b'x'; 64 << 10]), false)
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("answered without waiting for the body")
        .unwrap();
    let status = response
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_string());
    let trailers_status = if status.is_none() {
        let mut body = response.into_body();
        let trailers = tokio::time::timeout(Duration::from_secs(5), body.trailers())
            .await
            .unwrap()
            .unwrap();
        trailers.and_then(|t| {
            t.get("grpc-status")
                .map(|v| v.to_str().unwrap().to_string())
        })
    } else {
        status
    };
    assert_eq!(
        trailers_status.as_deref(),
        Some("11"),
        "OUT_OF_RANGE: the 1 KiB health cap"
    );
}

#[tokio::test]
async fn fingerprint_squatting_fails_regression_first_register_pinned_the_run() {
    let served = serve_pinned(None, ModelPin::by_config("weights-a".into())).await;
    let mut c = client(&served.addr).await;
    let squat = c
        .register(register_request("bogus|candle-x|q|cpu"))
        .await
        .unwrap_err();
    assert_eq!(squat.code(), Code::FailedPrecondition);
    assert!(
        !squat.message().contains("weights-a"),
        "a refusal never prints the expected fingerprint: {}",
        squat.message()
    );
    let real = c
        .register(register_request("weights-a|candle-x|q|cpu"))
        .await
        .unwrap()
        .into_inner();
    assert!(
        !real.session.is_empty(),
        "the real worker is not locked out"
    );
}

#[tokio::test]
async fn a_peer_registering_first_cannot_decide_the_numerics() {
    // Rank 0 runs a worker of its own that takes a moment to load; a token holder registers
    // first with the run's weights and another suffix. It used to pin the run (the real
    // workers were then refused and exited 3).
    let v = CANDLE_VERSION;
    let pin = ModelPin::by_config("weights-a".into()).with_numerics_check(numerics_known);
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig::default());
    let service = server::build_service(
        Arc::new(scheduler),
        &ServiceConfig {
            model: pin,
            ..open_service("run-under-test", Duration::from_secs(1))
        },
    );
    let handle = service.model_handle();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let own = ModelFingerprint {
        weights_sha256: "weights-a".into(),
        candle_version: v.into(),
        dtype: "cpu-q8-fixed-order".into(),
        device: "cpu".into(),
        architecture: "scripted".into(),
    };
    let start = LocalStart {
        addr,
        token: None,
        pin: LocalPin::new(handle.clone()),
    };
    let _workers = roles::spawn_local_workers(1, start, None, Default::default(), move |_| {
        std::thread::sleep(Duration::from_millis(800));
        Ok(ScriptedEngine::new(Script::new(Behaviour::default())).with_fingerprint(own.clone()))
    });
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server::serve(
        listener,
        service,
        EdgeConfig::default(),
        async {
            let _ = stopped.await;
        },
    ));
    let mut c = client(&format!("http://{addr}")).await;
    let squatter = format!("weights-a|candle-{v}|cuda-bf16|cuda");
    let early = c.register(register_request(&squatter)).await.unwrap_err();
    assert_eq!(early.code(), Code::Unavailable, "{}", early.message());
    let made_up = c
        .register(register_request(&format!("weights-a|candle-{v}|q|cpu-x")))
        .await
        .unwrap_err();
    assert_eq!(made_up.code(), Code::FailedPrecondition);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while handle.lock().unwrap().fingerprint.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "rank 0's worker never decided"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pinned = handle.lock().unwrap().clone();
    assert_eq!(pinned.numerics_pinned_by, "rank0_worker");
    let late = c.register(register_request(&squatter)).await.unwrap_err();
    assert_eq!(late.code(), Code::FailedPrecondition);
    let real = format!("weights-a|candle-{v}|cpu-q8-fixed-order|cpu");
    let mut request = register_request(&real);
    // The scripted engine holds any context, and rank 0's worker pinned that.
    request.worker.as_mut().unwrap().max_context = u32::MAX;
    let admitted = c.register(request).await;
    assert!(admitted.is_ok(), "{admitted:?}");
}

async fn lease_one_generate(served: &Served, c: &mut Client) -> (String, u64) {
    let session = c
        .register(register_request("fp-1"))
        .await
        .unwrap()
        .into_inner()
        .session;
    served.scheduler.enqueue(JobPayload::Generate {
        messages: vec![ChatMessage::user("x")],
        json_schema: None,
        seed: 1,
        temperature: 0.3,
        top_p: 0.9,
        repetition_penalty: 1.0,
        max_new_tokens: 16,
    });
    let leased = c
        .lease(pb::LeaseRequest {
            session: session.clone(),
            max_jobs: 1,
            wait_ms: 1000,
        })
        .await
        .unwrap()
        .into_inner();
    (session, leased.jobs[0].lease_id)
}

type Client = pb::coordinator_client::CoordinatorClient<tonic::transport::Channel>;

fn generated(prompt_tokens: u32, finish_reason: String) -> Option<pb::submit_request::Result> {
    Some(pb::submit_request::Result::Generate(pb::GenerateResult {
        text: "{}".into(),
        prompt_tokens,
        prefix_tokens: 0,
        completion_tokens: 2,
        finish_reason,
        latency_us: 10,
        ..Default::default()
    }))
}

#[tokio::test]
async fn a_u32_max_token_count_is_refused_not_a_panic_regression_usage_sum_overflow() {
    let mut served = serve_with_token(None).await;
    let mut c = client(&served.addr).await;
    let (session, lease_id) = lease_one_generate(&served, &mut c).await;
    let err = c
        .submit(pb::SubmitRequest {
            session: session.clone(),
            lease_id,
            result: generated(u32::MAX, "stop".into()),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(served.completions.try_recv().is_err());
    let ok = c
        .submit(pb::SubmitRequest {
            session,
            lease_id,
            result: generated(12, "stop".into()),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.status, pb::SubmitStatus::Accepted as i32);
}

#[tokio::test]
async fn unbounded_worker_strings_are_refused_regression_7_mib_finish_reason_8_mib_name() {
    let served = serve_with_token(None).await;
    let mut c = client(&served.addr).await;
    let long_name = c
        .register(named_register_request(&"n".repeat(1 << 20), "fp-1"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            long_name.code(),
            Code::InvalidArgument | Code::ResourceExhausted
        ),
        "{long_name:?}"
    );
    assert!(!long_name.message().contains("nnnn"));
    let (session, lease_id) = lease_one_generate(&served, &mut c).await;
    let err = c
        .submit(pb::SubmitRequest {
            session,
            lease_id,
            result: generated(12, "x".repeat(7 << 20)),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let bad_code = c
        .submit(pb::SubmitRequest {
            session: "s".into(),
            lease_id,
            result: Some(pb::submit_request::Result::Error(pb::JobError {
                code: "OOPS\nlevel=ERROR".into(),
                message: String::new(),
            })),
        })
        .await
        .unwrap_err();
    assert_eq!(bad_code.code(), Code::InvalidArgument);
}

/// `RegisterRequest` with its string field declared as bytes, to send invalid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawRegisterRequest {
    #[prost(bytes = "vec", tag = "1")]
    run_id: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct AnyResponse {}

#[tokio::test]
async fn invalid_utf8_in_a_message_is_invalid_argument_not_internal() {
    let served = serve_with_token(None).await;
    let channel = tonic::transport::Endpoint::from_shared(served.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let err = grpc
        .unary::<_, AnyResponse, _>(
            tonic::Request::new(RawRegisterRequest {
                run_id: vec![0xff, 0xfe, b'x'],
            }),
            http::uri::PathAndQuery::from_static("/stageb.v1.Coordinator/Register"),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
}

#[test]
fn a_short_token_is_refused_off_loopback_regression_one_character_token() {
    let (code, stderr) = coordinator_off_loopback(Some("x"));
    assert_eq!(code, Some(2), "stderr: {stderr}");
    assert!(stderr.contains("at least 32 bytes"), "stderr: {stderr}");
}

#[test]
fn worker_numerics_this_build_cannot_produce_are_refused_at_the_command_line() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stageb"))
        .args(["coordinator", "--config", "absent.yaml"])
        .args(["--worker-numerics", "cpu-q8-made-up/cpu"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--worker-numerics") && stderr.contains("cpu-q8-made-up/cpu"),
        "{stderr}"
    );
}

#[test]
fn off_loopback_without_a_worker_of_its_own_rank_0_needs_the_numerics_decided() {
    // Otherwise the first peer holding the token decides them.
    let token = "t".repeat(64);
    let (code, stderr) = coordinator_off_loopback(Some(&token));
    assert_eq!(code, Some(2), "stderr: {stderr}");
    assert!(
        stderr.contains("E_NUMERICS_UNDECIDED") && stderr.contains("--worker-numerics"),
        "stderr: {stderr}"
    );
}

// --- Who pins the run's weights when rank 0 cannot read the model ---

/// A copy of the demo's small config whose model rank 0 cannot read and whose runs go under
/// `dir`: a head node without the weights.
fn config_without_a_readable_model(dir: &std::path::Path) -> std::path::PathBuf {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/demo/small/config.yaml"),
    )
    .unwrap()
    .replace(
        ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "/nonexistent/weights-elsewhere.gguf",
    )
    .replace(
        "root: runs",
        &format!("root: {}", dir.join("runs").display()),
    );
    let path = dir.join("config.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `stageb coordinator` on `listen` with `config` and `args`, giving up a second after no worker
/// came: its exit code and stderr.
fn coordinator_without_workers(
    config: &std::path::Path,
    listen: &str,
    args: &[&str],
) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stageb"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["coordinator", "--config"])
        .arg(config)
        .args(["--listen", listen, "--worker-grace-s", "1", "--no-report"])
        .args(args)
        .env("STAGEB_TOKEN", "t".repeat(64))
        .env_remove("STAGEB_TOKEN_FILE")
        .env_remove("STAGEB_MODEL_DIGEST")
        .env_remove("STAGEB_WORKER_NUMERICS")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn off_loopback_a_coordinator_that_cannot_read_the_model_needs_its_digest() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_without_a_readable_model(dir.path());
    let (code, stderr) = coordinator_without_workers(&config, "0.0.0.0:0", &[]);
    assert_eq!(code, Some(2), "stderr: {stderr}");
    assert!(
        stderr.contains("E_MODEL_UNDECIDED") && stderr.contains("--model-digest"),
        "stderr: {stderr}"
    );
    assert!(
        !dir.path().join("runs").exists(),
        "refused before anything was written"
    );
    // Told the digest (and the numerics), it pins the run itself and serves.
    let digest = "ab".repeat(32);
    let (_, stderr) = coordinator_without_workers(
        &config,
        "0.0.0.0:0",
        &[
            "--model-digest",
            &digest,
            "--worker-numerics",
            "cpu-q8-fixed-order/cpu",
        ],
    );
    assert!(!stderr.contains("E_MODEL_UNDECIDED"), "stderr: {stderr}");
    assert!(
        stderr.contains("pinned by the weights digest it was given")
            && stderr.contains("coordinator listening"),
        "stderr: {stderr}"
    );
}

#[test]
fn on_loopback_a_coordinator_that_cannot_read_the_model_still_lets_the_first_worker_pin_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_without_a_readable_model(dir.path());
    let (_, stderr) = coordinator_without_workers(&config, "127.0.0.1:0", &[]);
    assert!(!stderr.contains("E_MODEL_UNDECIDED"), "stderr: {stderr}");
    assert!(
        stderr.contains("the first worker to register pins the run's model")
            && stderr.contains("coordinator listening"),
        "stderr: {stderr}"
    );
}

#[test]
fn a_coordinator_told_the_weights_digest_admits_no_worker_with_other_weights() {
    let dir = tempfile::tempdir().unwrap();
    support::write_toy_mission(dir.path());
    // The scripted model path names no file: rank 0 cannot read the model.
    let config = support::write_config(dir.path(), serde_json::json!({}));
    let inputs = roles::prepare_inputs(&config, "cluster").unwrap();
    let digest = "a".repeat(64);
    let settings = roles::CoordinatorSettings {
        token: None,
        rank0_runs_no_worker: true,
        model_digest: Some(digest.clone()),
        ..support::coordinator_settings(roles::StartMode::Fresh)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ended = runtime.block_on(async {
        let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let rank0 = roles::run_coordinator_until(
            inputs,
            settings,
            move |start| {
                let _ = addr_tx.send(start.addr);
                Vec::new()
            },
            async {
                let _ = stop_rx.await;
            },
        );
        let workers = async move {
            let addr = addr_rx.await.unwrap();
            let mut c = client(&format!("http://{addr}")).await;
            let numerics = format!("candle-{CANDLE_VERSION}|cpu-q8-fixed-order|cpu");
            let other = c
                .register(register_request(&format!("{}|{numerics}", "b".repeat(64))))
                .await
                .unwrap_err();
            assert_eq!(
                other.code(),
                Code::FailedPrecondition,
                "{}",
                other.message()
            );
            assert!(
                other.message().contains("not the run's model")
                    && !other.message().contains(&digest),
                "{}",
                other.message()
            );
            let same = c
                .register(register_request(&format!("{digest}|{numerics}")))
                .await;
            assert!(same.is_ok(), "{same:?}");
            let _ = stop_tx.send(());
        };
        tokio::join!(rank0, workers).0
    });
    let Err(roles::ClusterError::Interrupted { run_dir, .. }) = ended else {
        panic!("the run ended otherwise: {ended:?}");
    };
    let manifest = support::read_json(&run_dir, "manifest.json");
    assert_eq!(manifest["runtime"]["model_pinned_by"], "operator");
}
