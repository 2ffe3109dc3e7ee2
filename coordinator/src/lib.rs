//! `stageb-coordinator`: rank 0. Leases work to workers, validates what comes back, makes
//! every decision deterministically, and is the only process that writes artifacts.
//!
//! # Layout
//! - [`cluster`]: facing the workers: gRPC service, connection gate, model pin, the lease
//!   table (`cluster/scheduler/`: jobs, journal, result checks, speculation), completions.
//! - [`run`]: the epoch loop: rollout prompts, ticket recording, step checkpoints, start and
//!   resume of a run directory, prefix-reuse accounting.
//! - [`decide`]: selection, the fail-first guardrail, eligibility, accuracy windows.
//! - [`learn`]: two-pass reflection, op checks, rule text, feedback, need-review.
//! - [`guidance`]: the per-run guidance repository (atomic, snapshotted, hash-chained).
//! - [`progress`]: what rank 0 is doing now (its phase) and the ETA, for the progress display
//!   and the `stageb_phase` metric; written by the run loop and reflection alike.
//! - [`artifacts`]: crash-safe JSONL appends, atomic whole-file writes, artifact file names,
//!   and the typed rows and documents that rank 0 writes and `stageb-inspect` reads.

pub mod artifacts;
pub mod cluster;
pub mod decide;
pub mod guidance;
pub mod learn;
pub mod progress;
pub mod run;
