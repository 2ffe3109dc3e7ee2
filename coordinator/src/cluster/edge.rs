//! Rank 0's network edge: which TCP connections get to speak gRPC, for how long, and with
//! what limits. Everything here holds before a peer has authenticated, so it is written for
//! the hostile case: a socket that never speaks, a flood of connections, a client that keeps
//! a connection open after the run is written.
//!
//! - **Connection cap, authenticated first.** At most [`EdgeLimits::max_connections`]
//!   connections are held (derived from the process's file-descriptor limit), and at most
//!   [`EdgeLimits::max_unauthenticated`] of them have not yet made an authenticated call
//!   ([`Slots`]: the auth interceptor marks a connection when its token matches, or on any call
//!   when the run has no token; under mutual TLS only certified peers get that far). A new
//!   connection beyond either cap closes an unauthenticated one to make room (one that spent
//!   its allowance first, else the oldest), so strangers holding idle connections, stalled
//!   ClientHellos or half-sent health streams cannot lock a worker out; only when every held
//!   connection is authenticated is the new one closed at once (a warning says so, at most
//!   once every few seconds).
//! - **Strangers hold little.** Until it authenticates, a connection is charged for every byte
//!   read from it and for each call it has open ([`crate::cluster::slots`]): reads stop at its
//!   allowance ([`EdgeLimits::unauthenticated_connection_bytes`]) and it is closed if it stays
//!   there for [`EdgeLimits::unauthenticated_stall`]; all strangers together stay within
//!   [`EdgeLimits::unauthenticated_budget_bytes`].
//! - **Preface deadline.** A connection must start speaking (the HTTP/2 preface, or a TLS
//!   ClientHello) within [`EdgeLimits::preface_timeout`]; one that does not is closed before
//!   it reaches the HTTP/2 server, so silent sockets cannot pile up.
//! - **Forced close.** Shutdown is graceful for [`EdgeLimits::shutdown_grace`]; then every
//!   connection still open is aborted, so no client can keep rank 0 from exiting.
//! - **Accept errors** (`EMFILE` and friends) back off instead of spinning.
//!
//! The HTTP/2 and gRPC limits (streams per connection, keepalive, request timeout, header and
//! message sizes) are applied by [`crate::cluster::server::serve`] from the same [`EdgeLimits`].

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::cluster::slots::{Room, SlotGuard};
pub use crate::cluster::slots::{SlotCaps, Slots, StrangerUsage};

/// The first bytes of every HTTP/2 connection (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// First byte of a TLS handshake record (a ClientHello).
const TLS_HANDSHAKE: u8 = 0x16;
/// File descriptors kept back from the connection cap for artifacts, logs and the model.
const FD_RESERVE: usize = 128;
/// Connections the metrics listener (`--metrics-listen`, served by the binary) may hold; kept
/// back from the gRPC cap as well, so the two listeners together never take the descriptors
/// the run needs to write its artifacts.
pub const METRICS_MAX_CONNECTIONS: usize = 64;
/// Least time between two "connection cap reached" warnings.
const CAP_WARNING_EVERY: Duration = Duration::from_secs(10);

