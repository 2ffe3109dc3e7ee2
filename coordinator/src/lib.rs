//! `stageb-coordinator`: rank 0. Leases work to workers, validates what comes back, makes
//! every decision deterministically, and is the only process that writes artifacts.
//!
//! # Layout
//! - [`server`]: the gRPC service (thin: decode, call the scheduler, encode), auth, health.
//! - [`model_pin`]: which model and context a run accepts, and who decided them.
//! - [`edge`]: the connection gate in front of it (cap, preface deadline, forced close).
//! - [`scheduler`]: the lease table: queues, TTLs, fencing, re-leasing.
//! - [`result_check`]: what a worker's answer must be to be accepted (shape, sizes, counters).
//! - [`prompts`]: the rollout and reflection prompts built from guidance and summaries.
//! - [`selection`], [`signals`]: one verdict per ticket by majority vote, then the
//!   mission-scoped fail-first override.
//! - [`eligibility`]: which tickets carry learnable signal (gradient candidates).
//! - [`guidance`]: the per-run guidance repository (atomic, snapshotted, hash-chained).
//! - [`ops`]: validation of reflection operations proposed by the model.
//! - [`rule_text`]: whether a proposed rule text is a rule (no label leak, not a number, …).
//! - [`feedback`]: which rule (key and generation) buffered hit/miss feedback belongs to.
//! - [`need_review`]: the stop-gradient queue and its deterministic aggregation.
//! - [`metrics`]: accuracy windows and epoch rows, recomputable from selections.
//! - [`reflection`]: the two-pass reflection driver (decision → need-review, ops → guidance).
//! - [`completions`]: waiting for job results, giving up when no worker is alive.
//! - [`artifacts`]: crash-safe JSONL appends and atomic whole-file writes.
//! - [`journal`]: every accepted model answer by payload digest, replayed by `--resume`.
//! - [`run`]: the epoch loop tying it together.
//! - [`start`]: fresh start, `--overwrite` or `--resume` of a run directory.

pub mod artifacts;
pub mod checkpoint;
pub mod completions;
pub mod edge;
pub mod eligibility;
pub mod feedback;
pub mod guidance;
pub mod journal;
pub mod metrics;
pub mod model_pin;
pub mod need_review;
pub mod ops;
pub mod prompts;
pub mod reflection;
pub mod result_check;
pub mod rule_text;
pub mod run;
pub mod scheduler;
pub mod selection;
pub mod server;
pub mod signals;
pub mod speculation;
pub mod start;
