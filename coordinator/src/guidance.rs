//! The per-run guidance repository (reference §3, §7.4, §7.6; DESIGN §6).
//!
//! The global guidance file (`{mission: {step, updated_at, experiences, metadata}}`) is read
//! once; this mission's section is validated and copied to `{run_dir}/guidance.json`, which is
//! the only guidance rank 0 changes afterwards (the global file is never written).
//!
//! # Keys
//! `S<n>` are read-only scaffold rules, `G0` is the checklist (updatable, never deletable) and
//! `G1+` are learned rules. Keys are never renumbered (hit/miss counters and evidence refer to
//! them); a new rule takes the smallest unused `G<i>`; a rule whose normalized text already
//! exists reuses that key. [`RuleKey`] orders numerically, `S` before `G` (`G2` < `G10`, the
//! original's B5 bug was a lexicographic sort).
//!
//! # Versions
//! Every change of rule content is a version: `step + 1` per applied reflection (cleanup keeps
//! the step), content-addressed (`content_hash` = sha256 of the canonical JSON of experiences
//! and metadata *without* timestamps and hit/miss counters) and hash-chained (`version_hash`
//! commits to the parent's `version_hash`, the step, the ops and their outcome). The chain is
//! stored as a `versions` list inside the mission section of `guidance.json`, so content and
//! history are written by one atomic rename and can never disagree after a crash. The first
//! entry holds the seed content, so [`verify_chain`] can replay every version from the seed and
//! recompute every hash.
//!
//! Hit/miss counters are excluded from the content hash on purpose: they change on every
//! ticket's feedback without a step (as in the original), and a version per ticket would bury
//! the rule history. They are persisted with the same atomic write.
//!
//! # Persistence
//! Before a version is written, the current file is copied into `snapshots/` under a
//! deterministic name (`guidance-v{seq:04}-step{step:04}-{hash12}.json`, so reruns produce the
//! same names) and snapshots are pruned to `retention`; a snapshot failure aborts the change.
//! The write is temp file in the same directory, fsync, rename, fsync of the directory; on any
//! error the live file is unchanged and the temp file is removed. Feedback writes are not
//! snapshotted (the rule content did not change).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use stageb_shared::digest::digest_of;
use stageb_shared::domain::TicketKey;
use stageb_shared::error::{ErrorCode, InputError};
use stageb_shared::text;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// File name of the run guidance inside the run directory.
pub const GUIDANCE_FILE: &str = "guidance.json";
/// Directory of the pre-change snapshots inside the run directory.
pub const SNAPSHOTS_DIR: &str = "snapshots";
/// Text of a placeholder `G0` that the legacy `focus` field replaces.
pub const G0_PLACEHOLDER: &str = "Initial guidance placeholder";
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
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

fn default_confidence() -> f64 {
    1.0
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

    fn from_hashed(mission: &str, step: u64, content: &HashedContent) -> Self {
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

// ---------------------------------------------------------------------------------------------
// Ops

/// A validated guidance operation (the output of [`crate::ops::validate_ops`]). Serialized as
/// the ops-pass schema: `{"op": "add"|"update"|"delete"|"merge", …}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum GuidanceOp {
    Add {
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rationale: Option<String>,
        evidence: Vec<TicketKey>,
    },
    Update {
        key: RuleKey,
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rationale: Option<String>,
        evidence: Vec<TicketKey>,
    },
    Delete {
        key: RuleKey,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rationale: Option<String>,
        evidence: Vec<TicketKey>,
    },
    Merge {
        key: RuleKey,
        merged_from: Vec<RuleKey>,
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rationale: Option<String>,
        evidence: Vec<TicketKey>,
    },
}

impl GuidanceOp {
    pub fn kind(&self) -> &'static str {
        match self {
            GuidanceOp::Add { .. } => "add",
            GuidanceOp::Update { .. } => "update",
            GuidanceOp::Delete { .. } => "delete",
            GuidanceOp::Merge { .. } => "merge",
        }
    }

    pub fn evidence(&self) -> &[TicketKey] {
        match self {
            GuidanceOp::Add { evidence, .. }
            | GuidanceOp::Update { evidence, .. }
            | GuidanceOp::Delete { evidence, .. }
            | GuidanceOp::Merge { evidence, .. } => evidence,
        }
    }

    /// The target key, when the op names one (`add` does not).
    pub fn key(&self) -> Option<RuleKey> {
        match self {
            GuidanceOp::Add { .. } => None,
            GuidanceOp::Update { key, .. }
            | GuidanceOp::Delete { key, .. }
            | GuidanceOp::Merge { key, .. } => Some(*key),
        }
    }

    pub fn text(&self) -> Option<&str> {
        match self {
            GuidanceOp::Add { text, .. }
            | GuidanceOp::Update { text, .. }
            | GuidanceOp::Merge { text, .. } => Some(text),
            GuidanceOp::Delete { .. } => None,
        }
    }
}

/// What an applied op did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpEffect {
    Created,
    Updated,
    Deleted,
    Merged,
}

/// An op that changed the guidance, with the key it resolved to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedOp {
    /// Position in the op list given to [`apply_ops`].
    pub index: usize,
    pub op: String,
    pub key: RuleKey,
    pub effect: OpEffect,
    /// Keys removed by a merge (those that existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged_away: Vec<RuleKey>,
    pub evidence: Vec<TicketKey>,
}

/// Why an op was not applied (ops validation rejects these earlier; apply re-checks so that
/// guidance invariants never depend on the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    ScaffoldKey,
    G0Delete,
    MissingKey,
    EmptyText,
    DuplicateOfScaffold,
    DuplicateText,
    /// The text equals the rule's current text ([`loose_form`]): nothing would change, so the
    /// op gets no step, no version, no hit and covers no evidence.
    Unchanged,
}

/// An op that did not change the guidance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedOp {
    pub index: usize,
    pub op: String,
    pub reason: SkipReason,
    pub detail: String,
}

/// The pure result of [`apply_ops`].
#[derive(Debug, Clone, PartialEq)]
pub struct OpsApplication {
    pub guidance: MissionGuidance,
    pub applied: Vec<AppliedOp>,
    pub skipped: Vec<SkippedOp>,
}

