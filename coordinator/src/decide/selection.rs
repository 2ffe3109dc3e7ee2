//! One verdict per ticket: majority vote over format-ok candidates, then the mission-scoped
//! fail-first override (evidence of a failure in Stage-A overrides a passing vote).
//!
//! The decision is a pure function of its inputs and carries a `rule_hit` id and a template
//! explanation (seed 000): no free text beyond values.
//!
//! Order of reasoning, each step fixed:
//! 1. Pool = candidates with a verdict (malformed ones are logged elsewhere and excluded).
//!    No pool → `Selection.NoValidCandidates` (a hard failure for the runtime, never
//!    need-review).
//! 2. Candidates are ordered by `(temperature, candidate_index)`.
//! 3. Majority verdict; a tie goes to `fail` (fail-first, warning `tied_vote`). The selected
//!    candidate is the first in order with the chosen verdict.
//! 4. `vote_strength` = share of the chosen verdict, computed *before* overrides.
//! 5. Overrides from [`MissionEvidence`]: relevant hits force `fail` (reason rewritten from a
//!    template only when the verdict flipped: a model's own `fail` reason is more informative
//!    than the template); irrelevant and pending hits only flag manual review.
//! 6. `label_match` and `conflict_flag` from the final verdict; the final reason is sanitized.
//!
//! Deliberate difference from the original: the `label_mismatch` warning reflects the *final*
//! verdict only (the original could emit it for the pre-override vote and still report
//! `label_match=true`).

use crate::decide::fail_first::{MissionEvidence, SignalHit};
use serde::{Deserialize, Serialize};
use stageb_shared::digest::digest_of;
use stageb_shared::domain::Verdict;
use stageb_shared::text::{self, THIRD_STATE_ROLLOUT};
use std::cmp::Ordering;

/// One candidate as seen by the vote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VoteCandidate {
    pub candidate_index: u32,
    pub temperature: f32,
    /// `None` = malformed (not format-ok): excluded from the vote.
    pub verdict: Option<Verdict>,
    pub reason: String,
}

/// The fixed rule ids of a selection.
pub mod rule {
    pub const MAJORITY: &str = "Selection.Majority";
    pub const TIE_FAIL_FIRST: &str = "Selection.TieFailFirst";
    pub const OVERRIDE_FAIL_FIRST: &str = "Selection.Override.FailFirst";
    pub const NO_VALID_CANDIDATES: &str = "Selection.NoValidCandidates";
}

/// Warning vocabulary of the original's `selections.jsonl`.
pub mod warning {
    pub const TIED_VOTE: &str = "tied_vote";
    pub const LOW_AGREEMENT: &str = "low_agreement";
    pub const ROLLOUT_CONTRADICTION: &str = "rollout_contradiction";
    pub const FAIL_FIRST_IRRELEVANT_HIT: &str = "fail_first_irrelevant_hit";
    pub const PENDING_SIGNAL_HIT: &str = "pending_signal_hit";
    pub const FAIL_FIRST_OVERRIDE: &str = "fail_first_override";
    pub const LABEL_MISMATCH: &str = "label_mismatch";
}

/// Reason used when the selected reason is empty or contains third-state wording.
pub const FALLBACK_REASON_PASS: &str = "摘要中有覆盖任务要点的支持通过的依据，判通过。";
/// Reason used when the selected reason is empty or contains third-state wording.
pub const FALLBACK_REASON_FAIL: &str = "摘要中存在与任务要点相关的问题或关键点无法确认，判不通过。";

/// How many hits the override reason quotes.
pub const OVERRIDE_REASON_MAX_HITS: usize = 3;

/// Vote counts over format-ok candidates (`malformed` = candidates without a verdict).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoteCounts {
    pub pass: u32,
    pub fail: u32,
    pub malformed: u32,
}

impl VoteCounts {
    pub fn valid(&self) -> u32 {
        self.pass + self.fail
    }

    pub fn of(&self, verdict: Verdict) -> u32 {
        match verdict {
            Verdict::Pass => self.pass,
            Verdict::Fail => self.fail,
        }
    }
}

