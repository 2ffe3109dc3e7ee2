//! Specs of the op checks: one test per reject code and per acceptance rule.

use super::*;
use crate::guidance::{RuleMetadata, apply_ops};

fn guidance() -> MissionGuidance {
    let mut experiences = BTreeMap::new();
    experiences.insert(RuleKey::S(1), "若关键点无法确认则判不通过".to_string());
    experiences.insert(RuleKey::G0, "至少需要检测到挡风板".to_string());
    experiences.insert(RuleKey::G1, "若挡风板缺失则判不通过".to_string());
    experiences.insert(RuleKey::G(2), "若挡风板方向反向则判不通过".to_string());
    experiences.insert(RuleKey::G(3), "若全局图显示完整则以全局图为准".to_string());
    let mut metadata = BTreeMap::new();
    metadata.insert(
        RuleKey::G1,
        RuleMetadata {
            updated_at: None,
            reflection_id: "r0".into(),
            sources: vec![],
            rationale: None,
            hit_count: 1,
            miss_count: 0,
            confidence: 0.99,
            claims_hit: 0,
            claims_missed: 0,
            extra: BTreeMap::new(),
        },
    );
    MissionGuidance {
        mission: "m".into(),
        step: 1,
        updated_at: "2025-12-16".into(),
        experiences,
        metadata,
    }
}

fn keys(v: &[&str]) -> BTreeSet<TicketKey> {
    v.iter().map(|s| TicketKey(s.to_string())).collect()
}

fn op(kind: &str, key: Option<&str>, text: Option<&str>, evidence: &[&str]) -> ProposedOp {
    ProposedOp {
        op: kind.into(),
        key: key.map(Into::into),
        text: text.map(Into::into),
        rationale: Some("依据本批样本".into()),
        evidence: evidence.iter().map(|s| s.to_string()).collect(),
        merged_from: None,
        expected_flips: None,
    }
}

fn merge(key: &str, from: &[&str], text: &str) -> ProposedOp {
    ProposedOp {
        merged_from: Some(from.iter().map(|s| s.to_string()).collect()),
        expected_flips: None,
        ..op("merge", Some(key), Some(text), &["g1::pass"])
    }
}

struct Fixture {
    learnable: BTreeSet<TicketKey>,
    shorthand: BTreeMap<String, TicketKey>,
    guidance: MissionGuidance,
    group_ids: BTreeSet<String>,
    summaries: Vec<String>,
}

impl Fixture {
    fn new() -> Self {
        let mut shorthand = BTreeMap::new();
        shorthand.insert("第1组".to_string(), TicketKey("g1::pass".into()));
        shorthand.insert("第2组".to_string(), TicketKey("g2::pass".into()));
        Fixture {
            learnable: keys(&["g1::pass", "g2::pass"]),
            shorthand,
            guidance: guidance(),
            group_ids: ["g1", "g2", "QC-HOLD-0042"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            summaries: vec!["挡风板/显示完整×1，备注: 挡风板装反了，需要整改".into()],
        }
    }

    fn validate(&self, ops: &[ProposedOp], max: Option<usize>) -> OpsValidation {
        let ctx = OpsContext {
            learnable: &self.learnable,
            shorthand: &self.shorthand,
            guidance: &self.guidance,
            max_operations: max,
            group_ids: &self.group_ids,
            case_summaries: &self.summaries,
        };
        validate_ops(ops, &ctx)
    }
}

fn reasons(v: &OpsValidation) -> Vec<RejectReason> {
    v.rejected.iter().map(|r| r.reason).collect()
}

#[test]
fn evidence_outside_learnable_rejects_the_whole_op() {
    let f = Fixture::new();
    let v = f.validate(
        &[op(
            "add",
            None,
            Some("若螺丝松动则判不通过"),
            &["g1::pass", "STOP"],
        )],
        None,
    );
    assert!(v.accepted.is_empty());
    assert_eq!(reasons(&v), vec![RejectReason::EvidenceOutsideLearnable]);
    assert!(v.proposed_evidence().is_empty());
}

#[test]
fn only_the_valid_op_of_two_is_kept() {
    let f = Fixture::new();
    let v = f.validate(
        &[
            op("add", None, Some("若螺丝松动则判不通过"), &["STOP"]),
            op("add", None, Some("若挡风板变形则判不通过"), &["g2::pass"]),
        ],
        None,
    );
    assert_eq!(v.accepted.len(), 1);
    assert_eq!(v.accepted[0].index, 1);
    assert_eq!(v.proposed_evidence(), keys(&["g2::pass"]));
}

#[test]
fn third_state_text_or_rationale_is_rejected() {
    let f = Fixture::new();
    let v = f.validate(
        &[op("add", None, Some("需复核时通过。"), &["g1::pass"])],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::ThirdStateText]);
    let mut p = op("add", None, Some("若挡风板变形则判不通过"), &["g1::pass"]);
    p.rationale = Some("需要进一步确认".into());
    assert_eq!(
        reasons(&f.validate(&[p], None)),
        vec![RejectReason::ThirdStateText]
    );
    // Traditional characters and case do not slip through.
    let v = f.validate(
        &[op(
            "add",
            None,
            Some("若無法判斷則 Need-Review"),
            &["g1::pass"],
        )],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::ThirdStateText]);
}