/// Apply ops in order to a copy of `current` (pure; persistence is [`GuidanceRepo::apply`]).
///
/// Semantics (reference §7.4, with the strict differences noted):
/// - `delete`: `S*` and `G0` are never removed; a missing key is skipped (and therefore never
///   counts as evidence coverage, B9).
/// - `add`: text equal ([`loose_form`]) to an existing rule is skipped (`unchanged` for a `G`
///   rule, `duplicate_of_scaffold` for an `S` rule): it changes nothing, so it earns no hit and
///   covers no evidence; otherwise the smallest unused `G<i>` is created.
/// - `update` whose text equals the rule's current text is skipped `unchanged` likewise.
/// - `update`: the key must exist (the original created it; here a missing key is skipped so a
///   typo cannot invent a rule); text equal to a *different* rule is skipped (it would create a
///   duplicate).
/// - `merge`: the target must exist; each `merged_from` key that exists (and is not `S*`, `G0`
///   or the target) is removed and its counters and sources folded into the target.
/// - Every upsert/merge sets `hit = Σhit + 1` (reinforcement, as the original), `miss = Σmiss`,
///   `confidence`, `reflection_id`, `sources = evidence ∪ old sources`, rationale (new, else old).
///
/// `step` is incremented once. Nothing applied → [`GuidanceError::NothingApplied`].
pub fn apply_ops(
    current: &MissionGuidance,
    ops: &[GuidanceOp],
    reflection_id: &str,
    now: &str,
) -> Result<OpsApplication, GuidanceError> {
    if reflection_id.trim().is_empty() {
        return Err(GuidanceError::InvalidReflectionId);
    }
    let mut g = current.clone();
    let mut applied = Vec::new();
    let mut skipped = Vec::new();
    for (index, op) in ops.iter().enumerate() {
        let skip = |reason: SkipReason, detail: String| SkippedOp {
            index,
            op: op.kind().to_string(),
            reason,
            detail,
        };
        let done = |key: RuleKey, effect: OpEffect, merged_away: Vec<RuleKey>| AppliedOp {
            index,
            op: op.kind().to_string(),
            key,
            effect,
            merged_away,
            evidence: op.evidence().to_vec(),
        };
        match op {
            GuidanceOp::Delete { key, .. } => {
                if key.is_scaffold() {
                    skipped.push(skip(SkipReason::ScaffoldKey, format!("{key} is read-only")));
                } else if key.is_g0() {
                    skipped.push(skip(SkipReason::G0Delete, "G0 cannot be deleted".into()));
                } else if g.experiences.remove(key).is_none() {
                    skipped.push(skip(
                        SkipReason::MissingKey,
                        format!("{key} does not exist"),
                    ));
                } else {
                    g.metadata.remove(key);
                    applied.push(done(*key, OpEffect::Deleted, Vec::new()));
                }
            }
            GuidanceOp::Add {
                text,
                rationale,
                evidence,
            } => {
                let text = text::normalize(text);
                if dedupe_form(&text).is_empty() {
                    skipped.push(skip(SkipReason::EmptyText, "empty text".into()));
                    continue;
                }
                let target = match g.key_with_text(&text) {
                    Some(k) if k.is_scaffold() => {
                        skipped.push(skip(
                            SkipReason::DuplicateOfScaffold,
                            format!("same text as {k}"),
                        ));
                        continue;
                    }
                    Some(k) => {
                        skipped.push(skip(
                            SkipReason::Unchanged,
                            format!("{k} already says this"),
                        ));
                        continue;
                    }
                    None => g.next_free_g(),
                };
                let effect = OpEffect::Created;
                upsert(
                    &mut g,
                    target,
                    text,
                    rationale.as_deref(),
                    evidence,
                    &[],
                    reflection_id,
                    now,
                );
                applied.push(done(target, effect, Vec::new()));
            }
            GuidanceOp::Update {
                key,
                text,
                rationale,
                evidence,
            } => {
                let text = text::normalize(text);
                if key.is_scaffold() {
                    skipped.push(skip(SkipReason::ScaffoldKey, format!("{key} is read-only")));
                } else if !g.experiences.contains_key(key) {
                    skipped.push(skip(
                        SkipReason::MissingKey,
                        format!("{key} does not exist"),
                    ));
                } else if dedupe_form(&text).is_empty() {
                    skipped.push(skip(SkipReason::EmptyText, "empty text".into()));
                } else if g
                    .text(*key)
                    .is_some_and(|t| loose_form(t) == loose_form(&text))
                {
                    skipped.push(skip(
                        SkipReason::Unchanged,
                        format!("{key} already says this"),
                    ));
                } else if let Some(other) = g.key_with_text(&text).filter(|k| k != key) {
                    let reason = if other.is_scaffold() {
                        SkipReason::DuplicateOfScaffold
                    } else {
                        SkipReason::DuplicateText
                    };
                    skipped.push(skip(reason, format!("same text as {other}")));
                } else {
                    upsert(
                        &mut g,
                        *key,
                        text,
                        rationale.as_deref(),
                        evidence,
                        &[],
                        reflection_id,
                        now,
                    );
                    applied.push(done(*key, OpEffect::Updated, Vec::new()));
                }
            }
            GuidanceOp::Merge {
                key,
                merged_from,
                text,
                rationale,
                evidence,
            } => {
                let text = text::normalize(text);
                if key.is_scaffold() {
                    skipped.push(skip(SkipReason::ScaffoldKey, format!("{key} is read-only")));
                    continue;
                }
                if !g.experiences.contains_key(key) {
                    skipped.push(skip(
                        SkipReason::MissingKey,
                        format!("{key} does not exist"),
                    ));
                    continue;
                }
                if dedupe_form(&text).is_empty() {
                    skipped.push(skip(SkipReason::EmptyText, "empty text".into()));
                    continue;
                }
                let consumed =
                    |k: &RuleKey| merged_from.contains(k) && !k.is_scaffold() && !k.is_g0();
                if let Some(other) = g.key_with_text(&text).filter(|k| k != key && !consumed(k)) {
                    let reason = if other.is_scaffold() {
                        SkipReason::DuplicateOfScaffold
                    } else {
                        SkipReason::DuplicateText
                    };
                    skipped.push(skip(reason, format!("same text as {other}")));
                    continue;
                }
                let mut folded = Vec::new();
                let mut merged_away = Vec::new();
                for m in merged_from {
                    if m == key || m.is_scaffold() || m.is_g0() || merged_away.contains(m) {
                        continue;
                    }
                    if g.experiences.remove(m).is_some() {
                        if let Some(meta) = g.metadata.remove(m) {
                            folded.push(meta);
                        }
                        merged_away.push(*m);
                    }
                }
                upsert(
                    &mut g,
                    *key,
                    text,
                    rationale.as_deref(),
                    evidence,
                    &folded,
                    reflection_id,
                    now,
                );
                applied.push(done(*key, OpEffect::Merged, merged_away));
            }
        }
    }
    if applied.is_empty() {
        return Err(GuidanceError::NothingApplied {
            reflection_id: reflection_id.to_string(),
            skipped,
        });
    }
    check_invariants(current, &g)?;
    g.step = current.step + 1;
    g.updated_at = now.to_string();
    Ok(OpsApplication {
        guidance: g,
        applied,
        skipped,
    })
}

#[allow(clippy::too_many_arguments)] // one private helper; a struct would only rename the args
fn upsert(
    g: &mut MissionGuidance,
    key: RuleKey,
    text: String,
    rationale: Option<&str>,
    evidence: &[TicketKey],
    folded: &[RuleMetadata],
    reflection_id: &str,
    now: &str,
) {
    let old = g.metadata.get(&key);
    let mut sources: Vec<String> = Vec::new();
    let all_sources = evidence
        .iter()
        .map(|t| t.as_str().to_string())
        .chain(old.into_iter().flat_map(|m| m.sources.iter().cloned()))
        .chain(folded.iter().flat_map(|m| m.sources.iter().cloned()));
    for s in all_sources {
        if !sources.contains(&s) {
            sources.push(s);
        }
    }
    let hit = old.map_or(0, |m| m.hit_count) + folded.iter().map(|m| m.hit_count).sum::<u64>() + 1;
    let miss = old.map_or(0, |m| m.miss_count) + folded.iter().map(|m| m.miss_count).sum::<u64>();
    let rationale = rationale
        .map(text::normalize)
        .filter(|r| !r.is_empty())
        .or_else(|| old.and_then(|m| m.rationale.clone()))
        .or_else(|| folded.iter().find_map(|m| m.rationale.clone()));
    let meta = RuleMetadata {
        updated_at: Some(now.to_string()),
        reflection_id: reflection_id.to_string(),
        sources,
        rationale,
        hit_count: hit,
        miss_count: miss,
        confidence: confidence(hit, miss),
        extra: old.map(|m| m.extra.clone()).unwrap_or_default(),
    };
    g.metadata.insert(key, meta);
    g.experiences.insert(key, text);
}

