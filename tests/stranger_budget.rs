//! What connections that have not authenticated can make rank 0 hold, at the caps: 256 such
//! connections (`EdgeLimits::max_unauthenticated`), each sending all it can. Until it
//! authenticates, a connection is charged for the bytes read from it and for its open calls;
//! the charges stay within the strangers' budget (64 MiB), a connection past its allowance
//! is closed, and a worker with the token registers and works throughout. What is measured is
//! the edge's own account of the charges (`StrangerUsage`), not the process's memory.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use stageb_coordinator::cluster::edge::{EdgeLimits, StrangerUsage, raise_fd_limit};
use stageb_coordinator::cluster::scheduler::{Scheduler, SchedulerConfig};
use stageb_coordinator::cluster::server::{EdgeConfig, ModelPin, ServiceConfig};
use stageb_shared::auth::AuthToken;
use stageb_shared::pb;
use support::{open_service, serve_loopback};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

const TOKEN: &str = "stranger-budget-token-0123456789abcdef0123";
/// As many strangers as rank 0 holds: `EdgeLimits::max_unauthenticated`.
const STRANGERS: usize = 256;
const KIB: usize = 1024;

struct Rank0 {
    addr: SocketAddr,
    strangers: StrangerUsage,
    limits: EdgeLimits,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Rank 0 with a token and the default edge limits, except `stall`.
async fn rank0(stall: Duration) -> Rank0 {
    raise_fd_limit();
    let limits = EdgeLimits {
        unauthenticated_stall: stall,
        ..EdgeLimits::default()
    };
    assert_eq!(limits.max_unauthenticated, STRANGERS);
    let token = AuthToken::new(TOKEN).unwrap();
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig::default());
    let service = ServiceConfig {
        token: Some(token.clone()),
        model: ModelPin::by_resumed_run("fp-1".into()),
        ..open_service("budget", Duration::from_secs(1))
    };
    let edge = EdgeConfig {
        limits: limits.clone(),
        token: Some(token),
        ..Default::default()
    };
    let strangers = edge.strangers.clone();
    let server = serve_loopback(Arc::new(scheduler), &service, edge).await;
    Rank0 {
        addr: server.addr,
        strangers,
        limits,
        _stop: server.stop,
    }
}

/// A stranger that speaks HTTP/2 and then sends `bytes` in frames of an unknown type, which the
/// server must read and discard (flow control does not cover them). Resolves to whether rank 0
/// closed the connection within `within`.
fn flood_unknown_frames(addr: SocketAddr, bytes: usize, within: Duration) -> JoinHandle<bool> {
    tokio::spawn(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut read, mut write) = tcp.into_split();
        let writer = tokio::spawn(async move {
            write.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
            write.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await?; // SETTINGS, empty
            let payload = 16 * KIB;
            let mut frame = vec![0u8; 9 + payload];
            frame[..3].copy_from_slice(&(payload as u32).to_be_bytes()[1..]);
            frame[3] = 0xfa; // no such frame type
            for _ in 0..bytes.div_ceil(frame.len()) {
                write.write_all(&frame).await?;
            }
            Ok::<_, std::io::Error>(write)
        });
        let closed = tokio::time::timeout(within, async {
            let mut buf = [0u8; 4096];
            while let Ok(n) = read.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await
        .is_ok();
        writer.abort();
        closed
    })
}

/// A worker with the token: registers, leases and heartbeats.
async fn legit_worker_works(addr: SocketAddr) {
    let mut c = pb::coordinator_client::CoordinatorClient::connect(format!("http://{addr}"))
        .await
        .expect("the worker connects");
    let registered = c
        .register(with_token(pb::RegisterRequest {
            run_id: String::new(),
            worker: Some(pb::WorkerInfo {
                name: "legit".into(),
                device: "cpu".into(),
                model_fingerprint: "fp-1".into(),
                capacity: 1,
                version: "test".into(),
                max_context: 8192,
            }),
            previous_session: String::new(),
        }))
        .await
        .expect("the worker registers")
        .into_inner();
    c.lease(with_token(pb::LeaseRequest {
        session: registered.session.clone(),
        max_jobs: 1,
        wait_ms: 10,
    }))
    .await
    .expect("the worker leases");
    c.heartbeat(with_token(pb::HeartbeatRequest {
        session: registered.session,
        ..Default::default()
    }))
    .await
    .expect("the worker heartbeats");
}

