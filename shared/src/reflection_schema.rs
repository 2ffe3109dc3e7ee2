//! Typed outputs of the two reflection passes (seed 003) and the JSON Schemas that constrain
//! their generation.
//!
//! Reflection is strict JSON with no text fallback (a python-original flaw fixed): the original
//! dug JSON out of prose and code fences and silently accepted truncated blocks. Here a pass's
//! output is parsed by [`parse_decision`] / [`parse_ops`], which accept exactly one JSON object
//! (surrounding whitespace allowed) and report anything else with a stable
//! [`ReflectionParseCode`].
//!
//! # Decisions
//!
//! - **Unknown fields are rejected at every level** (`deny_unknown_fields`). The schemas set
//!   `additionalProperties: false` everywhere, so a constrained output never has one; an
//!   unconstrained output that does (e.g. the original's later `hypotheses`) is not following
//!   the contract and is retried, not guessed at.
//! - **`op` stays a `String`** in [`ProposedOp`]: an unknown op kind is one rejected op that rank
//!   0 records with its reason (validate–retry–process), not a parse failure of the whole
//!   proposal. The schema still only generates `add|update|delete|merge`.
//! - **The schemas bound everything** (`maxLength` on every string, `maxItems` on every array,
//!   bounded whitespace via `x-guidance.whitespace_pattern`) so a small model cannot loop
//!   forever inside a string or a list: every constrained generation ends in a bounded number
//!   of characters, and every output matching the schema deserializes into these types.
//! - **Per-op shapes**: the ops schema is an `anyOf` over the four op kinds, each with exactly
//!   the fields that kind needs (`add` has no key, `delete` has no text, `merge` has
//!   `merged_from`), keys match `G<n>` (so `S*` cannot even be proposed), evidence is a
//!   non-empty list of ticket keys (`…::pass|fail`). Rank 0 still validates every op.
//! - **Bounds are generation bounds, not validation**: the parse functions check structure and
//!   types; semantic limits (known keys, evidence ⊆ learnable, length caps, third-state words)
//!   are the ops validator's job on rank 0, which records each rejection.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Cap on `decision_analysis` and `evidence_analysis` (characters).
pub const ANALYSIS_MAX_CHARS: usize = 200;
/// Cap on an op's rule `text` (characters).
pub const RULE_TEXT_MAX_CHARS: usize = 160;
/// Cap on an op's `rationale` (characters).
pub const RATIONALE_MAX_CHARS: usize = 80;
/// Cap on one ticket key (`{group_id}::{label}`).
pub const TICKET_KEY_MAX_CHARS: usize = 128;
/// Cap on every list of ticket keys (a reflection batch is far smaller; the original's
/// production `reflection.batch_size` was 16).
pub const MAX_TICKET_KEYS: usize = 64;
/// Cap on `merged_from`.
pub const MAX_MERGED_FROM: usize = 8;
/// Regex a guidance key proposed by the model must match (`S*` is read-only).
pub const GUIDANCE_KEY_PATTERN: &str = "^G(0|[1-9][0-9]{0,3})$";
/// Regex a ticket key must match (search semantics, as in JSON Schema).
pub const TICKET_KEY_PATTERN: &str = "::(pass|fail)$";
/// JSON whitespace allowed at each position: bounded so whitespace cannot loop either.
const WHITESPACE_PATTERN: &str = "[\\x20\\x0A\\x0D\\x09]{1,16}";

/// Decision pass: which tickets are stop-gradient after seeing `gt_label`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionOutput {
    /// Ticket keys; ids not in the batch are ignored by rank 0.
    pub no_evidence_group_ids: Vec<String>,
    pub decision_analysis: String,
}

/// Ops pass: proposed guidance operations over the learnable tickets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpsOutput {
    /// Advisory; the engine never reads it (as in the original).
    pub has_evidence: bool,
    pub evidence_analysis: String,
    pub operations: Vec<ProposedOp>,
    /// Advisory; rank 0 computes coverage itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage: Option<Coverage>,
}

