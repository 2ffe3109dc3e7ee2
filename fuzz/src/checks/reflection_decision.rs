//! The reflection decision pass's answer (`reflection_schema::parse_decision`), model output.
//!
//! Invariants: deterministic; an accepted answer serializes back to JSON that parses to the
//! same value (nothing is dropped or invented); a rejection has a stable code.

use stageb_shared::reflection_schema::parse_decision;

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let first = parse_decision(text);
    match &first {
        Ok(decision) => {
            let again = serde_json::to_string(decision).expect("serializes");
            assert_eq!(parse_decision(&again).as_ref().ok(), Some(decision));
            let pretty = serde_json::to_string_pretty(decision).expect("serializes");
            assert_eq!(parse_decision(&pretty).as_ref().ok(), Some(decision));
        }
        Err(e) => {
            assert!(!e.code.code().is_empty());
        }
    }
    assert_eq!(
        first.as_ref().ok(),
        parse_decision(text).as_ref().ok(),
        "not deterministic"
    );
}
