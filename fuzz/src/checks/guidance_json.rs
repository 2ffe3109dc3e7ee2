//! A guidance file's mission section (`guidance::load_mission_section`), user input (the seed
//! file) or a run file read again on resume.
//!
//! The mission asked for is the first key of the JSON object (or `m`), so the fuzzer reaches
//! the section rules without guessing a name. Invariants: deterministic; a rejection is an
//! `E_INVALID_GUIDANCE` / `E_INPUT_BUDGET` naming the file; an accepted section is the mission
//! asked for, holds `G0`, 1..=MAX_RULES rules of trimmed, non-empty text within the
//! per-rule and total caps, and metadata only for rules that exist.

use super::support::scratch;
use stageb_coordinator::guidance::{RuleKey, load_mission_section};
use stageb_shared::budget::{MAX_GUIDANCE_CHARS, MAX_RULE_CHARS, MAX_RULES};
use stageb_shared::error::ErrorCode;

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let mission = serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .and_then(|v| v.as_object().and_then(|o| o.keys().next().cloned()))
        .unwrap_or_else(|| "m".to_string());
    let path = scratch().join("guidance.json");
    std::fs::write(&path, data).expect("write the input");
    let first = load_mission_section(&path, &mission);
    assert_eq!(
        first,
        load_mission_section(&path, &mission),
        "not deterministic"
    );
    match first {
        Ok(section) => {
            assert_eq!(section.mission, mission);
            assert!(section.experiences.contains_key(&RuleKey::G0));
            assert!(!section.experiences.is_empty() && section.experiences.len() <= MAX_RULES);
            let mut total = 0;
            for text in section.experiences.values() {
                let chars = text.chars().count();
                assert!(chars > 0 && chars <= MAX_RULE_CHARS && text.trim() == text);
                total += chars;
            }
            assert!(total <= MAX_GUIDANCE_CHARS, "{total} characters of rules");
            for key in section.metadata.keys() {
                assert!(
                    section.experiences.contains_key(key),
                    "metadata for {key:?}"
                );
            }
        }
        Err(err) => {
            assert!(
                matches!(
                    err.code,
                    ErrorCode::InvalidGuidance | ErrorCode::InputBudget
                ),
                "{err}"
            );
            assert_eq!(err.file, path.display().to_string());
        }
    }
}
