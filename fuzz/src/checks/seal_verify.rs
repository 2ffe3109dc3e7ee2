//! The integrity seals read by resume and audit (`artifacts::seal`): `integrity/<file>.seal`
//! and the per-row macs of the job journal, run files that anyone with access could change.
//!
//! The first byte picks a mode:
//! - 0: the rest is `<file bytes>\0<seal bytes>`; `verify_file` must never vouch for more
//!   bytes than the file holds, and is deterministic.
//! - 1: the rest is the file, sealed by `seal_prefix`; it must verify for exactly its length,
//!   refuse a flipped byte inside the sealed part (`Mismatch`) and a cut file (`Short`).
//! - 2: the rest is a journal line; a line `check_row_mac` accepts is exactly what
//!   `with_row_mac` writes for the row it returns, and a row wrapped by `with_row_mac` checks
//!   back to itself.

use super::support::{fresh_dir, split_parts};
use stageb_coordinator::artifacts::seal::{self, SealError};

const FILE: &str = "rows.jsonl";

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let dir = fresh_dir("run");
    std::fs::create_dir_all(dir.join(seal::INTEGRITY_DIR)).unwrap();
    std::fs::write(
        dir.join("integrity/key"),
        "00112233445566778899aabbccddeeff",
    )
    .unwrap();
    let key = seal::key_for(&dir).unwrap().expect("the key just written");
    match mode % 3 {
        0 => {
            let parts = split_parts(rest, 2);
            let (file, seal_bytes) = (parts[0], parts.get(1).copied().unwrap_or(b""));
            std::fs::write(dir.join(FILE), file).unwrap();
            std::fs::write(dir.join("integrity/rows.jsonl.seal"), seal_bytes).unwrap();
            let verdict = seal::verify_file(&dir, FILE);
            assert_eq!(verdict, seal::verify_file(&dir, FILE), "not deterministic");
            if let Ok(Some(n)) = verdict {
                assert!(
                    n <= file.len() as u64,
                    "vouches for {n} of {} bytes",
                    file.len()
                );
            }
        }
        1 => {
            let path = dir.join(FILE);
            std::fs::write(&path, rest).unwrap();
            let len = rest.len() as u64;
            seal::seal_prefix(&path, len).unwrap();
            assert_eq!(seal::verify_file(&dir, FILE), Ok(Some(len)));
            if let Some(&last) = rest.last() {
                let mut flipped = rest.to_vec();
                let at = usize::from(last) % rest.len();
                flipped[at] ^= 0x01;
                std::fs::write(&path, &flipped).unwrap();
                assert!(matches!(
                    seal::verify_file(&dir, FILE),
                    Err(SealError::Mismatch { .. })
                ));
                std::fs::write(&path, &rest[..rest.len() - 1]).unwrap();
                assert!(matches!(
                    seal::verify_file(&dir, FILE),
                    Err(SealError::Short { .. })
                ));
            }
        }
        _ => {
            let Ok(line) = std::str::from_utf8(rest) else {
                return;
            };
            if let Some(row) = seal::check_row_mac(&key, line) {
                assert_eq!(seal::with_row_mac(&key, row.as_bytes()), line.as_bytes());
            }
            if line.len() >= 2 && line.starts_with('{') && line.ends_with('}') {
                let sealed = seal::with_row_mac(&key, line.as_bytes());
                let sealed = String::from_utf8(sealed).expect("UTF-8 in, UTF-8 out");
                assert_eq!(seal::check_row_mac(&key, &sealed).as_deref(), Some(line));
            }
        }
    }
}
