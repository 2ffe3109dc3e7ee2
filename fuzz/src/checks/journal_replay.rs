//! The job journal read on resume (`ReplayCache::load`), a run file anyone with access to the
//! run directory could have changed.
//!
//! The input is `jobs.jsonl`; without a `\0` the run has no seal key, with one the bytes
//! before it become `integrity/key` (as hex) and the rest the journal. Invariants: loading
//! never fails on content (only on I/O), is deterministic, yields no more answers than lines,
//! and every row that parses as a current-version journal row (and, with a key, carries a
//! matching mac) is an answer; with a key, a row without its mac never is.

use super::support::{fresh_dir, line_count};
use stageb_coordinator::artifacts::seal;
use stageb_coordinator::cluster::scheduler::journal::{
    JOURNAL_FILE, JOURNAL_VERSION, JournalRow, ReplayCache,
};

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let dir = fresh_dir("run");
    let journal = match data.iter().position(|&b| b == 0) {
        Some(cut) => {
            std::fs::create_dir_all(dir.join("integrity")).unwrap();
            let key = if cut == 0 {
                b"k".as_slice()
            } else {
                &data[..cut]
            };
            std::fs::write(dir.join("integrity/key"), to_hex(key)).unwrap();
            &data[cut + 1..]
        }
        None => data,
    };
    let path = dir.join(JOURNAL_FILE);
    std::fs::write(&path, journal).unwrap();
    let key = seal::key_for(&dir).unwrap();
    let cache = ReplayCache::load(&path).expect("content never fails the load");
    assert_eq!(
        cache.len(),
        ReplayCache::load(&path).unwrap().len(),
        "not deterministic"
    );
    assert!(cache.len() <= line_count(journal));
    let Ok(text) = std::str::from_utf8(journal) else {
        return;
    };
    for line in text.lines() {
        let row = match &key {
            Some(key) => match seal::check_row_mac(key, line) {
                Some(row) => row,
                None => continue,
            },
            None => line.to_string(),
        };
        if let Ok(parsed) = serde_json::from_str::<JournalRow>(&row)
            && parsed.journal_version == JOURNAL_VERSION
        {
            assert!(
                cache.get(&parsed.digest).is_some(),
                "a valid row is not an answer: {row}"
            );
        }
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
