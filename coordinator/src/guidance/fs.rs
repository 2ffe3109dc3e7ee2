//! Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory.
//!
//! Both the live `guidance.json` and every snapshot are written this way, so a crash leaves
//! either the old or the new file, never a torn one. Tested through the repository's fault
//! injection (`repo.rs`).

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Write `bytes` to `path` atomically: `{name}.tmp` in the same directory, fsync, rename,
/// fsync the directory. On error the temp file is removed and `path` is untouched (unless the
/// error is the final directory fsync, after which the new content is in place).
pub(super) fn atomic_write(path: &Path, bytes: &[u8], inject_failure: bool) -> io::Result<()> {
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!("{file_name}.tmp"));
    let dir = path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        if inject_failure {
            return Err(io::Error::other("injected failure before rename"));
        }
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    sync_dir(&dir)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}