/// Invariants every version must keep relative to its parent: `S*` untouched, `G0` present,
/// experiences non-empty.
fn check_invariants(
    before: &MissionGuidance,
    after: &MissionGuidance,
) -> Result<(), GuidanceError> {
    let scaffold = |g: &MissionGuidance| -> Vec<(RuleKey, String)> {
        g.experiences
            .iter()
            .filter(|(k, _)| k.is_scaffold())
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    };
    if scaffold(before) != scaffold(after) {
        return Err(GuidanceError::Invariant("S* rules changed".into()));
    }
    if !after.experiences.contains_key(&RuleKey::G0) {
        return Err(GuidanceError::Invariant("G0 missing".into()));
    }
    if after.experiences.is_empty() {
        return Err(GuidanceError::Invariant(
            "experiences must be non-empty".into(),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Errors

/// Errors of the guidance repository.
#[derive(Debug, thiserror::Error)]
pub enum GuidanceError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("guidance I/O on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("snapshot of the current guidance into {path} failed: {source}")]
    Snapshot { path: PathBuf, source: io::Error },
    #[error("reflection {reflection_id} did not modify guidance ({} op(s) skipped)", skipped.len())]
    NothingApplied {
        reflection_id: String,
        skipped: Vec<SkippedOp>,
    },
    #[error("guidance invariant violated: {0}")]
    Invariant(String),
    #[error("reflection_id must be non-empty")]
    InvalidReflectionId,
    #[error("guidance.retention must be at least 1")]
    InvalidRetention,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> GuidanceError + '_ {
    move |source| GuidanceError::Io {
        path: path.to_path_buf(),
        source,
    }
}

// ---------------------------------------------------------------------------------------------
// Loading and validation

fn invalid(file: &Path, message: impl Into<String>) -> InputError {
    InputError::new(
        ErrorCode::InvalidGuidance,
        file.display().to_string(),
        None,
        message,
    )
}

/// Read and validate one mission's section of a guidance file (reference §3 rules).
pub fn load_mission_section(path: &Path, mission: &str) -> Result<MissionGuidance, InputError> {
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
    let section = mission_section(&value, mission, path)?;
    parse_section(section, mission, path)
}

fn mission_section<'a>(
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

fn looks_iso(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 10
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[5..7].iter().all(u8::is_ascii_digit)
        && b[7] == b'-'
        && b[8..10].iter().all(u8::is_ascii_digit)
}

fn parse_section(
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
    Ok(MissionGuidance {
        mission: mission.to_string(),
        step,
        updated_at,
        experiences,
        metadata,
    })
}

// ---------------------------------------------------------------------------------------------
// Versions

/// Why a version exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VersionKind {
    /// Copied from the global guidance file.
    Seed,
    /// An applied reflection (`step + 1`).
    Reflection,
    /// Lifecycle cleanup of low-confidence rules (step unchanged).
    Cleanup,
}

/// The hashed body of a version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionBody {
    pub seq: u64,
    pub step: u64,
    pub kind: VersionKind,
    pub parent_hash: Option<String>,
    pub content_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reflection_id: Option<String>,
    /// The ops given to apply (reflection).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<GuidanceOp>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied: Vec<AppliedOp>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedOp>,
    /// Keys removed by a cleanup.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<RuleKey>,
    /// The seed content (first version only), so the chain can be replayed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<HashedContent>,
}

/// One entry of the `versions` list: hashed body, its hash, and a timing field outside the hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionEntry {
    #[serde(flatten)]
    pub body: VersionBody,
    pub version_hash: String,
    /// Timing only; excluded from every hash.
    pub created_at: String,
}

impl VersionEntry {
    fn new(body: VersionBody, created_at: &str) -> Self {
        VersionEntry {
            version_hash: digest_of(&body),
            body,
            created_at: created_at.to_string(),
        }
    }
}

/// The mission section as written to the run's `guidance.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SectionFile {
    step: u64,
    updated_at: String,
    experiences: BTreeMap<RuleKey, String>,
    metadata: BTreeMap<RuleKey, RuleMetadata>,
    content_hash: String,
    version_hash: String,
    versions: Vec<VersionEntry>,
}

// ---------------------------------------------------------------------------------------------
// Repository

/// A clock returning an ISO-8601 UTC timestamp (injectable so tests are byte-reproducible).
pub type Clock = fn() -> String;

/// Options of a [`GuidanceRepo`].
#[derive(Debug, Clone, Copy)]
pub struct RepoOptions {
    /// Snapshots kept (`guidance.retention`, ≥ 1).
    pub retention: usize,
    pub clock: Clock,
}

impl Default for RepoOptions {
    fn default() -> Self {
        RepoOptions {
            retention: 5,
            clock: utc_now_iso,
        }
    }
}

/// The result of a persisted [`GuidanceRepo::apply`].
#[derive(Debug, Clone, PartialEq)]
pub struct ApplyOutcome {
    pub reflection_id: String,
    pub step_before: u64,
    pub step_after: u64,
    pub content_hash: String,
    pub version_hash: String,
    pub applied: Vec<AppliedOp>,
    pub skipped: Vec<SkippedOp>,
    /// Keys that did not exist before.
    pub new_keys: Vec<RuleKey>,
    /// Keys created, updated or merged into (for hit/miss attribution).
    pub touched_keys: Vec<RuleKey>,
}

/// The result of [`GuidanceRepo::record_feedback`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeedbackOutcome {
    pub updated: Vec<RuleKey>,
    /// Keys without metadata (seed rules never reflected on) or no longer present.
    pub ignored: Vec<RuleKey>,
}

/// Test-only fault injection for the persistence path.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailPoint {
    Snapshot,
    BeforeRename,
}

/// The run's guidance: in-memory state mirrored by `{run_dir}/guidance.json`.
#[derive(Debug)]
pub struct GuidanceRepo {
    run_dir: PathBuf,
    options: RepoOptions,
    current: MissionGuidance,
    versions: Vec<VersionEntry>,
    #[cfg(test)]
    fail_at: Option<FailPoint>,
}

impl GuidanceRepo {
    /// Seed the run guidance from the global file's `mission` section and write it to
    /// `{run_dir}/guidance.json` (replacing any earlier run guidance there: a fresh run starts
    /// from the global file; use [`GuidanceRepo::open`] to continue one).
    pub fn create(
        global: &Path,
        mission: &str,
        run_dir: &Path,
        options: RepoOptions,
    ) -> Result<Self, GuidanceError> {
        if options.retention == 0 {
            return Err(GuidanceError::InvalidRetention);
        }
        let seed = load_mission_section(global, mission)?;
        let now = (options.clock)();
        let body = VersionBody {
            seq: 0,
            step: seed.step,
            kind: VersionKind::Seed,
            parent_hash: None,
            content_hash: seed.content_hash(),
            reflection_id: None,
            ops: Vec::new(),
            applied: Vec::new(),
            skipped: Vec::new(),
            removed: Vec::new(),
            seed: Some(seed.hashed_content()),
        };
        fs::create_dir_all(run_dir).map_err(io_err(run_dir))?;
        let repo = GuidanceRepo {
            run_dir: run_dir.to_path_buf(),
            options,
            versions: vec![VersionEntry::new(body, &now)],
            current: seed,
            #[cfg(test)]
            fail_at: None,
        };
        let bytes = repo.render_file(&repo.current, &repo.versions);
        repo.write_live(&bytes)?;
        Ok(repo)
    }