/// One proposed operation, exactly as the model wrote it (validated on rank 0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProposedOp {
    /// `add`, `update`, `delete` or `merge` (anything else is rejected by the validator).
    pub op: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rationale: Option<String>,
    pub evidence: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_from: Option<Vec<String>>,
    /// The evidence tickets the op claims to decide correctly once applied (offered with
    /// `reflection.gate` only; checked in the next epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_flips: Option<Vec<String>>,
}

/// The model's own coverage claim (advisory only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Coverage {
    #[serde(default)]
    pub learnable_group_ids: Vec<String>,
    #[serde(default)]
    pub covered_group_ids: Vec<String>,
    #[serde(default)]
    pub uncovered_group_ids: Vec<String>,
}

fn ticket_key_schema() -> Value {
    json!({
        "type": "string",
        "minLength": 1,
        "maxLength": TICKET_KEY_MAX_CHARS,
        "pattern": TICKET_KEY_PATTERN,
    })
}

fn ticket_keys_schema(min_items: usize) -> Value {
    json!({
        "type": "array",
        "items": ticket_key_schema(),
        "minItems": min_items,
        "maxItems": MAX_TICKET_KEYS,
    })
}

fn bounded_string(max: usize, min: usize) -> Value {
    json!({ "type": "string", "minLength": min, "maxLength": max })
}

fn guidance_key_schema() -> Value {
    json!({ "type": "string", "pattern": GUIDANCE_KEY_PATTERN, "maxLength": 5 })
}

fn x_guidance() -> Value {
    json!({ "whitespace_pattern": WHITESPACE_PATTERN })
}

/// JSON Schema (draft 2020-12, the subset llguidance supports) for [`DecisionOutput`].
pub fn decision_json_schema() -> Value {
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "x-guidance": x_guidance(),
        "type": "object",
        "properties": {
            "no_evidence_group_ids": ticket_keys_schema(0),
            "decision_analysis": bounded_string(ANALYSIS_MAX_CHARS, 0),
        },
        "required": ["no_evidence_group_ids", "decision_analysis"],
        "additionalProperties": false,
    })
}

/// One `anyOf` branch of the op schema: `op` fixed to `kind`, then `fields` in order, all
/// required.
fn op_branch(kind: &str, fields: &[&str]) -> Value {
    let mut props = serde_json::Map::new();
    props.insert("op".into(), json!({ "const": kind }));
    for f in fields {
        let schema = match *f {
            "key" => guidance_key_schema(),
            "merged_from" => json!({
                "type": "array",
                "items": guidance_key_schema(),
                "minItems": 1,
                "maxItems": MAX_MERGED_FROM,
            }),
            "text" => bounded_string(RULE_TEXT_MAX_CHARS, 1),
            "rationale" => bounded_string(RATIONALE_MAX_CHARS, 1),
            "evidence" => ticket_keys_schema(1),
            other => unreachable!("unknown op field {other}"),
        };
        props.insert((*f).into(), schema);
    }
    let mut required = vec!["op"];
    required.extend_from_slice(fields);
    json!({
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": false,
    })
}

/// Offer the optional `expected_flips` (ticket ids, like `evidence`) on every op branch of an
/// ops schema.
pub fn offer_expected_flips(schema: &mut Value) {
    let Some(branches) = schema
        .pointer_mut("/properties/operations/items/anyOf")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for b in branches {
        if let Some(props) = b.get_mut("properties").and_then(Value::as_object_mut) {
            props.insert("expected_flips".into(), ticket_keys_schema(0));
        }
    }
}

/// JSON Schema for [`OpsOutput`] with at most `max_operations` operations.
pub fn ops_json_schema(max_operations: usize) -> Value {
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "x-guidance": x_guidance(),
        "type": "object",
        "properties": {
            "has_evidence": { "type": "boolean" },
            "evidence_analysis": bounded_string(ANALYSIS_MAX_CHARS, 0),
            "operations": {
                "type": "array",
                "items": { "anyOf": [
                    op_branch("add", &["text", "rationale", "evidence"]),
                    op_branch("update", &["key", "text", "rationale", "evidence"]),
                    op_branch("delete", &["key", "rationale", "evidence"]),
                    op_branch("merge", &["key", "merged_from", "text", "rationale", "evidence"]),
                ]},
                "maxItems": max_operations,
            },
            "coverage": {
                "type": "object",
                "properties": {
                    "learnable_group_ids": ticket_keys_schema(0),
                    "covered_group_ids": ticket_keys_schema(0),
                    "uncovered_group_ids": ticket_keys_schema(0),
                },
                "additionalProperties": false,
            },
        },
        "required": ["has_evidence", "evidence_analysis", "operations"],
        "additionalProperties": false,
    })
}

