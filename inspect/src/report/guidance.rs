//! The guidance timeline: every version of `guidance.json`'s chain as a readable diff (rules
//! added, removed, changed, with before and after texts), and the pre-change copies in
//! `snapshots/` checked against the chain.
//!
//! The chain records each version's ops and their outcome, not its full text, so the texts
//! are replayed here from the seed version: `applied[i].index` names the op whose `text` the
//! rule `applied[i].key` took. This replay only *displays*; `stageb audit` verifies the chain
//! (hashes, replay with the real op semantics) and its verdict heads the report.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;
use stageb_coordinator::guidance::{GUIDANCE_FILE, SNAPSHOTS_DIR};

use super::load::{FileStatus, read_json};
use super::{ROW_CAP, clip};

/// Longest rule text shown, in characters (rules the ops validator accepts are ≤ 160).
const RULE_CAP: usize = 1000;

/// Rules keyed `S1`, `G0`, …: a map ordered like the guidance file (`S*` first, then `G*`,
/// numerically).
pub type Rules = BTreeMap<RuleOrder, String>;

/// Sort key of a rule key: `S*` before `G*`, numeric within, anything else last by name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RuleOrder(u8, u64, String);

impl RuleOrder {
    pub fn of(key: &str) -> RuleOrder {
        let family = match key.chars().next() {
            Some('S') => 0,
            Some('G') => 1,
            _ => 2,
        };
        let number = key
            .get(1..)
            .and_then(|n| n.parse().ok())
            .unwrap_or(u64::MAX);
        RuleOrder(family, number, key.to_string())
    }

    pub fn key(&self) -> &str {
        &self.2
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    Added,
    Removed,
    Changed,
}

#[derive(Debug, Clone)]
pub struct RuleChange {
    pub key: String,
    pub kind: ChangeKind,
    pub before: Option<String>,
    pub after: Option<String>,
    /// Why, when the op alone does not say (`merged into G3`, `cleanup`).
    pub note: Option<String>,
}

#[derive(Debug, Clone)]
pub struct SkippedView {
    pub op: String,
    pub reason: String,
    pub detail: String,
}

/// One version of the chain and what it changed.
#[derive(Debug, Clone, Default)]
pub struct VersionView {
    pub seq: u64,
    pub step: u64,
    pub kind: String,
    pub reflection_id: Option<String>,
    pub created_at: Option<String>,
    pub changes: Vec<RuleChange>,
    pub skipped: Vec<SkippedView>,
}

/// A file of `snapshots/` and whether it holds the chain's text of its version.
#[derive(Debug, Clone)]
pub struct SnapshotView {
    pub name: String,
    pub seq: Option<u64>,
    pub step: Option<u64>,
    pub rules: Option<usize>,
    /// `None` when the snapshot or its version could not be read.
    pub matches_chain: Option<bool>,
}

#[derive(Debug, Clone, Default)]
pub struct GuidanceTimeline {
    pub mission: Option<String>,
    pub seed_rules: Rules,
    pub live_rules: Rules,
    /// The last [`ROW_CAP`] versions (the seed included when it fits), oldest first.
    pub versions: Vec<VersionView>,
    pub total_versions: usize,
    /// The replayed head equals the live `experiences`.
    pub replay_matches_live: Option<bool>,
    pub snapshots: Vec<SnapshotView>,
    pub snapshots_total: usize,
    pub problems: Vec<String>,
    pub file: FileStatus,
}

fn rules_of(experiences: Option<&Value>) -> Rules {
    experiences
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (RuleOrder::of(k), clip(v.as_str().unwrap_or(""), RULE_CAP)))
                .collect()
        })
        .unwrap_or_default()
}

/// The one mission section of a run's guidance file.
fn mission_section(doc: &Value) -> Option<(String, &Value)> {
    let top = doc.as_object()?;
    let (mission, section) = top.iter().next()?;
    Some((mission.clone(), section))
}

