//! Are two run directories' artifacts the same, aside runtime fields? What determinism means
//! for stageb, stated once: `stageb compare`, the specs and the system-test scripts all use
//! [`compare_runs`].
//!
//! The rules:
//! - every regular file at the top of the run directory takes part except the job journal
//!   (rows in completion order), the step checkpoint (it holds the journal's place: artifact
//!   byte lengths, which count runtime objects, and the guidance file's timestamps), the lock
//!   file (it names the process holding it) and `report.html` (a view of the others that
//!   shows their times); folders (`snapshots/`, `integrity/`) do not take part;
//! - a `.jsonl` file is its rows (blank lines skipped), any other file one JSON value;
//! - in every JSON object, at any depth, the keys `runtime`, `timing`, `*_at`, `config`,
//!   `config_path`, `config_sha256` and `run_dir` are dropped, and so is `manifest.json`'s
//!   top-level `mode` (how the processes were started: embedded or cluster);
//! - what is left must be equal, row by row, and no `(epoch, ticket)` row of
//!   `selections.jsonl` may be lost or duplicated against the reference.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;
use stageb_coordinator::cluster::scheduler::journal::JOURNAL_FILE;
use stageb_coordinator::run::checkpoint::CHECKPOINT_FILE;
use stageb_coordinator::run::dir::LOCK_FILE;

use crate::report::REPORT_FILE;

/// The files of a run directory that never take part (see the module header for why).
pub const SKIPPED_FILES: [&str; 4] = [JOURNAL_FILE, CHECKPOINT_FILE, LOCK_FILE, REPORT_FILE];

/// Object keys dropped at any depth, besides every key ending in `_at` (wall-clock times).
pub const DROPPED_KEYS: [&str; 6] = [
    "runtime",
    "timing",
    "config",
    "config_path",
    "config_sha256",
    "run_dir",
];

/// The file whose rows are counted for lost and duplicated tickets.
const SELECTIONS_FILE: &str = "selections.jsonl";

/// Why two run directories could not be compared (`stageb compare` exits 2).
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    #[error("{0}: not a directory")]
    NotADirectory(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: line {line}: not JSON: {source}")]
    Json {
        path: PathBuf,
        line: usize,
        source: serde_json::Error,
    },
}

/// One artifact present in both runs: `difference` is the first place they differ, if any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileVerdict {
    pub name: String,
    pub difference: Option<String>,
}

/// The verdict on a run against a reference run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Comparison {
    /// Artifacts the reference has and the run has not.
    pub only_in_reference: Vec<String>,
    /// Artifacts the run has and the reference has not.
    pub only_in_run: Vec<String>,
    /// The artifacts both have, by name.
    pub files: Vec<FileVerdict>,
    /// Rows of the run's `selections.jsonl`.
    pub selection_rows: usize,
    /// `(epoch, ticket)` rows of the reference missing from the run.
    pub rows_lost: usize,
    /// Rows of the run beyond the first of their `(epoch, ticket)`, or beyond the reference's
    /// count of it (a row of a ticket the reference never decided counts too).
    pub rows_duplicated: usize,
}

impl Comparison {
    /// Every difference in words: the file sets, then the first difference of each file.
    pub fn differences(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.only_in_reference.is_empty() || !self.only_in_run.is_empty() {
            out.push(format!(
                "file sets differ: only in the reference {:?}, only in the run {:?}",
                self.only_in_reference, self.only_in_run
            ));
        }
        out.extend(self.files.iter().filter_map(|f| f.difference.clone()));
        out
    }

    /// The artifacts are equal and no selection row was lost or duplicated.
    pub fn identical(&self) -> bool {
        self.differences().is_empty() && self.rows_lost == 0 && self.rows_duplicated == 0
    }

    /// The one JSON object the soak and chaos scripts read: `equal` (the artifacts, rows
    /// aside), `differing`, `selection_rows`, `rows_lost`, `rows_duplicated`.
    pub fn summary_json(&self) -> Value {
        let differing = self.differences();
        serde_json::json!({
            "equal": differing.is_empty(),
            "differing": differing,
            "selection_rows": self.selection_rows,
            "rows_lost": self.rows_lost,
            "rows_duplicated": self.rows_duplicated,
        })
    }
}

/// Compare `run` with `reference` under the rules of the module header.
pub fn compare_runs(reference: &Path, run: &Path) -> Result<Comparison, CompareError> {
    let want = artifact_names(reference)?;
    let got = artifact_names(run)?;
    let mut files = Vec::new();
    for name in want.iter().filter(|n| got.contains(n)) {
        let a = Value::Array(comparable(&reference.join(name))?);
        let b = Value::Array(comparable(&run.join(name))?);
        files.push(FileVerdict {
            name: name.clone(),
            difference: first_difference(&a, &b, name.clone()),
        });
    }
    let (want_rows, got_rows) = (selection_keys(reference)?, selection_keys(run)?);
    let rows_lost: usize = want_rows
        .iter()
        .map(|(k, n)| n.saturating_sub(got_rows.get(k).copied().unwrap_or(0)))
        .sum();
    let rows_duplicated: usize = got_rows
        .iter()
        .map(|(k, n)| {
            // A row beyond the first, or beyond the reference's count: each extra row once.
            let want = want_rows.get(k).copied().unwrap_or(0);
            n.saturating_sub(1).max(n.saturating_sub(want))
        })
        .sum();
    Ok(Comparison {
        only_in_reference: want.iter().filter(|n| !got.contains(n)).cloned().collect(),
        only_in_run: got.iter().filter(|n| !want.contains(n)).cloned().collect(),
        files,
        selection_rows: got_rows.values().sum(),
        rows_lost,
        rows_duplicated,
    })
}