#[test]
fn add_with_nearly_existing_text_becomes_update_of_that_key() {
    let f = Fixture::new();
    // Near-identical (contained, length ratio ≥ 0.85) also reuses the key.
    let v = f.validate(
        &[op(
            "add",
            None,
            Some("若挡风板缺失则判不通过了"),
            &["g1::pass"],
        )],
        None,
    );
    assert_eq!(v.accepted[0].op.key(), Some(RuleKey::G1));
    // An add identical to a scaffold rule is rejected, never an S* update.
    let v = f.validate(
        &[op(
            "add",
            None,
            Some("若关键点无法确认则判不通过"),
            &["g1::pass"],
        )],
        None,
    );
    assert!(v.accepted.is_empty(), "{v:?}");
}

#[test]
fn decision_ids_resolve_shorthand_and_drop_unknown() {
    let f = Fixture::new();
    let batch = keys(&["g1::pass", "g2::pass"]);
    let raw: Vec<String> = ["第1组", "g2::pass", "UNKNOWN", " 第 1 组 ", "g1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let r = resolve_ids(&raw, &f.shorthand, &batch);
    assert_eq!(
        r.keys,
        vec![TicketKey("g1::pass".into()), TicketKey("g2::pass".into())]
    );
    assert_eq!(r.unknown, vec!["UNKNOWN".to_string(), "g1".to_string()]);
}

#[test]
fn evidence_shorthand_is_resolved_and_deduplicated() {
    let f = Fixture::new();
    let v = f.validate(
        &[op(
            "add",
            None,
            Some("若挡风板变形则判不通过"),
            &["第1组", "g1::pass", "第2组"],
        )],
        None,
    );
    assert_eq!(
        v.accepted[0].op.evidence(),
        &[TicketKey("g1::pass".into()), TicketKey("g2::pass".into())]
    );
    let v = f.validate(
        &[op("add", None, Some("若挡风板变形则判不通过"), &["第3组"])],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::EvidenceOutsideLearnable]);
}

#[test]
fn empty_evidence_is_rejected_even_for_delete() {
    let f = Fixture::new();
    let v = f.validate(
        &[
            op("delete", Some("G1"), None, &[]),
            op("delete", Some("G2"), None, &["  "]),
        ],
        None,
    );
    assert_eq!(
        reasons(&v),
        vec![RejectReason::EmptyEvidence, RejectReason::EmptyEvidence]
    );
}

#[test]
fn scaffold_keys_are_never_targets() {
    let f = Fixture::new();
    let v = f.validate(
        &[
            op("update", Some("S1"), Some("改写"), &["g1::pass"]),
            op("delete", Some("S1"), None, &["g1::pass"]),
            merge("G1", &["S1"], "合并"),
        ],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::ScaffoldKey; 3]);
}

#[test]
fn g0_is_updatable_but_not_deletable_nor_mergeable_away() {
    let f = Fixture::new();
    let v = f.validate(&[op("delete", Some("G0"), None, &["g1::pass"])], None);
    assert_eq!(reasons(&v), vec![RejectReason::G0Delete]);
    let v = f.validate(&[merge("G1", &["G0"], "合并规则")], None);
    assert_eq!(reasons(&v), vec![RejectReason::MergedFromInvalid]);
    let v = f.validate(
        &[op(
            "update",
            Some("G0"),
            Some("至少需要检测到挡风板和螺丝"),
            &["g1::pass"],
        )],
        None,
    );
    assert_eq!(v.accepted.len(), 1);
}

#[test]
fn keys_must_exist_and_be_canonical() {
    let f = Fixture::new();
    let v = f.validate(
        &[
            op("update", Some("G9"), Some("新规则"), &["g1::pass"]),
            op("update", None, Some("新规则"), &["g1::pass"]),
            op("update", Some("rule1"), Some("新规则"), &["g1::pass"]),
            op("delete", Some("G9"), None, &["g1::pass"]),
        ],
        None,
    );
    assert_eq!(
        reasons(&v),
        vec![
            RejectReason::UnknownKey,
            RejectReason::MissingKey,
            RejectReason::InvalidKey,
            RejectReason::UnknownKey
        ]
    );
}

