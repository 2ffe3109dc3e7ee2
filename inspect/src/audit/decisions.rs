//! The per-ticket checks: one selection per ticket and epoch, one trajectory row per candidate
//! with an honest parse, malformed candidates ↔ failure rows, and every selection re-derived
//! from its candidates (vote counts, verdict, strength, `label_match`) and its signals
//! (eligibility). The rows are read as rank 0's row types (`artifacts::rows`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use stageb_coordinator::artifacts::files;
use stageb_coordinator::artifacts::rows::{
    CandidateResult, FailureRow, SelectionResult, SelectionRow, TicketHead, TrajectoryRow,
    failure_reason,
};
use stageb_coordinator::decide::eligibility::{self, Eligibility};
use stageb_coordinator::decide::split::Split;
use stageb_shared::contract;
use stageb_shared::domain::Verdict;

use super::rows::{for_each_row, for_each_row_as};
use super::{AuditReport, RunFacts};

/// What the checks keep of a selection row.
pub struct Selection {
    pub line: usize,
    pub group_id: Option<String>,
    pub gt: Option<Verdict>,
    /// The row's `result` object as written: a [`SelectionResult`], read with
    /// [`Selection::decision`] (kept as JSON for `learning.rs`, which reads its verdict).
    pub result: Value,
    pub eligibility: Eligibility,
    pub split: Option<Split>,
}

impl Selection {
    /// The row's `result`, typed (it was read as a [`SelectionRow`] already, so it reads).
    pub fn decision(&self) -> SelectionResult {
        SelectionResult::deserialize(&self.result).unwrap_or_default()
    }
}

/// Selections by epoch, then ticket key.
pub type Selections = BTreeMap<u64, BTreeMap<String, Selection>>;

/// (epoch, ticket key, candidate index).
type CandidateId = (u64, String, u64);

/// What the checks keep of the trajectories: each candidate's parsed verdict, by ticket.
#[derive(Default)]
pub struct Candidates {
    votes: BTreeMap<(u64, String), BTreeMap<u64, Option<Verdict>>>,
    malformed: BTreeSet<CandidateId>,
}

/// Reads `selections.jsonl`: one row per ticket per epoch, for every ticket in every epoch.
pub fn read_selections(report: &mut AuditReport, dir: &Path, run: &RunFacts) -> Selections {
    let mut by_epoch = Selections::new();
    report.selections = for_each_row(report, dir, files::SELECTIONS, |report, line, mut row| {
        let typed = match SelectionRow::deserialize(&row) {
            Ok(typed) => typed,
            Err(e) => {
                return report.fail("jsonl_parse", files::SELECTIONS, Some(line), e.to_string());
            }
        };
        let (epoch, key) = (u64::from(typed.ticket.epoch), typed.ticket.ticket_key);
        let selection = Selection {
            line,
            group_id: Some(typed.ticket.group_id).filter(|g| !g.is_empty()),
            gt: typed.ticket.gt_label,
            result: row["result"].take(),
            eligibility: typed.eligibility,
            split: typed.split,
        };
        let epoch_rows = by_epoch.entry(epoch).or_default();
        if epoch_rows.insert(key.clone(), selection).is_some() {
            report.fail(
                "one_selection_per_ticket",
                files::SELECTIONS,
                Some(line),
                format!("{key} selected twice in epoch {epoch}"),
            );
        }
    });
    for epoch in 1..=run.config.runner.epochs as u64 {
        let n = by_epoch.get(&epoch).map_or(0, BTreeMap::len);
        if n != run.tickets {
            report.fail(
                "one_selection_per_ticket",
                files::SELECTIONS,
                None,
                format!(
                    "epoch {epoch} has {n} selections for {} tickets",
                    run.tickets
                ),
            );
        }
    }
    by_epoch
}

/// Reads `trajectories.jsonl`: each row's `format_ok`/`verdict`/`reason` must be what the
/// contract parser says of its raw text, and each candidate appears once.
pub fn read_trajectories(report: &mut AuditReport, dir: &Path) -> Candidates {
    let mut out = Candidates::default();
    let trajectories = files::TRAJECTORIES;
    report.trajectories = for_each_row_as(report, dir, trajectories, |report, line, row| {
        let TrajectoryRow {
            ticket:
                TicketHead {
                    epoch,
                    ticket_key: key,
                    ..
                },
            result: r,
            ..
        } = row;
        let (epoch, idx) = (u64::from(epoch), u64::from(r.candidate_index));
        check_parse(report, line, &r);
        if !r.format_ok {
            out.malformed.insert((epoch, key.clone(), idx));
        }
        let seen = out.votes.entry((epoch, key.clone())).or_default();
        if seen.insert(idx, r.verdict).is_some() {
            report.fail(
                "one_row_per_candidate",
                files::TRAJECTORIES,
                Some(line),
                format!("{key} candidate {idx} twice"),
            );
        }
    });
    out
}

/// A trajectory's recorded parse equals the contract parser's verdict on its text.
fn check_parse(report: &mut AuditReport, line: usize, r: &CandidateResult) {
    let parsed = contract::parse(&r.text);
    let format_ok = r.format_ok;
    if parsed.is_ok() != format_ok {
        report.fail(
            "trajectory_parse",
            files::TRAJECTORIES,
            Some(line),
            format!(
                "format_ok={format_ok} but the parser says {}",
                parsed.is_ok()
            ),
        );
    }
    if let Ok(p) = &parsed
        && (r.verdict != Some(p.verdict) || r.reason != p.reason)
    {
        report.fail(
            "trajectory_parse",
            files::TRAJECTORIES,
            Some(line),
            "verdict/reason differ from the parsed text",
        );
    }
}

