//! `stageb-worker`: a rank that pulls jobs from rank 0 and runs them on a model.
//!
//! # Layout
//! - [`engine`]: the [`engine::Engine`] interface and the candle implementation (model loading,
//!   tokenizer, chat templates, batched sampling).
//! - [`constraint`]: constrained decoding (the two-line contract and JSON schemas) over the
//!   model's byte-level vocabulary, with llguidance.
//! - [`client`]: the lease → run → submit loop against a coordinator, with heartbeats.
//! - [`generate`]: `stageb generate`, one prompt run like a rollout job, each candidate read
//!   back against the contract.

pub mod client;
pub mod constraint;
pub mod engine;
pub mod generate;
