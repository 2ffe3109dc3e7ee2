//! The checks of what the run learned and reported: the need-review files, the metrics epoch
//! rows (with their checked predictions, `splits.rs`), every reflection cycle (read with the reflector's own row type, [`ReflectionRow`]:
//! stop-gradient isolation, evidence ⊆ learnable, coverage, no label in rule texts) and the
//! guidance chain.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use serde_json::Value;
use stageb_coordinator::artifacts::files;
use stageb_coordinator::decide::accuracy;
use stageb_coordinator::guidance;
use stageb_coordinator::learn::need_review::{self, NeedReviewRow};
use stageb_coordinator::learn::reflection::ReflectionRow;
use stageb_shared::domain::{TicketKey, Verdict};

use super::decisions::Selections;
use super::rows::for_each_row;
use super::splits::Claims;
use super::{AuditReport, RunFacts, verdict_of};

/// `need_review.json` is the aggregation of the queue. Returns the queue's rows.
pub fn check_need_review(
    report: &mut AuditReport,
    dir: &Path,
    run: &RunFacts,
) -> Vec<NeedReviewRow> {
    let mut rows = Vec::new();
    let mut unreadable = false;
    for_each_row(
        report,
        dir,
        files::NEED_REVIEW_QUEUE,
        |_, _, row| match serde_json::from_value(row) {
            Ok(r) => rows.push(r),
            Err(_) => unreadable = true,
        },
    );
    if unreadable {
        report.fail(
            "need_review",
            files::NEED_REVIEW_QUEUE,
            None,
            "rows that do not match the schema",
        );
    }
    let written = fs::read(dir.join(files::NEED_REVIEW))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    let Some(written) = written else {
        report.fail(
            "need_review",
            files::NEED_REVIEW,
            None,
            "missing or not JSON",
        );
        return rows;
    };
    let expected = serde_json::to_value(need_review::aggregate(
        &run.mission,
        &rows,
        run.config.runner.epochs,
    ))
    .unwrap_or_default();
    if written != expected {
        report.fail(
            "need_review",
            files::NEED_REVIEW,
            None,
            "differs from the aggregation of need_review_queue.jsonl",
        );
    }
    rows
}

/// Metrics epoch rows recomputed from the selections and the epoch's need-review routing.
pub fn check_metrics(
    report: &mut AuditReport,
    dir: &Path,
    selections: &Selections,
    queue: &[NeedReviewRow],
    claims: &Claims,
) {
    let mut epoch_rows = Vec::new();
    for_each_row(report, dir, files::METRICS, |_, line, row| {
        if row["event"] == "epoch_end" {
            epoch_rows.push((line, row));
        }
    });
    for (line, row) in epoch_rows {
        let epoch = row["epoch"].as_u64().unwrap_or(0);
        let Some(by_key) = selections.get(&epoch) else {
            continue;
        };
        let routed: BTreeSet<&TicketKey> = queue
            .iter()
            .filter(|q| q.epoch as u64 == epoch)
            .map(|q| &q.ticket_key)
            .collect();
        let mut ordered: Vec<(&String, &super::decisions::Selection)> = by_key.iter().collect();
        ordered.sort_by_key(|(_, s)| s.line);
        let outcomes: Vec<accuracy::Outcome> = ordered
            .into_iter()
            .map(|(key, s)| {
                let key = TicketKey(key.clone());
                let verdict = verdict_of(&s.result["verdict"]);
                accuracy::Outcome {
                    in_manual_review: verdict.is_none() || routed.contains(&key),
                    ticket_key: key,
                    gt: s.gt.unwrap_or(Verdict::Fail),
                    verdict,
                    split: s.split,
                }
            })
            .collect();
        let expected = [
            (
                "include_manual_review",
                serde_json::to_value(accuracy::counts(&outcomes, accuracy::ManualReview::Include)),
            ),
            (
                "exclude_manual_review",
                serde_json::to_value(accuracy::counts(&outcomes, accuracy::ManualReview::Exclude)),
            ),
            (
                "splits",
                serde_json::to_value(accuracy::split_counts(&outcomes)),
            ),
        ];
        for (name, expected) in expected {
            let expected = expected.unwrap_or_default();
            if row[name] != expected {
                report.fail(
                    "metrics_recomputed",
                    files::METRICS,
                    Some(line),
                    format!(
                        "epoch {epoch} {name}: written {} ≠ recomputed {expected}",
                        row[name]
                    ),
                );
            }
        }
        super::splits::check_row_predictions(report, line, &row, claims, selections);
    }
}

