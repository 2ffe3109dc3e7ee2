//! `stageb-worker`: a rank that pulls jobs from rank 0 and runs them on a model.
//!
//! # Layout
//! - [`engine`]: the [`engine::Engine`] interface and the candle implementation (model loading,
//!   tokenizer, chat templates, batched sampling).
//! - [`constraint`]: constrained decoding (the two-line contract and JSON schemas) over the
//!   model's byte-level vocabulary, with llguidance: the `stageb-constraint` crate, re-exported
//!   under its old path (it needs no candle, so the fuzz targets build it alone).
//! - [`client`]: the lease → run → submit loop against a coordinator, with heartbeats; up to
//!   `--max-jobs` jobs in hand within the KV budget.
//! - [`runner`]: the engine thread: the jobs in hand in one continuous batch (or one at a
//!   time on an engine that does not batch), each ending on its own.
//! - [`job_codec`]: leased jobs into engine jobs, engine results into submissions.
//! - `pace.rs`: the measured pace that caps the jobs in hand to what finishes within the
//!   lease TTL.
//! - [`generate`]: `stageb generate`, one prompt run like a rollout job, each candidate read
//!   back against the contract.
//! - [`probe`]: the hidden `stageb probe` diagnostics (logits, greedy tokens and the timed
//!   rollout workload on token ids, for the GPU check against transformers).

pub mod client;
pub use stageb_constraint as constraint;
pub mod engine;
pub mod generate;
pub mod job_codec;
mod pace;
pub mod probe;
pub mod runner;
