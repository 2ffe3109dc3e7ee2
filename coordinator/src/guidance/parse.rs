//! Reading and validating a mission's section of a guidance file (the reference's file rules).
//!
//! The same validation applies to the global guidance file (seeding a run) and to the run's own
//! `guidance.json` (resume, chain verification), so a resumed run never accepts content that
//! seeding would have rejected. Every failure is a coded [`InputError`] naming the file.

use super::model::{BadRuleKey, MissionGuidance, RuleKey, RuleMetadata};
use serde_json::Value;
use stageb_shared::budget::{
    MAX_GUIDANCE_CHARS, MAX_GUIDANCE_FILE_BYTES, MAX_RULE_CHARS, MAX_RULES,
};
use stageb_shared::error::{ErrorCode, InputError};
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

/// Text of a placeholder `G0` that the legacy `focus` field replaces.
pub const G0_PLACEHOLDER: &str = "Initial guidance placeholder";

pub(super) fn invalid(file: &Path, message: impl Into<String>) -> InputError {
    InputError::new(
        ErrorCode::InvalidGuidance,
        file.display().to_string(),
        None,
        message,
    )
}

fn over_budget(file: &Path, message: impl Into<String>) -> InputError {
    InputError::new(
        ErrorCode::InputBudget,
        file.display().to_string(),
        None,
        message,
    )
}

/// A guidance file (seed or run) as JSON; unreadable or malformed files are coded input errors.
pub(super) fn read_json(path: &Path) -> Result<Value, InputError> {
    use std::io::Read as _;
    let unreadable = |e: std::io::Error| {
        InputError::new(
            ErrorCode::FileNotFound,
            path.display().to_string(),
            None,
            format!("cannot read: {e}"),
        )
    };
    // Read at most one byte past the budget, so a huge file is never held in memory.
    let mut bytes = Vec::new();
    fs::File::open(path)
        .and_then(|f| f.take(MAX_GUIDANCE_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(unreadable)?;
    if bytes.len() as u64 > MAX_GUIDANCE_FILE_BYTES {
        return Err(over_budget(
            path,
            format!("the guidance file is larger than {MAX_GUIDANCE_FILE_BYTES} bytes"),
        ));
    }
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(path, format!("not valid JSON: {e}")))?;
    Ok(value)
}

/// Read and validate one mission's section of a guidance file (the reference's file rules).
pub fn load_mission_section(path: &Path, mission: &str) -> Result<MissionGuidance, InputError> {
    let value = read_json(path)?;
    let section = mission_section(&value, mission, path)?;
    parse_section(section, mission, path)
}

pub(super) fn mission_section<'a>(
    value: &'a Value,
    mission: &str,
    file: &Path,
) -> Result<&'a Value, InputError> {
    let top = value
        .as_object()
        .ok_or_else(|| invalid(file, "guidance file must be a JSON object keyed by mission"))?;
    if top.contains_key("version") && top.contains_key("guidance") {
        return Err(invalid(
            file,
            "legacy {version, guidance} schema is not supported; expected {mission: {step, updated_at, experiences, metadata}}",
        ));
    }
    let section = top.get(mission).ok_or_else(|| {
        invalid(
            file,
            format!("Mission {mission} not found in guidance file"),
        )
    })?;
    if !section.is_object() {
        return Err(invalid(
            file,
            format!("Mission {mission} section must be an object"),
        ));
    }
    Ok(section)
}

pub(super) fn looks_iso(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 10
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[5..7].iter().all(u8::is_ascii_digit)
        && b[7] == b'-'
        && b[8..10].iter().all(u8::is_ascii_digit)
}

