//! What a caller may set of the session loop beyond [`super::WorkerOptions`]: the HTTP/2
//! keepalive, and an observer told of every call to rank 0 and what it took. The CLI worker
//! takes the defaults; the load generator (`examples/loadgen.rs`) runs many sessions in one
//! process with a simulated engine and measures them through the observer.

use std::sync::Arc;
use std::time::Duration;

use stageb_shared::pb;

/// Default [`ClientHooks::keepalive`].
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(20);

/// Told what a worker's session loop does, as it does it. Every method does nothing by
/// default. Called from the session loop's task: keep them cheap.
pub trait CallObserver: Send + Sync {
    /// A session was registered (the first, or again after one was lost).
    fn registered(&self) {}
    /// A Lease call returned `jobs` jobs after `took`; rank 0 held it `waited_for_work` for
    /// work to arrive (zero when work was queued).
    fn leased(&self, _took: Duration, _jobs: usize, _waited_for_work: Duration) {}
    /// The jobs in hand after a Lease call handed its jobs over.
    fn holding(&self, _jobs: usize) {}
    /// A Submit call was answered `status` after `took`.
    fn submitted(&self, _took: Duration, _status: pb::SubmitStatus) {}
    /// A job was abandoned before it ended (its lease fenced, or the run stopped under it).
    fn cancelled(&self) {}
    /// The session was lost (rank 0 forgot it, or a call failed): the loop registers again.
    fn session_lost(&self) {}
}

/// The observer that is told nothing.
struct Unobserved;

impl CallObserver for Unobserved {}

/// What a caller may set of the session loop beyond the options.
#[derive(Clone)]
pub struct ClientHooks {
    /// HTTP/2 keepalive ping interval and ack timeout: how long a silently partitioned
    /// connection takes to be noticed.
    pub keepalive: Duration,
    pub observer: Arc<dyn CallObserver>,
}

impl Default for ClientHooks {
    fn default() -> Self {
        ClientHooks {
            keepalive: DEFAULT_KEEPALIVE,
            observer: Arc::new(Unobserved),
        }
    }
}
