//! Security properties of the coordinator, checked against a real gRPC server on an ephemeral
//! loopback port and, for the listen policy, the real binary.

use std::sync::Arc;
use std::time::Duration;

use stageb_coordinator::scheduler::{DecodeJob, JobPayload, Scheduler, SchedulerConfig};
use stageb_coordinator::server::{self, ServiceConfig};
use stageb_shared::auth::AuthToken;
use stageb_shared::domain::ChatMessage;
use stageb_shared::pb;
use tokio::net::TcpListener;
use tonic::Code;
use tonic::metadata::MetadataValue;

struct Served {
    addr: String,
    scheduler: Arc<Scheduler>,
    completions: tokio::sync::mpsc::UnboundedReceiver<stageb_coordinator::scheduler::Completion>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve_with_token(token: Option<AuthToken>) -> Served {
    let (scheduler, completions) = Scheduler::new(SchedulerConfig::default());
    let scheduler = Arc::new(scheduler);
    let service = server::build_service(
        scheduler.clone(),
        &ServiceConfig {
            run_id: "run-under-test".into(),
            token: token.clone(),
            expected_fingerprint: Some("fp-1".into()),
            heartbeat_interval: Duration::from_secs(1),
        },
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server::serve(listener, service, token, async {
        let _ = stopped.await;
    }));
    Served {
        addr,
        scheduler,
        completions,
        _stop: stop,
    }
}

fn register_request(fingerprint: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        run_id: String::new(),
        worker: Some(pb::WorkerInfo {
            name: "test".into(),
            device: "cpu".into(),
            model_fingerprint: fingerprint.into(),
            capacity: 1,
            version: "test".into(),
        }),
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
        prefill_us: 1,
        decode_us: 1,
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

#[test]
fn listening_off_loopback_without_a_token_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stageb"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "coordinator",
            "--config",
            "examples/demo/small/config.yaml",
            "--listen",
            "0.0.0.0:0",
        ])
        .env_remove("STAGEB_TOKEN")
        .env_remove("STAGEB_TOKEN_FILE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("without a token"), "stderr: {stderr}");
}