    /// Open an existing run guidance (resume). Its content hash and chain head must match.
    pub fn open(
        run_dir: &Path,
        mission: &str,
        options: RepoOptions,
    ) -> Result<Self, GuidanceError> {
        if options.retention == 0 {
            return Err(GuidanceError::InvalidRetention);
        }
        let path = guidance_path(run_dir);
        let (current, file) = read_run_file(&path, mission)?;
        let head = file
            .versions
            .last()
            .ok_or_else(|| invalid(&path, "run guidance has no versions"))?;
        if head.body.content_hash != current.content_hash()
            || head.version_hash != file.version_hash
        {
            return Err(invalid(
                &path,
                "run guidance content does not match its version chain",
            )
            .into());
        }
        Ok(GuidanceRepo {
            run_dir: run_dir.to_path_buf(),
            options,
            current,
            versions: file.versions,
            #[cfg(test)]
            fail_at: None,
        })
    }

    pub fn current(&self) -> &MissionGuidance {
        &self.current
    }

    pub fn step(&self) -> u64 {
        self.current.step
    }

    pub fn versions(&self) -> &[VersionEntry] {
        &self.versions
    }

    /// `version_hash` of the newest version.
    pub fn head_hash(&self) -> &str {
        self.versions.last().map_or("", |v| v.version_hash.as_str())
    }

    pub fn content_hash(&self) -> String {
        self.current.content_hash()
    }

    pub fn render_for_prompt(&self) -> Vec<(String, String)> {
        self.current.render_for_prompt()
    }

    pub fn path(&self) -> PathBuf {
        guidance_path(&self.run_dir)
    }

    /// Apply validated ops as one reflection: a new version (`step + 1`), snapshotted and
    /// written atomically. On error nothing changes, on disk or in memory.
    pub fn apply(
        &mut self,
        ops: &[GuidanceOp],
        reflection_id: &str,
    ) -> Result<ApplyOutcome, GuidanceError> {
        let now = (self.options.clock)();
        let result = apply_ops(&self.current, ops, reflection_id, &now)?;
        let body = VersionBody {
            seq: self.versions.len() as u64,
            step: result.guidance.step,
            kind: VersionKind::Reflection,
            parent_hash: Some(self.head_hash().to_string()),
            content_hash: result.guidance.content_hash(),
            reflection_id: Some(reflection_id.to_string()),
            ops: ops.to_vec(),
            applied: result.applied.clone(),
            skipped: result.skipped.clone(),
            removed: Vec::new(),
            seed: None,
        };
        let entry = VersionEntry::new(body, &now);
        let outcome = ApplyOutcome {
            reflection_id: reflection_id.to_string(),
            step_before: self.current.step,
            step_after: result.guidance.step,
            content_hash: entry.body.content_hash.clone(),
            version_hash: entry.version_hash.clone(),
            new_keys: result
                .guidance
                .experiences
                .keys()
                .filter(|k| !self.current.experiences.contains_key(k))
                .copied()
                .collect(),
            touched_keys: {
                let set: BTreeSet<RuleKey> = result
                    .applied
                    .iter()
                    .filter(|a| a.effect != OpEffect::Deleted)
                    .map(|a| a.key)
                    .collect();
                set.into_iter().collect()
            },
            applied: result.applied,
            skipped: result.skipped,
        };
        self.commit_version(result.guidance, entry)?;
        Ok(outcome)
    }

    /// Add one hit per key in `hits` and one miss per key in `misses` (keys with metadata only;
    /// seed rules without metadata are reported in `ignored`, as the original). No step, no
    /// version, no snapshot; written atomically.
    pub fn record_feedback(
        &mut self,
        hits: &[RuleKey],
        misses: &[RuleKey],
    ) -> Result<FeedbackOutcome, GuidanceError> {
        let mut next = self.current.clone();
        let mut outcome = FeedbackOutcome::default();
        let marks = hits
            .iter()
            .map(|k| (*k, true))
            .chain(misses.iter().map(|k| (*k, false)));
        for (key, hit) in marks {
            match next.metadata.get_mut(&key) {
                Some(meta) => {
                    if hit {
                        meta.hit_count += 1;
                    } else {
                        meta.miss_count += 1;
                    }
                    meta.confidence = confidence(meta.hit_count, meta.miss_count);
                    if !outcome.updated.contains(&key) {
                        outcome.updated.push(key);
                    }
                }
                None => {
                    if !outcome.ignored.contains(&key) {
                        outcome.ignored.push(key);
                    }
                }
            }
        }
        if outcome.updated.is_empty() {
            return Ok(outcome);
        }
        let bytes = self.render_file(&next, &self.versions);
        self.write_live(&bytes)?;
        self.current = next;
        Ok(outcome)
    }

    /// Remove learned rules with `confidence < threshold && miss_count >= min_miss` (never `G0`
    /// or `S*`, never emptying the guidance). A cleanup version keeps the step; the current
    /// file is snapshotted first. Returns the removed keys (empty: nothing written).
    pub fn cleanup_low_confidence(
        &mut self,
        threshold: f64,
        min_miss: u64,
    ) -> Result<Vec<RuleKey>, GuidanceError> {
        let removed: Vec<RuleKey> = self
            .current
            .metadata
            .iter()
            .filter(|(k, m)| {
                !k.is_scaffold()
                    && !k.is_g0()
                    && m.confidence < threshold
                    && m.miss_count >= min_miss
            })
            .map(|(k, _)| *k)
            .filter(|k| self.current.experiences.contains_key(k))
            .collect();
        if removed.is_empty() || removed.len() >= self.current.experiences.len() {
            return Ok(Vec::new());
        }
        let now = (self.options.clock)();
        let next = remove_keys(&self.current, &removed, &now);
        check_invariants(&self.current, &next)?;
        let body = VersionBody {
            seq: self.versions.len() as u64,
            step: next.step,
            kind: VersionKind::Cleanup,
            parent_hash: Some(self.head_hash().to_string()),
            content_hash: next.content_hash(),
            reflection_id: None,
            ops: Vec::new(),
            applied: Vec::new(),
            skipped: Vec::new(),
            removed: removed.clone(),
            seed: None,
        };
        let entry = VersionEntry::new(body, &now);
        self.commit_version(next, entry)?;
        Ok(removed)
    }

    /// Snapshot, prune, write; only then update memory.
    fn commit_version(
        &mut self,
        next: MissionGuidance,
        entry: VersionEntry,
    ) -> Result<(), GuidanceError> {
        self.snapshot_current()?;
        let mut versions = self.versions.clone();
        versions.push(entry);
        let bytes = self.render_file(&next, &versions);
        self.write_live(&bytes)?;
        self.current = next;
        self.versions = versions;
        Ok(())
    }

    fn snapshot_current(&self) -> Result<(), GuidanceError> {
        let dir = snapshots_dir(&self.run_dir);
        let head = self.versions.last().map(|v| &v.body);
        let name = snapshot_name(
            head.map_or(0, |b| b.seq),
            self.current.step,
            head.map_or("", |b| b.content_hash.as_str()),
        );
        let target = dir.join(&name);
        let snap_err = |source: io::Error| GuidanceError::Snapshot {
            path: target.clone(),
            source,
        };
        #[cfg(test)]
        if self.fail_at == Some(FailPoint::Snapshot) {
            return Err(snap_err(io::Error::other("injected snapshot failure")));
        }
        let bytes = fs::read(self.path()).map_err(snap_err)?;
        fs::create_dir_all(&dir).map_err(snap_err)?;
        atomic_write(&target, &bytes, false).map_err(snap_err)?;
        prune_snapshots(&dir, self.options.retention).map_err(snap_err)?;
        Ok(())
    }

