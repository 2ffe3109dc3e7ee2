//! TLS and mutual TLS on the coordinator's gRPC port, with certificates generated in the test
//! (rcgen): what a TLS server refuses, and that `stageb tls-init`'s certificates work for both
//! sides. The demo over mTLS with separate processes is in `tests/e2e_real_model.rs`.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use stageb_coordinator::cluster::scheduler::{Scheduler, SchedulerConfig};
use stageb_coordinator::cluster::server::EdgeConfig;
use stageb_shared::pb;
use stageb_shared::tls::{ClientTls, ServerTls};
use support::{open_service, serve_loopback};

/// A CA that can sign leaf certificates.
struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(params, key),
    }
}

/// A leaf for `localhost`/127.0.0.1 signed by `ca`; `expired` puts its validity in the past.
fn leaf(ca: &Ca, usage: ExtendedKeyUsagePurpose, expired: bool) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.extended_key_usages = vec![usage];
    if expired {
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    }
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Serve with `tls`; returns the port and the stop switch.
async fn serve_tls(tls: ServerTls) -> (u16, tokio::sync::oneshot::Sender<()>) {
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig::default());
    let service = open_service("tls", Duration::from_secs(1));
    let edge = EdgeConfig {
        tls: Some(tls),
        ..Default::default()
    };
    let server = serve_loopback(Arc::new(scheduler), &service, edge).await;
    (server.addr.port(), server.stop)
}

fn register_request() -> pb::RegisterRequest {
    pb::RegisterRequest {
        run_id: String::new(),
        worker: Some(pb::WorkerInfo {
            name: "tls-test".into(),
            device: "cpu".into(),
            model_fingerprint: "w|c|d|cpu".into(),
            capacity: 1,
            version: "test".into(),
            max_context: 8192,
        }),
        previous_session: String::new(),
    }
}

/// Register over `url` with `tls` (or plaintext); Ok on a successful call.
async fn try_register(url: String, tls: Option<ClientTls>) -> Result<(), String> {
    let mut endpoint = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls.config("localhost")).unwrap();
    }
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    let mut client = pb::coordinator_client::CoordinatorClient::new(channel);
    client
        .register(register_request())
        .await
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
}

struct Setup {
    _dir: tempfile::TempDir,
    port: u16,
    _stop: tokio::sync::oneshot::Sender<()>,
    ca: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    dir: PathBuf,
}

/// A server with a certificate from CA "good"; mutual when `mutual`.
async fn setup(mutual: bool, expired_server: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let good = ca("good");
    let (server_cert, server_key) =
        leaf(&good, ExtendedKeyUsagePurpose::ServerAuth, expired_server);
    let (client_cert, client_key) = leaf(&good, ExtendedKeyUsagePurpose::ClientAuth, false);
    let ca = write(&path, "ca.pem", &good.pem);
    let tls = ServerTls::from_files(
        Some(&write(&path, "server.pem", &server_cert)),
        Some(&write(&path, "server.key", &server_key)),
        mutual.then_some(ca.as_path()),
    )
    .unwrap()
    .unwrap();
    let (port, stop) = serve_tls(tls).await;
    Setup {
        _dir: dir,
        port,
        _stop: stop,
        client_cert: write(&path, "client.pem", &client_cert),
        client_key: write(&path, "client.key", &client_key),
        ca,
        dir: path,
    }
}

fn client_tls(ca: &Path, identity: Option<(&Path, &Path)>) -> Option<ClientTls> {
    ClientTls::from_files(Some(ca), identity.map(|i| i.0), identity.map(|i| i.1), None).unwrap()
}