/// The names of the files that take part, sorted.
pub fn artifact_names(run_dir: &Path) -> Result<Vec<String>, CompareError> {
    if !run_dir.is_dir() {
        return Err(CompareError::NotADirectory(run_dir.to_path_buf()));
    }
    let io = |source| CompareError::Io {
        path: run_dir.to_path_buf(),
        source,
    };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(run_dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // Follows links, as a reader of the artifacts would.
        if entry.path().is_file() && !SKIPPED_FILES.contains(&name.as_str()) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// A file's rows (or its one value) without what legitimately differs between two runs of
/// the same work.
pub fn comparable(path: &Path) -> Result<Vec<Value>, CompareError> {
    let text = std::fs::read_to_string(path).map_err(|source| CompareError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let parse = |(i, line): (usize, &str)| {
        serde_json::from_str::<Value>(line).map_err(|source| CompareError::Json {
            path: path.to_path_buf(),
            line: i + 1,
            source,
        })
    };
    let mut rows = if path.extension().is_some_and(|e| e == "jsonl") {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(parse)
            .collect::<Result<Vec<_>, _>>()?
    } else {
        vec![parse((0, &text))?]
    };
    rows.iter_mut().for_each(strip);
    if path.file_name().is_some_and(|n| n == "manifest.json") {
        for row in &mut rows {
            if let Value::Object(o) = row {
                o.shift_remove("mode");
            }
        }
    }
    Ok(rows)
}

/// Drop the runtime keys of every object in `v`, at any depth.
fn strip(v: &mut Value) {
    match v {
        Value::Object(o) => {
            o.retain(|k, _| !(k.ends_with("_at") || DROPPED_KEYS.contains(&k.as_str())));
            o.values_mut().for_each(strip);
        }
        Value::Array(a) => a.iter_mut().for_each(strip),
        _ => {}
    }
}

/// The first place two values differ, as a path from `at` (`summary.json[0].tickets`), or
/// `None` when they are equal.
pub fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => {
                        if let Some(d) = first_difference(v, w, format!("{at}.{k}")) {
                            return Some(d);
                        }
                    }
                    None => return Some(format!("{at}.{k}: only in the reference")),
                }
            }
            y.keys()
                .find(|k| !x.contains_key(*k))
                .map(|k| format!("{at}.{k}: only in the run"))
        }
        (Value::Array(x), Value::Array(y)) if x.len() != y.len() => Some(format!(
            "{at}: {} rows/items in the reference, {} in the run",
            x.len(),
            y.len()
        )),
        (Value::Array(x), Value::Array(y)) => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(v, w, format!("{at}[{i}]"))),
        _ if a == b => None,
        _ => Some(format!("{at}: {} vs {}", clip(a), clip(b))),
    }
}

/// A value as JSON, cut to 200 characters (a differing guidance text stays readable).
fn clip(v: &Value) -> String {
    v.to_string().chars().take(200).collect()
}

/// How many rows `selections.jsonl` holds per `(epoch, ticket key)`; none when it is absent.
fn selection_keys(run_dir: &Path) -> Result<BTreeMap<(String, String), usize>, CompareError> {
    let path = run_dir.join(SELECTIONS_FILE);
    let mut out = BTreeMap::new();
    if !path.is_file() {
        return Ok(out);
    }
    for row in comparable(&path)? {
        let ticket = match row.get("ticket_key") {
            Some(k) if !k.is_null() && k.as_str() != Some("") => k,
            _ => row.get("group_id").unwrap_or(&Value::Null),
        };
        let epoch = row.get("epoch").unwrap_or(&Value::Null);
        *out.entry((epoch.to_string(), ticket.to_string()))
            .or_insert(0) += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rows(dir: &Path, name: &str, text: &str) -> Vec<Value> {
        std::fs::write(dir.join(name), text).unwrap();
        comparable(&dir.join(name)).unwrap()
    }

    #[test]
    fn runtime_keys_go_at_any_depth_and_mode_only_at_the_manifests_top() {
        let dir = tempfile::tempdir().unwrap();
        let text = json!({"mode": "cluster", "a": {"mode": 1, "runtime": 2, "leased_at": 3,
                          "config_sha256": "x", "kept": [{"timing": 4, "at": 5}]}})
        .to_string();
        let want = json!({"a": {"mode": 1, "kept": [{"at": 5}]}});
        assert_eq!(rows(dir.path(), "manifest.json", &text), vec![want.clone()]);
        let mut other = want;
        other["mode"] = json!("cluster");
        assert_eq!(rows(dir.path(), "summary.json", &text), vec![other]);
    }

    #[test]
    fn blank_lines_of_a_jsonl_file_are_skipped_and_a_bad_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            rows(dir.path(), "x.jsonl", "{\"a\":1}\n\n  \n[2]\n").len(),
            2
        );
        std::fs::write(dir.path().join("y.jsonl"), "{}\n{\n").unwrap();
        let err = comparable(&dir.path().join("y.jsonl")).unwrap_err();
        assert!(matches!(err, CompareError::Json { line: 2, .. }), "{err}");
    }

    #[test]
    fn the_first_difference_is_a_path_to_it() {
        let a = json!([{"x": [1, 2], "y": "s"}]);
        let first = |b: Value| first_difference(&a, &b, "f".into());
        assert_eq!(first(a.clone()), None);
        assert_eq!(
            first(json!([{"x": [1, 3], "y": "s"}])).as_deref(),
            Some("f[0].x[1]: 2 vs 3")
        );
        assert_eq!(
            first(json!([{"x": [1]}])).as_deref(),
            Some("f[0].x: 2 rows/items in the reference, 1 in the run")
        );
        assert_eq!(
            first(json!([{"x": [1, 2], "y": "s", "z": 0}])).as_deref(),
            Some("f[0].z: only in the run")
        );
    }
}
