//! The two-line rollout contract (`stageb_shared::contract::parse`) on arbitrary model output.
//!
//! Invariants: the parser is deterministic; an accepted candidate round-trips through its
//! canonical form (`Verdict: <v>\nReason: <reason>`) to the same value, with or without a
//! trailing newline; an accepted reason is trimmed, non-empty, one line and within the cap;
//! a rejection carries a stable code and a bounded detail (never the whole text).

use stageb_shared::contract::{MAX_REASON_CHARS, ViolationCode, parse};
use stageb_shared::domain::Verdict;

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let first = parse(text);
    assert_eq!(first, parse(text), "the parser is not deterministic");
    match first {
        Ok(candidate) => {
            let value = match candidate.verdict {
                Verdict::Pass => "通过",
                Verdict::Fail => "不通过",
            };
            let canonical = format!("Verdict: {value}\nReason: {}", candidate.reason);
            assert_eq!(parse(&canonical).as_ref(), Ok(&candidate), "canonical form");
            assert_eq!(parse(&format!("{canonical}\n")).as_ref(), Ok(&candidate));
            let reason = &candidate.reason;
            assert!(!reason.is_empty() && reason.trim() == reason);
            assert!(!reason.contains('\n') && !reason.contains('\r'));
            assert!(reason.chars().count() <= MAX_REASON_CHARS);
            assert!(!text.trim_end().contains('\r'));
        }
        Err(violation) => {
            assert_eq!(
                ViolationCode::from_code(violation.code.code()),
                Some(violation.code)
            );
            // The detail quotes an excerpt only (40 characters, escaped at most 10 bytes each).
            assert!(
                violation.detail.len() <= 600,
                "detail of {} bytes",
                violation.detail.len()
            );
        }
    }
}
