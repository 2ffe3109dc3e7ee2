//! The guidance data model: rule keys, per-rule metadata, one mission's guidance and the
//! text normal forms rules are compared in.
//!
//! Everything else in [`crate::guidance`] builds on these types (ops name [`RuleKey`]s, versions
//! hash [`HashedContent`], the repository holds a [`MissionGuidance`]), so this module depends on
//! none of its siblings. What counts as "the same rule text" ([`dedupe_form`], [`loose_form`])
//! lives here because [`MissionGuidance::key_with_text`] is defined by it.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use stageb_shared::digest::digest_of;
use stageb_shared::text;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// Added to the denominator of `confidence` (the original's constant).
pub const CONFIDENCE_EPSILON: f64 = 1e-5;

// ---------------------------------------------------------------------------------------------
// Keys

/// A rule key: `S<n>` (scaffold) or `G<n>`. Orders `S` before `G`, then numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RuleKey {
    S(u32),
    G(u32),
}

impl RuleKey {
    pub const G0: RuleKey = RuleKey::G(0);
    pub const G1: RuleKey = RuleKey::G(1);

    pub fn is_scaffold(self) -> bool {
        matches!(self, RuleKey::S(_))
    }

    pub fn is_g0(self) -> bool {
        self == RuleKey::G0
    }
}

impl fmt::Display for RuleKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleKey::S(n) => write!(f, "S{n}"),
            RuleKey::G(n) => write!(f, "G{n}"),
        }
    }
}

/// A string that is not a canonical `S<n>`/`G<n>` key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not a rule key (expected S<n> or G<n>)")]
pub struct BadRuleKey(pub String);

impl FromStr for RuleKey {
    type Err = BadRuleKey;

    /// Canonical form only: `G1`, not `g1`, `G01` or ` G1` (a key that could be spelled two ways
    /// would let two rules share one identity).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadRuleKey(s.to_string());
        let (kind, digits) = s.split_at_checked(1).ok_or_else(bad)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        if digits.len() > 1 && digits.starts_with('0') {
            return Err(bad());
        }
        let n: u32 = digits.parse().map_err(|_| bad())?;
        match kind {
            "S" => Ok(RuleKey::S(n)),
            "G" => Ok(RuleKey::G(n)),
            _ => Err(bad()),
        }
    }
}

impl Serialize for RuleKey {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RuleKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------------
// Content

/// Per-rule metadata (the original's fields; unknown fields are kept in `extra`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuleMetadata {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    pub reflection_id: String,
    #[serde(default)]
    pub sources: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rationale: Option<String>,
    #[serde(default)]
    pub hit_count: u64,
    #[serde(default)]
    pub miss_count: u64,
    #[serde(default = "default_confidence")]
    pub confidence: f64,
    /// Checked predictions (`reflection.gate` on): tickets that ops on this rule claimed to fix
    /// (`expected_flips`) and that a later epoch decided right, or wrong. Absent while zero, so
    /// runs without predictions write what they always wrote.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub claims_hit: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub claims_missed: u64,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

fn default_confidence() -> f64 {
    1.0
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl RuleMetadata {
    /// Whether the rule's checked predictions failed repeatedly: at least `min_missed` claims
    /// missed and a hit rate (`claims_hit / claims`) below `threshold`. A lifecycle cleanup
    /// candidate, as a low confidence is.
    pub fn claims_failing(&self, threshold: f64, min_missed: u64) -> bool {
        let claims = self.claims_hit + self.claims_missed;
        self.claims_missed >= min_missed.max(1)
            && (self.claims_hit as f64 / claims as f64) < threshold
    }
}

/// `hit / (hit + miss + 1e-5)`, rounded to 6 decimals: a short decimal survives a JSON
/// write/read exactly (serde_json's default float parsing is not exact for 16-17 digit values),
/// so a resumed run rewrites the same bytes.
pub fn confidence(hit: u64, miss: u64) -> f64 {
    let c = hit as f64 / (hit as f64 + miss as f64 + CONFIDENCE_EPSILON);
    (c * 1e6).round() / 1e6
}

/// The hashed part of a rule's metadata: provenance, not timing or counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HashedMetadata {
    pub reflection_id: String,
    pub sources: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rationale: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, Value>,
}

/// What `content_hash` is computed over; also the seed content stored in the first version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HashedContent {
    pub experiences: BTreeMap<RuleKey, String>,
    pub metadata: BTreeMap<RuleKey, HashedMetadata>,
}

/// One mission's guidance.
#[derive(Debug, Clone, PartialEq)]
pub struct MissionGuidance {
    pub mission: String,
    pub step: u64,
    pub updated_at: String,
    pub experiences: BTreeMap<RuleKey, String>,
    pub metadata: BTreeMap<RuleKey, RuleMetadata>,
}