/// The selected outcome of one ticket. Field names follow the original's `selections.jsonl`
/// `result` object; `rule_hit`, `explanation`, `vote_counts`, `vote_verdict`, `fail_first_hits`
/// and `inputs_digest` are stageb's audit additions. A reader takes a key missing from a row
/// as its default (see [`crate::artifacts::rows`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Selection {
    /// Final verdict after overrides; `None` only for `Selection.NoValidCandidates`.
    pub verdict: Option<Verdict>,
    /// Final, sanitized reason (never third-state, never empty when a verdict exists).
    pub reason: String,
    /// Share of the vote winner among format-ok candidates, before overrides.
    pub vote_strength: Option<f64>,
    pub label_match: bool,
    /// The vote winner's `candidate_index` (the override does not change it).
    pub selected_candidate: Option<u32>,
    pub warnings: Vec<String>,
    pub conflict_flag: bool,
    pub needs_manual_review: bool,
    /// The original's alias of `needs_manual_review`, kept for existing tooling.
    pub manual_review_recommended: bool,
    pub low_agreement: bool,
    /// Both verdicts among format-ok candidates.
    pub rollout_contradiction: bool,
    pub vote_counts: VoteCounts,
    /// The vote's verdict before overrides.
    pub vote_verdict: Option<Verdict>,
    /// The relevant hits that forced `fail` (empty when none).
    pub fail_first_hits: Vec<SignalHit>,
    pub rule_hit: String,
    pub explanation: String,
    /// `sha256` of the canonical JSON of the inputs (see [`selection_inputs_digest`]).
    pub inputs_digest: String,
}

#[derive(Serialize)]
struct SelectionInputs<'a> {
    candidates: &'a [VoteCandidate],
    evidence: &'a MissionEvidence,
    gt: Verdict,
    min_verdict_agreement: f64,
}

/// The digest stored in [`Selection::inputs_digest`], so an auditor can check that a row was
/// computed from the candidates and evidence it claims.
pub fn selection_inputs_digest(
    candidates: &[VoteCandidate],
    evidence: &MissionEvidence,
    gt: Verdict,
    min_verdict_agreement: f64,
) -> String {
    digest_of(&SelectionInputs {
        candidates,
        evidence,
        gt,
        min_verdict_agreement,
    })
}

/// Select one verdict for a ticket. See the module documentation for the rules.
pub fn select(
    candidates: &[VoteCandidate],
    evidence: &MissionEvidence,
    gt: Verdict,
    min_verdict_agreement: f64,
) -> Selection {
    let inputs_digest = selection_inputs_digest(candidates, evidence, gt, min_verdict_agreement);
    let mut pool: Vec<(&VoteCandidate, Verdict)> = candidates
        .iter()
        .filter_map(|c| c.verdict.map(|v| (c, v)))
        .collect();
    pool.sort_by(|a, b| candidate_order(a.0, b.0));
    let counts = VoteCounts {
        pass: pool.iter().filter(|(_, v)| *v == Verdict::Pass).count() as u32,
        fail: pool.iter().filter(|(_, v)| *v == Verdict::Fail).count() as u32,
        malformed: (candidates.len() - pool.len()) as u32,
    };

    if pool.is_empty() {
        return Selection {
            verdict: None,
            reason: String::new(),
            vote_strength: None,
            label_match: false,
            selected_candidate: None,
            warnings: Vec::new(),
            conflict_flag: true,
            needs_manual_review: false,
            manual_review_recommended: false,
            low_agreement: false,
            rollout_contradiction: false,
            vote_counts: counts,
            vote_verdict: None,
            fail_first_hits: Vec::new(),
            rule_hit: rule::NO_VALID_CANDIDATES.to_string(),
            explanation: format!(
                "No format-ok candidate among {} (rule {}).",
                candidates.len(),
                rule::NO_VALID_CANDIDATES
            ),
            inputs_digest,
        };
    }

    let tied = counts.pass == counts.fail;
    let vote_verdict = if tied || counts.fail > counts.pass {
        Verdict::Fail
    } else {
        Verdict::Pass
    };
    let (winner, _) = pool
        .iter()
        .find(|(_, v)| *v == vote_verdict)
        .copied()
        .expect("the chosen verdict has at least one vote");
    let vote_strength = f64::from(counts.of(vote_verdict)) / f64::from(counts.valid());
    let low_agreement = vote_strength < min_verdict_agreement;
    let rollout_contradiction = counts.pass > 0 && counts.fail > 0;

    let mut warnings: Vec<&str> = Vec::new();
    if tied {
        warnings.push(warning::TIED_VOTE);
    }
    if low_agreement {
        warnings.push(warning::LOW_AGREEMENT);
    }
    if rollout_contradiction {
        warnings.push(warning::ROLLOUT_CONTRADICTION);
    }
    if !evidence.irrelevant_hits.is_empty() {
        warnings.push(warning::FAIL_FIRST_IRRELEVANT_HIT);
    }
    if !evidence.pending_hits.is_empty() {
        warnings.push(warning::PENDING_SIGNAL_HIT);
    }
    let flipped = !evidence.relevant_hits.is_empty() && vote_verdict == Verdict::Pass;
    let (verdict, raw_reason) = if flipped {
        warnings.push(warning::FAIL_FIRST_OVERRIDE);
        (Verdict::Fail, override_reason(&evidence.relevant_hits))
    } else {
        (vote_verdict, winner.reason.clone())
    };
    let label_match = verdict == gt;
    if !label_match {
        warnings.push(warning::LABEL_MISMATCH);
    }
    let needs_manual_review = low_agreement
        || rollout_contradiction
        || !evidence.irrelevant_hits.is_empty()
        || !evidence.pending_hits.is_empty();

    let (rule_hit, explanation) = if flipped {
        (
            rule::OVERRIDE_FAIL_FIRST,
            format!(
                "Vote chose pass ({}/{}); {} relevant fail-first hit(s) forced fail (rule {}).",
                counts.pass,
                counts.valid(),
                evidence.relevant_hits.len(),
                rule::OVERRIDE_FAIL_FIRST
            ),
        )
    } else if tied {
        (
            rule::TIE_FAIL_FIRST,
            format!(
                "Tied vote pass={} fail={}; fail-first tie-break chose fail (rule {}).",
                counts.pass,
                counts.fail,
                rule::TIE_FAIL_FIRST
            ),
        )
    } else {
        (
            rule::MAJORITY,
            format!(
                "Majority chose {} with {}/{} format-ok votes (rule {}).",
                vote_verdict,
                counts.of(vote_verdict),
                counts.valid(),
                rule::MAJORITY
            ),
        )
    };

    Selection {
        verdict: Some(verdict),
        reason: sanitize_reason(&raw_reason, verdict),
        vote_strength: Some(vote_strength),
        label_match,
        selected_candidate: Some(winner.candidate_index),
        warnings: warnings.into_iter().map(str::to_string).collect(),
        conflict_flag: !label_match,
        needs_manual_review,
        manual_review_recommended: needs_manual_review,
        low_agreement,
        rollout_contradiction,
        vote_counts: counts,
        vote_verdict: Some(vote_verdict),
        fail_first_hits: evidence.relevant_hits.clone(),
        rule_hit: rule_hit.to_string(),
        explanation,
        inputs_digest,
    }
}

