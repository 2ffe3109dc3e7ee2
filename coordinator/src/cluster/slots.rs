//! The connections rank 0 holds, which of them have authenticated, and what the others (the
//! strangers) may make it hold. Shared by the accept loop, each connection's reads
//! ([`crate::cluster::edge`]), the auth interceptor and the services ([`ChargeCalls`]).
//!
//! A stranger's connection is charged for what it makes rank 0 hold: every byte read from it,
//! and [`STREAM_COST_BYTES`] for each call it has open. Its charge may not pass its allowance,
//! nor the strangers' charges together the shared budget ([`SlotCaps`]). A read with no room
//! left waits (the edge closes a connection that stays full past its stall deadline); a call
//! beyond the allowance closes its connection; when the shared budget is full, the stranger
//! holding most is closed first. Authenticating gives the whole charge back: from then on the
//! connection has the server's ordinary HTTP/2 limits. The charge is a quota for the
//! connection's whole unauthenticated life: bytes are not given back as they are consumed.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tokio_util::sync::CancellationToken;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

/// What one open call of a stranger is charged: its decoded header list (at most 16 KiB,
/// `EdgeLimits::max_header_list_bytes`) and the HTTP/2, hyper and tonic state of the stream
/// (~11 KB measured), rounded up.
pub const STREAM_COST_BYTES: usize = 32 * 1024;

/// The caps [`Slots`] enforces (from `EdgeLimits`).
#[derive(Debug, Clone, Copy)]
pub struct SlotCaps {
    /// Connections held at once.
    pub max_connections: usize,
    /// Of those, connections that have not authenticated.
    pub max_unauthenticated: usize,
    /// What one stranger's connection may be charged.
    pub connection_bytes: usize,
    /// What all strangers' connections together may be charged.
    pub budget_bytes: usize,
    /// Calls a stranger's connection may have open at once.
    pub streams: u32,
}

/// What strangers hold now, the most they ever held, and how many of their connections were
/// closed for it. Read by tests and reports; written only by [`Slots`].
#[derive(Clone, Default)]
pub struct StrangerUsage(Arc<UsageCounters>);

#[derive(Default)]
struct UsageCounters {
    held: AtomicUsize,
    peak: AtomicUsize,
    over_allowance: AtomicU64,
    over_budget: AtomicU64,
}

impl StrangerUsage {
    /// Bytes charged to unauthenticated connections now.
    pub fn held_bytes(&self) -> usize {
        self.0.held.load(Ordering::Acquire)
    }

    /// The most bytes ever charged to unauthenticated connections at once.
    pub fn peak_bytes(&self) -> usize {
        self.0.peak.load(Ordering::Acquire)
    }

    /// Connections closed for passing their own allowance (bytes or calls).
    pub fn closed_over_allowance(&self) -> u64 {
        self.0.over_allowance.load(Ordering::Acquire)
    }

    /// Connections closed to keep the strangers within the shared budget.
    pub fn closed_over_budget(&self) -> u64 {
        self.0.over_budget.load(Ordering::Acquire)
    }
}

/// Why a stranger's connection was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CloseCause {
    /// A new connection needed its slot.
    Room,
    /// It passed its own allowance.
    Allowance,
    /// The strangers' budget was full and it held most.
    Budget,
}

/// The connections held, in arrival order, and which of them have authenticated (see the
/// module header).
#[derive(Clone)]
pub struct Slots(Arc<Mutex<SlotTable>>);

struct SlotTable {
    caps: SlotCaps,
    next_id: u64,
    /// By arrival (ids increase), so the first unauthenticated entry is the oldest.
    held: BTreeMap<u64, Held>,
    by_peer: HashMap<SocketAddr, u64>,
    unauthenticated: usize,
    /// The sum of the unauthenticated connections' charges.
    charged: usize,
    usage: StrangerUsage,
}