fn with_token<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

/// Wait until `done` holds (checked every 20 ms), at most `within`.
async fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_caps_strangers_flooding_bytes_hold_at_most_the_budget_and_are_closed() {
    let rank0 = rank0(Duration::from_secs(5)).await;
    let budget = rank0.limits.unauthenticated_budget_bytes;
    let allowance = rank0.limits.unauthenticated_connection_bytes;
    assert_eq!(
        STRANGERS * allowance,
        budget,
        "the defaults fill the budget at the caps"
    );
    // Each sends four times its allowance: 1 MiB, the most HTTP/2 lets a connection buffer.
    let floods: Vec<_> = (0..STRANGERS)
        .map(|_| flood_unknown_frames(rank0.addr, 4 * allowance, Duration::from_secs(60)))
        .collect();
    let usage = rank0.strangers.clone();
    assert!(
        eventually(Duration::from_secs(20), || usage.held_bytes() > budget / 2).await,
        "the strangers' bytes are charged: {} held",
        usage.held_bytes()
    );
    tokio::time::timeout(Duration::from_secs(20), legit_worker_works(rank0.addr))
        .await
        .expect("the worker works during the flood");
    assert!(usage.held_bytes() > 0, "the flood was still on");
    for flood in floods {
        assert!(
            flood.await.unwrap(),
            "a stranger past its allowance is closed"
        );
    }
    eprintln!(
        "{STRANGERS} strangers sent {} MiB each; they held at most {} bytes (budget {budget}); {} closed over their allowance",
        4 * allowance / (KIB * KIB),
        usage.peak_bytes(),
        usage.closed_over_allowance()
    );
    assert!(
        usage.peak_bytes() <= budget,
        "strangers held {} bytes, over the {budget} budget",
        usage.peak_bytes()
    );
    // The worker's connection took one stranger's slot; every other one was closed for
    // spending its allowance.
    assert!(
        usage.closed_over_allowance() >= (STRANGERS - 2) as u64,
        "{} closed over their allowance",
        usage.closed_over_allowance()
    );
    assert_eq!(usage.held_bytes(), 0, "closing gives the charges back");
}

/// An HTTP/2 connection that completed its handshake; the request sender and the driver.
async fn h2_connection(
    addr: SocketAddr,
) -> (h2::client::SendRequest<bytes::Bytes>, JoinHandle<()>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    (send.ready().await.unwrap(), driver)
}