/// `(temperature, candidate_index)` ascending; `total_cmp` so a NaN temperature still has a
/// fixed place (after every number) instead of making the sort order undefined.
fn candidate_order(a: &VoteCandidate, b: &VoteCandidate) -> Ordering {
    a.temperature
        .total_cmp(&b.temperature)
        .then(a.candidate_index.cmp(&b.candidate_index))
}

/// The override reason: up to [`OVERRIDE_REASON_MAX_HITS`] quoted hits and a fixed summary.
pub fn override_reason(hits: &[SignalHit]) -> String {
    let mut parts: Vec<String> = hits
        .iter()
        .take(OVERRIDE_REASON_MAX_HITS)
        .map(|h| format!("{}: {}", h.image_key, clean_clause(&h.clause)))
        .collect();
    parts.push("总结: 存在与任务要点相关的明确负项，判不通过。".to_string());
    parts.join("；")
}

/// A clause as quoted in a reason: counts stripped, the review marker dropped.
fn clean_clause(clause: &str) -> String {
    let c = crate::decide::fail_first::strip_counts(clause);
    let c = c
        .replace("需复核,备注:", "备注:")
        .replace("需复核，备注:", "备注:");
    c.replace("需复核", "")
}

/// Normalize the final reason; empty or third-state → the fixed fallback for the verdict.
pub fn sanitize_reason(reason: &str, verdict: Verdict) -> String {
    let r = text::normalize(reason);
    if r.is_empty() || text::find_third_state(&r, THIRD_STATE_ROLLOUT).is_some() {
        match verdict {
            Verdict::Pass => FALLBACK_REASON_PASS.to_string(),
            Verdict::Fail => FALLBACK_REASON_FAIL.to_string(),
        }
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::fail_first::extract_mission_evidence;
    use Verdict::{Fail, Pass};

    fn cand(idx: u32, temp: f32, v: Option<Verdict>, reason: &str) -> VoteCandidate {
        VoteCandidate {
            candidate_index: idx,
            temperature: temp,
            verdict: v,
            reason: reason.to_string(),
        }
    }

    fn none() -> MissionEvidence {
        MissionEvidence::default()
    }

    #[test]
    fn unanimous_majority_is_strong_and_matches() {
        let c = [
            cand(0, 0.1, Some(Pass), "a"),
            cand(1, 0.4, Some(Pass), "b"),
            cand(2, 0.7, Some(Pass), "c"),
        ];
        let s = select(&c, &none(), Pass, 0.67);
        assert_eq!(s.verdict, Some(Pass));
        assert_eq!(s.vote_strength, Some(1.0));
        assert_eq!(s.selected_candidate, Some(0));
        assert_eq!(s.reason, "a");
        assert_eq!(s.rule_hit, rule::MAJORITY);
        assert!(s.label_match && !s.conflict_flag && !s.low_agreement && !s.needs_manual_review);
        assert!(s.warnings.is_empty());
        assert_eq!(
            s.explanation,
            "Majority chose pass with 3/3 format-ok votes (rule Selection.Majority)."
        );
    }

    #[test]
    fn two_of_three_is_low_agreement_at_067_and_contradiction() {
        let c = [
            cand(0, 0.1, Some(Fail), "f"),
            cand(1, 0.4, Some(Pass), "p"),
            cand(2, 0.7, Some(Pass), "p2"),
        ];
        let s = select(&c, &none(), Pass, 0.67);
        assert_eq!(s.verdict, Some(Pass));
        assert_eq!(
            s.selected_candidate,
            Some(1),
            "first majority candidate in (temperature, index) order"
        );
        assert!(
            s.low_agreement
                && s.rollout_contradiction
                && s.needs_manual_review
                && s.manual_review_recommended
        );
        assert_eq!(s.warnings, vec!["low_agreement", "rollout_contradiction"]);
    }

    #[test]
    fn tie_goes_to_fail_first() {
        let c = [cand(0, 0.1, Some(Pass), "p"), cand(1, 0.4, Some(Fail), "f")];
        let s = select(&c, &none(), Pass, 0.8);
        assert_eq!(s.verdict, Some(Fail));
        assert_eq!(s.selected_candidate, Some(1));
        assert_eq!(s.rule_hit, rule::TIE_FAIL_FIRST);
        assert_eq!(s.vote_strength, Some(0.5));
        assert!(s.warnings.contains(&"tied_vote".to_string()));
        assert!(!s.label_match && s.conflict_flag);
        assert!(s.warnings.contains(&"label_mismatch".to_string()));
        // 1 pass / 1 fail with threshold 0.8 → needs manual review (original test).
        assert!(s.needs_manual_review);
    }

    #[test]
    fn candidates_are_ordered_by_temperature_then_index() {
        // Input order is irrelevant: the lowest temperature among the majority wins.
        let c = [
            cand(0, 0.7, Some(Fail), "hot"),
            cand(5, 0.1, Some(Fail), "cold"),
            cand(1, 0.1, Some(Pass), "p"),
        ];
        let s = select(&c, &none(), Fail, 0.5);
        assert_eq!(s.selected_candidate, Some(5));
        assert_eq!(s.reason, "cold");
        let c = [
            cand(3, 0.1, Some(Fail), "three"),
            cand(2, 0.1, Some(Fail), "two"),
        ];
        assert_eq!(select(&c, &none(), Fail, 0.5).selected_candidate, Some(2));
    }

    #[test]
    fn malformed_candidates_are_excluded_from_the_vote() {
        let c = [
            cand(0, 0.1, None, "garbage"),
            cand(1, 0.4, Some(Pass), "p"),
            cand(2, 0.7, Some(Pass), "p2"),
        ];
        let s = select(&c, &none(), Pass, 0.67);
        assert_eq!(s.vote_strength, Some(1.0));
        assert_eq!(
            s.vote_counts,
            VoteCounts {
                pass: 2,
                fail: 0,
                malformed: 1
            }
        );
        assert_eq!(s.selected_candidate, Some(1));
    }

    #[test]
    fn no_valid_candidates_is_a_hard_failure_not_review() {
        let c = [cand(0, 0.1, None, "x")];
        let s = select(&c, &none(), Pass, 0.67);
        assert_eq!(s.verdict, None);
        assert_eq!(s.rule_hit, rule::NO_VALID_CANDIDATES);
        assert!(!s.needs_manual_review);
        assert_eq!(s.vote_strength, None);
        let s = select(&[], &none(), Fail, 0.67);
        assert_eq!(s.rule_hit, rule::NO_VALID_CANDIDATES);
        assert_eq!(
            s.explanation,
            "No format-ok candidate among 0 (rule Selection.NoValidCandidates)."
        );
    }

    #[test]
    fn relevant_hit_overrides_pass_to_fail_with_template_reason() {
        let ev = extract_mission_evidence(&[("image_1".into(), "光纤/缺失×1".into())], "光纤");
        let c = [cand(0, 0.1, Some(Pass), "Image1: 光纤正常; 总结: 通过")];
        let s = select(&c, &ev, Fail, 0.67);
        assert_eq!(s.verdict, Some(Fail));
        assert_eq!(s.vote_verdict, Some(Pass));
        assert_eq!(
            s.vote_strength,
            Some(1.0),
            "vote strength is measured before the override"
        );
        assert_eq!(s.rule_hit, rule::OVERRIDE_FAIL_FIRST);
        assert!(s.warnings.contains(&"fail_first_override".to_string()));
        assert!(s.reason.contains("判不通过"), "{}", s.reason);
        assert!(s.reason.starts_with("image_1: 光纤/缺失"), "{}", s.reason);
        assert!(!s.reason.contains("需复核") && !s.reason.to_lowercase().contains("need-review"));
        assert!(s.label_match && !s.conflict_flag);
        assert_eq!(s.selected_candidate, Some(0));
        assert_eq!(s.fail_first_hits.len(), 1);
    }

    #[test]
    fn override_reason_quotes_at_most_three_hits() {
        let hits: Vec<SignalHit> = (1..=5)
            .map(|i| SignalHit {
                image_key: format!("image_{i}"),
                trigger: "缺失".into(),
                clause: "光纤/缺失".into(),
            })
            .collect();
        let r = override_reason(&hits);
        assert_eq!(r.matches("光纤/缺失").count(), 3);
        assert!(r.ends_with("判不通过。"));
    }

    #[test]
    fn relevant_hit_on_a_fail_vote_keeps_the_models_reason() {
        let ev = extract_mission_evidence(&[("image_1".into(), "光纤/缺失×1".into())], "光纤");
        let c = [cand(0, 0.1, Some(Fail), "光纤缺失，判不通过")];
        let s = select(&c, &ev, Fail, 0.67);
        assert_eq!(s.rule_hit, rule::MAJORITY);
        assert_eq!(s.reason, "光纤缺失，判不通过");
        assert!(!s.warnings.contains(&"fail_first_override".to_string()));
    }

    #[test]
    fn irrelevant_and_pending_hits_only_flag_review() {
        let ev =
            extract_mission_evidence(&[("image_1".into(), "标签/损坏，光纤/模糊".into())], "光纤");
        let c = [cand(0, 0.1, Some(Pass), "ok")];
        let s = select(&c, &ev, Pass, 0.67);
        assert_eq!(s.verdict, Some(Pass));
        assert!(s.needs_manual_review);
        assert_eq!(
            s.warnings,
            vec!["fail_first_irrelevant_hit", "pending_signal_hit"]
        );
    }

    #[test]
    fn single_pass_with_pending_summary_needs_review() {
        let ev = extract_mission_evidence(&[("image_1".into(), "无法确认".into())], "光纤");
        let s = select(&[cand(0, 0.1, Some(Pass), "ok")], &ev, Pass, 0.8);
        assert!(s.needs_manual_review);
    }

    #[test]
    fn single_clean_image_stays_pass_without_warnings() {
        let ev = extract_mission_evidence(
            &[("image_1".into(), "光纤/显示完整/符合要求×2".into())],
            "光纤",
        );
        let s = select(&[cand(0, 0.1, Some(Pass), "光纤完整")], &ev, Pass, 0.67);
        assert_eq!(s.verdict, Some(Pass));
        assert!(s.warnings.is_empty());
    }

    #[test]
    fn third_state_or_empty_reason_falls_back() {
        let s = select(
            &[cand(0, 0.1, Some(Pass), "通过但需複核")],
            &none(),
            Pass,
            0.67,
        );
        assert_eq!(s.reason, FALLBACK_REASON_PASS);
        let s = select(&[cand(0, 0.1, Some(Fail), "  \n ")], &none(), Fail, 0.67);
        assert_eq!(s.reason, FALLBACK_REASON_FAIL);
        let s = select(
            &[cand(0, 0.1, Some(Fail), "螺丝 松动\n判 不通过")],
            &none(),
            Fail,
            0.67,
        );
        assert_eq!(s.reason, "螺丝松动判不通过");
    }

    #[test]
    fn selection_is_deterministic_and_digest_tracks_inputs() {
        let c = [cand(0, 0.1, Some(Pass), "a"), cand(1, 0.4, Some(Fail), "b")];
        let a = select(&c, &none(), Pass, 0.67);
        let b = select(&c, &none(), Pass, 0.67);
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
        let other = select(&c, &none(), Fail, 0.67);
        assert_ne!(a.inputs_digest, other.inputs_digest);
        assert!(a.inputs_digest.starts_with("sha256:"));
    }
}