struct Held {
    peer: SocketAddr,
    /// Set once, under the table's lock; read without it by the connection's reads.
    authenticated: Arc<AtomicBool>,
    /// Closes this connection (a child of the edge's `force_close`).
    close: CancellationToken,
    /// Bytes read while unauthenticated, plus [`STREAM_COST_BYTES`] per open call.
    charged: usize,
    streams: u32,
    /// The read waiting for room, woken when some comes back.
    reader: Option<Waker>,
}

impl Held {
    fn full(&self, caps: &SlotCaps) -> bool {
        !self.authenticated.load(Ordering::Relaxed) && self.charged >= caps.connection_bytes
    }
}

/// Room for one read of a connection ([`SlotGuard::reserve`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Room {
    /// The connection has authenticated: read without a charge.
    Unlimited,
    /// Read at most this many bytes (already charged; settle what was not read).
    Granted(usize),
    /// The allowance is spent: wait (the waker is woken when room comes back).
    Full,
    /// The connection was closed.
    Closed,
}

impl Slots {
    pub fn new(caps: SlotCaps, usage: StrangerUsage) -> Self {
        let caps = SlotCaps {
            max_connections: caps.max_connections.max(1),
            max_unauthenticated: caps.max_unauthenticated.max(1),
            connection_bytes: caps.connection_bytes.max(1),
            budget_bytes: caps.budget_bytes.max(1),
            streams: caps.streams,
        };
        Slots(Arc::new(Mutex::new(SlotTable {
            caps,
            next_id: 0,
            held: BTreeMap::new(),
            by_peer: HashMap::new(),
            unauthenticated: 0,
            charged: 0,
            usage,
        })))
    }

    fn table(&self) -> MutexGuard<'_, SlotTable> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection from `peer` made an authenticated call: it is no longer closed to make
    /// room for others, and its charge is given back. Unknown peers (already closed) are
    /// ignored.
    pub fn mark_authenticated(&self, peer: SocketAddr) {
        let mut t = self.table();
        let Some(id) = t.by_peer.get(&peer).copied() else {
            return;
        };
        let Some(h) = t.held.get_mut(&id) else {
            return;
        };
        if h.authenticated.load(Ordering::Relaxed) {
            return;
        }
        h.authenticated.store(true, Ordering::Release);
        let released = std::mem::take(&mut h.charged);
        h.streams = 0;
        let reader = h.reader.take();
        t.unauthenticated -= 1;
        t.charged -= released;
        t.sync_usage();
        if let Some(reader) = reader {
            reader.wake();
        }
    }

    /// Connections held, and how many of them have authenticated.
    pub fn held(&self) -> (usize, usize) {
        let t = self.table();
        (t.held.len(), t.held.len() - t.unauthenticated)
    }

    /// A slot for a new connection from `peer`, closing an unauthenticated connection if a cap
    /// is reached (one that has spent its allowance first, else the oldest); `None` when every
    /// held connection is authenticated and the cap is reached.
    pub(crate) fn admit(
        &self,
        peer: SocketAddr,
        force_close: &CancellationToken,
    ) -> Option<SlotGuard> {
        let mut t = self.table();
        if t.held.len() >= t.caps.max_connections || t.unauthenticated >= t.caps.max_unauthenticated
        {
            let caps = t.caps;
            let strangers = || {
                t.held
                    .iter()
                    .filter(|(_, h)| !h.authenticated.load(Ordering::Relaxed))
            };
            let victim = strangers()
                .find(|(_, h)| h.full(&caps))
                .or_else(|| strangers().next())
                .map(|(id, _)| *id)?;
            t.close(victim, CloseCause::Room);
        }
        let id = t.next_id;
        t.next_id += 1;
        let close = force_close.child_token();
        let authenticated = Arc::new(AtomicBool::new(false));
        t.held.insert(
            id,
            Held {
                peer,
                authenticated: authenticated.clone(),
                close: close.clone(),
                charged: 0,
                streams: 0,
                reader: None,
            },
        );
        t.by_peer.insert(peer, id);
        t.unauthenticated += 1;
        Some(SlotGuard {
            slots: self.clone(),
            id,
            close,
            authenticated,
        })
    }

