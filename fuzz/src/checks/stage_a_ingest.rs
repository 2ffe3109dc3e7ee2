//! Stage-A JSONL ingest (`stageb_shared::ingest::load_tickets`), user input read from a file.
//!
//! Invariants: deterministic; a rejection names the file and, when it has one, a line that
//! exists; an accepted file records its exact sha256 and as many records as tickets, no more
//! records than lines, unique ticket keys, labels `pass`/`fail`; the same file given twice
//! is rejected as duplicate tickets (every ticket repeats).

use super::support::{line_count, scratch};
use stageb_shared::digest;
use stageb_shared::error::ErrorCode;
use stageb_shared::ingest::load_tickets;
use std::collections::HashSet;

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let path = scratch().join("stage_a.jsonl");
    std::fs::write(&path, data).expect("write the input");
    let label = path.display().to_string();
    let lines = line_count(data);
    let first = load_tickets(std::slice::from_ref(&path));
    assert_eq!(
        first,
        load_tickets(std::slice::from_ref(&path)),
        "not deterministic"
    );
    match first {
        Ok(run) => {
            let [input] = run.input_digests.as_slice() else {
                panic!("one digest per file");
            };
            assert_eq!(input.sha256, digest::sha256_hex(data));
            assert_eq!(input.records, run.tickets.len());
            assert!(input.records >= 1 && input.records <= lines);
            let keys: HashSet<String> = run.tickets.iter().map(|t| t.key().0).collect();
            assert_eq!(keys.len(), run.tickets.len(), "ticket keys repeat");
            let twice = load_tickets(&[path.clone(), path.clone()]);
            assert_eq!(
                twice
                    .expect_err("a file given twice repeats its tickets")
                    .code,
                ErrorCode::DuplicateTicket
            );
        }
        Err(err) => {
            assert_eq!(err.file, label);
            if let Some(line) = err.line {
                assert!((1..=lines).contains(&line), "line {line} of {lines}: {err}");
            }
        }
    }
}