/// Why a reflection output was not accepted. Codes are stable (written to `reflection.jsonl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReflectionParseCode {
    /// Nothing but whitespace.
    Empty,
    /// The text does not start with `{` (prose, a code fence, an array, …).
    NotJsonObject,
    /// The object ends before it is closed (the original's truncation bug).
    TruncatedJson,
    /// Not valid JSON, or text after the object.
    InvalidJson,
    /// Valid JSON that does not fit the pass's type (missing/unknown field, wrong type).
    SchemaMismatch,
}

impl ReflectionParseCode {
    pub fn code(self) -> &'static str {
        match self {
            ReflectionParseCode::Empty => "EMPTY",
            ReflectionParseCode::NotJsonObject => "NOT_JSON_OBJECT",
            ReflectionParseCode::TruncatedJson => "TRUNCATED_JSON",
            ReflectionParseCode::InvalidJson => "INVALID_JSON",
            ReflectionParseCode::SchemaMismatch => "SCHEMA_MISMATCH",
        }
    }
}

impl std::fmt::Display for ReflectionParseCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

/// A reflection output that could not be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("reflection output rejected ({code}): {detail}")]
pub struct ReflectionParseError {
    pub code: ReflectionParseCode,
    pub detail: String,
}

fn parse_strict<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ReflectionParseError> {
    let err = |code, detail: String| ReflectionParseError { code, detail };
    let body = text.trim();
    if body.is_empty() {
        return Err(err(ReflectionParseCode::Empty, "no text".into()));
    }
    if !body.starts_with('{') {
        return Err(err(
            ReflectionParseCode::NotJsonObject,
            "output must be exactly one JSON object, with no prose or code fence around it".into(),
        ));
    }
    serde_json::from_str::<T>(body).map_err(|e| {
        use serde_json::error::Category;
        let code = match e.classify() {
            Category::Eof => ReflectionParseCode::TruncatedJson,
            Category::Syntax | Category::Io => ReflectionParseCode::InvalidJson,
            Category::Data => ReflectionParseCode::SchemaMismatch,
        };
        err(code, e.to_string())
    })
}

/// Parse a decision-pass output: exactly one JSON object of [`DecisionOutput`]'s shape.
pub fn parse_decision(text: &str) -> Result<DecisionOutput, ReflectionParseError> {
    parse_strict(text)
}