    /// Charge a call opened on `peer`'s connection, if it has not authenticated. A call beyond
    /// the connection's allowance closes the connection (`None`); so does a full shared
    /// budget when this connection holds most (else the one that does is closed).
    pub fn open_call(&self, peer: SocketAddr) -> Option<CallCharge> {
        let mut t = self.table();
        let id = t.by_peer.get(&peer).copied()?;
        let caps = t.caps;
        let h = t.held.get(&id)?;
        if h.authenticated.load(Ordering::Relaxed) {
            return None;
        }
        if h.streams >= caps.streams || h.charged + STREAM_COST_BYTES > caps.connection_bytes {
            tracing::debug!(peer = %h.peer, "closing an unauthenticated connection over its allowance of calls or bytes");
            t.close(id, CloseCause::Allowance);
            return None;
        }
        if !t.make_room(id, STREAM_COST_BYTES) {
            return None;
        }
        let h = t.held.get_mut(&id)?;
        h.streams += 1;
        h.charged += STREAM_COST_BYTES;
        t.charged += STREAM_COST_BYTES;
        t.sync_usage();
        Some(CallCharge {
            slots: self.clone(),
            id,
        })
    }
}

impl SlotTable {
    fn remove(&mut self, id: u64) -> Option<Held> {
        let h = self.held.remove(&id)?;
        if self.by_peer.get(&h.peer) == Some(&id) {
            self.by_peer.remove(&h.peer);
        }
        if !h.authenticated.load(Ordering::Relaxed) {
            self.unauthenticated -= 1;
            self.charged -= h.charged;
            self.sync_usage();
        }
        Some(h)
    }

    /// Close connection `id` now: its charge is given back at once (its reads fail from here
    /// on, so what it buffered is dropped with it).
    fn close(&mut self, id: u64, cause: CloseCause) {
        let Some(mut h) = self.remove(id) else {
            return;
        };
        match cause {
            CloseCause::Room => {
                tracing::debug!(peer = %h.peer, "closing an unauthenticated connection to make room")
            }
            CloseCause::Allowance => {
                self.usage.0.over_allowance.fetch_add(1, Ordering::AcqRel);
            }
            CloseCause::Budget => {
                tracing::debug!(peer = %h.peer, "closing the unauthenticated connection holding most: the strangers' budget is full");
                self.usage.0.over_budget.fetch_add(1, Ordering::AcqRel);
            }
        }
        h.close.cancel();
        if let Some(reader) = h.reader.take() {
            reader.wake();
        }
    }

    /// Make room for `want` more bytes in the shared budget, closing the strangers that hold
    /// most (the oldest of equals) until there is. `false` when `id` itself was closed.
    fn make_room(&mut self, id: u64, want: usize) -> bool {
        while self.charged + want > self.caps.budget_bytes {
            let victim = self
                .held
                .iter()
                .filter(|(_, h)| !h.authenticated.load(Ordering::Relaxed))
                .max_by(|(a_id, a), (b_id, b)| a.charged.cmp(&b.charged).then(b_id.cmp(a_id)))
                .map(|(victim, _)| *victim);
            let Some(victim) = victim else {
                return true;
            };
            self.close(victim, CloseCause::Budget);
            if victim == id {
                return false;
            }
        }
        true
    }

    fn sync_usage(&self) {
        let usage = &self.usage.0;
        usage.held.store(self.charged, Ordering::Release);
        usage.peak.fetch_max(self.charged, Ordering::AcqRel);
    }
}

/// One connection's place in [`Slots`]; given back when the connection ends.
pub(crate) struct SlotGuard {
    slots: Slots,
    id: u64,
    close: CancellationToken,
    authenticated: Arc<AtomicBool>,
}

impl SlotGuard {
    /// Fires when rank 0 closes this connection (room, allowance, budget or shutdown).
    pub(crate) fn close_token(&self) -> CancellationToken {
        self.close.clone()
    }

