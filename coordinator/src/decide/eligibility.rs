//! Gradient candidates: which tickets carry learnable signal for reflection (seed 003 and the
//! user's design define the rules below).
//!
//! A ticket is eligible when any of these holds (all are reported, the first in this fixed
//! precedence is the primary `rule_hit`):
//! 1. `Eligible.LabelMismatch`: the final verdict (after overrides) differs from `gt_label`;
//! 2. `Eligible.Contradiction`: format-ok candidates contain both verdicts (even when the final
//!    verdict is right);
//! 3. `Eligible.LowAgreement`: `vote_strength < manual_review.min_verdict_agreement`;
//! 4. `Eligible.ConflictFlag`: `conflict_flag` (today always `!label_match`, kept separate
//!    because the spec names it as its own signal);
//! 5. `Eligible.NeedsManualReview`: the observability flag; never stop-gradient.
//!
//! Otherwise `NotEligible.Stable`. A selection without a verdict (no format-ok candidate) is a
//! hard failure and never enters reflection: `NotEligible.NoValidCandidates`.
//!
//! The reflection priority orders cases when packing a reflection prompt, highest first:
//! 3 = contradiction, 2 = every format-ok candidate disagrees with `gt`, 1 = the final verdict
//! mismatches, 0 = otherwise.

use crate::decide::selection::Selection;
use serde::{Deserialize, Serialize};
use stageb_shared::domain::Verdict;

/// One eligibility signal, in precedence order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum EligibilityReason {
    LabelMismatch,
    Contradiction,
    LowAgreement,
    ConflictFlag,
    NeedsManualReview,
}

impl EligibilityReason {
    pub fn rule_hit(self) -> &'static str {
        match self {
            EligibilityReason::LabelMismatch => "Eligible.LabelMismatch",
            EligibilityReason::Contradiction => "Eligible.Contradiction",
            EligibilityReason::LowAgreement => "Eligible.LowAgreement",
            EligibilityReason::ConflictFlag => "Eligible.ConflictFlag",
            EligibilityReason::NeedsManualReview => "Eligible.NeedsManualReview",
        }
    }
}

/// Rule id of a stable (not eligible) ticket.
pub const NOT_ELIGIBLE_STABLE: &str = "NotEligible.Stable";
/// Rule id of a ticket without a selected verdict (hard failure).
pub const NOT_ELIGIBLE_NO_VALID_CANDIDATES: &str = "NotEligible.NoValidCandidates";

/// The inputs of the decision, as they appear in a `selections.jsonl` row, so an auditor can
/// rebuild them from artifacts without re-running selection.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EligibilitySignals {
    pub has_verdict: bool,
    pub label_match: bool,
    pub rollout_contradiction: bool,
    pub low_agreement: bool,
    pub conflict_flag: bool,
    pub needs_manual_review: bool,
    /// Format-ok candidates whose verdict equals `gt_label`.
    pub candidates_matching_gt: u32,
    /// Format-ok candidates.
    pub valid_candidates: u32,
}

impl EligibilitySignals {
    pub fn from_selection(selection: &Selection, gt: Verdict) -> Self {
        EligibilitySignals {
            has_verdict: selection.verdict.is_some(),
            label_match: selection.label_match,
            rollout_contradiction: selection.rollout_contradiction,
            low_agreement: selection.low_agreement,
            conflict_flag: selection.conflict_flag,
            needs_manual_review: selection.needs_manual_review,
            candidates_matching_gt: selection.vote_counts.of(gt),
            valid_candidates: selection.vote_counts.valid(),
        }
    }
}

/// The eligibility decision for one ticket (a reader takes a key missing from a row as its
/// default).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Eligibility {
    pub eligible: bool,
    /// Every reason that holds, in precedence order.
    pub reasons: Vec<EligibilityReason>,
    pub rule_hit: String,
    pub explanation: String,
    /// 3 contradiction, 2 all candidates wrong, 1 final mismatch, 0 otherwise.
    pub reflection_priority: u8,
}

/// Decide eligibility from a selection.
pub fn assess(selection: &Selection, gt: Verdict) -> Eligibility {
    assess_signals(&EligibilitySignals::from_selection(selection, gt))
}

/// Decide eligibility from the signals (the pure core of [`assess`]).
pub fn assess_signals(s: &EligibilitySignals) -> Eligibility {
    let reflection_priority = reflection_priority(s);
    if !s.has_verdict {
        return Eligibility {
            eligible: false,
            reasons: Vec::new(),
            rule_hit: NOT_ELIGIBLE_NO_VALID_CANDIDATES.to_string(),
            explanation: format!(
                "No selected verdict; hard failures never enter reflection (rule {NOT_ELIGIBLE_NO_VALID_CANDIDATES})."
            ),
            reflection_priority: 0,
        };
    }
    let checks = [
        (EligibilityReason::LabelMismatch, !s.label_match),
        (EligibilityReason::Contradiction, s.rollout_contradiction),
        (EligibilityReason::LowAgreement, s.low_agreement),
        (EligibilityReason::ConflictFlag, s.conflict_flag),
        (EligibilityReason::NeedsManualReview, s.needs_manual_review),
    ];
    let reasons: Vec<EligibilityReason> = checks
        .iter()
        .filter(|(_, on)| *on)
        .map(|(r, _)| *r)
        .collect();
    match reasons.first() {
        Some(primary) => {
            let names: Vec<&str> = reasons.iter().map(|r| r.rule_hit()).collect();
            Eligibility {
                eligible: true,
                rule_hit: primary.rule_hit().to_string(),
                explanation: format!(
                    "Gradient candidate: {} (rule {}).",
                    names.join(", "),
                    primary.rule_hit()
                ),
                reasons,
                reflection_priority,
            }
        }
        None => Eligibility {
            eligible: false,
            reasons,
            rule_hit: NOT_ELIGIBLE_STABLE.to_string(),
            explanation: format!(
                "Label matches, votes agree and no review flag (rule {NOT_ELIGIBLE_STABLE})."
            ),
            reflection_priority,
        },
    }
}

