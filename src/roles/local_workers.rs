//! Workers started in this process (the embedded run, `launch`'s rank 0), and the name every
//! worker goes by in logs. The first of them to load its model decides the run's numerics
//! ([`LocalPin`]): rank 0 trusts its own worker, not the first peer to register.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use stageb_coordinator::cluster::server::ModelPinHandle;
use stageb_shared::auth::AuthToken;
use stageb_shared::tls::ClientTls;
use stageb_worker::client::{JobLimits, WorkerOptions, WorkerSummary, run_worker};
use stageb_worker::engine::Engine;
use tokio::task::JoinHandle;

/// Handles of workers started in this process.
pub type LocalWorkers = Vec<JoinHandle<Result<WorkerSummary, String>>>;

/// Rank 0's model pin as its own workers see it: while they load, other workers are told to
/// retry; the first loaded engine's fingerprint decides the numerics; a failed load leaves the
/// decision to the first acceptable worker.
#[derive(Clone)]
pub struct LocalPin(ModelPinHandle);

impl LocalPin {
    pub fn new(pin: ModelPinHandle) -> Self {
        LocalPin(pin)
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut stageb_coordinator::cluster::server::ModelPin) -> T,
    ) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A worker's identity for logs: `host:pid:index`.
pub fn worker_name(index: usize) -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}:{index}", std::process::id())
}

/// Where in-process workers find rank 0, and the pin their models decide.
pub struct LocalStart {
    pub addr: SocketAddr,
    pub token: Option<AuthToken>,
    pub pin: LocalPin,
}

/// Start `n` in-process workers, each with its own engine built by `make_engine(index)` on a
/// blocking thread (model loading is CPU-heavy). Call it before rank 0 serves: with `n > 0`
/// the pin waits for these workers' numerics from the first request on.
pub fn spawn_local_workers<E, F>(
    n: usize,
    start: LocalStart,
    tls: Option<ClientTls>,
    limits: JobLimits,
    make_engine: F,
) -> LocalWorkers
where
    E: Engine + 'static,
    F: Fn(usize) -> Result<E, String> + Send + Sync + 'static,
{
    let LocalStart { addr, token, pin } = start;
    if n > 0 {
        pin.with(|p| p.expect_local());
    }
    let make_engine = Arc::new(make_engine);
    (0..n)
        .map(|i| {
            let make_engine = make_engine.clone();
            let token = token.clone();
            let tls = tls.clone();
            let pin = pin.clone();
            tokio::spawn(async move {
                let loaded = tokio::task::spawn_blocking(move || make_engine(i))
                    .await
                    .map_err(|e| format!("engine loader panicked: {e}"))
                    .and_then(|r| r);
                let engine = match loaded {
                    Ok(engine) => {
                        pin.with(|p| p.decide_local(&engine.fingerprint().id()));
                        engine
                    }
                    Err(e) => {
                        pin.with(|p| p.release_local());
                        return Err(e);
                    }
                };
                let opts = WorkerOptions {
                    coordinator: addr.to_string(),
                    token,
                    tls,
                    name: worker_name(i),
                    device: "local".into(),
                    run_id: String::new(),
                    connect_timeout: Duration::from_secs(30),
                    reconnect_timeout: stageb_worker::client::DEFAULT_RECONNECT_TIMEOUT,
                    limits,
                };
                run_worker(engine, opts, std::future::pending())
                    .await
                    .map_err(|e| e.to_string())
            })
        })
        .collect()
}