    pub(crate) fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Acquire)
    }

    /// Room for a read of up to `want` bytes, charged before the read so the strangers never
    /// hold more than the budget even for a moment. `waker` is kept while the connection is
    /// full.
    pub(crate) fn reserve(&self, want: usize, waker: &Waker) -> Room {
        let mut t = self.slots.table();
        let caps = t.caps;
        let Some(h) = t.held.get_mut(&self.id) else {
            return Room::Closed;
        };
        if h.authenticated.load(Ordering::Relaxed) {
            return Room::Unlimited;
        }
        let own = caps.connection_bytes.saturating_sub(h.charged);
        if own == 0 {
            h.reader = Some(waker.clone());
            return Room::Full;
        }
        let want = want.min(own).max(1);
        if !t.make_room(self.id, want) {
            return Room::Closed;
        }
        let Some(h) = t.held.get_mut(&self.id) else {
            return Room::Closed;
        };
        h.charged += want;
        t.charged += want;
        t.sync_usage();
        Room::Granted(want)
    }

    /// Give back what a granted read did not use.
    pub(crate) fn settle(&self, granted: usize, used: usize) {
        let unused = granted.saturating_sub(used);
        if unused == 0 {
            return;
        }
        let mut t = self.slots.table();
        let Some(h) = t.held.get_mut(&self.id) else {
            return;
        };
        if h.authenticated.load(Ordering::Relaxed) {
            return;
        }
        h.charged -= unused;
        t.charged -= unused;
        t.sync_usage();
    }

    /// Close this connection: it stayed full past its stall deadline.
    pub(crate) fn close_full(&self) {
        let mut t = self.slots.table();
        if let Some(h) = t.held.get(&self.id) {
            tracing::debug!(peer = %h.peer, "closing an unauthenticated connection that spent its allowance");
        }
        t.close(self.id, CloseCause::Allowance);
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.slots.table().remove(self.id);
    }
}

/// One open call of a stranger, charged to its connection until the call's answer is ready.
pub struct CallCharge {
    slots: Slots,
    id: u64,
}

impl Drop for CallCharge {
    fn drop(&mut self) {
        let mut t = self.slots.table();
        let Some(h) = t.held.get_mut(&self.id) else {
            return;
        };
        if h.authenticated.load(Ordering::Relaxed) || h.streams == 0 {
            return;
        }
        h.streams -= 1;
        h.charged -= STREAM_COST_BYTES;
        let reader = h.reader.take();
        t.charged -= STREAM_COST_BYTES;
        t.sync_usage();
        if let Some(reader) = reader {
            reader.wake();
        }
    }
}

/// A gRPC service whose calls on a stranger's connection are charged to it
/// ([`Slots::open_call`]) until their answer is ready. The inner service is called first, so
/// the auth interceptor has marked a caller with a token before the charge is decided.
#[derive(Clone)]
pub struct ChargeCalls<S> {
    inner: S,
    slots: Slots,
}

impl<S> ChargeCalls<S> {
    pub fn new(inner: S, slots: Slots) -> Self {
        ChargeCalls { inner, slots }
    }
}

type CallFuture<R> = Pin<Box<dyn Future<Output = Result<R, Infallible>> + Send>>;

impl<S, B> Service<http::Request<B>> for ChargeCalls<S>
where
    S: Service<http::Request<B>, Error = Infallible>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = CallFuture<S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let peer = remote_addr(&request);
        let call = self.inner.call(request);
        let charge = peer.and_then(|peer| self.slots.open_call(peer));
        Box::pin(async move {
            let answer = call.await;
            drop(charge);
            answer
        })
    }
}

impl<S: NamedService> NamedService for ChargeCalls<S> {
    const NAME: &'static str = S::NAME;
}