#[test]
fn merge_sources_must_be_valid() {
    let f = Fixture::new();
    let cases = [
        (
            merge("G1", &[], "合并规则"),
            RejectReason::MergedFromInvalid,
        ),
        (
            merge("G1", &["G1"], "合并规则"),
            RejectReason::MergedFromInvalid,
        ),
        (
            merge("G1", &["G9"], "合并规则"),
            RejectReason::MergedFromInvalid,
        ),
        (
            merge("G1", &["G2", "G2"], "合并规则"),
            RejectReason::MergedFromInvalid,
        ),
        (
            ProposedOp {
                merged_from: None,
                expected_flips: None,
                ..merge("G1", &[], "合并规则")
            },
            RejectReason::MergedFromInvalid,
        ),
    ];
    for (p, want) in cases {
        assert_eq!(
            reasons(&f.validate(std::slice::from_ref(&p), None)),
            vec![want],
            "{p:?}"
        );
    }
    let v = f.validate(
        &[merge("G1", &["G2", "G3"], "若挡风板缺失或反向则判不通过")],
        None,
    );
    assert_eq!(v.accepted.len(), 1, "{v:?}");
    let GuidanceOp::Merge { merged_from, .. } = &v.accepted[0].op else {
        panic!()
    };
    assert_eq!(merged_from, &vec![RuleKey::G(2), RuleKey::G(3)]);
}

#[test]
fn stage_a_object_chain_is_rejected_natural_rule_is_accepted() {
    let f = Fixture::new();
    let leak = "BBU设备/显示完整,机柜空间充足需要安装/这个BBU设备按要求配备了挡风板。";
    let v = f.validate(&[op("add", None, Some(leak), &["g1::pass"])], None);
    assert_eq!(reasons(&v), vec![RejectReason::StageALeak]);
    let rule = "若机柜空间充足且BBU设备按要求配备挡风板则判通过；否则判不通过。";
    assert_eq!(
        f.validate(&[op("add", None, Some(rule), &["g1::pass"])], None)
            .accepted
            .len(),
        1
    );
    for leak in [
        "image_1显示缺失则不通过",
        "若Image2缺失则不通过",
        "挡风板×2则通过",
        "备注: 无",
        "标签/可以识别则通过",
    ] {
        assert!(stage_a_leak(leak).is_some(), "{leak}");
    }
    assert!(
        stage_a_leak("若螺丝/光纤之一缺失则不通过").is_none(),
        "one slash is prose"
    );
}

#[test]
fn length_caps_reject_instead_of_truncating() {
    let f = Fixture::new();
    let long = "若".repeat(MAX_TEXT_CHARS + 1);
    assert_eq!(
        reasons(&f.validate(&[op("add", None, Some(&long), &["g1::pass"])], None)),
        vec![RejectReason::TextTooLong]
    );
    let exact = format!("若{}则不通过", "长".repeat(MAX_TEXT_CHARS - 5));
    assert_eq!(
        f.validate(&[op("add", None, Some(&exact), &["g1::pass"])], None)
            .accepted
            .len(),
        1
    );
    let mut p = op("add", None, Some("若挡风板变形则判不通过"), &["g1::pass"]);
    p.rationale = Some("理".repeat(MAX_RATIONALE_CHARS + 1));
    assert_eq!(
        reasons(&f.validate(&[p], None)),
        vec![RejectReason::RationaleTooLong]
    );
}

#[test]
fn unknown_op_and_missing_text_are_rejected() {
    let f = Fixture::new();
    let v = f.validate(
        &[
            op("none", None, None, &["g1::pass"]),
            op("upsert", Some("G1"), Some("x"), &["g1::pass"]),
            op("add", None, Some(" 。"), &["g1::pass"]),
        ],
        None,
    );
    assert_eq!(
        reasons(&v),
        vec![
            RejectReason::UnknownOp,
            RejectReason::UnknownOp,
            RejectReason::MissingText
        ]
    );
    // Case and spaces in the kind are tolerated.
    assert_eq!(
        f.validate(
            &[op(
                " ADD ",
                None,
                Some("若挡风板变形则判不通过"),
                &["g1::pass"]
            )],
            None
        )
        .accepted
        .len(),
        1
    );
}

