//! What the worker's real-model tests share: where the test model is.
//!
//! The model is part of the suite, not optional: `scripts/ci/test.sh` fetches it and exports
//! `STAGEB_MODEL`. A missing model fails the test with the fix in the message, rather than
//! skipping it (a skipped real-model test would pass CI without ever running).

use std::path::{Path, PathBuf};

/// The real test model (SmolLM2-135M-Instruct Q4_1): `STAGEB_MODEL`, else the fetch cache.
pub fn model_path() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    match stageb_worker::engine::default_model_path(&root) {
        Some(p) if p.exists() => p,
        Some(p) => panic!(
            "STAGEB_MODEL={} does not exist; run scripts/fetch-model.sh",
            p.display()
        ),
        None => panic!(
            "test model missing: run scripts/fetch-model.sh (or scripts/ci/test.sh, which runs it)"
        ),
    }
}