/// Largest gRPC message either side may send (prompts, reflection outputs).
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// Every limit of the edge, with its default (listed in docs/design/security.md).
#[derive(Debug, Clone)]
pub struct EdgeLimits {
    /// Connections held at once (default: 4096, or the fd limit less 128 and less the metrics
    /// listener's 64 if lower).
    pub max_connections: usize,
    /// Of those, connections that have not made an authenticated call yet (256): what a
    /// stranger can hold at most, each closed first when a new connection needs room.
    pub max_unauthenticated: usize,
    /// Time a new connection has to send its first bytes (10 s).
    pub preface_timeout: Duration,
    /// Concurrent HTTP/2 streams per connection (64).
    pub max_concurrent_streams: u32,
    /// Longest a single request may take, body included (45 s; `Lease` long-polls ≤ 30 s).
    pub request_timeout: Duration,
    /// HTTP/2 keepalive ping interval and ack timeout (20 s each).
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// Largest request header block (16 KiB).
    pub max_header_list_bytes: u32,
    /// HTTP/2 flow-control windows: per stream (256 KiB) and per connection (1 MiB).
    pub stream_window_bytes: u32,
    pub connection_window_bytes: u32,
    /// Largest `grpc.health.v1` request (1 KiB): health is unauthenticated.
    pub health_message_bytes: usize,
    /// Largest coordinator request (8 MiB: a `Submit` of reflection output); other RPCs are
    /// checked against far smaller caps after decoding.
    pub coordinator_message_bytes: usize,
    /// How long shutdown waits for open connections before aborting them (5 s).
    pub shutdown_grace: Duration,
    /// What one connection may make rank 0 hold before it authenticates (256 KiB): the bytes
    /// read from it, plus 32 KiB for each call it has open (a 16 KiB header list and the
    /// stream's state: [`crate::cluster::slots::STREAM_COST_BYTES`]). Reads stop there; see
    /// `unauthenticated_stall`.
    pub unauthenticated_connection_bytes: usize,
    /// What all unauthenticated connections together may make rank 0 hold (64 MiB). The
    /// defaults are derived so that it holds at the caps: 256 connections x 256 KiB = 64 MiB.
    /// When it is full (only with other settings) the connection holding most is closed.
    pub unauthenticated_budget_bytes: usize,
    /// Calls an unauthenticated connection may have open at once (4: health checks need one);
    /// one more closes the connection. 4 x 32 KiB leaves 128 KiB of the allowance for bytes.
    pub unauthenticated_streams: u32,
    /// How long an unauthenticated connection that spent its allowance may wait for its
    /// first authenticated call to be seen before it is closed (10 s). A worker's first call
    /// carries its token ahead of any bulk, so it waits milliseconds at most.
    pub unauthenticated_stall: Duration,
}

impl Default for EdgeLimits {
    fn default() -> Self {
        EdgeLimits {
            max_connections: connection_cap(4096, fd_limit()),
            max_unauthenticated: 256,
            preface_timeout: Duration::from_secs(10),
            max_concurrent_streams: 64,
            request_timeout: Duration::from_secs(45),
            keepalive_interval: Duration::from_secs(20),
            keepalive_timeout: Duration::from_secs(20),
            max_header_list_bytes: 16 * 1024,
            stream_window_bytes: 256 * 1024,
            connection_window_bytes: 1024 * 1024,
            health_message_bytes: 1024,
            coordinator_message_bytes: MAX_MESSAGE_BYTES,
            shutdown_grace: Duration::from_secs(5),
            unauthenticated_connection_bytes: 256 * 1024,
            unauthenticated_budget_bytes: 64 * 1024 * 1024,
            unauthenticated_streams: 4,
            unauthenticated_stall: Duration::from_secs(10),
        }
    }
}

impl EdgeLimits {
    /// The caps the connection table enforces.
    pub fn slot_caps(&self) -> SlotCaps {
        SlotCaps {
            max_connections: self.max_connections,
            max_unauthenticated: self.max_unauthenticated,
            connection_bytes: self.unauthenticated_connection_bytes,
            budget_bytes: self.unauthenticated_budget_bytes,
            streams: self.unauthenticated_streams,
        }
    }
}

/// `wanted`, lowered to fit the process's descriptor limit with `FD_RESERVE` and the metrics
/// listener's connections to spare.
pub fn connection_cap(wanted: usize, fd_limit: Option<u64>) -> usize {
    match fd_limit {
        Some(limit) => wanted.min(
            (limit as usize)
                .saturating_sub(FD_RESERVE + METRICS_MAX_CONNECTIONS)
                .max(16),
        ),
        None => wanted,
    }
}

