//! Crash-safe artifact files. Rank 0 is the only writer.
//!
//! - JSONL rows are serialized to one complete line and written with a single `write_all`, so
//!   a crash leaves at most a torn *last* line, never a torn middle. Files are synced at step
//!   boundaries and before any guidance change ([`JsonlWriter::sync`]).
//! - Whole files (`manifest.json`, `summary.json`, `guidance.json`, …) go through
//!   [`write_atomic`]: a temp file in the same directory, fsync, rename, fsync of the directory.
//!   Readers see the old file or the new one, never a mix.
//!
//! What the files hold: their names ([`files`]), the rows of the per-ticket JSONL files
//! ([`rows`]) and the run's manifest and summary ([`documents`]), one type each, shared by
//! rank 0 (the writer) and `stageb report`/`stageb audit` (the readers).

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

pub mod documents;
pub mod rows;
pub mod seal;

/// An append-only JSONL file, sealed at every sync when its run has a key ([`seal`]).
pub struct JsonlWriter {
    path: PathBuf,
    file: File,
    rows: u64,
    /// Bytes in the file (what a step checkpoint weighs the journal by).
    bytes: u64,
    sealer: Option<seal::Sealer>,
}

impl JsonlWriter {
    /// Create (or truncate) `path`: per-run artifacts start fresh.
    pub fn create(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)?;
        Ok(JsonlWriter {
            path: path.to_path_buf(),
            file,
            rows: 0,
            bytes: 0,
            sealer: seal::Sealer::for_file(path, b"")?,
        })
    }

    /// Open `path` for appending after a crash: a torn last line (no trailing newline) is cut
    /// off first, earlier bytes are never rewritten. Returns the writer and how many complete
    /// rows the file holds.
    pub fn open_resume(path: &Path) -> io::Result<Self> {
        let mut rows = 0u64;
        let mut kept = 0u64;
        let sealer;
        if path.exists() {
            let bytes = fs::read(path)?;
            let keep = match bytes.iter().rposition(|b| *b == b'\n') {
                Some(i) => i + 1,
                None => 0,
            };
            if keep < bytes.len() {
                tracing::warn!(path = %path.display(), dropped = bytes.len() - keep, "truncating a torn last line");
                let f = OpenOptions::new().write(true).open(path)?;
                f.set_len(keep as u64)?;
                f.sync_all()?;
            }
            rows = bytes[..keep].iter().filter(|b| **b == b'\n').count() as u64;
            kept = keep as u64;
            sealer = seal::Sealer::for_file(path, &bytes[..keep])?;
        } else {
            sealer = seal::Sealer::for_file(path, b"")?;
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(JsonlWriter {
            path: path.to_path_buf(),
            file,
            rows,
            bytes: kept,
            sealer,
        })
    }

    pub fn append<T: Serialize>(&mut self, row: &T) -> io::Result<()> {
        let line = serde_json::to_vec(row).map_err(io::Error::other)?;
        self.append_raw(line)
    }

    /// Appends `line`, one serialized JSON object without its newline.
    pub fn append_raw(&mut self, mut line: Vec<u8>) -> io::Result<()> {
        line.push(b'\n');
        self.file.write_all(&line)?;
        if let Some(s) = &mut self.sealer {
            s.update(&line);
        }
        self.rows += 1;
        self.bytes += line.len() as u64;
        Ok(())
    }

    /// Make everything appended so far durable, and seal it.
    pub fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()?;
        match &self.sealer {
            Some(s) => s.write(self.bytes),
            None => Ok(()),
        }
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Replace `path` atomically with `bytes`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("atomic write needs a file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Serialize `value` as pretty JSON (with a trailing newline) and write it atomically.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    bytes.push(b'\n');
    write_atomic(path, &bytes)
}

/// Read every row of a JSONL file; a line that does not parse (a torn last line included) is
/// an `InvalidData` error naming the file.
pub fn read_jsonl(path: &Path) -> io::Result<Vec<serde_json::Value>> {
    let file = File::open(path)?;
    let mut out = Vec::new();
    for line in io::BufReader::new(file).lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(&line) {
            Ok(v) => out.push(v),
            Err(e) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: {e}", path.display()),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn resume_cuts_a_torn_last_line_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl");
        fs::write(&p, b"{\"a\":1}\n{\"a\":2}\n{\"a\":").unwrap();
        let mut w = JsonlWriter::open_resume(&p).unwrap();
        assert_eq!(w.rows(), 2);
        w.append(&json!({"a": 3})).unwrap();
        w.sync().unwrap();
        assert_eq!(
            fs::read_to_string(&p).unwrap(),
            "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n"
        );
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.json");
        write_json_atomic(&p, &json!({"v": 1})).unwrap();
        write_json_atomic(&p, &json!({"v": 2})).unwrap();
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&fs::read(&p).unwrap()).unwrap()["v"],
            2
        );
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn failed_atomic_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.json");
        write_atomic(&p, b"old").unwrap();
        // Renaming over a directory fails: the live file must be untouched and no temp left.
        let target_dir = dir.path().join("sub");
        fs::create_dir(&target_dir).unwrap();
        assert!(write_atomic(&target_dir, b"new").is_err());
        assert_eq!(fs::read(&p).unwrap(), b"old");
        let temps = fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains(".tmp-")
            })
            .count();
        assert_eq!(temps, 0);
    }
}

/// Artifact file names inside `{output.root}/{run_name}/{mission}/`.
pub mod files {
    pub const MANIFEST: &str = "manifest.json";
    pub const TRAJECTORIES: &str = "trajectories.jsonl";
    pub const SELECTIONS: &str = "selections.jsonl";
    pub const METRICS: &str = "metrics.jsonl";
    pub const FAILURE_MALFORMED: &str = "failure_malformed.jsonl";
    pub const NEED_REVIEW_QUEUE: &str = "need_review_queue.jsonl";
    pub const NEED_REVIEW: &str = "need_review.json";
    pub const REFLECTION: &str = "reflection.jsonl";
    pub const SUMMARY: &str = "summary.json";
}
