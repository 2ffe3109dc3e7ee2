//! The reflection ops pass's answer (`reflection_schema::parse_ops`), model output.
//!
//! Invariants: deterministic; an accepted answer round-trips through its JSON serialization
//! (compact and pretty) to the same value; a rejection has a stable code.

use stageb_shared::reflection_schema::parse_ops;

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let first = parse_ops(text);
    match &first {
        Ok(ops) => {
            let again = serde_json::to_string(ops).expect("serializes");
            assert_eq!(parse_ops(&again).as_ref().ok(), Some(ops));
            let pretty = serde_json::to_string_pretty(ops).expect("serializes");
            assert_eq!(parse_ops(&pretty).as_ref().ok(), Some(ops));
        }
        Err(e) => {
            assert!(!e.code.code().is_empty());
        }
    }
    assert_eq!(
        first.as_ref().ok(),
        parse_ops(text).as_ref().ok(),
        "not deterministic"
    );
}
