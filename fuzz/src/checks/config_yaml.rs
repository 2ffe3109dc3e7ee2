//! The run config (`stageb_shared::config`): YAML with strict validation, user input.
//!
//! Invariants: deterministic; every rejection names the file and, except for YAML the
//! scanner cannot locate, a line that exists in the text; an accepted config records the
//! sha256 of the exact text; bytes that are not UTF-8 are `E_INVALID_UTF8` at a real line.

use super::support::{line_count, scratch};
use stageb_shared::config::{load_config, parse_config};
use stageb_shared::digest;
use stageb_shared::error::ErrorCode;

const LABEL: &str = "fuzz.yaml";

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let lines = line_count(data);
    let Ok(text) = std::str::from_utf8(data) else {
        let path = scratch().join(LABEL);
        std::fs::write(&path, data).expect("write the input");
        let err = load_config(&path).expect_err("bytes that are not UTF-8 are rejected");
        assert_eq!(err.code, ErrorCode::InvalidUtf8);
        assert!(
            matches!(err.line, Some(l) if (1..=lines).contains(&l)),
            "{err}"
        );
        return;
    };
    let first = parse_config(text, LABEL);
    assert_eq!(first, parse_config(text, LABEL), "not deterministic");
    match first {
        Ok(loaded) => {
            assert_eq!(
                loaded.source_text_sha256,
                digest::sha256_hex(text.as_bytes())
            );
        }
        Err(err) => {
            assert_eq!(err.file, LABEL);
            match err.line {
                Some(line) => assert!((1..=lines).contains(&line), "line {line} of {lines}: {err}"),
                None => assert_eq!(err.code, ErrorCode::InvalidYaml, "no line: {err}"),
            }
        }
    }
}
