//! `stageb-shared`: everything rank 0 and the workers must agree on.
//!
//! # Layout
//! - [`pb`]: the generated wire protocol (`proto/stageb/v1/stageb.proto`), behind one re-export.
//! - [`domain`]: tickets, verdicts, decode specs, chat messages: the typed values the rest of
//!   the code works on after decoding at the edge.
//! - [`error`]: stable error codes and the located input error (file, line, code).
//! - [`config`]: the YAML run config with the Python original's keys, strictly validated.
//! - [`ingest`]: Stage-A JSONL into tickets, every bad line a located, coded error.
//! - [`limits`]: the run's token limits, fitted into the model's context.
//! - [`placement`]: which GPU a worker runs on, one rule for every launcher.
//! - [`text`]: Chinese text normalization (traditional→simplified, spaces) and the canonical
//!   third-state vocabulary.
//! - [`contract`]: the strict two-line verdict parser (the rubric every candidate passes on
//!   rank 0).
//! - [`digest`]: canonical JSON and sha256 input digests.
//! - [`reflection_schema`]: typed decision/ops pass outputs and their JSON schemas.
//! - [`seed`]: stable candidate-seed derivation and the counter-based per-token random draw.
//! - [`auth`]: the shared token (env or file) and its constant-time check.
//! - [`telemetry`]: tracing setup (text or JSON logs).
//! - [`tls`]: TLS/mTLS material for gRPC links, read from PEM files.
//! - [`wire`]: caps on what a peer sends, log-safe rendering, the edge codec.

pub mod auth;
pub mod budget;
pub mod config;
pub mod contract;
pub mod digest;
pub mod domain;
pub mod error;
pub mod ingest;
pub mod limits;
pub mod observe;
pub mod placement;
pub mod reflection_schema;
pub mod seed;
pub mod telemetry;
pub mod text;
pub mod tls;
pub mod wire;

/// The generated protocol. Only this module names prost types; the rest of stageb converts
/// them into [`domain`] values at the gRPC edge.
pub mod pb {
    tonic::include_proto!("stageb.v1");
}

/// Version of every JSONL row and JSON artifact schema written by rank 0.
pub const SCHEMA_VERSION: u32 = 1;
