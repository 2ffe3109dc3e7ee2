//! Reading and validating a mission's section of a guidance file (reference §3 rules).
//!
//! The same validation applies to the global guidance file (seeding a run) and to the run's own
//! `guidance.json` (resume, chain verification), so a resumed run never accepts content that
//! seeding would have rejected. Every failure is a coded [`InputError`] naming the file.

use super::model::{BadRuleKey, MissionGuidance, RuleKey, RuleMetadata};
use serde_json::Value;
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

/// A guidance file (seed or run) as JSON; unreadable or malformed files are coded input errors.
pub(super) fn read_json(path: &Path) -> Result<Value, InputError> {
    let bytes = fs::read(path).map_err(|e| {
        InputError::new(
            ErrorCode::FileNotFound,
            path.display().to_string(),
            None,
            format!("cannot read: {e}"),
        )
    })?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(path, format!("not valid JSON: {e}")))?;
    Ok(value)
}

/// Read and validate one mission's section of a guidance file (reference §3 rules).
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
    Ok(experiences)
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
