//! The Prometheus endpoint (`--metrics-listen`): installs the process-wide `metrics` recorder
//! and serves its text exposition at `GET /metrics`.
//!
//! The libraries only record through the facade (names in [`stageb_shared::observe`]); this
//! module is the one place that decides how they are exported. It is off unless asked for, and
//! the server takes a bound listener and a shutdown future like the gRPC one, so tests bind
//! `127.0.0.1:0`. In `stageb run` rank 0 and its local workers share one process, hence one
//! endpoint with both sets of metrics. The endpoint needs no token: it carries counts and
//! rates only, never a ticket id, a text or a secret (labels are closed sets), but it is still
//! loopback unless the address says otherwise, and a wider address is logged as such. Its
//! connections are capped and deadlined ([`MetricsLimits`]) so strangers cannot use it to take
//! rank 0's descriptors or memory.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use stageb_coordinator::cluster::edge;
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

/// The metrics listener's connection policy. It needs no token, so it is written for the
/// hostile case like the gRPC edge (`stageb_coordinator::cluster::edge`): a flood of idle or
/// half-sent connections can use up only this listener's own slots, never the descriptors
/// or memory rank 0 needs to finish the run.
#[derive(Debug, Clone)]
pub struct MetricsLimits {
    /// Connections held at once ([`edge::METRICS_MAX_CONNECTIONS`], also kept back from the
    /// gRPC cap); a new one beyond it is closed at once.
    pub max_connections: usize,
    /// Time a connection has to send its whole request head (5 s).
    pub header_timeout: Duration,
    /// Longest a connection lives, response included (30 s).
    pub connection_timeout: Duration,
}

impl Default for MetricsLimits {
    fn default() -> Self {
        MetricsLimits {
            max_connections: edge::METRICS_MAX_CONNECTIONS,
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(30),
        }
    }
}

/// Largest request head buffered (hyper's minimum): a half-sent request holds at most this.
const MAX_REQUEST_HEAD_BYTES: usize = 8192;

/// Serve `GET /metrics` on `listener` until `shutdown` resolves, with the default limits.
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, handle, MetricsLimits::default(), shutdown).await
}

/// Serve `GET /metrics` on `listener` under `limits` until `shutdown` resolves. One request
/// per connection (Prometheus reconnects for every scrape anyway), so no connection idles.
pub async fn serve_with(
    listener: TcpListener,
    handle: PrometheusHandle,
    limits: MetricsLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let held = Arc::new(AtomicUsize::new(0));
    let mut backoff = Duration::from_millis(5);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(5);
                stream
            }
            Err(e) => {
                tracing::debug!("metrics: accepting a connection failed: {e}; backing off");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
                continue;
            }
        };
        if held.fetch_add(1, Ordering::AcqRel) >= limits.max_connections {
            held.fetch_sub(1, Ordering::AcqRel);
            drop(stream);
            continue;
        }
        let permit = Slot(held.clone());
        let (handle, limits) = (handle.clone(), limits.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req| {
                std::future::ready(Ok::<_, std::convert::Infallible>(respond(&handle, &req)))
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(MAX_REQUEST_HEAD_BYTES)
                .keep_alive(false);
            let conn = http.serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(limits.connection_timeout, conn).await;
        });
    }
}

/// One held metrics connection; the count drops with it.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `GET /metrics` gets the exposition; any other path 404, any other method 405.
fn respond<B>(handle: &PrometheusHandle, req: &Request<B>) -> Response<Full<Bytes>> {
    let (status, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => (StatusCode::OK, handle.render()),
        (_, "/metrics") => (StatusCode::METHOD_NOT_ALLOWED, String::new()),
        _ => (StatusCode::NOT_FOUND, String::new()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
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
