//! The error type shared by op application and the repository.
//!
//! [`GuidanceError`] is returned both by the pure [`super::apply_ops`] (nothing applied, an
//! invariant broken) and by [`super::GuidanceRepo`] (I/O, snapshot, options), so it sits below
//! both rather than in either.

use super::edits::SkippedOp;
use stageb_shared::error::InputError;
use std::io;
use std::path::{Path, PathBuf};

/// Errors of the guidance repository.
#[derive(Debug, thiserror::Error)]
pub enum GuidanceError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("guidance I/O on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("snapshot of the current guidance into {path} failed: {source}")]
    Snapshot { path: PathBuf, source: io::Error },
    #[error("reflection {reflection_id} did not modify guidance ({} op(s) skipped)", skipped.len())]
    NothingApplied {
        reflection_id: String,
        skipped: Vec<SkippedOp>,
    },
    #[error("guidance invariant violated: {0}")]
    Invariant(String),
    #[error("reflection_id must be non-empty")]
    InvalidReflectionId,
    #[error("guidance.retention must be at least 1")]
    InvalidRetention,
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> GuidanceError + '_ {
    move |source| GuidanceError::Io {
        path: path.to_path_buf(),
        source,
    }
}
