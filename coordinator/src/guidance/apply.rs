//! Op application: the pure transitions from one version's content to the next.
//!
//! [`apply_ops`] (a reflection) and [`remove_keys`] (a lifecycle cleanup) never touch the disk;
//! the repository persists their result and [`super::verify_chain`] replays them to recompute
//! every recorded version. Keeping them pure and in one place is what makes the replay
//! trustworthy: the chain is verified with exactly the code that produced it.

use super::edits::{AppliedOp, GuidanceOp, OpEffect, SkipReason, SkippedOp};
use super::error::GuidanceError;
use super::model::{MissionGuidance, RuleKey, RuleMetadata, confidence, dedupe_form, loose_form};
use stageb_shared::domain::TicketKey;
use stageb_shared::text;

/// The pure result of [`apply_ops`].
#[derive(Debug, Clone, PartialEq)]
pub struct OpsApplication {
    pub guidance: MissionGuidance,
    pub applied: Vec<AppliedOp>,
    pub skipped: Vec<SkippedOp>,
}

/// Apply ops in order to a copy of `current` (pure; persistence is [`GuidanceRepo::apply`]).
///
/// Semantics (the reference's apply rules, with the strict differences noted):
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
///
/// [`GuidanceRepo::apply`]: super::GuidanceRepo::apply
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
        match apply_one(&mut g, op, reflection_id, now) {
            Ok((key, effect, merged_away)) => applied.push(AppliedOp {
                index,
                op: op.kind().to_string(),
                key,
                effect,
                merged_away,
                evidence: op.evidence().to_vec(),
            }),
            Err((reason, detail)) => skipped.push(SkippedOp {
                index,
                op: op.kind().to_string(),
                reason,
                detail,
            }),
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

/// What one op did to the guidance: the key it resolved to, its effect and the keys a merge
/// removed; or why it was skipped, in which case the guidance is unchanged.
type OpOutcome = Result<(RuleKey, OpEffect, Vec<RuleKey>), (SkipReason, String)>;

/// Apply one op to `g` (one step of [`apply_ops`]; the semantics are documented there).
fn apply_one(
    g: &mut MissionGuidance,
    op: &GuidanceOp,
    reflection_id: &str,
    now: &str,
) -> OpOutcome {
    match op {
        GuidanceOp::Delete { key, .. } => apply_delete(g, *key),
        GuidanceOp::Add {
            text,
            rationale,
            evidence,
        } => apply_add(g, text, rationale.as_deref(), evidence, reflection_id, now),
        GuidanceOp::Update {
            key,
            text,
            rationale,
            evidence,
        } => apply_update(
            g,
            *key,
            text,
            rationale.as_deref(),
            evidence,
            reflection_id,
            now,
        ),
        GuidanceOp::Merge {
            key,
            merged_from,
            text,
            rationale,
            evidence,
        } => apply_merge(
            g,
            *key,
            merged_from,
            text,
            rationale.as_deref(),
            evidence,
            reflection_id,
            now,
        ),
    }
}

fn apply_delete(g: &mut MissionGuidance, key: RuleKey) -> OpOutcome {
    if key.is_scaffold() {
        Err((SkipReason::ScaffoldKey, format!("{key} is read-only")))
    } else if key.is_g0() {
        Err((SkipReason::G0Delete, "G0 cannot be deleted".into()))
    } else if g.experiences.remove(&key).is_none() {
        Err((SkipReason::MissingKey, format!("{key} does not exist")))
    } else {
        g.metadata.remove(&key);
        Ok((key, OpEffect::Deleted, Vec::new()))
    }
}

fn apply_add(
    g: &mut MissionGuidance,
    text: &str,
    rationale: Option<&str>,
    evidence: &[TicketKey],
    reflection_id: &str,
    now: &str,
) -> OpOutcome {
    let text = text::normalize(text);
    if dedupe_form(&text).is_empty() {
        return Err((SkipReason::EmptyText, "empty text".into()));
    }
    let target = match g.key_with_text(&text) {
        Some(k) if k.is_scaffold() => {
            return Err((SkipReason::DuplicateOfScaffold, format!("same text as {k}")));
        }
        Some(k) => {
            return Err((SkipReason::Unchanged, format!("{k} already says this")));
        }
        None => g.next_free_g(),
    };
    let effect = OpEffect::Created;
    upsert(
        g,
        target,
        text,
        rationale,
        evidence,
        &[],
        reflection_id,
        now,
    );
    Ok((target, effect, Vec::new()))
}

/// What an update and a merge both need: an existing learnable key and a non-empty new text.
fn check_rewrite_target(
    g: &MissionGuidance,
    key: RuleKey,
    text: &str,
) -> Result<(), (SkipReason, String)> {
    if key.is_scaffold() {
        Err((SkipReason::ScaffoldKey, format!("{key} is read-only")))
    } else if !g.experiences.contains_key(&key) {
        Err((SkipReason::MissingKey, format!("{key} does not exist")))
    } else if dedupe_form(text).is_empty() {
        Err((SkipReason::EmptyText, "empty text".into()))
    } else {
        Ok(())
    }
}

fn apply_update(
    g: &mut MissionGuidance,
    key: RuleKey,
    text: &str,
    rationale: Option<&str>,
    evidence: &[TicketKey],
    reflection_id: &str,
    now: &str,
) -> OpOutcome {
    let text = text::normalize(text);
    if let Err(skip) = check_rewrite_target(g, key, &text) {
        Err(skip)
    } else if g
        .text(key)
        .is_some_and(|t| loose_form(t) == loose_form(&text))
    {
        Err((SkipReason::Unchanged, format!("{key} already says this")))
    } else if let Some(other) = g.key_with_text(&text).filter(|k| *k != key) {
        let reason = if other.is_scaffold() {
            SkipReason::DuplicateOfScaffold
        } else {
            SkipReason::DuplicateText
        };
        Err((reason, format!("same text as {other}")))
    } else {
        upsert(g, key, text, rationale, evidence, &[], reflection_id, now);
        Ok((key, OpEffect::Updated, Vec::new()))
    }
}

#[allow(clippy::too_many_arguments)] // the op's fields plus the stamp, as `upsert`
fn apply_merge(
    g: &mut MissionGuidance,
    key: RuleKey,
    merged_from: &[RuleKey],
    text: &str,
    rationale: Option<&str>,
    evidence: &[TicketKey],
    reflection_id: &str,
    now: &str,
) -> OpOutcome {
    let text = text::normalize(text);
    check_rewrite_target(g, key, &text)?;
    let consumed = |k: &RuleKey| merged_from.contains(k) && !k.is_scaffold() && !k.is_g0();
    if let Some(other) = g.key_with_text(&text).filter(|k| *k != key && !consumed(k)) {
        let reason = if other.is_scaffold() {
            SkipReason::DuplicateOfScaffold
        } else {
            SkipReason::DuplicateText
        };
        return Err((reason, format!("same text as {other}")));
    }
    let mut folded = Vec::new();
    let mut merged_away = Vec::new();
    for m in merged_from {
        if *m == key || m.is_scaffold() || m.is_g0() || merged_away.contains(m) {
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
        g,
        key,
        text,
        rationale,
        evidence,
        &folded,
        reflection_id,
        now,
    );
    Ok((key, OpEffect::Merged, merged_away))
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
    // Checked predictions stay with the rule through updates and merges, as the counters do.
    let claims = |f: fn(&RuleMetadata) -> u64| old.map_or(0, f) + folded.iter().map(f).sum::<u64>();
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
        claims_hit: claims(|m| m.claims_hit),
        claims_missed: claims(|m| m.claims_missed),
        extra: old.map(|m| m.extra.clone()).unwrap_or_default(),
    };
    g.metadata.insert(key, meta);
    g.experiences.insert(key, text);
}

/// Invariants every version must keep relative to its parent: `S*` untouched, `G0` present,
/// experiences non-empty.
pub(super) fn check_invariants(
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

pub(super) fn remove_keys(g: &MissionGuidance, keys: &[RuleKey], now: &str) -> MissionGuidance {
    let mut next = g.clone();
    for k in keys {
        next.experiences.remove(k);
        next.metadata.remove(k);
    }
    next.updated_at = now.to_string();
    next
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guidance::test_support::*;
    use crate::guidance::{GuidanceRepo, verify_chain};
    use serde_json::json;

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
    fn regression_an_identical_rule_changes_nothing() {
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
            crate::learn::op_check::evidence_covered(&out.applied),
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
}
