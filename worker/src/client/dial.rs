//! Dialing rank 0: the endpoint for a worker's options (plaintext or TLS, and the warning
//! for a token in clear text) and the connect loop with its backoff and window.

use std::time::{Duration, Instant};

use stageb_shared::auth::AuthToken;
use stageb_shared::pb;
use tonic::transport::Endpoint;

use super::{BearerInterceptor, Client, WorkerError, WorkerOptions};

fn endpoint_url(addr: &str, tls: bool) -> String {
    if addr.starts_with("http://") || addr.starts_with("https://") {
        addr.to_string()
    } else if tls {
        format!("https://{addr}")
    } else {
        format!("http://{addr}")
    }
}

/// The endpoint for `opts`: plaintext, or TLS verified against the configured CA; HTTP/2
/// pings every `keepalive`, the connection dropped when one goes unanswered that long.
fn endpoint(opts: &WorkerOptions, keepalive: Duration) -> Result<Endpoint, WorkerError> {
    let url = endpoint_url(&opts.coordinator, opts.tls.is_some());
    let mut endpoint = Endpoint::from_shared(url)
        .map_err(|_| WorkerError::BadAddress(opts.coordinator.clone()))?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(keepalive)
        .keep_alive_timeout(keepalive);
    let host = endpoint.uri().host().unwrap_or("localhost").to_string();
    match &opts.tls {
        Some(tls) => {
            if endpoint.uri().scheme_str() == Some("http") {
                return Err(WorkerError::Tls {
                    addr: opts.coordinator.clone(),
                    reason: "an http:// address with TLS configured (use https:// or host:port)"
                        .into(),
                });
            }
            endpoint = endpoint
                .tls_config(tls.config(&host))
                .map_err(|e| WorkerError::Tls {
                    addr: opts.coordinator.clone(),
                    reason: e.to_string(),
                })?;
        }
        None => {
            let loopback = host == "localhost"
                || host
                    .trim_matches(|c| c == '[' || c == ']')
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback && opts.token.is_some() {
                tracing::warn!(
                    coordinator = %opts.coordinator,
                    "dialing without TLS: the token crosses the network in clear text (pass --tls-ca)"
                );
            }
        }
    }
    Ok(endpoint)
}

/// Dial rank 0 until it answers or `window` has passed since `start` (the first attempt of
/// this reach: a connection that opens but cannot register does not restart the clock).
pub(super) async fn connect(
    opts: &WorkerOptions,
    keepalive: Duration,
    start: Instant,
    window: Duration,
) -> Result<Client, WorkerError> {
    let endpoint = endpoint(opts, keepalive)?;
    let mut backoff = Duration::from_millis(100);
    loop {
        match endpoint.connect().await {
            Ok(channel) => {
                let interceptor = BearerInterceptor(opts.token.as_ref().map(AuthToken::bearer));
                return Ok(pb::coordinator_client::CoordinatorClient::with_interceptor(
                    channel,
                    interceptor,
                )
                .max_decoding_message_size(8 * 1024 * 1024)
                .max_encoding_message_size(8 * 1024 * 1024));
            }
            Err(e) => {
                if start.elapsed() >= window {
                    return Err(WorkerError::Unreachable {
                        addr: opts.coordinator.clone(),
                        waited: start.elapsed(),
                        last: e.to_string(),
                    });
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}
