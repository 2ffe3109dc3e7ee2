//! The Prometheus endpoint (`--metrics-listen`): installs the process-wide `metrics` recorder
//! and serves its text exposition at `GET /metrics`.
//!
//! The libraries only record through the facade (names in [`stageb_shared::observe`]); this
//! module is the one place that decides how they are exported. It is off unless asked for, and
//! the server takes a bound listener and a shutdown future like the gRPC one, so tests bind
//! `127.0.0.1:0`. In `stageb run` rank 0 and its local workers share one process, hence one
//! endpoint with both sets of metrics. The endpoint needs no token: it carries counts and
//! rates only, never a ticket id, a text or a secret (labels are closed sets), but it is still
//! loopback unless the address says otherwise, and a wider address is logged as such.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use stageb_shared::observe;
use tokio::net::TcpListener;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot install the metrics recorder: {0}")]
    Recorder(String),
    #[error("cannot listen for metrics on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

static RECORDER: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// The process's Prometheus recorder, installed on first use (histograms with fixed buckets,
/// so the exposition is real `histogram`s that aggregate across workers).
pub fn recorder() -> Result<PrometheusHandle, MetricsError> {
    RECORDER
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Suffix("_seconds".into()),
                    observe::LATENCY_BUCKETS,
                )
                .map_err(|e| e.to_string())?
                .set_buckets_for_metric(
                    Matcher::Prefix("stageb_worker_step_".into()),
                    observe::STEP_ROW_BUCKETS,
                )
                .map_err(|e| e.to_string())?
                .install_recorder()
                .map_err(|e| e.to_string())?;
            observe::describe_all();
            Ok(handle)
        })
        .clone()
        .map_err(MetricsError::Recorder)
}

/// Serve `GET /metrics` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let render = move || {
        let handle = handle.clone();
        async move {
            (
                [(
                    axum::http::header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                handle.render(),
            )
        }
    };
    let app = axum::Router::new().route("/metrics", axum::routing::get(render));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Bind `addr`, start serving in the background for the life of the process, and return the
/// bound address (port 0 picks one).
pub async fn start(addr: SocketAddr) -> Result<SocketAddr, MetricsError> {
    let handle = recorder()?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    if !bound.ip().is_loopback() {
        tracing::warn!(%bound, "metrics served beyond loopback without authentication (counts and rates only: no ticket ids, texts or secrets)");
    }
    // Histograms and summaries need their upkeep even between scrapes.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(async move {
        if let Err(e) = serve(listener, handle, std::future::pending()).await {
            tracing::warn!("the metrics endpoint stopped: {e}");
        }
    });
    tracing::info!(url = %format!("http://{bound}/metrics"), "serving Prometheus metrics");
    Ok(bound)
}
