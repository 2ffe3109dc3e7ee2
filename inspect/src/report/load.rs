//! Reading a run directory's artifacts for the report, tolerant of damage.
//!
//! The report is what a person opens when something went wrong, so an artifact that is
//! missing, torn or partly unreadable must never stop it: every reader here returns what it
//! could read plus a [`FileStatus`] that the sections show as a note. (Finding *why* a row is
//! wrong is `stageb audit`'s job; the report only says that it could not use it.)
//!
//! JSONL files are streamed row by row into small typed rows, never held whole: a run of
//! 100k tickets writes hundreds of megabytes of trajectories.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::de::DeserializeOwned;

/// How reading one artifact went.
#[derive(Debug, Clone, Default)]
pub struct FileStatus {
    /// The artifact's file name.
    pub file: String,
    /// The file exists and could be opened.
    pub present: bool,
    /// Rows (JSONL) or documents (JSON) read.
    pub rows: u64,
    /// Lines that were not a row of the expected shape (bad JSON, bad UTF-8, wrong types).
    pub bad_rows: u64,
    /// The first unusable line, 1-based, with why.
    pub first_bad: Option<(u64, String)>,
    /// Why a JSON document could not be used, or why a JSONL file stopped being read.
    pub error: Option<String>,
}

impl FileStatus {
    fn new(file: &str) -> Self {
        FileStatus {
            file: file.to_string(),
            ..FileStatus::default()
        }
    }

    /// Everything was read as expected.
    pub fn is_clean(&self) -> bool {
        self.present && self.bad_rows == 0 && self.error.is_none()
    }

    /// A sentence for the sections that use this file, `None` when there is nothing to say.
    pub fn note(&self) -> Option<String> {
        if !self.present {
            return Some(format!(
                "{} is missing: this part of the report is empty.",
                self.file
            ));
        }
        if let Some(e) = &self.error {
            return Some(format!("{} could not be read: {e}.", self.file));
        }
        if self.bad_rows > 0 {
            let first = self
                .first_bad
                .as_ref()
                .map(|(line, why)| format!(" (first at line {line}: {why})"))
                .unwrap_or_default();
            return Some(format!(
                "{}: {} of {} lines could not be used and are left out{first}; `stageb audit` \
                 says what is wrong with them.",
                self.file,
                self.bad_rows,
                self.rows + self.bad_rows
            ));
        }
        None
    }

    fn bad(&mut self, line: u64, why: String) {
        self.bad_rows += 1;
        if self.first_bad.is_none() {
            self.first_bad = Some((line, why));
        }
    }
}

/// Stream `dir/name` one line at a time, deserializing each into `T` and handing it to
/// `each`. Lines that are not UTF-8 or not a `T` are counted in the status, not fatal; an
/// empty trailing line (the file's final newline) is not a row.
pub fn stream_jsonl<T: DeserializeOwned>(
    dir: &Path,
    name: &str,
    mut each: impl FnMut(T),
) -> FileStatus {
    let mut status = FileStatus::new(name);
    let file = match File::open(dir.join(name)) {
        Ok(f) => f,
        Err(_) => return status,
    };
    status.present = true;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut line = Vec::new();
    let mut number = 0u64;
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                status.error = Some(format!("read error after line {number}: {e}"));
                break;
            }
        }
        number += 1;
        let text = match std::str::from_utf8(&line) {
            Ok(t) => t.trim_end_matches(['\n', '\r']),
            Err(_) => {
                status.bad(number, "not UTF-8".into());
                continue;
            }
        };
        if text.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<T>(text) {
            Ok(row) => {
                status.rows += 1;
                each(row);
            }
            Err(e) => status.bad(number, e.to_string()),
        }
    }
    status
}

/// Read the JSON document `dir/name` as a `T`; `None` (with the status saying why) when it
/// is missing or is not a `T`.
pub fn read_json<T: DeserializeOwned>(dir: &Path, name: &str) -> (Option<T>, FileStatus) {
    let mut status = FileStatus::new(name);
    let bytes = match std::fs::read(dir.join(name)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return (None, status),
        Err(e) => {
            status.present = true;
            status.error = Some(e.to_string());
            return (None, status);
        }
    };
    status.present = true;
    match serde_json::from_slice::<T>(&bytes) {
        Ok(v) => {
            status.rows = 1;
            (Some(v), status)
        }
        Err(e) => {
            status.error = Some(format!("not the expected JSON ({e})"));
            (None, status)
        }
    }
}