/// Open a `grpc.health.v1` `Check` that announces a 1000-byte message, send half of it and
/// keep the call open (the server waits for the rest).
async fn hold_a_health_call(
    send: &mut h2::client::SendRequest<bytes::Bytes>,
    addr: SocketAddr,
) -> Option<(h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>)> {
    let ready = send.clone().ready().await.ok()?;
    *send = ready;
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut body) = send.send_request(request, false).ok()?;
    let mut frame = vec![0u8];
    frame.extend_from_slice(&1000u32.to_be_bytes());
    frame.extend_from_slice(&[b'x'; 500]);
    body.send_data(bytes::Bytes::from(frame), false).ok()?;
    Some((response, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_caps_strangers_holding_calls_open_stay_within_the_budget_and_a_fifth_call_closes_one()
 {
    let rank0 = rank0(Duration::from_secs(10)).await;
    let calls = rank0.limits.unauthenticated_streams as usize;
    let usage = rank0.strangers.clone();
    let mut strangers = Vec::new();
    let mut held = Vec::new();
    for _ in 0..STRANGERS {
        let (mut send, driver) = h2_connection(rank0.addr).await;
        for _ in 0..calls {
            held.push(hold_a_health_call(&mut send, rank0.addr).await.unwrap());
        }
        strangers.push((send, driver));
    }
    let charged_calls = STRANGERS * calls * stageb_coordinator::cluster::slots::STREAM_COST_BYTES;
    assert!(
        eventually(Duration::from_secs(20), || usage.held_bytes()
            >= charged_calls)
        .await,
        "every open call is charged: {} held, {charged_calls} expected",
        usage.held_bytes()
    );
    let budget = rank0.limits.unauthenticated_budget_bytes;
    assert!(usage.peak_bytes() <= budget, "{}", usage.peak_bytes());
    assert_eq!(
        usage.closed_over_allowance(),
        0,
        "four calls each are allowed"
    );
    tokio::time::timeout(Duration::from_secs(20), legit_worker_works(rank0.addr))
        .await
        .expect("the worker works while strangers hold their calls");
    // One call more than the allowance closes each stranger's connection.
    let mut fifth = Vec::new();
    for (send, _) in &mut strangers {
        fifth.push(hold_a_health_call(send, rank0.addr).await);
    }
    for (_, driver) in strangers {
        tokio::time::timeout(Duration::from_secs(20), driver)
            .await
            .expect("a stranger over its call allowance is closed")
            .unwrap();
    }
    eprintln!(
        "{STRANGERS} strangers holding {calls} calls each: at most {} bytes held (budget {budget}); {} closed at their fifth call",
        usage.peak_bytes(),
        usage.closed_over_allowance()
    );
    assert!(
        usage.closed_over_allowance() >= (STRANGERS - 1) as u64,
        "{}",
        usage.closed_over_allowance()
    );
    assert!(usage.peak_bytes() <= budget, "{}", usage.peak_bytes());
    assert!(
        eventually(Duration::from_secs(5), || usage.held_bytes() == 0).await,
        "{} still held",
        usage.held_bytes()
    );
    drop((held, fifth));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_authenticates_is_no_longer_charged_and_gets_the_ordinary_limits() {
    let rank0 = rank0(Duration::from_millis(500)).await;
    let usage = rank0.strangers.clone();
    let (mut send, driver) = h2_connection(rank0.addr).await;
    let register = prost::Message::encode_to_vec(&pb::RegisterRequest {
        run_id: String::new(),
        worker: Some(pb::WorkerInfo {
            name: "raw".into(),
            device: "cpu".into(),
            model_fingerprint: "fp-1".into(),
            capacity: 1,
            version: "test".into(),
            max_context: 8192,
        }),
        previous_session: String::new(),
    });
    let request = http::Request::builder()
        .method("POST")
        .uri(format!(
            "http://{}/stageb.v1.Coordinator/Register",
            rank0.addr
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(())
        .unwrap();
    let (response, mut body) = send.send_request(request, false).unwrap();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(register.len() as u32).to_be_bytes());
    frame.extend_from_slice(&register);
    body.send_data(bytes::Bytes::from(frame), true).unwrap();
    assert_eq!(response.await.unwrap().status(), 200);
    assert!(
        usage.peak_bytes() > 0,
        "its bytes were charged until it authenticated"
    );
    assert_eq!(usage.held_bytes(), 0, "authenticating gave the charge back");
    // Twice the calls a stranger may hold, on the same connection, without the token.
    let calls = 2 * rank0.limits.unauthenticated_streams as usize;
    let mut held = Vec::new();
    for _ in 0..calls {
        held.push(hold_a_health_call(&mut send, rank0.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!driver.is_finished(), "the connection is still open");
    assert_eq!(usage.held_bytes(), 0, "its calls are not charged");
    assert_eq!(usage.closed_over_allowance(), 0);
    drop(held);
}
