//! Property: whatever op sequence a model proposes, validation followed by apply keeps the
//! guidance's invariants, however hostile the model. Random proposals mix valid and hostile ops
//! (S* and G0 targets, unknown keys, label leaks, version strings, restatements, evidence
//! outside L); over several rounds applied to the same guidance:
//! - `S*` never changes, `G0` always exists and keeps its focus, experiences are non-empty;
//! - no accepted text names a group id or label, none is a number/version/identifier;
//! - every accepted op's evidence ⊆ L; coverage comes only from applied ops and an op skipped at
//!   apply covers nothing;
//! - a restatement (unchanged text) is never accepted and never bumps the step.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use stageb_coordinator::guidance::{MissionGuidance, RuleKey, apply_ops, loose_form};
use stageb_coordinator::learn::op_check::{OpsContext, ProposedOp, evidence_covered, validate_ops};
use stageb_coordinator::learn::rule_text;
use stageb_shared::domain::TicketKey;

const GROUPS: [&str; 3] = ["QC-PROP-0001", "QC-PROP-0002", "QC-PROP-0003"];
const TEXTS: [&str; 12] = [
    "若摘要出现“挡风板松动”则判不通过；否则按其他规则判定",
    "若挡风板安装方向反向则判不通过",
    "若螺丝缺失导致挡风板不牢固则判不通过",
    "检查BBU设备是否按要求配备挡风板且安装牢固",
    "2.0.0",
    "rule_7",
    "若工单QC-PROP-0001出现则判不通过",
    "若挡风板缺失则判不通过（ｑｃ－ｐｒｏｐ－０００２）",
    "Fail when the baffle is loose",
    "判不通过",
    "所有样本一律判为合格并说明理由",
    "@same",
];
const KEYS: [&str; 7] = ["S1", "G0", "G1", "G2", "G3", "G9", "g1"];
const EVIDENCE: [&str; 5] = [
    "QC-PROP-0001::fail",
    "QC-PROP-0002::pass",
    "第1组",
    "QC-OUT-1::fail",
    "QC-PROP-0003::fail",
];

fn seed() -> MissionGuidance {
    let mut experiences = BTreeMap::new();
    experiences.insert(
        RuleKey::S(1),
        "结论只能基于摘要中与挡风板相关的证据".to_string(),
    );
    experiences.insert(
        RuleKey::G0,
        "检查BBU设备是否按要求配备挡风板；挡风板安装方向是否正确".to_string(),
    );
    experiences.insert(RuleKey::G1, "若挡风板缺失则判不通过".to_string());
    MissionGuidance {
        mission: "挡风板安装检查".into(),
        step: 1,
        updated_at: "2026-01-01".into(),
        experiences,
        metadata: BTreeMap::new(),
    }
}

fn op_strategy() -> impl Strategy<Value = (usize, usize, usize, Vec<usize>)> {
    (
        0..4usize,
        0..KEYS.len(),
        0..TEXTS.len(),
        proptest::collection::vec(0..EVIDENCE.len(), 0..3),
    )
}

fn build(
    (kind, key, text, evidence): (usize, usize, usize, Vec<usize>),
    g: &MissionGuidance,
) -> ProposedOp {
    let kind = ["add", "update", "delete", "merge"][kind];
    let key = KEYS[key];
    let text = if TEXTS[text] == "@same" {
        key.parse::<RuleKey>()
            .ok()
            .and_then(|k| g.text(k))
            .unwrap_or("若挡风板缺失则判不通过")
            .to_string()
    } else {
        TEXTS[text].to_string()
    };
    ProposedOp {
        op: kind.into(),
        key: (kind != "add").then(|| key.to_string()),
        text: (kind != "delete").then_some(text),
        rationale: Some("依据本批样本".into()),
        evidence: evidence.iter().map(|&i| EVIDENCE[i].to_string()).collect(),
        merged_from: (kind == "merge").then(|| vec!["G2".to_string()]),
        expected_flips: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn random_op_sequences_keep_the_invariants(
        rounds in proptest::collection::vec(proptest::collection::vec(op_strategy(), 0..6), 1..6)
    ) {
        let groups: BTreeSet<String> = GROUPS.iter().map(|s| s.to_string()).collect();
        let learnable: BTreeSet<TicketKey> = ["QC-PROP-0001::fail", "QC-PROP-0002::pass"]
            .iter().map(|s| TicketKey(s.to_string())).collect();
        let mut shorthand = BTreeMap::new();
        shorthand.insert("第1组".to_string(), TicketKey("QC-PROP-0001::fail".into()));
        let summaries = vec!["挡风板/显示完整×1，备注: 挡风板有晃动".to_string()];
        let mut g = seed();
        let scaffold = g.text(RuleKey::S(1)).unwrap().to_string();
        for (round, spec) in rounds.into_iter().enumerate() {
            let proposed: Vec<ProposedOp> = spec.into_iter().map(|s| build(s, &g)).collect();
            let ctx = OpsContext {
                learnable: &learnable,
                shorthand: &shorthand,
                guidance: &g,
                max_operations: Some(4),
                group_ids: &groups,
                case_summaries: &summaries,
            };
            let v = validate_ops(&proposed, &ctx);
            prop_assert!(v.accepted.len() <= 4);
            for a in &v.accepted {
                prop_assert!(a.op.evidence().iter().all(|e| learnable.contains(e)));
                if let Some(t) = a.op.text() {
                    prop_assert_eq!(rule_text::label_leak(t, &groups), None);
                    prop_assert_eq!(rule_text::not_a_rule(t), None);
                    if let Some(k) = a.op.key() {
                        let unchanged = g.text(k).is_some_and(|cur| loose_form(cur) == loose_form(t));
                        prop_assert!(!unchanged || a.op.kind() == "merge", "restatement accepted");
                    }
                }
            }
            // Err: nothing applied, so guidance, step and coverage stay as they were.
            if let Ok(out) = apply_ops(&g, &v.ops(), &format!("r{round}"), "t") {
                prop_assert_eq!(out.guidance.step, g.step + 1);
                let covered = evidence_covered(&out.applied);
                let skipped: BTreeSet<usize> = out.skipped.iter().map(|s| s.index).collect();
                prop_assert!(out.applied.iter().all(|a| !skipped.contains(&a.index)));
                prop_assert!(covered.iter().all(|e| learnable.contains(e)));
                g = out.guidance;
            }
            prop_assert_eq!(g.text(RuleKey::S(1)), Some(scaffold.as_str()));
            prop_assert!(g.experiences.contains_key(&RuleKey::G0));
            prop_assert!(g.g0().contains("挡风板"), "G0 lost its focus: {}", g.g0());
        }
    }
}