/// Parse an ops-pass output: exactly one JSON object of [`OpsOutput`]'s shape.
pub fn parse_ops(text: &str) -> Result<OpsOutput, ReflectionParseError> {
    parse_strict(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_003_examples_parse() {
        let d = parse_decision(
            r#"{"no_evidence_group_ids": ["QC-xxx::fail", "QC-yyy::pass"], "decision_analysis": "..."}"#,
        )
        .unwrap();
        assert_eq!(d.no_evidence_group_ids.len(), 2);
        let o = parse_ops(
            r#"{
  "has_evidence": true,
  "evidence_analysis": "...",
  "operations": [
    {"op":"add","text":"...","rationale":"...","evidence":["QC-1","QC-2"]},
    {"op":"update","key":"G1","text":"...","rationale":"...","evidence":["QC-3"]},
    {"op":"delete","key":"G2","rationale":"...","evidence":["QC-4"]},
    {"op":"merge","key":"G3","merged_from":["G4","G5"],"text":"...","rationale":"...","evidence":["QC-6"]}
  ],
  "coverage": {"learnable_group_ids":[], "covered_group_ids":[], "uncovered_group_ids":[]}
}"#,
        )
        .unwrap();
        assert_eq!(o.operations.len(), 4);
        assert_eq!(
            o.operations[3].merged_from.as_deref(),
            Some(&["G4".into(), "G5".into()][..])
        );
        assert_eq!(o.coverage, Some(Coverage::default()));
    }

    #[test]
    fn no_text_fallback_regression_for_original_json_salvage() {
        // The original dug JSON out of prose and fences; a fenced answer must be refused.
        let fenced = "```json\n{\"no_evidence_group_ids\": [], \"decision_analysis\": \"\"}\n```";
        assert_eq!(
            parse_decision(fenced).unwrap_err().code,
            ReflectionParseCode::NotJsonObject
        );
        let prose = "好的：{\"no_evidence_group_ids\": [], \"decision_analysis\": \"\"}";
        assert_eq!(
            parse_decision(prose).unwrap_err().code,
            ReflectionParseCode::NotJsonObject
        );
        let trailing = "{\"no_evidence_group_ids\": [], \"decision_analysis\": \"\"} 以上";
        assert_eq!(
            parse_decision(trailing).unwrap_err().code,
            ReflectionParseCode::InvalidJson
        );
        let truncated = "{\"no_evidence_group_ids\": [\"QC-1::fail\"], \"decision_anal";
        assert_eq!(
            parse_decision(truncated).unwrap_err().code,
            ReflectionParseCode::TruncatedJson
        );
        assert_eq!(
            parse_decision("  \n").unwrap_err().code,
            ReflectionParseCode::Empty
        );
        let surrounded = "\n {\"no_evidence_group_ids\": [], \"decision_analysis\": \"\"} \n";
        assert!(parse_decision(surrounded).is_ok());
    }

    #[test]
    fn unknown_and_missing_fields_are_schema_mismatches() {
        let extra = r#"{"no_evidence_group_ids": [], "decision_analysis": "", "operations": []}"#;
        assert_eq!(
            parse_decision(extra).unwrap_err().code,
            ReflectionParseCode::SchemaMismatch
        );
        let missing = r#"{"has_evidence": true, "operations": []}"#;
        assert_eq!(
            parse_ops(missing).unwrap_err().code,
            ReflectionParseCode::SchemaMismatch
        );
        let hypotheses = r#"{"has_evidence": false, "evidence_analysis": "", "operations": [], "hypotheses": []}"#;
        assert_eq!(
            parse_ops(hypotheses).unwrap_err().code,
            ReflectionParseCode::SchemaMismatch
        );
        // An unknown op kind parses: it is one op for the validator to reject, with a reason.
        let odd = r#"{"has_evidence": true, "evidence_analysis": "", "operations": [{"op": "rename", "evidence": ["QC-1::fail"]}]}"#;
        assert_eq!(parse_ops(odd).unwrap().operations[0].op, "rename");
    }

    #[test]
    fn schemas_bound_every_string_and_array() {
        fn walk(v: &Value, path: &str, problems: &mut Vec<String>) {
            if let Some(obj) = v.as_object() {
                match obj.get("type").and_then(Value::as_str) {
                    Some("string") if !obj.contains_key("maxLength") => {
                        problems.push(format!("{path}: string without maxLength"))
                    }
                    Some("array") if !obj.contains_key("maxItems") => {
                        problems.push(format!("{path}: array without maxItems"))
                    }
                    Some("object") if obj.get("additionalProperties") != Some(&json!(false)) => {
                        problems.push(format!("{path}: object allows additional properties"))
                    }
                    _ => {}
                }
                for (k, child) in obj {
                    walk(child, &format!("{path}/{k}"), problems);
                }
            } else if let Some(arr) = v.as_array() {
                for (i, child) in arr.iter().enumerate() {
                    walk(child, &format!("{path}/{i}"), problems);
                }
            }
        }
        let mut problems = Vec::new();
        walk(&decision_json_schema(), "decision", &mut problems);
        walk(&ops_json_schema(3), "ops", &mut problems);
        assert!(problems.is_empty(), "{problems:#?}");
    }
}
