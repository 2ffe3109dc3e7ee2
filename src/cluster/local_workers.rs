//! Workers started in this process (the embedded run, `launch`'s rank 0), and the name every
//! worker goes by in logs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use stageb_shared::auth::AuthToken;
use stageb_shared::tls::ClientTls;
use stageb_worker::client::{JobLimits, WorkerOptions, WorkerSummary, run_worker};
use stageb_worker::engine::Engine;
use tokio::task::JoinHandle;

/// Handles of workers started in this process.
pub type LocalWorkers = Vec<JoinHandle<Result<WorkerSummary, String>>>;

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

/// Start `n` in-process workers, each with its own engine built by `make_engine(index)` on a
/// blocking thread (model loading is CPU-heavy).
pub fn spawn_local_workers<E, F>(
    n: usize,
    addr: SocketAddr,
    token: Option<AuthToken>,
    tls: Option<ClientTls>,
    limits: JobLimits,
    make_engine: F,
) -> LocalWorkers
where
    E: Engine + 'static,
    F: Fn(usize) -> Result<E, String> + Send + Sync + 'static,
{
    let make_engine = Arc::new(make_engine);
    (0..n)
        .map(|i| {
            let make_engine = make_engine.clone();
            let token = token.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let engine = tokio::task::spawn_blocking(move || make_engine(i))
                    .await
                    .map_err(|e| format!("engine loader panicked: {e}"))??;
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
