//! The per-ticket checks: one selection per ticket and epoch, one trajectory row per candidate
//! with an honest parse, malformed candidates ↔ failure rows, and every selection re-derived
//! from its candidates (vote counts, verdict, strength, `label_match`) and its signals
//! (eligibility).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;
use stageb_coordinator::artifacts::files;
use stageb_coordinator::decide::eligibility;
use stageb_shared::contract;
use stageb_shared::domain::Verdict;

use super::rows::for_each_row;
use super::{AuditReport, RunFacts, verdict_of};

/// What the checks keep of a selection row.
pub struct Selection {
    pub line: usize,
    pub group_id: Option<String>,
    pub gt: Option<Verdict>,
    pub result: Value,
    pub eligibility: Value,
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
    report.selections = for_each_row(report, dir, files::SELECTIONS, |report, line, row| {
        let epoch = row["epoch"].as_u64().unwrap_or(0);
        let key = row["ticket_key"].as_str().unwrap_or("").to_string();
        let selection = Selection {
            line,
            group_id: row["group_id"].as_str().map(str::to_string),
            gt: verdict_of(&row["gt_label"]),
            result: row["result"].clone(),
            eligibility: row["eligibility"].clone(),
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
    report.trajectories = for_each_row(report, dir, files::TRAJECTORIES, |report, line, row| {
        let epoch = row["epoch"].as_u64().unwrap_or(0);
        let key = row["ticket_key"].as_str().unwrap_or("").to_string();
        let r = &row["result"];
        let idx = r["candidate_index"].as_u64().unwrap_or(u64::MAX);
        check_parse(report, line, r);
        if !r["format_ok"].as_bool().unwrap_or(false) {
            out.malformed.insert((epoch, key.clone(), idx));
        }
        let seen = out.votes.entry((epoch, key.clone())).or_default();
        if seen.insert(idx, verdict_of(&r["verdict"])).is_some() {
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
fn check_parse(report: &mut AuditReport, line: usize, r: &Value) {
    let parsed = contract::parse(r["text"].as_str().unwrap_or(""));
    let format_ok = r["format_ok"].as_bool().unwrap_or(false);
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
        && (verdict_of(&r["verdict"]) != Some(p.verdict)
            || r["reason"].as_str() != Some(p.reason.as_str()))
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
            let Some(votes) = candidates.votes.get(&(*epoch, key.clone())) else {
                if sel.result["ineligible_reason"]
                    .as_str()
                    .is_none_or(|r| !r.starts_with("engine_error"))
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
            check_vote(report, key, sel, pass, fail);
            check_eligibility(report, key, sel, pass, fail);
        }
    }
}

/// Vote counts, the vote's verdict (majority, ties to fail) and its strength.
fn check_vote(report: &mut AuditReport, key: &str, sel: &Selection, pass: u64, fail: u64) {
    let r = &sel.result;
    let line = Some(sel.line);
    let counts = &r["vote_counts"];
    if counts["pass"].as_u64() != Some(pass) || counts["fail"].as_u64() != Some(fail) {
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
    if verdict_of(&r["vote_verdict"]) != vote_verdict {
        report.fail(
            "selection_rederived",
            files::SELECTIONS,
            line,
            format!("{key}: vote verdict differs (majority, ties to fail)"),
        );
    }
    if let Some(v) = vote_verdict {
        let strength = (if v == Verdict::Pass { pass } else { fail }) as f64 / (pass + fail) as f64;
        if r["vote_strength"]
            .as_f64()
            .is_none_or(|s| (s - strength).abs() > 1e-9)
        {
            report.fail(
                "selection_rederived",
                files::SELECTIONS,
                line,
                format!("{key}: vote_strength should be {strength}"),
            );
        }
    }
    let final_verdict = verdict_of(&r["verdict"]);
    if final_verdict.is_some() && r["label_match"].as_bool() != Some(final_verdict == sel.gt) {
        report.fail(
            "selection_rederived",
            files::SELECTIONS,
            line,
            format!("{key}: label_match inconsistent with the final verdict"),
        );
    }
}

/// Eligibility is a pure function of the row's own signals: recompute and compare.
fn check_eligibility(report: &mut AuditReport, key: &str, sel: &Selection, pass: u64, fail: u64) {
    let Some(gt) = sel.gt else {
        return;
    };
    let r = &sel.result;
    let flag = |k: &str| r[k].as_bool().unwrap_or(false);
    let signals = eligibility::EligibilitySignals {
        has_verdict: verdict_of(&r["verdict"]).is_some(),
        label_match: flag("label_match"),
        rollout_contradiction: flag("rollout_contradiction"),
        low_agreement: flag("low_agreement"),
        conflict_flag: flag("conflict_flag"),
        needs_manual_review: flag("needs_manual_review"),
        candidates_matching_gt: (if gt == Verdict::Pass { pass } else { fail }) as u32,
        valid_candidates: (pass + fail) as u32,
    };
    let expected = serde_json::to_value(eligibility::assess_signals(&signals)).unwrap_or_default();
    if sel.eligibility != expected {
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
    for_each_row(
        report,
        dir,
        files::FAILURE_MALFORMED,
        |report, line, row| {
            if row["reason"] != "format_error" {
                return;
            }
            let id = (
                row["epoch"].as_u64().unwrap_or(0),
                row["ticket_key"].as_str().unwrap_or("").to_string(),
                row["candidate_index"].as_u64().unwrap_or(u64::MAX),
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