/// Every reflection cycle: the row matches the row type, learnable ∩ stop-gradient = ∅,
/// coverage from the applied ops only, applied evidence ⊆ learnable, no accepted rule text
/// naming a group id or a label. Returns whether any cycle applied a change.
pub fn check_reflections(
    report: &mut AuditReport,
    dir: &Path,
    group_ids: &BTreeSet<String>,
) -> bool {
    let mut any_applied = false;
    report.reflection_cycles = for_each_row(report, dir, files::REFLECTION, |report, line, row| {
        match serde_json::from_value::<ReflectionRow>(row) {
            Ok(row) => {
                any_applied |= row.applied();
                check_cycle(report, line, &row, group_ids);
            }
            Err(e) => report.fail(
                "reflection_row",
                files::REFLECTION,
                Some(line),
                format!("does not match the row schema: {e}"),
            ),
        }
    });
    any_applied
}

fn check_cycle(
    report: &mut AuditReport,
    line: usize,
    row: &ReflectionRow,
    group_ids: &BTreeSet<String>,
) {
    let fail = |report: &mut AuditReport, check, detail: String| {
        report.fail(check, files::REFLECTION, Some(line), detail)
    };
    let none = BTreeSet::new();
    let learnable = row.learnable.as_ref().unwrap_or(&none);
    if !learnable.is_disjoint(row.stop_gradient.as_ref().unwrap_or(&none)) {
        fail(
            report,
            "stop_gradient_isolation",
            "a ticket is both learnable and stop-gradient".into(),
        );
    }
    let applied_evidence: BTreeSet<&TicketKey> = row
        .applied_op_list()
        .iter()
        .flat_map(|op| &op.evidence)
        .collect();
    if let Some(covered) = &row.covered {
        let expected: BTreeSet<&TicketKey> = applied_evidence
            .iter()
            .copied()
            .filter(|k| learnable.contains(*k))
            .collect();
        if covered.iter().collect::<BTreeSet<_>>() != expected {
            fail(
                report,
                "coverage_from_applied_ops",
                "covered is not the evidence of the applied ops within the learnable set".into(),
            );
        }
    }
    for accepted in row.accepted() {
        if let Some(leak) = accepted
            .op
            .text()
            .and_then(|t| stageb_coordinator::learn::rule_text::label_leak(t, group_ids))
        {
            fail(
                report,
                "no_label_in_rules",
                format!("an accepted rule text contains {leak}"),
            );
        }
    }
    for ev in applied_evidence.iter().filter(|k| !learnable.contains(**k)) {
        fail(
            report,
            "evidence_subset_of_learnable",
            format!("applied op evidence {ev} is not learnable in this cycle"),
        );
    }
}

/// The guidance hash chain verifies (with a new version when a change was applied), `S*` rules
/// are the seed's, and no rule of the final guidance names a group id or a label.
pub fn check_guidance(
    report: &mut AuditReport,
    dir: &Path,
    run: &RunFacts,
    group_ids: &BTreeSet<String>,
    any_applied: bool,
) {
    match guidance::verify_chain(dir) {
        Ok(chain) if any_applied && chain.versions < 2 => report.fail(
            "guidance_chain",
            guidance::GUIDANCE_FILE,
            None,
            "reflections were applied but the chain has no new version",
        ),
        Ok(_) => {}
        Err(e) => report.fail(
            "guidance_chain",
            guidance::GUIDANCE_FILE,
            None,
            e.to_string(),
        ),
    }
    if let Err(detail) = scaffold_unchanged(dir, &run.mission) {
        report.fail("scaffold_untouched", guidance::GUIDANCE_FILE, None, detail);
    }
    let path = dir.join(guidance::GUIDANCE_FILE);
    if let Ok(g) = guidance::load_mission_section(&path, &run.mission) {
        for (k, t) in &g.experiences {
            if let Some(leak) = stageb_coordinator::learn::rule_text::label_leak(t, group_ids) {
                report.fail(
                    "no_label_in_rules",
                    guidance::GUIDANCE_FILE,
                    None,
                    format!("{k} contains {leak}"),
                );
            }
        }
    }
}

/// `S*` rules of the current guidance equal those of the chain's seed version.
fn scaffold_unchanged(dir: &Path, mission: &str) -> Result<(), String> {
    let bytes = fs::read(dir.join(guidance::GUIDANCE_FILE)).map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    let section = v.get(mission).ok_or("mission section missing")?;
    let scaffold = |exp: &Value| -> BTreeMap<String, String> {
        exp.as_object()
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| k.starts_with('S'))
                    .map(|(k, t)| (k.clone(), t.as_str().unwrap_or("").to_string()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let current = scaffold(&section["experiences"]);
    let seed = section["versions"]
        .as_array()
        .and_then(|vs| vs.first())
        .and_then(|v0| v0.pointer("/seed/experiences").cloned())
        .ok_or("the first guidance version has no seed content")?;
    if scaffold(&seed) != current {
        return Err("S* rules differ from the seed guidance".into());
    }
    Ok(())
}