/// The peer of a request, in plaintext or under TLS (as `tonic::Request::remote_addr`).
fn remote_addr<B>(request: &http::Request<B>) -> Option<SocketAddr> {
    let ext = request.extensions();
    ext.get::<TcpConnectInfo>()
        .and_then(|i| i.remote_addr())
        .or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.get_ref().remote_addr())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1024;

    fn caps(connection_bytes: usize, budget_bytes: usize) -> SlotCaps {
        SlotCaps {
            max_connections: 100,
            max_unauthenticated: 10,
            connection_bytes,
            budget_bytes,
            streams: 2,
        }
    }

    fn peer(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Counts its wakes.
    struct Wakes(AtomicUsize);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waker() -> (Arc<Wakes>, Waker) {
        let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
        (wakes.clone(), Waker::from(wakes))
    }

    /// Reserve `want` and use all of it; what was granted.
    fn read(slot: &SlotGuard, want: usize) -> Room {
        let room = slot.reserve(want, &waker().1);
        if let Room::Granted(n) = room {
            slot.settle(n, n);
        }
        room
    }

    #[test]
    fn a_strangers_reads_are_charged_up_to_its_allowance_then_it_waits() {
        let usage = StrangerUsage::default();
        let slots = Slots::new(caps(KIB, 64 * KIB), usage.clone());
        let force = CancellationToken::new();
        let slot = slots.admit(peer(1), &force).unwrap();
        let room = slot.reserve(600, &waker().1);
        assert_eq!(room, Room::Granted(600));
        slot.settle(600, 400);
        assert_eq!(usage.held_bytes(), 400, "what was not read is given back");
        assert_eq!(read(&slot, 10 * KIB), Room::Granted(KIB - 400));
        assert_eq!(usage.held_bytes(), KIB);
        let (wakes, full) = waker();
        assert_eq!(slot.reserve(1, &full), Room::Full);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
        assert!(
            !slot.close_token().is_cancelled(),
            "a full connection waits"
        );
        assert_eq!(usage.peak_bytes(), KIB);
    }

    #[test]
    fn authenticating_gives_the_charge_back_wakes_the_reader_and_lifts_the_limits() {
        let usage = StrangerUsage::default();
        let slots = Slots::new(caps(KIB, 64 * KIB), usage.clone());
        let force = CancellationToken::new();
        let slot = slots.admit(peer(1), &force).unwrap();
        let call = slots.open_call(peer(1)).map(|_| ());
        assert!(
            call.is_none(),
            "a 32 KiB call does not fit a 1 KiB allowance"
        );
        let slot = {
            drop(slot);
            slots.admit(peer(1), &force).unwrap()
        };
        read(&slot, KIB);
        let (wakes, full) = waker();
        assert_eq!(slot.reserve(1, &full), Room::Full);
        slots.mark_authenticated(peer(1));
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            1,
            "the waiting read is woken"
        );
        assert_eq!(usage.held_bytes(), 0);
        assert!(slot.is_authenticated());
        assert_eq!(slot.reserve(1 << 20, &full), Room::Unlimited);
        assert!(
            slots.open_call(peer(1)).is_none(),
            "its calls are not charged"
        );
        assert_eq!(slots.held(), (1, 1));
        assert_eq!(usage.held_bytes(), 0);
    }

    #[test]
    fn closing_a_connection_gives_its_charge_back() {
        let usage = StrangerUsage::default();
        let slots = Slots::new(caps(KIB, 64 * KIB), usage.clone());
        let force = CancellationToken::new();
        let a = slots.admit(peer(1), &force).unwrap();
        let b = slots.admit(peer(2), &force).unwrap();
        read(&a, 300);
        read(&b, 500);
        assert_eq!(usage.held_bytes(), 800);
        drop(a);
        assert_eq!(usage.held_bytes(), 500);
        // A read granted just before its connection closed gives nothing back twice.
        let room = b.reserve(100, &waker().1);
        assert_eq!(room, Room::Granted(100));
        drop(b);
        assert_eq!(usage.held_bytes(), 0);
        assert_eq!(slots.held(), (0, 0));
    }

    #[test]
    fn when_the_budget_is_full_the_stranger_holding_most_is_closed_first() {
        let usage = StrangerUsage::default();
        let slots = Slots::new(caps(KIB, 1500), usage.clone());
        let force = CancellationToken::new();
        let a = slots.admit(peer(1), &force).unwrap();
        let b = slots.admit(peer(2), &force).unwrap();
        let c = slots.admit(peer(3), &force).unwrap();
        assert_eq!(read(&a, 900), Room::Granted(900));
        assert_eq!(read(&b, 500), Room::Granted(500));
        // 1400 held: 400 more does not fit; `a` holds most and goes.
        assert_eq!(read(&c, 400), Room::Granted(400));
        assert!(a.close_token().is_cancelled());
        assert!(!b.close_token().is_cancelled());
        assert_eq!(a.reserve(1, &waker().1), Room::Closed);
        assert_eq!(usage.held_bytes(), 900);
        assert_eq!(
            read(&b, 1000),
            Room::Granted(524),
            "up to its own allowance"
        );
        assert_eq!(usage.held_bytes(), 1424);
        assert_eq!(read(&c, 100), Room::Granted(100), "b (1024) goes, c stays");
        assert!(b.close_token().is_cancelled());
        let d = slots.admit(peer(4), &force).unwrap();
        assert_eq!(read(&d, 1000), Room::Granted(1000));
        assert_eq!(usage.held_bytes(), 1500);
        // When the reader itself holds most, it is the one closed.
        assert_eq!(read(&d, 1), Room::Closed, "d (1000) holds most: it goes");
        assert!(d.close_token().is_cancelled());
        assert!(!c.close_token().is_cancelled());
        assert_eq!(usage.closed_over_budget(), 3);
        assert!(usage.peak_bytes() <= 1500, "{}", usage.peak_bytes());
    }

    #[test]
    fn a_stranger_opening_more_calls_than_its_allowance_is_closed() {
        let usage = StrangerUsage::default();
        let slots = Slots::new(caps(256 * KIB, 64 * KIB * KIB), usage.clone());
        let force = CancellationToken::new();
        let slot = slots.admit(peer(1), &force).unwrap();
        let first = slots.open_call(peer(1)).expect("first call");
        let second = slots.open_call(peer(1)).expect("second call");
        assert_eq!(usage.held_bytes(), 2 * STREAM_COST_BYTES);
        assert!(slots.open_call(peer(1)).is_none());
        assert!(
            slot.close_token().is_cancelled(),
            "the third call closes it"
        );
        assert_eq!(usage.closed_over_allowance(), 1);
        assert_eq!(usage.held_bytes(), 0);
        drop((first, second));
        assert_eq!(usage.held_bytes(), 0, "nothing is given back twice");
    }

    #[test]
    fn a_finished_call_gives_its_charge_back_and_wakes_a_full_reader() {
        let usage = StrangerUsage::default();
        let slots = Slots::new(caps(2 * STREAM_COST_BYTES, 64 * KIB * KIB), usage.clone());
        let force = CancellationToken::new();
        let slot = slots.admit(peer(1), &force).unwrap();
        let call = slots.open_call(peer(1)).unwrap();
        assert_eq!(read(&slot, 1 << 20), Room::Granted(STREAM_COST_BYTES));
        let (wakes, full) = waker();
        assert_eq!(slot.reserve(1, &full), Room::Full);
        drop(call);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(usage.held_bytes(), STREAM_COST_BYTES);
        assert_eq!(read(&slot, 1 << 20), Room::Granted(STREAM_COST_BYTES));
    }

    #[test]
    fn a_new_connection_closes_a_stranger_that_spent_its_allowance_before_the_oldest() {
        let slots = Slots::new(
            SlotCaps {
                max_unauthenticated: 2,
                ..caps(KIB, 64 * KIB)
            },
            StrangerUsage::default(),
        );
        let force = CancellationToken::new();
        let oldest = slots.admit(peer(1), &force).unwrap();
        let full = slots.admit(peer(2), &force).unwrap();
        read(&full, KIB);
        let _third = slots.admit(peer(3), &force).unwrap();
        assert!(full.close_token().is_cancelled());
        assert!(!oldest.close_token().is_cancelled());
        let _fourth = slots.admit(peer(4), &force).unwrap();
        assert!(oldest.close_token().is_cancelled(), "then the oldest");
    }
}