pub(super) fn parse_section(
    section: &Value,
    mission: &str,
    file: &Path,
) -> Result<MissionGuidance, InputError> {
    let obj = section
        .as_object()
        .ok_or_else(|| invalid(file, format!("Mission {mission} section must be an object")))?;
    let step = match obj.get("step") {
        None => return Err(invalid(file, format!("Mission {mission}: missing step"))),
        Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64().unwrap_or_default(),
        Some(other) => {
            return Err(invalid(
                file,
                format!("Mission {mission}: step must be a non-negative integer, got {other}"),
            ));
        }
    };
    let updated_at = match obj.get("updated_at") {
        Some(Value::String(s)) if looks_iso(s) => s.clone(),
        Some(other) => {
            return Err(invalid(
                file,
                format!("Mission {mission}: updated_at must be an ISO timestamp, got {other}"),
            ));
        }
        None => {
            return Err(invalid(
                file,
                format!("Mission {mission}: missing updated_at"),
            ));
        }
    };
    let experiences = parse_experiences(obj, mission, file)?;
    let metadata = parse_metadata(obj, &experiences, mission, file)?;
    Ok(MissionGuidance {
        mission: mission.to_string(),
        step,
        updated_at,
        experiences,
        metadata,
    })
}

/// The `experiences` mapping of a section, with a legacy `focus` promoted to `G0`; non-empty
/// and containing `G0` (a step of [`parse_section`]).
fn parse_experiences(
    obj: &serde_json::Map<String, Value>,
    mission: &str,
    file: &Path,
) -> Result<BTreeMap<RuleKey, String>, InputError> {
    let raw_exp = obj
        .get("experiences")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            invalid(
                file,
                format!("Mission {mission}: experiences must be a non-empty mapping"),
            )
        })?;
    let mut experiences = BTreeMap::new();
    for (k, v) in raw_exp {
        let key: RuleKey = k
            .parse()
            .map_err(|e: BadRuleKey| invalid(file, format!("Mission {mission}: {e}")))?;
        let text = v
            .as_str()
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                invalid(
                    file,
                    format!("Mission {mission}: experience {k} must be a non-empty string"),
                )
            })?;
        experiences.insert(key, text.to_string());
    }
    let focus = obj
        .get("focus")
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|f| !f.is_empty());
    if let Some(focus) = focus
        && experiences
            .get(&RuleKey::G0)
            .is_none_or(|g0| g0 == G0_PLACEHOLDER)
    {
        // Legacy files kept the checklist in `focus`.
        experiences.insert(RuleKey::G0, focus.to_string());
    }
    if experiences.is_empty() {
        return Err(invalid(
            file,
            format!("Mission {mission}: experiences must be a non-empty mapping"),
        ));
    }
    if !experiences.contains_key(&RuleKey::G0) {
        return Err(invalid(
            file,
            format!("Mission {mission}: experiences must contain G0"),
        ));
    }
    check_budget(&experiences, mission, file)?;
    Ok(experiences)
}

/// The input budget's caps on a mission's rules ([`stageb_shared::budget`]): they go into
/// every prompt.
fn check_budget(
    experiences: &BTreeMap<RuleKey, String>,
    mission: &str,
    file: &Path,
) -> Result<(), InputError> {
    if experiences.len() > MAX_RULES {
        return Err(over_budget(
            file,
            format!(
                "Mission {mission}: {} rules, at most {MAX_RULES} are accepted",
                experiences.len()
            ),
        ));
    }
    let mut total = 0usize;
    for (key, text) in experiences {
        let chars = text.chars().count();
        if chars > MAX_RULE_CHARS {
            return Err(over_budget(
                file,
                format!(
                    "Mission {mission}: rule {key} has {chars} characters, at most {MAX_RULE_CHARS}"
                ),
            ));
        }
        total += chars;
    }
    if total > MAX_GUIDANCE_CHARS {
        return Err(over_budget(
            file,
            format!(
                "Mission {mission}: the rules hold {total} characters together, at most {MAX_GUIDANCE_CHARS}"
            ),
        ));
    }
    Ok(())
}