#[tokio::test]
async fn a_tls_server_serves_a_verifying_client_and_refuses_plaintext() {
    let s = setup(false, false).await;
    let url = format!("https://127.0.0.1:{}", s.port);
    try_register(url, client_tls(&s.ca, None))
        .await
        .expect("TLS with the right CA works");
    let plain = try_register(format!("http://127.0.0.1:{}", s.port), None).await;
    assert!(plain.is_err(), "a plaintext client is refused");
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused() {
    let s = setup(false, false).await;
    let other = ca("other");
    let other_ca = write(&s.dir, "other-ca.pem", &other.pem);
    let r = try_register(
        format!("https://127.0.0.1:{}", s.port),
        client_tls(&other_ca, None),
    )
    .await;
    assert!(r.is_err(), "wrong CA accepted");
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let s = setup(false, true).await;
    let r = try_register(
        format!("https://127.0.0.1:{}", s.port),
        client_tls(&s.ca, None),
    )
    .await;
    r.expect_err("an expired certificate was accepted");
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_from_the_ca() {
    let s = setup(true, false).await;
    let url = format!("https://127.0.0.1:{}", s.port);
    assert!(
        try_register(url.clone(), client_tls(&s.ca, None))
            .await
            .is_err(),
        "a client without a certificate is refused under mTLS"
    );
    try_register(
        url.clone(),
        client_tls(&s.ca, Some((&s.client_cert, &s.client_key))),
    )
    .await
    .expect("a client with a certificate from the CA is served");
    // A client certificate from another CA, and an expired one from the right CA.
    let other = ca("other");
    let (cert, key) = leaf(&other, ExtendedKeyUsagePurpose::ClientAuth, false);
    let (c, k) = (write(&s.dir, "o.pem", &cert), write(&s.dir, "o.key", &key));
    assert!(
        try_register(url.clone(), client_tls(&s.ca, Some((&c, &k))))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn an_expired_client_certificate_is_refused_under_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let good = ca("good");
    let (server_cert, server_key) = leaf(&good, ExtendedKeyUsagePurpose::ServerAuth, false);
    let (client_cert, client_key) = leaf(&good, ExtendedKeyUsagePurpose::ClientAuth, true);
    let ca_path = write(dir.path(), "ca.pem", &good.pem);
    let tls = ServerTls::from_files(
        Some(&write(dir.path(), "s.pem", &server_cert)),
        Some(&write(dir.path(), "s.key", &server_key)),
        Some(&ca_path),
    )
    .unwrap()
    .unwrap();
    let (port, _stop) = serve_tls(tls).await;
    let c = write(dir.path(), "c.pem", &client_cert);
    let k = write(dir.path(), "c.key", &client_key);
    assert!(
        try_register(
            format!("https://127.0.0.1:{port}"),
            client_tls(&ca_path, Some((&c, &k)))
        )
        .await
        .is_err(),
        "an expired client certificate was accepted"
    );
}

#[tokio::test]
async fn tls_init_certificates_serve_both_sides_by_the_coordinator_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tls");
    stageb::certs::write_job_certificates(&out, &[], 1).unwrap();
    let (ca, cert, key) = (
        out.join("ca.pem"),
        out.join("node.pem"),
        out.join("node.key"),
    );
    let tls = ServerTls::from_files(Some(&cert), Some(&key), Some(&ca))
        .unwrap()
        .unwrap();
    assert!(tls.is_mutual());
    let (port, _stop) = serve_tls(tls).await;
    let client = ClientTls::from_files(
        Some(&ca),
        Some(&cert),
        Some(&key),
        Some("stageb-coordinator"),
    )
    .unwrap()
    .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(client.config("127.0.0.1"))
        .unwrap()
        .connect()
        .await
        .expect("the job certificate verifies as stageb-coordinator");
    pb::coordinator_client::CoordinatorClient::new(channel)
        .register(register_request())
        .await
        .expect("and authenticates the worker");
}

/// Regression: a worker with a token but no TLS, pointed at a mutual-TLS port, retried
/// forever despite `--connect-timeout-s` (its connections opened, every Register failed, and
/// only connection failures counted against the window), logging nothing at INFO. Connecting
/// and registering now share the window, and the error says what is likely wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_worker_at_a_mutual_tls_port_gives_up_after_its_connect_window() {
    let s = setup(true, false).await;
    let opts = stageb_worker::client::WorkerOptions {
        token: Some(stageb_shared::auth::AuthToken::new("t".repeat(40)).unwrap()),
        connect_timeout: Duration::from_secs(2),
        ..support::worker_options(format!("127.0.0.1:{}", s.port))
    };
    let engine = support::ScriptedEngine::new(support::Script::new(support::Behaviour::default()));
    let ended = tokio::time::timeout(
        Duration::from_secs(20),
        stageb_worker::client::run_worker(engine, opts, std::future::pending()),
    )
    .await
    .expect("the worker gives up within its window, not never");
    let err = ended.expect_err("no registration is possible").to_string();
    assert!(err.contains("cannot reach the coordinator"), "{err}");
    assert!(err.contains("--tls-ca"), "{err}");
}
