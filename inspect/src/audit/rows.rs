//! Reading a JSONL artifact one row at a time, recording framing and parse violations; the
//! rows rank 0 writes per ticket are read as their types ([`for_each_row_as`],
//! `stageb_coordinator::artifacts::rows`).
//!
//! Rows are streamed, never held as a whole file: the checks keep only the facts they compare
//! (a vote per candidate, a selection's result), so auditing a 100,000-ticket run does not need
//! the whole run in memory as JSON values (a parsed row costs ~15× its bytes).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::AuditReport;

/// Calls `visit(report, line, row)` for every row of `dir/name` that parses. Returns how many
/// rows were visited. A missing file, a torn last line, invalid UTF-8 and unparsable lines are
/// violations; rows after invalid UTF-8 are not read.
pub fn for_each_row(
    report: &mut AuditReport,
    dir: &Path,
    name: &str,
    mut visit: impl FnMut(&mut AuditReport, usize, Value),
) -> usize {
    let Ok(mut file) = File::open(dir.join(name)) else {
        report.fail("file_present", name, None, "missing");
        return 0;
    };
    if !ends_with_newline(&mut file) {
        report.fail(
            "jsonl_framing",
            name,
            None,
            "the file does not end with a newline (torn last line)",
        );
    }
    let mut visited = 0;
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let Ok(line) = line else {
            report.fail("jsonl_utf8", name, Some(i + 1), "not UTF-8");
            break;
        };
        match serde_json::from_str::<Value>(&line) {
            Ok(row) => {
                if row.get("schema_version").is_none() {
                    report.fail(
                        "schema_version",
                        name,
                        Some(i + 1),
                        "row without schema_version",
                    );
                }
                visited += 1;
                visit(report, i + 1, row);
            }
            Err(e) => report.fail("jsonl_parse", name, Some(i + 1), e.to_string()),
        }
    }
    visited
}

/// An empty file, or one whose last byte is a newline.
fn ends_with_newline(file: &mut File) -> bool {
    let mut last = [0u8; 1];
    let ok = match file.seek(SeekFrom::End(-1)) {
        Ok(_) => file.read_exact(&mut last).is_ok() && last[0] == b'\n',
        // Seeking before the start: the file is empty.
        Err(_) => true,
    };
    let _ = file.seek(SeekFrom::Start(0));
    ok
}

/// [`for_each_row`] with each row read as a `T`: a row that is JSON but not a `T` (a value of
/// the wrong type) is a `jsonl_parse` violation and is not visited; a missing key reads as its
/// default. Returns how many rows were JSON.
pub fn for_each_row_as<T: DeserializeOwned>(
    report: &mut AuditReport,
    dir: &Path,
    name: &str,
    mut visit: impl FnMut(&mut AuditReport, usize, T),
) -> usize {
    for_each_row(
        report,
        dir,
        name,
        |report, line, row| match serde_json::from_value::<T>(row) {
            Ok(row) => visit(report, line, row),
            Err(e) => report.fail("jsonl_parse", name, Some(line), e.to_string()),
        },
    )
}