/// The optional `metadata` mapping of a section; every key must name one of `experiences` (a
/// step of [`parse_section`]).
fn parse_metadata(
    obj: &serde_json::Map<String, Value>,
    experiences: &BTreeMap<RuleKey, String>,
    mission: &str,
    file: &Path,
) -> Result<BTreeMap<RuleKey, RuleMetadata>, InputError> {
    let mut metadata = BTreeMap::new();
    match obj.get("metadata") {
        None | Some(Value::Null) => {}
        Some(Value::Object(raw_meta)) => {
            for (k, v) in raw_meta {
                let key: RuleKey = k.parse().map_err(|e: BadRuleKey| {
                    invalid(file, format!("Mission {mission}: metadata {e}"))
                })?;
                if !experiences.contains_key(&key) {
                    return Err(invalid(
                        file,
                        format!("Mission {mission}: metadata for unknown experience {k}"),
                    ));
                }
                let meta: RuleMetadata = serde_json::from_value(v.clone())
                    .map_err(|e| invalid(file, format!("Mission {mission}: metadata {k}: {e}")))?;
                if meta.reflection_id.trim().is_empty() {
                    return Err(invalid(
                        file,
                        format!("Mission {mission}: metadata {k}: reflection_id must be non-empty"),
                    ));
                }
                metadata.insert(key, meta);
            }
        }
        Some(other) => {
            return Err(invalid(
                file,
                format!("Mission {mission}: metadata must be a mapping, got {other}"),
            ));
        }
    }
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guidance::test_support::*;
    use crate::guidance::{GuidanceError, GuidanceRepo};
    use serde_json::json;

    #[test]
    fn metadata_defaults_when_absent() {
        let tmp = tempfile::tempdir().unwrap();
        let global = write_global(
            tmp.path(),
            json!({"step": 3, "updated_at": "2025-12-16T00:00:00+00:00", "experiences": {"G0": "x"},
                   "metadata": {"G0": {"reflection_id": "r1"}}}),
        );
        let g = load_mission_section(&global, MISSION).unwrap();
        let m = &g.metadata[&RuleKey::G0];
        assert_eq!((m.hit_count, m.miss_count, m.confidence), (0, 0, 1.0));
        let global = write_global(
            tmp.path(),
            json!({"step": 3, "updated_at": "2025-12-16T00:00:00+00:00", "experiences": {"G0": "x"}}),
        );
        assert!(
            load_mission_section(&global, MISSION)
                .unwrap()
                .metadata
                .is_empty()
        );
    }

    #[test]
    fn invalid_guidance_files_are_coded_input_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let cases = [
            (
                json!({"step": 1, "updated_at": "2025-12-16T00:00:00", "experiences": {}}),
                "non-empty",
            ),
            (
                json!({"updated_at": "2025-12-16T00:00:00", "experiences": {"G0": "x"}}),
                "missing step",
            ),
            (
                json!({"step": true, "updated_at": "2025-12-16T00:00:00", "experiences": {"G0": "x"}}),
                "step",
            ),
            (
                json!({"step": 1, "updated_at": "yesterday", "experiences": {"G0": "x"}}),
                "ISO",
            ),
            (
                json!({"step": 1, "updated_at": "2025-12-16T00:00:00", "experiences": {"G1": "x"}}),
                "G0",
            ),
            (
                json!({"step": 1, "updated_at": "2025-12-16T00:00:00", "experiences": {"G0": "  "}}),
                "non-empty string",
            ),
            (
                json!({"step": 1, "updated_at": "2025-12-16T00:00:00", "experiences": {"G0": "x", "rule": "y"}}),
                "not a rule key",
            ),
            (
                json!({"step": 1, "updated_at": "2025-12-16T00:00:00", "experiences": {"G0": "x"},
                       "metadata": {"G0": {"reflection_id": ""}}}),
                "reflection_id",
            ),
            (
                json!({"step": 1, "updated_at": "2025-12-16T00:00:00", "experiences": {"G0": "x"},
                       "metadata": {"G5": {"reflection_id": "r"}}}),
                "unknown experience",
            ),
        ];
        for (section, needle) in cases {
            let global = write_global(tmp.path(), section.clone());
            let err = load_mission_section(&global, MISSION).unwrap_err();
            assert_eq!(err.code, ErrorCode::InvalidGuidance, "{section}");
            assert!(
                err.message.contains(needle),
                "{needle} not in {}",
                err.message
            );
            assert!(err.file.ends_with("initial_guidance.json"));
        }
    }

    /// Regression: a 100,000-rule guidance passed `validate` and then failed every
    /// ticket (every prompt too long). Rules beyond the input budget are refused at load,
    /// with `E_INPUT_BUDGET`, and so is a file larger than its byte cap, before it is parsed.
    #[test]
    fn a_hundred_thousand_rules_are_refused_at_load_by_the_input_budget() {
        use stageb_shared::budget::{MAX_GUIDANCE_FILE_BYTES, MAX_RULE_CHARS};
        let tmp = tempfile::tempdir().unwrap();
        let section = |experiences: serde_json::Map<String, Value>| json!({"step": 1, "updated_at": "2025-12-16T00:00:00", "experiences": experiences});
        let many: serde_json::Map<String, Value> = (0..100_000)
            .map(|i| (format!("G{i}"), json!("挡风板必须安装到位")))
            .collect();
        let one_long = [("G0".to_string(), json!("长".repeat(MAX_RULE_CHARS + 1)))]
            .into_iter()
            .collect();
        let wide: serde_json::Map<String, Value> = (0..20)
            .map(|i| (format!("G{i}"), json!("长".repeat(MAX_RULE_CHARS))))
            .collect();
        for (experiences, needle) in [
            (many, "100000 rules, at most 256"),
            (one_long, "rule G0 has 4001 characters"),
            (wide, "characters together, at most 32000"),
        ] {
            let global = write_global(tmp.path(), section(experiences));
            let err = load_mission_section(&global, MISSION).unwrap_err();
            assert_eq!(err.code, ErrorCode::InputBudget, "{err:?}");
            assert!(err.message.contains(needle), "{needle}: {}", err.message);
        }
        let huge = tmp.path().join("huge.json");
        let file = fs::File::create(&huge).unwrap();
        file.set_len(MAX_GUIDANCE_FILE_BYTES + 1).unwrap();
        let err = load_mission_section(&huge, MISSION).unwrap_err();
        assert_eq!(err.code, ErrorCode::InputBudget, "{err:?}");
        assert!(err.message.contains("larger than"), "{}", err.message);
    }

    #[test]
    fn missing_mission_is_reported_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("g.json");
        fs::write(&path, json!({"其他任务": base_section()}).to_string()).unwrap();
        let err =
            GuidanceRepo::create(&path, MISSION, &tmp.path().join("run"), opts()).unwrap_err();
        let GuidanceError::Input(e) = err else {
            panic!("{err:?}")
        };
        assert_eq!(e.code, ErrorCode::InvalidGuidance);
        assert_eq!(
            e.message,
            format!("Mission {MISSION} not found in guidance file")
        );
        assert!(!tmp.path().join("run/guidance.json").exists());
    }

    #[test]
    fn legacy_version_guidance_schema_is_rejected() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("g.json");
        fs::write(
            &path,
            json!({"version": 1, "guidance": {"G0": "x"}}).to_string(),
        )
        .unwrap();
        let err = load_mission_section(&path, MISSION).unwrap_err();
        assert!(err.message.contains("legacy"), "{}", err.message);
    }

    #[test]
    fn legacy_focus_is_promoted_to_g0() {
        let tmp = tempfile::tempdir().unwrap();
        let global = write_global(
            tmp.path(),
            json!({"step": 1, "updated_at": "2025-12-16T00:00:00", "experiences": {"G0": G0_PLACEHOLDER}, "focus": "挡风板"}),
        );
        assert_eq!(
            load_mission_section(&global, MISSION).unwrap().g0(),
            "挡风板"
        );
    }
}