    fn render_file(&self, g: &MissionGuidance, versions: &[VersionEntry]) -> Vec<u8> {
        let section = SectionFile {
            step: g.step,
            updated_at: g.updated_at.clone(),
            experiences: g.experiences.clone(),
            metadata: g.metadata.clone(),
            content_hash: g.content_hash(),
            version_hash: versions
                .last()
                .map_or(String::new(), |v| v.version_hash.clone()),
            versions: versions.to_vec(),
        };
        let mut file = serde_json::Map::new();
        file.insert(
            g.mission.clone(),
            serde_json::to_value(section).unwrap_or(Value::Null),
        );
        let mut bytes = serde_json::to_vec_pretty(&Value::Object(file)).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }

    fn write_live(&self, bytes: &[u8]) -> Result<(), GuidanceError> {
        let path = self.path();
        #[cfg(test)]
        let fail = self.fail_at == Some(FailPoint::BeforeRename);
        #[cfg(not(test))]
        let fail = false;
        atomic_write(&path, bytes, fail).map_err(io_err(&path))
    }
}

fn remove_keys(g: &MissionGuidance, keys: &[RuleKey], now: &str) -> MissionGuidance {
    let mut next = g.clone();
    for k in keys {
        next.experiences.remove(k);
        next.metadata.remove(k);
    }
    next.updated_at = now.to_string();
    next
}

/// `{run_dir}/guidance.json`.
pub fn guidance_path(run_dir: &Path) -> PathBuf {
    run_dir.join(GUIDANCE_FILE)
}

/// `{run_dir}/snapshots`.
pub fn snapshots_dir(run_dir: &Path) -> PathBuf {
    run_dir.join(SNAPSHOTS_DIR)
}

/// Deterministic snapshot name of the version `seq` (step, first 12 hex of its content hash).
pub fn snapshot_name(seq: u64, step: u64, content_hash: &str) -> String {
    let hex = content_hash.strip_prefix("sha256:").unwrap_or(content_hash);
    let short: String = hex.chars().take(12).collect();
    format!("guidance-v{seq:04}-step{step:04}-{short}.json")
}

fn parse_snapshot_seq(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("guidance-v")?.strip_suffix(".json")?;
    let (seq, rest) = rest.split_once("-step")?;
    let (step, hash) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(step) || hash.len() != 12 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    if !digits(seq) {
        return None;
    }
    seq.parse().ok()
}

/// Keep the `retention` newest snapshots (by version number, not by name, so `v10000` sorts
/// after `v9999`). Files that are not snapshots are left alone.
fn prune_snapshots(dir: &Path, retention: usize) -> io::Result<()> {
    let mut snaps: Vec<(u64, PathBuf)> = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if let Some(seq) = entry.file_name().to_str().and_then(parse_snapshot_seq) {
            snaps.push((seq, entry.path()));
        }
    }
    snaps.sort();
    let excess = snaps.len().saturating_sub(retention);
    for (_, path) in snaps.into_iter().take(excess) {
        fs::remove_file(path)?;
    }
    Ok(())
}

/// Write `bytes` to `path` atomically: `{name}.tmp` in the same directory, fsync, rename,
/// fsync the directory. On error the temp file is removed and `path` is untouched (unless the
/// error is the final directory fsync, after which the new content is in place).
fn atomic_write(path: &Path, bytes: &[u8], inject_failure: bool) -> io::Result<()> {
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!("{file_name}.tmp"));
    let dir = path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        if inject_failure {
            return Err(io::Error::other("injected failure before rename"));
        }
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    sync_dir(&dir)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

fn read_run_file(path: &Path, mission: &str) -> Result<(MissionGuidance, SectionFile), InputError> {
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
    let section = mission_section(&value, mission, path)?;
    let current = parse_section(section, mission, path)?;
    let file: SectionFile = serde_json::from_value(section.clone())
        .map_err(|e| invalid(path, format!("run guidance section is malformed: {e}")))?;
    Ok((current, file))
}

// ---------------------------------------------------------------------------------------------
// Chain verification

/// The verified state of a run's guidance chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainReport {
    pub mission: String,
    pub versions: usize,
    pub step: u64,
    pub head_hash: String,
    pub content_hash: String,
}

/// A broken or unreadable guidance chain.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("guidance chain broken at version {seq}: {reason}")]
    Broken { seq: u64, reason: String },
}

/// Verify `{run_dir}/guidance.json`: the version list starts with a seed, each entry links to
/// its parent, every `version_hash` recomputes, replaying every version from the seed gives
/// its recorded `content_hash` (and the recorded applied/skipped outcome), steps advance by
/// one per reflection and not on cleanup, `S*` never changes, `G0` always exists, and the live
/// content and step equal the head.
pub fn verify_chain(run_dir: &Path) -> Result<ChainReport, ChainError> {
    let path = guidance_path(run_dir);
    let bytes = fs::read(&path).map_err(|e| {
        InputError::new(
            ErrorCode::FileNotFound,
            path.display().to_string(),
            None,
            format!("cannot read: {e}"),
        )
    })?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(&path, format!("not valid JSON: {e}")))?;
    let mission = match value.as_object() {
        Some(top) if top.len() == 1 => top.keys().next().cloned().unwrap_or_default(),
        _ => return Err(invalid(&path, "run guidance must hold exactly one mission").into()),
    };
    let (live, file) = read_run_file(&path, &mission)?;
    let broken = |seq: u64, reason: String| ChainError::Broken { seq, reason };

    let first = file
        .versions
        .first()
        .ok_or_else(|| broken(0, "no versions".into()))?;
    let seed_content = match (&first.body.kind, &first.body.seed, &first.body.parent_hash) {
        (VersionKind::Seed, Some(seed), None) => seed,
        _ => {
            return Err(broken(
                0,
                "first version must be a seed with its content and no parent".into(),
            ));
        }
    };
    let mut state = MissionGuidance::from_hashed(&mission, first.body.step, seed_content);
    let seed_scaffold: Vec<(RuleKey, String)> = state
        .experiences
        .iter()
        .filter(|(k, _)| k.is_scaffold())
        .map(|(k, v)| (*k, v.clone()))
        .collect();
    let mut prev: Option<&VersionEntry> = None;
    for (i, entry) in file.versions.iter().enumerate() {
        let seq = i as u64;
        let body = &entry.body;
        if body.seq != seq {
            return Err(broken(seq, format!("seq is {}", body.seq)));
        }
        if digest_of(body) != entry.version_hash {
            return Err(broken(seq, "version_hash does not match its body".into()));
        }
        if let Some(p) = prev {
            if body.parent_hash.as_deref() != Some(p.version_hash.as_str()) {
                return Err(broken(
                    seq,
                    "parent_hash does not link to the previous version".into(),
                ));
            }
            match body.kind {
                VersionKind::Seed => {
                    return Err(broken(seq, "a seed after the first version".into()));
                }
                VersionKind::Reflection => {
                    let rid = body.reflection_id.as_deref().unwrap_or("");
                    let replay = apply_ops(&state, &body.ops, rid, "")
                        .map_err(|e| broken(seq, format!("replay failed: {e}")))?;
                    if replay.applied != body.applied || replay.skipped != body.skipped {
                        return Err(broken(
                            seq,
                            "replayed op outcome differs from the recorded one".into(),
                        ));
                    }
                    state = replay.guidance;
                }
                VersionKind::Cleanup => {
                    for k in &body.removed {
                        if k.is_scaffold() || k.is_g0() || !state.experiences.contains_key(k) {
                            return Err(broken(
                                seq,
                                format!("cleanup removed {k}, which it may not"),
                            ));
                        }
                    }
                    state = remove_keys(&state, &body.removed, "");
                }
            }
            if body.step != state.step {
                return Err(broken(
                    seq,
                    format!("step {} but replay gives {}", body.step, state.step),
                ));
            }
        }
        if state.content_hash() != body.content_hash {
            return Err(broken(
                seq,
                "content_hash does not match the replayed content".into(),
            ));
        }
        let scaffold: Vec<(RuleKey, String)> = state
            .experiences
            .iter()
            .filter(|(k, _)| k.is_scaffold())
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        if scaffold != seed_scaffold {
            return Err(broken(seq, "S* rules differ from the seed".into()));
        }
        if !state.experiences.contains_key(&RuleKey::G0) {
            return Err(broken(seq, "G0 missing".into()));
        }
        prev = Some(entry);
    }
    let head = prev.ok_or_else(|| broken(0, "no versions".into()))?;
    let last = head.body.seq;
    if live.content_hash() != head.body.content_hash || file.content_hash != head.body.content_hash
    {
        return Err(broken(
            last,
            "live content does not match the head version".into(),
        ));
    }
    if live.step != head.body.step {
        return Err(broken(
            last,
            format!("live step {} but head step {}", live.step, head.body.step),
        ));
    }
    if file.version_hash != head.version_hash {
        return Err(broken(last, "live version_hash is not the head's".into()));
    }
    Ok(ChainReport {
        mission,
        versions: file.versions.len(),
        step: live.step,
        head_hash: head.version_hash.clone(),
        content_hash: head.body.content_hash.clone(),
    })
}

