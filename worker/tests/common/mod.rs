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

/// How many cases a long property walks: `full` under `STAGEB_TEST_DEPTH=full` (the long suite,
/// `scripts/ci/test.sh --full`), else `quick`, the slice CI runs on every push. The quick slice
/// still meets every kind of case the full walk does; the full walk adds samples, not kinds.
pub fn depth(quick: usize, full: usize) -> usize {
    match std::env::var("STAGEB_TEST_DEPTH").as_deref() {
        Ok("full") => full,
        _ => quick,
    }
}

/// Whether this is the long suite (`STAGEB_TEST_DEPTH=full`): a check that only repeats, on a
/// bigger model, what a smaller one already showed in CI runs there.
pub fn full_depth() -> bool {
    depth(0, 1) == 1
}