/// Every selection re-derived from its candidates and its own signals.
pub fn rederive_selections(
    report: &mut AuditReport,
    run: &RunFacts,
    selections: &Selections,
    candidates: &Candidates,
) {
    let per_ticket = run.config.candidates_per_ticket() as usize;
    for (epoch, by_key) in selections {
        for (key, sel) in by_key {
            let decision = sel.decision();
            let Some(votes) = candidates.votes.get(&(*epoch, key.clone())) else {
                if decision
                    .ineligible_reason
                    .as_deref()
                    .is_none_or(|r| !r.starts_with(failure_reason::ENGINE_ERROR))
                {
                    report.fail(
                        "one_row_per_candidate",
                        files::TRAJECTORIES,
                        None,
                        format!("{key} epoch {epoch} has no candidates"),
                    );
                }
                continue;
            };
            if votes.len() != per_ticket {
                report.fail(
                    "one_row_per_candidate",
                    files::TRAJECTORIES,
                    None,
                    format!(
                        "{key} epoch {epoch}: {} candidates, expected {per_ticket}",
                        votes.len()
                    ),
                );
            }
            let count = |v: Verdict| votes.values().filter(|x| **x == Some(v)).count() as u64;
            let (pass, fail) = (count(Verdict::Pass), count(Verdict::Fail));
            check_vote(report, key, sel, &decision, (pass, fail));
            check_eligibility(report, key, sel, &decision, (pass, fail));
        }
    }
}

/// Vote counts, the vote's verdict (majority, ties to fail) and its strength.
fn check_vote(
    report: &mut AuditReport,
    key: &str,
    sel: &Selection,
    decision: &SelectionResult,
    (pass, fail): (u64, u64),
) {
    let r = &decision.selection;
    let line = Some(sel.line);
    let counts = r.vote_counts;
    if u64::from(counts.pass) != pass || u64::from(counts.fail) != fail {
        report.fail(
            "selection_rederived",
            files::SELECTIONS,
            line,
            format!("{key}: vote counts differ from trajectories ({pass} pass, {fail} fail)"),
        );
    }
    let vote_verdict = if pass + fail == 0 {
        None
    } else if pass > fail {
        Some(Verdict::Pass)
    } else {
        Some(Verdict::Fail)
    };
    if r.vote_verdict != vote_verdict {
        report.fail(
            "selection_rederived",
            files::SELECTIONS,
            line,
            format!("{key}: vote verdict differs (majority, ties to fail)"),
        );
    }
    if let Some(v) = vote_verdict {
        let strength = (if v == Verdict::Pass { pass } else { fail }) as f64 / (pass + fail) as f64;
        if r.vote_strength.is_none_or(|s| (s - strength).abs() > 1e-9) {
            report.fail(
                "selection_rederived",
                files::SELECTIONS,
                line,
                format!("{key}: vote_strength should be {strength}"),
            );
        }
    }
    let final_verdict = r.verdict;
    if final_verdict.is_some() && r.label_match != (final_verdict == sel.gt) {
        report.fail(
            "selection_rederived",
            files::SELECTIONS,
            line,
            format!("{key}: label_match inconsistent with the final verdict"),
        );
    }
}

/// Eligibility is a pure function of the row's own signals: recompute and compare.
fn check_eligibility(
    report: &mut AuditReport,
    key: &str,
    sel: &Selection,
    decision: &SelectionResult,
    (pass, fail): (u64, u64),
) {
    let Some(gt) = sel.gt else {
        return;
    };
    let r = &decision.selection;
    let signals = eligibility::EligibilitySignals {
        has_verdict: r.verdict.is_some(),
        label_match: r.label_match,
        rollout_contradiction: r.rollout_contradiction,
        low_agreement: r.low_agreement,
        conflict_flag: r.conflict_flag,
        needs_manual_review: r.needs_manual_review,
        candidates_matching_gt: (if gt == Verdict::Pass { pass } else { fail }) as u32,
        valid_candidates: (pass + fail) as u32,
    };
    if sel.eligibility != eligibility::assess_signals(&signals) {
        report.fail(
            "eligibility_rederived",
            files::SELECTIONS,
            Some(sel.line),
            format!("{key}: eligibility differs from its signals"),
        );
    }
}

/// Every malformed candidate has its `failure_malformed.jsonl` row, and every such row names a
/// malformed candidate.
pub fn check_failure_rows(report: &mut AuditReport, dir: &Path, candidates: &Candidates) {
    let mut logged = BTreeSet::new();
    for_each_row_as(
        report,
        dir,
        files::FAILURE_MALFORMED,
        |report, line, row: FailureRow| {
            if row.reason != failure_reason::FORMAT_ERROR {
                return;
            }
            let id = (
                u64::from(row.epoch),
                row.ticket_key,
                row.candidate_index.map_or(u64::MAX, u64::from),
            );
            if !candidates.malformed.contains(&id) {
                report.fail(
                    "failure_malformed",
                    files::FAILURE_MALFORMED,
                    Some(line),
                    "format_error row for a candidate that is not malformed",
                );
            }
            logged.insert(id);
        },
    );
    for (epoch, key, idx) in candidates.malformed.difference(&logged) {
        report.fail(
            "failure_malformed",
            files::FAILURE_MALFORMED,
            None,
            format!("malformed candidate {key} #{idx} (epoch {epoch}) not logged"),
        );
    }
}