/// The soft limit on open file descriptors, if the platform has one.
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every unix
pub fn fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we own and reads nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            return Some(limit.rlim_cur as u64);
        }
        None
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Raise the soft descriptor limit to the hard one (as Go and nginx do at start), so the
/// connection cap is not needlessly low. Returns the new soft limit.
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every unix
pub fn raise_fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: both calls only read or write the struct we own.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return None;
            }
            if limit.rlim_cur < limit.rlim_max {
                let raised = libc::rlimit {
                    rlim_cur: limit.rlim_max,
                    rlim_max: limit.rlim_max,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                    return Some(raised.rlim_cur as u64);
                }
            }
        }
        Some(limit.rlim_cur as u64)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Counts one held connection; the count drops when the connection does.
struct ConnectionPermit(Arc<AtomicUsize>);

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An accepted connection that passed the gate: counted against the cap, charged for what it
/// sends until it authenticates, and aborted when `force_close` fires.
pub struct GatedConnection {
    stream: TcpStream,
    _permit: ConnectionPermit,
    slot: SlotGuard,
    /// Fires at forced shutdown, or when the connection is closed to make room or for
    /// passing its allowance.
    force_close: Pin<Box<WaitForCancellationFutureOwned>>,
    /// How long a full connection may wait to authenticate ([`EdgeLimits::unauthenticated_stall`]).
    stall_limit: Duration,
    /// Set while the connection waits with its allowance spent.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl GatedConnection {
    fn aborted(&mut self, cx: &mut Context<'_>) -> bool {
        self.force_close.as_mut().poll(cx).is_ready()
    }

    /// Wait for room (the connection authenticates or a call ends); close the connection
    /// when none comes within the stall limit.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let limit = self.stall_limit;
        let deadline = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(deadline.as_mut().poll(cx));
        self.slot.close_full();
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "rank 0 closed an unauthenticated connection that spent its allowance",
        )))
    }

    /// Read at most `granted` bytes (already charged) into `buf`; give back what was not read.
    fn poll_read_granted(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
        granted: usize,
    ) -> Poll<io::Result<()>> {
        let mut part = ReadBuf::new(buf.initialize_unfilled_to(granted));
        let polled = Pin::new(&mut self.stream).poll_read(cx, &mut part);
        let used = match polled {
            Poll::Ready(Ok(())) => part.filled().len(),
            _ => 0,
        };
        self.slot.settle(granted, used);
        if used > 0 {
            buf.advance(used);
        }
        polled
    }
}

fn aborted_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "rank 0 closed the connection (shutdown, or room for another)",
    )
}

impl AsyncRead for GatedConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.aborted(cx) {
            return Poll::Ready(Err(aborted_error()));
        }
        if self.slot.is_authenticated() || buf.remaining() == 0 {
            self.stalled = None;
            return Pin::new(&mut self.stream).poll_read(cx, buf);
        }
        match self.slot.reserve(buf.remaining(), cx.waker()) {
            Room::Unlimited => {
                self.stalled = None;
                Pin::new(&mut self.stream).poll_read(cx, buf)
            }
            Room::Granted(granted) => {
                self.stalled = None;
                self.poll_read_granted(cx, buf, granted)
            }
            Room::Full => self.poll_stalled(cx),
            Room::Closed => Poll::Ready(Err(aborted_error())),
        }
    }
}