#[test]
fn identical_ops_are_deduplicated_and_conflicts_rejected() {
    let f = Fixture::new();
    let a = op("add", None, Some("若挡风板变形则判不通过"), &["g1::pass"]);
    let b = op("add", None, Some("若挡风板变形则判不通过。"), &["g1::pass"]);
    let v = f.validate(&[a, b], None);
    assert_eq!(reasons(&v), vec![RejectReason::DuplicateOp]);
    let v = f.validate(
        &[
            op(
                "update",
                Some("G1"),
                Some("若挡风板缺失则判不通过，除非另有全局图"),
                &["g1::pass"],
            ),
            op("delete", Some("G1"), None, &["g2::pass"]),
        ],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::KeyConflict]);
    let v = f.validate(
        &[op(
            "update",
            Some("G3"),
            Some("若挡风板缺失则判不通过"),
            &["g1::pass"],
        )],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::DuplicateText]);
}

#[test]
fn max_operations_caps_accepted_ops() {
    let f = Fixture::new();
    let v = f.validate(
        &[
            op("add", None, Some("若螺丝松动则判不通过"), &["STOP"]),
            op("add", None, Some("若挡风板变形则判不通过"), &["g1::pass"]),
            op(
                "add",
                None,
                Some("若挡风板颜色异常则判不通过"),
                &["g2::pass"],
            ),
            op(
                "update",
                Some("G2"),
                Some("若挡风板装反则判不通过"),
                &["g2::pass"],
            ),
        ],
        Some(2),
    );
    assert_eq!(
        v.accepted.iter().map(|a| a.index).collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(
        reasons(&v),
        vec![
            RejectReason::EvidenceOutsideLearnable,
            RejectReason::MaxOperationsExceeded
        ]
    );
}

/// The guidance a run writes must load again on resume, so ops stop at the input budget:
/// an add past `MAX_RULES` rules, or text past `MAX_GUIDANCE_CHARS`, is `guidance_budget`.
#[test]
fn adds_past_the_rule_budget_and_text_past_the_character_budget_are_guidance_budget() {
    use stageb_shared::budget::{MAX_GUIDANCE_CHARS, MAX_RULES};
    let mut f = Fixture::new();
    let filler = |i: usize| format!("规则{i}：若部件{i}缺失则判不通过");
    for i in f.guidance.experiences.len()..MAX_RULES {
        f.guidance
            .experiences
            .insert(RuleKey::G(i as u32 + 10), filler(i));
    }
    let v = f.validate(
        &[
            op("add", None, Some("若挡风板变形则判不通过"), &["g1::pass"]),
            op(
                "update",
                Some("G2"),
                Some("若挡风板装反则判不通过"),
                &["g2::pass"],
            ),
        ],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::GuidanceBudget]);
    assert!(v.rejected[0].detail.contains("more than 256 rules"));
    assert_eq!(
        v.accepted.iter().map(|a| a.index).collect::<Vec<_>>(),
        vec![1]
    );

    // Room for rules, none for characters.
    let mut f = Fixture::new();
    let used: usize = f
        .guidance
        .experiences
        .values()
        .map(|t| t.chars().count())
        .sum();
    let pad = MAX_GUIDANCE_CHARS - used - 3;
    f.guidance
        .experiences
        .insert(RuleKey::G(9), "长".repeat(pad));
    let v = f.validate(
        &[op(
            "add",
            None,
            Some("若挡风板变形则判不通过"),
            &["g1::pass"],
        )],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::GuidanceBudget]);
    assert!(v.rejected[0].detail.contains("characters together"));
    assert_eq!(RejectReason::GuidanceBudget.code(), "guidance_budget");
}

#[test]
fn regression_noop_update_and_add_of_an_existing_rule_are_unchanged_text() {
    // A restated rule changed nothing and must not count toward closure `L == E`.
    let f = Fixture::new();
    let v = f.validate(
        &[
            op(
                "update",
                Some("G1"),
                Some("若挡风板缺失则判不通过。"),
                &["g1::pass"],
            ),
            op("add", None, Some("若 挡风板缺失 则判不通过"), &["g2::pass"]),
            op(
                "update",
                Some("G0"),
                Some("至少需要检测到挡风板"),
                &["g2::pass"],
            ),
        ],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::UnchangedText; 3], "{v:?}");
    assert!(v.accepted.is_empty());
}