// ---------------------------------------------------------------------------------------------
// Clock

/// Current UTC time as `YYYY-MM-DDTHH:MM:SS.ffffff+00:00` (Python `isoformat()` style).
pub fn utc_now_iso() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as i64;
    let micros = now.subsec_micros();
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}+00:00",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MISSION: &str = "挡风板安装检查";

    fn fixed_clock() -> String {
        "2025-12-19T08:00:00.000000+00:00".to_string()
    }

    fn opts() -> RepoOptions {
        RepoOptions {
            retention: 3,
            clock: fixed_clock,
        }
    }

    fn tk(s: &str) -> TicketKey {
        TicketKey(s.to_string())
    }

    fn write_global(dir: &Path, section: Value) -> PathBuf {
        let path = dir.join("initial_guidance.json");
        fs::write(
            &path,
            serde_json::to_vec_pretty(&json!({ MISSION: section })).unwrap(),
        )
        .unwrap();
        path
    }

    fn base_section() -> Value {
        json!({
            "step": 1,
            "updated_at": "2025-12-16T12:54:39.555188+00:00",
            "experiences": {"S1": "若关键点无法确认则不通过", "G0": "至少需要检测到挡风板，判断挡风板安装方向", "G1": "若挡风板缺失则不通过"},
            "metadata": {"G1": {"updated_at": "2025-12-16T12:54:39+00:00", "reflection_id": "a1b2c3d4e5f6", "sources": ["QC-0::fail"], "rationale": "seed", "hit_count": 1, "miss_count": 0, "confidence": 0.99999}}
        })
    }

    fn repo(dir: &Path) -> GuidanceRepo {
        let global = write_global(dir, base_section());
        GuidanceRepo::create(&global, MISSION, &dir.join("run"), opts()).unwrap()
    }

    fn add(text: &str, ev: &[&str]) -> GuidanceOp {
        GuidanceOp::Add {
            text: text.into(),
            rationale: Some("r".into()),
            evidence: ev.iter().map(|e| tk(e)).collect(),
        }
    }

    fn update(key: RuleKey, text: &str, ev: &[&str]) -> GuidanceOp {
        GuidanceOp::Update {
            key,
            text: text.into(),
            rationale: Some("r".into()),
            evidence: ev.iter().map(|e| tk(e)).collect(),
        }
    }

    fn delete(key: RuleKey) -> GuidanceOp {
        GuidanceOp::Delete {
            key,
            rationale: None,
            evidence: vec![tk("QC-9::fail")],
        }
    }

    fn snapshot_names(run: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(snapshots_dir(run))
            .map(|rd| {
                rd.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    fn no_tmp_files(run: &Path) -> bool {
        fs::read_dir(run)
            .unwrap()
            .all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tmp"))
    }

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
    fn load_keeps_step_experiences_and_updated_at_and_copies_into_the_run_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let r = repo(tmp.path());
        let g = r.current();
        assert_eq!(g.step, 1);
        assert_eq!(g.updated_at, "2025-12-16T12:54:39.555188+00:00");
        assert_eq!(g.text(RuleKey::G1), Some("若挡风板缺失则不通过"));
        assert_eq!(g.metadata[&RuleKey::G1].hit_count, 1);
        assert!(tmp.path().join("run/guidance.json").exists());
        let global_before = fs::read(tmp.path().join("initial_guidance.json")).unwrap();
        assert!(!global_before.is_empty());
        verify_chain(&tmp.path().join("run")).unwrap();
    }

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

    #[test]
    fn apply_updates_g0_and_adds_g_next_with_provenance() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let ops = [
            update(RuleKey::G0, "新检查清单", &["QC-001", "QC-002"]),
            add("若螺丝松动则不通过", &["QC-002", "QC-001"]),
        ];
        let out = r.apply(&ops, "rid-1").unwrap();
        assert_eq!((out.step_before, out.step_after), (1, 2));
        assert_eq!(out.new_keys, vec![RuleKey::G(2)]);
        assert_eq!(out.touched_keys, vec![RuleKey::G0, RuleKey::G(2)]);
        let g = r.current();
        assert_eq!(g.g0(), "新检查清单");
        let m0 = &g.metadata[&RuleKey::G0];
        assert_eq!(m0.reflection_id, "rid-1");
        assert_eq!(m0.sources, vec!["QC-001", "QC-002"]);
        assert_eq!(m0.rationale.as_deref(), Some("r"));
        assert_eq!(g.metadata[&RuleKey::G(2)].sources, vec!["QC-002", "QC-001"]);
        // Persisted: a reopened repo sees the same content.
        let reopened = GuidanceRepo::open(&tmp.path().join("run"), MISSION, opts()).unwrap();
        assert_eq!(reopened.current(), r.current());
        assert_eq!(reopened.head_hash(), r.head_hash());
        verify_chain(&tmp.path().join("run")).unwrap();
    }

    #[test]
    fn new_keys_fill_the_smallest_gap_and_are_never_renumbered() {
        let tmp = tempfile::tempdir().unwrap();
        let mut section = base_section();
        section["experiences"]["G3"] = json!("三");
        let global = write_global(tmp.path(), section);
        let mut r =
            GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), opts()).unwrap();
        r.apply(&[delete(RuleKey::G1)], "rid-1").unwrap();
        assert_eq!(
            r.current().text(RuleKey::G(3)),
            Some("三"),
            "G3 keeps its key after G1 is deleted"
        );
        r.apply(
            &[add("甲", &["QC-1::fail"]), add("乙", &["QC-1::fail"])],
            "rid-2",
        )
        .unwrap();
        let keys: Vec<String> = r.render_for_prompt().into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec!["S1", "G0", "G1", "G2", "G3"]);
        assert_eq!(r.current().text(RuleKey::G1), Some("甲"));
        assert_eq!(r.current().text(RuleKey::G(2)), Some("乙"));
    }

    #[test]
    fn regression_issue8_an_identical_rule_changes_nothing() {
        // An add equal to an existing rule (or repeated in the same apply) and an update that
        // restates its rule are skipped `unchanged`: no hit, no sources, no coverage, and when
        // nothing else changes, no step and no version.
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let out = r
            .apply(
                &[
                    add("规则一", &["QC-1::fail"]),
                    add("规则一。", &["QC-2::fail"]),
                ],
                "rid",
            )
            .unwrap();
        let keys: Vec<RuleKey> = r.current().experiences.keys().copied().collect();
        assert_eq!(
            keys,
            vec![RuleKey::S(1), RuleKey::G0, RuleKey::G1, RuleKey::G(2)]
        );
        assert_eq!(
            r.current().metadata[&RuleKey::G(2)].sources,
            vec!["QC-1::fail"]
        );
        assert_eq!(out.skipped[0].reason, SkipReason::Unchanged);
        assert_eq!(
            crate::ops::evidence_covered(&out.applied),
            [TicketKey("QC-1::fail".into())].into_iter().collect()
        );
        let (step, versions) = (r.step(), r.versions().len());
        let hits = r.current().metadata[&RuleKey::G(2)].hit_count;
        let err = r
            .apply(
                &[
                    add("若挡风板缺失则不通过", &["QC-3::fail"]),
                    GuidanceOp::Update {
                        key: RuleKey::G(2),
                        text: " 规则一 ".into(),
                        rationale: None,
                        evidence: vec![TicketKey("QC-4::fail".into())],
                    },
                ],
                "rid2",
            )
            .unwrap_err();
        let GuidanceError::NothingApplied { skipped, .. } = err else {
            panic!("{err:?}")
        };
        assert!(skipped.iter().all(|s| s.reason == SkipReason::Unchanged));
        assert_eq!((r.step(), r.versions().len()), (step, versions));
        assert_eq!(r.current().metadata[&RuleKey::G(2)].hit_count, hits);
    }

    #[test]
    fn scaffold_is_never_changed() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let before = r.current().text(RuleKey::S(1)).unwrap().to_string();
        let err = r
            .apply(
                &[
                    delete(RuleKey::S(1)),
                    update(RuleKey::S(1), "改", &["QC-1::fail"]),
                ],
                "rid",
            )
            .unwrap_err();
        let GuidanceError::NothingApplied { skipped, .. } = err else {
            panic!("{err:?}")
        };
        assert!(skipped.iter().all(|s| s.reason == SkipReason::ScaffoldKey));
        assert_eq!(r.current().text(RuleKey::S(1)), Some(before.as_str()));
        assert_eq!(r.step(), 1);
        // An add equal to a scaffold rule is skipped, not turned into an S* update.
        let err = r
            .apply(&[add("若关键点无法确认则不通过", &["QC-1::fail"])], "rid")
            .unwrap_err();
        assert!(matches!(err, GuidanceError::NothingApplied { .. }));
        assert!(
            snapshot_names(&tmp.path().join("run")).is_empty(),
            "failed applies write nothing"
        );
    }

    #[test]
    fn g0_cannot_be_deleted() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let err = r.apply(&[delete(RuleKey::G0)], "rid").unwrap_err();
        let GuidanceError::NothingApplied { skipped, .. } = err else {
            panic!("{err:?}")
        };
        assert_eq!(skipped[0].reason, SkipReason::G0Delete);
        assert!(r.current().experiences.contains_key(&RuleKey::G0));
    }

    #[test]
    fn merge_folds_existing_sources_and_ignores_missing_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let op = GuidanceOp::Merge {
            key: RuleKey::G0,
            merged_from: vec![RuleKey::G1, RuleKey::G(2)],
            text: "合并后的清单".into(),
            rationale: None,
            evidence: vec![tk("QC-5::fail")],
        };
        let out = r.apply(&[op, delete(RuleKey::G(9))], "rid").unwrap();
        let g = r.current();
        assert_eq!(g.g0(), "合并后的清单");
        assert!(!g.experiences.contains_key(&RuleKey::G1));
        assert_eq!(out.applied.len(), 1);
        assert_eq!(out.applied[0].merged_away, vec![RuleKey::G1]);
        assert_eq!(out.skipped.len(), 1, "delete of missing G9 is a no-op");
        assert_eq!(out.skipped[0].reason, SkipReason::MissingKey);
        let m = &g.metadata[&RuleKey::G0];
        assert_eq!(m.hit_count, 2, "G1's hit plus the reinforcement");
        assert_eq!(m.sources, vec!["QC-5::fail", "QC-0::fail"]);
        assert_eq!(
            m.rationale.as_deref(),
            Some("seed"),
            "falls back to the merged rule's rationale"
        );
    }

    #[test]
    fn update_of_a_missing_key_is_skipped_not_created() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let err = r
            .apply(&[update(RuleKey::G(7), "新", &["QC-1::fail"])], "rid")
            .unwrap_err();
        let GuidanceError::NothingApplied { skipped, .. } = err else {
            panic!("{err:?}")
        };
        assert_eq!(skipped[0].reason, SkipReason::MissingKey);
    }

    #[test]
    fn snapshot_holds_the_pre_update_file_under_a_deterministic_name() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let run = tmp.path().join("run");
        let before = fs::read(run.join(GUIDANCE_FILE)).unwrap();
        let hash_before = r.content_hash();
        r.apply(&[add("若螺丝松动则不通过", &["QC-1::fail"])], "rid")
            .unwrap();
        let names = snapshot_names(&run);
        assert_eq!(names, vec![snapshot_name(0, 1, &hash_before)]);
        assert!(names[0].starts_with("guidance-v0000-step0001-"));
        assert_eq!(
            fs::read(snapshots_dir(&run).join(&names[0])).unwrap(),
            before
        );
        assert!(no_tmp_files(&run) && no_tmp_files(&snapshots_dir(&run)));
    }

    #[test]
    fn snapshots_are_pruned_to_retention_keeping_the_newest() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        for i in 0..5 {
            r.apply(
                &[add(&format!("规则{i}"), &["QC-1::fail"])],
                &format!("rid{i}"),
            )
            .unwrap();
        }
        let names = snapshot_names(&tmp.path().join("run"));
        assert_eq!(names.len(), 3);
        assert!(
            names[0].starts_with("guidance-v0002-") && names[2].starts_with("guidance-v0004-"),
            "{names:?}"
        );
        assert_eq!(r.step(), 6);
        let report = verify_chain(&tmp.path().join("run")).unwrap();
        assert_eq!(report.versions, 6);
        assert_eq!(report.step, 6);
    }

    #[test]
    fn reruns_are_byte_identical() {
        let run_once = |dir: &Path| {
            let mut r = repo(dir);
            r.apply(&[add("若螺丝松动则不通过", &["QC-1::fail"])], "rid")
                .unwrap();
            r.record_feedback(&[RuleKey::G1], &[RuleKey::G(2)]).unwrap();
            let run = dir.join("run");
            let mut files = vec![(
                "guidance".to_string(),
                fs::read(run.join(GUIDANCE_FILE)).unwrap(),
            )];
            for n in snapshot_names(&run) {
                files.push((n.clone(), fs::read(snapshots_dir(&run).join(n)).unwrap()));
            }
            files
        };
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        assert_eq!(run_once(a.path()), run_once(b.path()));
    }

    #[test]
    fn regression_temp_open_failure_leaves_live_file_and_no_temp() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let run = tmp.path().join("run");
        let before = fs::read(run.join(GUIDANCE_FILE)).unwrap();
        r.fail_at = Some(FailPoint::BeforeRename);
        let err = r
            .apply(&[add("新规则", &["QC-1::fail"])], "rid")
            .unwrap_err();
        assert!(matches!(err, GuidanceError::Io { .. }), "{err:?}");
        assert_eq!(fs::read(run.join(GUIDANCE_FILE)).unwrap(), before);
        assert!(no_tmp_files(&run));
        assert_eq!(r.step(), 1, "memory unchanged too");
        assert_eq!(r.versions().len(), 1);
        verify_chain(&run).unwrap();
    }

    #[test]
    fn snapshot_failure_is_an_error_and_nothing_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let run = tmp.path().join("run");
        let before = fs::read(run.join(GUIDANCE_FILE)).unwrap();
        r.fail_at = Some(FailPoint::Snapshot);
        let err = r
            .apply(&[add("新规则", &["QC-1::fail"])], "rid")
            .unwrap_err();
        assert!(matches!(err, GuidanceError::Snapshot { .. }), "{err:?}");
        assert_eq!(fs::read(run.join(GUIDANCE_FILE)).unwrap(), before);
        // A real failure: `snapshots` is a file, so the directory cannot be created.
        r.fail_at = None;
        fs::write(snapshots_dir(&run), b"not a dir").unwrap();
        let err = r
            .apply(&[add("新规则", &["QC-1::fail"])], "rid")
            .unwrap_err();
        assert!(matches!(err, GuidanceError::Snapshot { .. }), "{err:?}");
        assert_eq!(fs::read(run.join(GUIDANCE_FILE)).unwrap(), before);
        assert!(no_tmp_files(&run));
    }

    #[test]
    fn feedback_updates_counters_without_step_or_version() {
        let tmp = tempfile::tempdir().unwrap();
        let mut section = base_section();
        section["metadata"]["G1"]["hit_count"] = json!(0);
        section["metadata"]["G1"]["miss_count"] = json!(2);
        let global = write_global(tmp.path(), section);
        let mut r =
            GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), opts()).unwrap();
        let hash = r.content_hash();
        let out = r.record_feedback(&[RuleKey::G1], &[RuleKey::G0]).unwrap();
        assert_eq!(out.updated, vec![RuleKey::G1]);
        assert_eq!(
            out.ignored,
            vec![RuleKey::G0],
            "seed rules without metadata get no stats"
        );
        let m = &r.current().metadata[&RuleKey::G1];
        assert_eq!((m.hit_count, m.miss_count), (1, 2));
        assert!(m.confidence > 0.0 && m.confidence < 1.0);
        assert_eq!(r.step(), 1);
        assert_eq!(r.versions().len(), 1);
        assert_eq!(r.content_hash(), hash);
        let reopened = GuidanceRepo::open(&tmp.path().join("run"), MISSION, opts()).unwrap();
        assert_eq!(reopened.current().metadata[&RuleKey::G1].hit_count, 1);
        assert!(snapshot_names(&tmp.path().join("run")).is_empty());
        verify_chain(&tmp.path().join("run")).unwrap();
    }

    #[test]
    fn lifecycle_cleanup_removes_only_weak_learned_rules() {
        let tmp = tempfile::tempdir().unwrap();
        let mut section = base_section();
        section["experiences"]["G2"] = json!("二");
        section["metadata"]["G1"] =
            json!({"reflection_id": "r", "hit_count": 0, "miss_count": 3, "confidence": 0.0});
        section["metadata"]["G2"] =
            json!({"reflection_id": "r", "hit_count": 0, "miss_count": 2, "confidence": 0.0});
        section["metadata"]["G0"] =
            json!({"reflection_id": "r", "hit_count": 0, "miss_count": 9, "confidence": 0.0});
        let global = write_global(tmp.path(), section);
        let mut r =
            GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), opts()).unwrap();
        let removed = r.cleanup_low_confidence(0.35, 3).unwrap();
        assert_eq!(removed, vec![RuleKey::G1]);
        assert_eq!(r.step(), 1, "cleanup does not bump step");
        assert_eq!(r.versions().len(), 2);
        assert_eq!(
            snapshot_names(&tmp.path().join("run")).len(),
            1,
            "snapshot first"
        );
        assert!(r.current().experiences.contains_key(&RuleKey::G0));
        assert!(r.cleanup_low_confidence(0.35, 3).unwrap().is_empty());
        verify_chain(&tmp.path().join("run")).unwrap();
    }

    #[test]
    fn chain_verification_detects_tampering() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        r.apply(&[add("若螺丝松动则不通过", &["QC-1::fail"])], "rid")
            .unwrap();
        r.apply(&[delete(RuleKey::G1)], "rid2").unwrap();
        let run = tmp.path().join("run");
        let report = verify_chain(&run).unwrap();
        assert_eq!((report.versions, report.step), (3, 3));
        assert_eq!(report.head_hash, r.head_hash());

        let path = run.join(GUIDANCE_FILE);
        let original: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        let tamper = |f: &dyn Fn(&mut Value)| {
            let mut v = original.clone();
            f(&mut v[MISSION]);
            fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
            verify_chain(&run)
        };
        assert!(
            tamper(&|s| s["experiences"]["G2"] = json!("偷改")).is_err(),
            "live edit"
        );
        assert!(
            tamper(&|s| s["experiences"]["S1"] = json!("偷改")).is_err(),
            "scaffold edit"
        );
        assert!(
            tamper(&|s| s["versions"][1]["ops"][0]["text"] = json!("别的")).is_err(),
            "op edit"
        );
        assert!(
            tamper(&|s| s["versions"][2]["parent_hash"] = json!("sha256:00")).is_err(),
            "relink"
        );
        assert!(tamper(&|s| s["step"] = json!(9)).is_err(), "step edit");
        // Timing fields are outside the hashes.
        assert!(tamper(&|s| s["versions"][1]["created_at"] = json!("2030-01-01T00:00:00")).is_ok());
    }

    #[test]
    fn apply_ops_is_pure_and_rejects_empty_reflection_id() {
        let tmp = tempfile::tempdir().unwrap();
        let r = repo(tmp.path());
        assert!(matches!(
            apply_ops(r.current(), &[add("x", &["a"])], " ", "t"),
            Err(GuidanceError::InvalidReflectionId)
        ));
        let a = apply_ops(r.current(), &[add("x", &["a"])], "rid", "t1").unwrap();
        let b = apply_ops(r.current(), &[add("x", &["a"])], "rid", "t2").unwrap();
        assert_eq!(
            a.guidance.content_hash(),
            b.guidance.content_hash(),
            "timestamps are not content"
        );
    }

    #[test]
    fn reopening_a_run_rewrites_identical_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        r.apply(&[add("若螺丝松动则不通过", &["QC-1::fail"])], "rid")
            .unwrap();
        r.record_feedback(
            &[RuleKey::G1, RuleKey::G(2)],
            &[RuleKey::G(2), RuleKey::G(2)],
        )
        .unwrap();
        let run = tmp.path().join("run");
        let on_disk = fs::read(run.join(GUIDANCE_FILE)).unwrap();
        let reopened = GuidanceRepo::open(&run, MISSION, opts()).unwrap();
        assert_eq!(
            reopened.render_file(reopened.current(), reopened.versions()),
            on_disk
        );
    }

    #[test]
    fn confidence_is_hit_share_rounded() {
        assert_eq!(confidence(0, 0), 0.0);
        assert_eq!(confidence(1, 0), 0.99999);
        assert_eq!(confidence(1, 2), 0.333332);
    }

    #[test]
    fn zero_retention_is_rejected() {
        let tmp = tempfile::tempdir().unwrap();
        let global = write_global(tmp.path(), base_section());
        let o = RepoOptions {
            retention: 0,
            clock: fixed_clock,
        };
        assert!(matches!(
            GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), o),
            Err(GuidanceError::InvalidRetention)
        ));
    }

    #[test]
    fn clock_formats_iso_utc() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_438), (2025, 12, 16));
        assert!(looks_iso(&utc_now_iso()));
    }
}