impl MissionGuidance {
    pub fn text(&self, key: RuleKey) -> Option<&str> {
        self.experiences.get(&key).map(String::as_str)
    }

    pub fn g0(&self) -> &str {
        self.text(RuleKey::G0).unwrap_or("")
    }

    /// `[(key, text)]` in numeric order, `S*` first.
    pub fn render_for_prompt(&self) -> Vec<(String, String)> {
        self.experiences
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    pub fn hashed_content(&self) -> HashedContent {
        HashedContent {
            experiences: self.experiences.clone(),
            metadata: self
                .metadata
                .iter()
                .map(|(k, m)| {
                    let h = HashedMetadata {
                        reflection_id: m.reflection_id.clone(),
                        sources: m.sources.clone(),
                        rationale: m.rationale.clone(),
                        extra: m.extra.clone(),
                    };
                    (*k, h)
                })
                .collect(),
        }
    }

    /// `sha256:` of the canonical JSON of [`HashedContent`].
    pub fn content_hash(&self) -> String {
        digest_of(&self.hashed_content())
    }

    /// The key whose text has the same dedupe form as `text`, if any.
    pub fn key_with_text(&self, text: &str) -> Option<RuleKey> {
        let wanted = loose_form(text);
        self.experiences
            .iter()
            .find(|(_, v)| loose_form(v) == wanted)
            .map(|(k, _)| *k)
    }

    /// The smallest `G<i>` not in use.
    pub fn next_free_g(&self) -> RuleKey {
        (0..)
            .map(RuleKey::G)
            .find(|k| !self.experiences.contains_key(k))
            .unwrap_or(RuleKey::G(u32::MAX))
    }

    pub(super) fn from_hashed(mission: &str, step: u64, content: &HashedContent) -> Self {
        MissionGuidance {
            mission: mission.to_string(),
            step,
            updated_at: String::new(),
            experiences: content.experiences.clone(),
            metadata: content
                .metadata
                .iter()
                .map(|(k, m)| {
                    let meta = RuleMetadata {
                        updated_at: None,
                        reflection_id: m.reflection_id.clone(),
                        sources: m.sources.clone(),
                        rationale: m.rationale.clone(),
                        hit_count: 0,
                        miss_count: 0,
                        confidence: 1.0,
                        claims_hit: 0,
                        claims_missed: 0,
                        extra: m.extra.clone(),
                    };
                    (*k, meta)
                })
                .collect(),
        }
    }
}

/// The form two rule texts are compared in for dedupe: simplified, space-normalized, without
/// trailing `。`/`.`.
pub fn dedupe_form(s: &str) -> String {
    text::normalize(s)
        .trim_end_matches(['。', '.'])
        .trim()
        .to_string()
}

/// The form in which two rule texts are *the same rule* (duplicate detection, and an update
/// that changes nothing): [`dedupe_form`], lowercase, without whitespace and punctuation.
pub fn loose_form(s: &str) -> String {
    dedupe_form(s)
        .to_lowercase()
        .chars()
        .filter(|c| {
            !c.is_whitespace()
                && !c.is_ascii_punctuation()
                && !"，。！？；：、（）【】《》“”‘’·~—…".contains(*c)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guidance::GuidanceRepo;
    use crate::guidance::test_support::*;
    use serde_json::json;

    #[test]
    fn rule_keys_parse_canonically_and_sort_numerically() {
        assert_eq!("G10".parse::<RuleKey>().unwrap(), RuleKey::G(10));
        assert_eq!("S1".parse::<RuleKey>().unwrap(), RuleKey::S(1));
        for bad in ["g1", "G01", " G1", "G", "X1", "G-1", "", "G1a"] {
            assert!(bad.parse::<RuleKey>().is_err(), "{bad}");
        }
        let mut keys = [
            RuleKey::G(10),
            RuleKey::G(2),
            RuleKey::S(3),
            RuleKey::G(0),
            RuleKey::S(1),
        ];
        keys.sort();
        let s: Vec<String> = keys.iter().map(ToString::to_string).collect();
        assert_eq!(s, vec!["S1", "S3", "G0", "G2", "G10"]);
    }

    #[test]
    fn regression_b5_g10_sorts_after_g2_in_prompts() {
        let tmp = tempfile::tempdir().unwrap();
        let mut section = base_section();
        section["experiences"]["G10"] = json!("十");
        section["experiences"]["G2"] = json!("二");
        let global = write_global(tmp.path(), section);
        let r = GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), opts()).unwrap();
        let keys: Vec<String> = r.render_for_prompt().into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec!["S1", "G0", "G1", "G2", "G10"]);
    }

    #[test]
    fn confidence_is_hit_share_rounded() {
        assert_eq!(confidence(0, 0), 0.0);
        assert_eq!(confidence(1, 0), 0.99999);
        assert_eq!(confidence(1, 2), 0.333332);
    }
}