#[test]
fn regression_label_leak_is_rejected_in_every_form() {
    // A rule naming a ticket would put its label into every later rollout prompt.
    let f = Fixture::new();
    for text in [
        "若工单QC-HOLD-0042出现则判不通过",
        "若工单ＱＣ－ＨＯＬＤ－００４２出现则判不通过",
        "若工单 QC HOLD 0042 出现则判不通过",
        "若挡风板缺失则判不通过，见g1::pass",
        "若挡风板缺失则判不通过，见ｇ１：：ｆａｉｌ",
    ] {
        let v = f.validate(&[op("add", None, Some(text), &["g1::pass"])], None);
        assert_eq!(reasons(&v), vec![RejectReason::LabelLeak], "{text}");
        assert!(v.rejected[0].detail.contains("must not name"));
    }
    let v = f.validate(
        &[op(
            "update",
            Some("G1"),
            Some("若挡风板缺失则判不通过 QC-HOLD-0042"),
            &["g1::pass"],
        )],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::LabelLeak]);
}

#[test]
fn regression_version_strings_are_not_rules() {
    // Observed on the real model: G0 replaced by `2.0.0`, `G2: "1.0.0"`, `G3: "1.2.0"`.
    let f = Fixture::new();
    let v = f.validate(
        &[
            op("update", Some("G0"), Some("2.0.0"), &["g1::pass"]),
            op("add", None, Some("1.0.0"), &["g1::pass"]),
            op("add", None, Some("1.2.0"), &["g2::pass"]),
            op(
                "add",
                None,
                Some("Fail when the panel is missing"),
                &["g2::pass"],
            ),
            op("add", None, Some("判不通过"), &["g2::pass"]),
            op("add", None, Some("挡风板装反了，需要整改"), &["g2::pass"]),
            op(
                "update",
                Some("G0"),
                Some("所有样本都判为合格即可"),
                &["g2::pass"],
            ),
        ],
        None,
    );
    assert_eq!(
        reasons(&v),
        vec![
            RejectReason::NotARule,
            RejectReason::NotARule,
            RejectReason::NotARule,
            RejectReason::ScriptMismatch,
            RejectReason::TextTooShort,
            RejectReason::CopiesCaseSummary,
            RejectReason::G0NotFocus,
        ],
        "{v:#?}"
    );
}

#[test]
fn reject_reason_codes_are_stable() {
    let json = serde_json::to_string(&RejectReason::EvidenceOutsideLearnable).unwrap();
    assert_eq!(json, "\"evidence_outside_learnable\"");
    assert_eq!(
        RejectReason::MaxOperationsExceeded.code(),
        "max_operations_exceeded"
    );
    assert_eq!(
        serde_json::to_string(&RejectReason::G0Delete).unwrap(),
        "\"g0_delete\""
    );
}

#[test]
fn regression_b13_rules_use_the_reflection_list_reasons_the_rollout_list() {
    // One list per layer on purpose: hedging words are harmless in a reason but turn a rule
    // into a third-state instruction.
    let f = Fixture::new();
    let v = f.validate(
        &[op("add", None, Some("若无佐证则判通过"), &["g1::pass"])],
        None,
    );
    assert_eq!(reasons(&v), vec![RejectReason::ThirdStateText]);
    assert!(
        text::find_third_state("若无佐证则判通过", stageb_shared::text::THIRD_STATE_ROLLOUT)
            .is_none()
    );
}

#[test]
fn regression_b9_delete_of_missing_key_is_not_coverage() {
    // Validation already rejects it; here the op reaches apply anyway (e.g. the key was
    // removed by an earlier op), and coverage must come from what was applied.
    let g = guidance();
    let ops = vec![
        GuidanceOp::Delete {
            key: RuleKey::G(9),
            rationale: None,
            evidence: vec![TicketKey("g1::pass".into())],
        },
        GuidanceOp::Add {
            text: "若挡风板变形则判不通过".into(),
            rationale: None,
            evidence: vec![TicketKey("g2::pass".into())],
        },
    ];
    let out = apply_ops(&g, &ops, "rid", "t").unwrap();
    let e = evidence_covered(&out.applied);
    assert_eq!(e, keys(&["g2::pass"]));
    assert_eq!(
        uncovered(&keys(&["g1::pass", "g2::pass"]), &e),
        vec![TicketKey("g1::pass".into())]
    );
}

#[test]
fn accepted_ops_apply_cleanly() {
    let f = Fixture::new();
    let v = f.validate(
        &[
            op("add", None, Some("若挡风板变形则判不通过"), &["第1组"]),
            merge("G1", &["G2"], "若挡风板缺失或反向则判不通过"),
            op("delete", Some("G3"), None, &["g2::pass"]),
        ],
        Some(5),
    );
    assert!(v.rejected.is_empty(), "{v:?}");
    let out = apply_ops(&f.guidance, &v.ops(), "rid", "t").unwrap();
    assert_eq!(out.applied.len(), 3);
    assert!(out.skipped.is_empty());
    assert_eq!(
        evidence_covered(&out.applied),
        keys(&["g1::pass", "g2::pass"])
    );
}
