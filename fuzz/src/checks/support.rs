//! Helpers shared by the checks: a scratch directory per thread (parsers that read from a
//! path get the input written there) and a line count to bound reported lines.

use std::path::PathBuf;
use std::sync::OnceLock;

/// This thread's scratch directory, under one temporary directory per process (removed when
/// the process exits normally; libFuzzer runs one process per target, so a few KB stay
/// behind at most after a crash). One per thread, because the stable corpus replay runs
/// targets on parallel test threads in one process.
pub fn scratch() -> PathBuf {
    static ROOT: OnceLock<tempfile::TempDir> = OnceLock::new();
    let root = ROOT.get_or_init(|| tempfile::tempdir().expect("a temp dir"));
    let id = format!("{:?}", std::thread::current().id());
    let dir = root
        .path()
        .join(id.replace(|c: char| !c.is_ascii_alphanumeric(), ""));
    std::fs::create_dir_all(&dir).expect("create a scratch dir");
    dir
}

/// A fresh, empty subdirectory of the scratch directory, named `name`.
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a scratch dir");
    dir
}

/// The number of lines a located error may name in `bytes`: one per `\n`, plus the last.
pub fn line_count(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| b == b'\n').count() + 1
}

/// Splits `data` at each `\0` into at most `n` parts (the rest stays in the last one).
pub fn split_parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    data.splitn(n, |&b| b == 0).collect()
}