pub fn collect(dir: &Path) -> GuidanceTimeline {
    let (doc, file) = read_json::<Value>(dir, GUIDANCE_FILE);
    let mut out = GuidanceTimeline {
        file,
        ..GuidanceTimeline::default()
    };
    let snapshot_names = list_snapshots(dir, &mut out);
    let Some((mission, section)) = doc.as_ref().and_then(mission_section) else {
        if doc.is_some() {
            out.problems
                .push("guidance.json holds no mission section".into());
        }
        return out;
    };
    out.mission = Some(mission);
    out.live_rules = rules_of(section.get("experiences"));
    let versions = section
        .get("versions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    out.total_versions = versions.len();
    let wanted: BTreeSet<u64> = snapshot_names.iter().filter_map(|(_, seq)| *seq).collect();
    let mut states: BTreeMap<u64, Rules> = BTreeMap::new();
    let mut state = Rules::new();
    let first_shown = versions.len().saturating_sub(ROW_CAP);
    for (i, version) in versions.iter().enumerate() {
        let view = replay(&mut state, version, &mut out);
        if i == 0 {
            out.seed_rules = state.clone();
        }
        if wanted.contains(&view.seq) {
            states.insert(view.seq, state.clone());
        }
        if i >= first_shown {
            out.versions.push(view);
        }
    }
    if !versions.is_empty() {
        out.replay_matches_live = Some(state == out.live_rules);
    }
    check_snapshots(dir, snapshot_names, &states, &mut out);
    out
}

/// Apply one version to `state` and describe what it changed.
fn replay(state: &mut Rules, version: &Value, out: &mut GuidanceTimeline) -> VersionView {
    let num = |k: &str| version.get(k).and_then(Value::as_u64).unwrap_or(0);
    let text = |k: &str| version.get(k).and_then(Value::as_str).map(|s| clip(s, 80));
    let mut view = VersionView {
        seq: num("seq"),
        step: num("step"),
        kind: text("kind").unwrap_or_else(|| "?".into()),
        reflection_id: text("reflection_id"),
        created_at: text("created_at"),
        ..VersionView::default()
    };
    match view.kind.as_str() {
        "seed" => {
            *state = rules_of(version.pointer("/seed/experiences"));
            view.changes = state
                .iter()
                .map(|(k, t)| change(k.key(), ChangeKind::Added, None, Some(t.clone()), None))
                .collect();
        }
        "reflection" => replay_reflection(state, version, &mut view, out),
        "cleanup" => {
            for key in strings(version.get("removed")) {
                let before = state.remove(&RuleOrder::of(&key));
                let note = Some("cleanup: low confidence".to_string());
                view.changes
                    .push(change(&key, ChangeKind::Removed, before, None, note));
            }
        }
        other => out.problems.push(format!(
            "version {}: unknown kind {}",
            view.seq,
            clip(other, 40)
        )),
    }
    view
}

fn replay_reflection(
    state: &mut Rules,
    version: &Value,
    view: &mut VersionView,
    out: &mut GuidanceTimeline,
) {
    let ops = version.get("ops").and_then(Value::as_array);
    for applied in array(version, "applied") {
        let key = str_of(applied, "key").unwrap_or("?").to_string();
        let effect = str_of(applied, "effect").unwrap_or("");
        let text = applied
            .get("index")
            .and_then(Value::as_u64)
            .and_then(|i| ops?.get(i as usize))
            .and_then(|op| str_of(op, "text"))
            .map(|t| clip(t, RULE_CAP));
        if !apply_effect(state, applied, &key, effect, text, view) {
            out.problems.push(format!(
                "version {}: unknown effect {} on {}",
                view.seq,
                clip(effect, 40),
                clip(&key, 40)
            ));
        }
    }
    for skipped in array(version, "skipped") {
        let s = |k: &str| clip(str_of(skipped, k).unwrap_or(""), 240);
        view.skipped.push(SkippedView {
            op: s("op"),
            reason: s("reason"),
            detail: s("detail"),
        });
    }
}

/// Apply one `applied` entry (the rule `key` took `text` with `effect`) to `state` and
/// record the change; `false` for an effect this replay does not know.
fn apply_effect(
    state: &mut Rules,
    applied: &Value,
    key: &str,
    effect: &str,
    text: Option<String>,
    view: &mut VersionView,
) -> bool {
    let order = RuleOrder::of(key);
    match effect {
        "created" => {
            let t = text.unwrap_or_default();
            state.insert(order, t.clone());
            view.changes
                .push(change(key, ChangeKind::Added, None, Some(t), None));
        }
        "updated" | "merged" => {
            let t = text.unwrap_or_default();
            let before = state.insert(order, t.clone());
            let kind = if before.is_some() {
                ChangeKind::Changed
            } else {
                ChangeKind::Added
            };
            view.changes.push(change(key, kind, before, Some(t), None));
            for away in strings(applied.get("merged_away")) {
                let before = state.remove(&RuleOrder::of(&away));
                let note = Some(format!("merged into {key}"));
                view.changes
                    .push(change(&away, ChangeKind::Removed, before, None, note));
            }
        }
        "deleted" => {
            let before = state.remove(&order);
            view.changes
                .push(change(key, ChangeKind::Removed, before, None, None));
        }
        _ => return false,
    }
    true
}

fn array<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    v.get(key).and_then(Value::as_array).into_iter().flatten()
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn change(
    key: &str,
    kind: ChangeKind,
    before: Option<String>,
    after: Option<String>,
    note: Option<String>,
) -> RuleChange {
    RuleChange {
        key: clip(key, 40),
        kind,
        before,
        after,
        note,
    }
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// `guidance-v{seq:04}-step{step:04}-{hash12}.json` → (seq, step).
fn parse_snapshot_name(name: &str) -> Option<(u64, u64)> {
    let rest = name.strip_prefix("guidance-v")?.strip_suffix(".json")?;
    let (seq, rest) = rest.split_once("-step")?;
    let (step, _hash) = rest.split_once('-')?;
    Some((seq.parse().ok()?, step.parse().ok()?))
}

/// The snapshot files (name, seq), newest [`ROW_CAP`] by name.
fn list_snapshots(dir: &Path, out: &mut GuidanceTimeline) -> Vec<(String, Option<u64>)> {
    let Ok(entries) = std::fs::read_dir(dir.join(SNAPSHOTS_DIR)) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    out.snapshots_total = names.len();
    let skip = names.len().saturating_sub(ROW_CAP);
    names
        .into_iter()
        .skip(skip)
        .map(|n| {
            let seq = parse_snapshot_name(&n).map(|(seq, _)| seq);
            (n, seq)
        })
        .collect()
}

fn check_snapshots(
    dir: &Path,
    names: Vec<(String, Option<u64>)>,
    states: &BTreeMap<u64, Rules>,
    out: &mut GuidanceTimeline,
) {
    let snapshots_dir = dir.join(SNAPSHOTS_DIR);
    for (name, seq) in names {
        let (doc, _) = read_json::<Value>(&snapshots_dir, &name);
        let rules = doc
            .as_ref()
            .and_then(mission_section)
            .map(|(_, s)| rules_of(s.get("experiences")));
        let matches_chain = match (&rules, seq.and_then(|s| states.get(&s))) {
            (Some(r), Some(state)) => Some(r == state),
            _ => None,
        };
        out.snapshots.push(SnapshotView {
            step: parse_snapshot_name(&name).map(|(_, step)| step),
            name: clip(&name, 120),
            seq,
            rules: rules.as_ref().map(BTreeMap::len),
            matches_chain,
        });
    }
}