impl AsyncWrite for GatedConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.aborted(cx) {
            return Poll::Ready(Err(aborted_error()));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl Connected for GatedConnection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

/// The signals that end serving: `stop_accepting` closes the listener (graceful shutdown
/// begins), `force_close` aborts every connection still open.
#[derive(Clone, Default)]
pub struct EdgeShutdown {
    pub stop_accepting: CancellationToken,
    pub force_close: CancellationToken,
}

/// Live connection count, shared with whoever wants to report it.
#[derive(Clone, Default)]
pub struct ConnectionCount(Arc<AtomicUsize>);

impl ConnectionCount {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

/// Accept connections on `listener` through the gate. `tls` says which first bytes to
/// expect. The stream ends when `shutdown.stop_accepting` fires (the listener is dropped
/// then, so the port stops accepting at once).
pub fn gated_incoming(
    listener: TcpListener,
    limits: &EdgeLimits,
    tls: bool,
    shutdown: EdgeShutdown,
    count: ConnectionCount,
    slots: Slots,
) -> ReceiverStream<io::Result<GatedConnection>> {
    let (tx, rx) = mpsc::channel(64);
    let max = limits.max_connections.max(1);
    let preface_timeout = limits.preface_timeout;
    let stall_limit = limits.unauthenticated_stall;
    tokio::spawn(async move {
        let mut refused = 0u64;
        let mut last_warning: Option<Instant> = None;
        let mut accept_backoff = Duration::from_millis(5);
        loop {
            let accepted = tokio::select! {
                _ = shutdown.stop_accepting.cancelled() => break,
                r = listener.accept() => r,
            };
            let (stream, peer) = match accepted {
                Ok(ok) => {
                    accept_backoff = Duration::from_millis(5);
                    ok
                }
                Err(e) => {
                    // EMFILE/ENFILE/ENOBUFS: wait for descriptors to come back instead of
                    // spinning on a listener that stays readable.
                    tracing::warn!("accepting a connection failed: {e}; backing off");
                    tokio::time::sleep(accept_backoff).await;
                    accept_backoff = (accept_backoff * 2).min(Duration::from_millis(500));
                    continue;
                }
            };
            let Some(slot) = slots.admit(peer, &shutdown.force_close) else {
                refused += 1;
                drop(stream);
                if last_warning.is_none_or(|t| t.elapsed() >= CAP_WARNING_EVERY) {
                    tracing::warn!(
                        max_connections = max,
                        refused,
                        %peer,
                        "connection cap reached and every connection authenticated: closing new connections until some end"
                    );
                    last_warning = Some(Instant::now());
                }
                continue;
            };
            // Small gRPC messages both ways: without TCP_NODELAY, Nagle holding the answer for
            // the peer's delayed ACK added ~40 ms to every Lease (tonic sets it on connections
            // it accepts itself; this listener accepts them here).
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(%peer, "TCP_NODELAY not set: {e}");
            }
            count.0.fetch_add(1, Ordering::AcqRel);
            let permit = ConnectionPermit(count.0.clone());
            let tx = tx.clone();
            let close = slot.close_token();
            tokio::spawn(async move {
                match tokio::time::timeout(preface_timeout, speaks_first(&stream, tls)).await {
                    Ok(Ok(true)) => {
                        let conn = GatedConnection {
                            stream,
                            _permit: permit,
                            slot,
                            force_close: Box::pin(close.cancelled_owned()),
                            stall_limit,
                            stalled: None,
                        };
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Ok(false)) => {
                        tracing::debug!(%peer, "closing a connection that does not speak gRPC")
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, "connection failed before its preface: {e}")
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "closing a connection silent for {preface_timeout:?}")
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Wait for the connection's first bytes: the full HTTP/2 preface in plaintext, the TLS
/// handshake record type under TLS. `false` for anything else or for an early close.
async fn speaks_first(stream: &TcpStream, tls: bool) -> io::Result<bool> {
    let want = if tls { 1 } else { H2_PREFACE.len() };
    let mut buf = [0u8; 24];
    loop {
        let n = stream.peek(&mut buf[..want]).await?;
        if n == 0 {
            return Ok(false);
        }
        if tls {
            return Ok(buf[0] == TLS_HANDSHAKE);
        }
        if buf[..n] != H2_PREFACE[..n] {
            return Ok(false);
        }
        if n == want {
            return Ok(true);
        }
        // A partial preface: peek returns at once while bytes are buffered, so wait a little
        // for the rest rather than spin.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: connections accepted here kept Nagle on, and every Lease answer waited
    /// for the worker's delayed ACK (~40 ms: a one-worker run at 200 ms jobs ran at 0.82 of
    /// its ideal rate).
    #[tokio::test]
    async fn accepted_connections_send_small_messages_at_once() {
        use tokio::io::AsyncWriteExt;
        use tokio_stream::StreamExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = EdgeShutdown {
            stop_accepting: CancellationToken::new(),
            force_close: CancellationToken::new(),
        };
        let limits = EdgeLimits::default();
        let mut incoming = gated_incoming(
            listener,
            &limits,
            false,
            shutdown,
            ConnectionCount::default(),
            Slots::new(limits.slot_caps(), StrangerUsage::default()),
        );
        let mut client = TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let conn = incoming.next().await.unwrap().unwrap();
        assert!(conn.stream.nodelay().unwrap());
    }

    /// A gate with a 1 KiB allowance per stranger and a 300 ms stall; the client side of two
    /// connections that each sent the preface and 4 KiB more, and their server side.
    async fn two_strangers_over_their_allowance() -> (Slots, Vec<(TcpStream, GatedConnection)>) {
        use tokio::io::AsyncWriteExt;
        use tokio_stream::StreamExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = EdgeLimits {
            unauthenticated_connection_bytes: 1024,
            unauthenticated_stall: Duration::from_millis(300),
            ..EdgeLimits::default()
        };
        let slots = Slots::new(limits.slot_caps(), StrangerUsage::default());
        let mut incoming = gated_incoming(
            listener,
            &limits,
            false,
            EdgeShutdown::default(),
            ConnectionCount::default(),
            slots.clone(),
        );
        let mut pairs = Vec::new();
        for _ in 0..2 {
            let mut client = TcpStream::connect(addr).await.unwrap();
            client.write_all(H2_PREFACE).await.unwrap();
            client.write_all(&[7u8; 4096]).await.unwrap();
            let conn = incoming.next().await.unwrap().unwrap();
            pairs.push((client, conn));
        }
        (slots, pairs)
    }

    /// Read from `conn` until it fails or `within` passes; the bytes read and the failure.
    async fn read_all(conn: &mut GatedConnection, within: Duration) -> (usize, Option<io::Error>) {
        use tokio::io::AsyncReadExt;
        let mut got = 0;
        let mut buf = [0u8; 8192];
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
                Ok(Ok(0)) | Err(_) => return (got, None),
                Ok(Ok(n)) => got += n,
                Ok(Err(e)) => return (got, Some(e)),
            }
        }
    }

    #[tokio::test]
    async fn a_stranger_is_read_up_to_its_allowance_then_closed_after_the_stall() {
        let (slots, mut pairs) = two_strangers_over_their_allowance().await;
        let (_client, conn) = &mut pairs[0];
        let started = Instant::now();
        let (read, failed) = read_all(conn, Duration::from_secs(5)).await;
        assert_eq!(read, 1024, "nothing past the allowance reaches the server");
        let failed = failed.expect("the connection is closed");
        assert_eq!(failed.kind(), io::ErrorKind::ConnectionAborted);
        assert!(started.elapsed() >= Duration::from_millis(250));
        assert_eq!(slots.held(), (1, 0), "its slot is given back at once");
    }

    #[tokio::test]
    async fn a_full_stranger_that_authenticates_is_read_on_without_a_charge() {
        let (slots, mut pairs) = two_strangers_over_their_allowance().await;
        let (client, conn) = &mut pairs[1];
        let (read, failed) = read_all(conn, Duration::from_millis(100)).await;
        assert_eq!((read, failed.is_none()), (1024, true), "it waits, full");
        slots.mark_authenticated(client.local_addr().unwrap());
        let (rest, failed) = read_all(conn, Duration::from_millis(500)).await;
        assert!(failed.is_none(), "{failed:?}");
        assert_eq!(read + rest, H2_PREFACE.len() + 4096);
    }

    #[test]
    fn the_connection_cap_leaves_descriptors_for_the_run() {
        assert_eq!(
            connection_cap(4096, Some(1024)),
            1024 - FD_RESERVE - METRICS_MAX_CONNECTIONS
        );
        assert_eq!(connection_cap(4096, Some(1_048_576)), 4096);
        assert_eq!(connection_cap(4096, None), 4096);
        assert_eq!(connection_cap(4096, Some(10)), 16);
    }
}