fn reflection_priority(s: &EligibilitySignals) -> u8 {
    if !s.has_verdict {
        0
    } else if s.rollout_contradiction {
        3
    } else if s.valid_candidates > 0 && s.candidates_matching_gt == 0 {
        2
    } else if !s.label_match {
        1
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::fail_first::{MissionEvidence, extract_mission_evidence};
    use crate::decide::selection::{VoteCandidate, select};
    use EligibilityReason::*;
    use Verdict::{Fail, Pass};

    fn sel(verdicts: &[Verdict], gt: Verdict) -> Selection {
        let c: Vec<VoteCandidate> = verdicts
            .iter()
            .enumerate()
            .map(|(i, v)| VoteCandidate {
                candidate_index: i as u32,
                temperature: 0.1 * i as f32,
                verdict: Some(*v),
                reason: "r".into(),
            })
            .collect();
        select(&c, &MissionEvidence::default(), gt, 0.67)
    }

    #[test]
    fn stable_correct_ticket_is_not_eligible() {
        let e = assess(&sel(&[Pass, Pass, Pass], Pass), Pass);
        assert!(!e.eligible);
        assert_eq!(e.rule_hit, NOT_ELIGIBLE_STABLE);
        assert_eq!(e.reflection_priority, 0);
    }

    #[test]
    fn correct_final_verdict_with_contradiction_is_still_eligible() {
        // Original test: _is_gradient_candidate(label_match=True, verdicts=[pass, fail]) is True.
        let e = assess(&sel(&[Pass, Fail, Pass], Pass), Pass);
        assert!(e.eligible);
        assert_eq!(e.rule_hit, "Eligible.Contradiction");
        assert_eq!(
            e.reasons,
            vec![Contradiction, LowAgreement, NeedsManualReview]
        );
        assert_eq!(e.reflection_priority, 3);
    }

    #[test]
    fn all_wrong_is_mismatch_with_priority_two() {
        let e = assess(&sel(&[Pass, Pass, Pass], Fail), Fail);
        assert_eq!(e.rule_hit, "Eligible.LabelMismatch");
        assert_eq!(e.reasons, vec![LabelMismatch, ConflictFlag]);
        assert_eq!(e.reflection_priority, 2);
    }

    #[test]
    fn mismatch_after_override_is_measured_on_the_final_verdict() {
        // All candidates say pass, the guardrail forces fail, gt is fail: label matches.
        let ev = extract_mission_evidence(&[("image_1".into(), "光纤/缺失".into())], "光纤");
        let c = [VoteCandidate {
            candidate_index: 0,
            temperature: 0.1,
            verdict: Some(Pass),
            reason: "r".into(),
        }];
        let s = select(&c, &ev, Fail, 0.67);
        let e = assess(&s, Fail);
        assert!(!e.eligible, "{e:?}");
        // ... and gt pass now mismatches although every candidate said pass.
        let s = select(&c, &ev, Pass, 0.67);
        let e = assess(&s, Pass);
        assert_eq!(e.rule_hit, "Eligible.LabelMismatch");
        assert_eq!(e.reflection_priority, 1);
    }

    #[test]
    fn low_agreement_alone_is_eligible() {
        let s = EligibilitySignals {
            has_verdict: true,
            label_match: true,
            rollout_contradiction: false,
            low_agreement: true,
            conflict_flag: false,
            needs_manual_review: false,
            candidates_matching_gt: 1,
            valid_candidates: 1,
        };
        let e = assess_signals(&s);
        assert_eq!(e.rule_hit, "Eligible.LowAgreement");
        assert_eq!(
            e.explanation,
            "Gradient candidate: Eligible.LowAgreement (rule Eligible.LowAgreement)."
        );
    }

    #[test]
    fn needs_manual_review_alone_is_eligible_not_stop_gradient() {
        let ev = extract_mission_evidence(&[("image_1".into(), "光纤/模糊".into())], "光纤");
        let c = [VoteCandidate {
            candidate_index: 0,
            temperature: 0.1,
            verdict: Some(Pass),
            reason: "r".into(),
        }];
        let e = assess(&select(&c, &ev, Pass, 0.67), Pass);
        assert!(e.eligible);
        assert_eq!(e.reasons, vec![NeedsManualReview]);
        assert_eq!(e.rule_hit, "Eligible.NeedsManualReview");
    }

    #[test]
    fn no_valid_candidates_never_enters_reflection() {
        let c = [VoteCandidate {
            candidate_index: 0,
            temperature: 0.1,
            verdict: None,
            reason: String::new(),
        }];
        let e = assess(&select(&c, &MissionEvidence::default(), Pass, 0.67), Pass);
        assert!(!e.eligible);
        assert_eq!(e.rule_hit, NOT_ELIGIBLE_NO_VALID_CANDIDATES);
    }
}
