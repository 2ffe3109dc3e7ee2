//! Rank 0 facing the workers: the gRPC service and the connection gate in front of it, which
//! model a run accepts, the lease table, and waiting for results.
//!
//! - [`server`]: the gRPC service (thin: decode, call the scheduler, encode), auth, health.
//! - [`edge`]: the connection gate (cap, preface deadline, forced close after the grace).
//! - [`slots`]: the connections held, which have authenticated, and what strangers may hold.
//! - [`model_pin`]: which model and context a run accepts, and who decided them.
//! - [`scheduler`]: the lease table (queues, TTLs, fencing, re-leasing), with the journal of
//!   accepted answers, the checks an answer must pass and straggler speculation.
//! - [`completions`]: waiting for job results, giving up when no worker is alive.

pub mod completions;
pub mod dispatch;
pub mod edge;
pub mod model_pin;
pub mod scheduler;
pub mod server;
pub mod slots;
