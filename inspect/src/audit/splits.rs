//! What `reflection.gate` promises: every selection row carries the split the run seed gives
//! its group (and none when the gate is off), no gate or final ticket reached reflection (a
//! batch, the decision pass, an op's evidence) or the need-review queue, which only reflection
//! fills, and each epoch row's checked predictions follow from the ops applied in the epoch
//! before and this epoch's decisions.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;
use stageb_coordinator::artifacts::files;
use stageb_coordinator::decide::split::Splits;
use stageb_coordinator::learn::need_review::NeedReviewRow;
use stageb_coordinator::learn::reflection::ReflectionRow;
use stageb_shared::domain::TicketKey;

use super::decisions::Selections;
use super::rows::for_each_row;
use super::{AuditReport, RunFacts};

/// Each selection row's split against the seeded assignment. Returns the held-out tickets.
pub fn check_assignment(
    report: &mut AuditReport,
    run: &RunFacts,
    selections: &Selections,
) -> BTreeSet<TicketKey> {
    let gate = &run.config.reflection.gate;
    let rows = selections.values().flat_map(|by_key| by_key.iter());
    let groups = rows.clone().filter_map(|(_, s)| s.group_id.as_deref());
    let splits = gate
        .enabled
        .then(|| Splits::assign(run.config.seed, groups, gate));
    let mut held_out = BTreeSet::new();
    for (key, s) in rows {
        let expected = splits
            .as_ref()
            .map(|splits| splits.of(s.group_id.as_deref().unwrap_or_default()));
        if s.split != expected {
            report.fail(
                "split_assignment",
                files::SELECTIONS,
                Some(s.line),
                format!(
                    "{key}: split {:?}, the run seed gives {expected:?}",
                    s.split
                ),
            );
        }
        if expected.is_some_and(|split| split.held_out()) {
            held_out.insert(TicketKey(key.clone()));
        }
    }
    held_out
}

/// No held-out ticket in any reflection cycle's inputs or evidence, nor in need-review.
pub fn check_isolation(
    report: &mut AuditReport,
    dir: &Path,
    held_out: &BTreeSet<TicketKey>,
    queue: &[NeedReviewRow],
) {
    if held_out.is_empty() {
        return;
    }
    for_each_row(report, dir, files::REFLECTION, |report, line, row| {
        let Ok(row) = serde_json::from_value::<ReflectionRow>(row) else {
            return; // reported by the reflection checks
        };
        let none = BTreeSet::new();
        let evidence = row.applied_op_list().iter().flat_map(|op| &op.evidence);
        let seen = row
            .batch
            .iter()
            .chain(row.learnable.as_ref().unwrap_or(&none))
            .chain(row.stop_gradient.as_ref().unwrap_or(&none))
            .chain(evidence);
        if let Some(leak) = seen.into_iter().find(|k| held_out.contains(*k)) {
            report.fail(
                "held_out_isolation",
                files::REFLECTION,
                Some(line),
                format!("held-out ticket {leak} reached reflection"),
            );
        }
    });
    for row in queue.iter().filter(|q| held_out.contains(&q.ticket_key)) {
        report.fail(
            "held_out_isolation",
            files::NEED_REVIEW_QUEUE,
            None,
            format!(
                "held-out ticket {} was routed to need-review",
                row.ticket_key
            ),
        );
    }
}

/// The `predictions` of every `metrics.jsonl` epoch row, recomputed: the ops applied in the
/// epoch before with claimed flips (`expected_flips` of their accepted op), in the order they
/// were applied, each claim a hit when the ticket's verdict in this epoch matches its label.
pub fn check_predictions(report: &mut AuditReport, dir: &Path, selections: &Selections) {
    let mut claims: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
    for_each_row(report, dir, files::REFLECTION, |_, _, row| {
        let Ok(row) = serde_json::from_value::<ReflectionRow>(row) else {
            return; // reported by the reflection checks
        };
        let accepted = row.accepted();
        for applied in row.applied_op_list() {
            let Some(op) = accepted.get(applied.index) else {
                continue;
            };
            if !op.expected_flips.is_empty() {
                let made = (
                    row.reflection_id.clone(),
                    applied.key.to_string(),
                    op.expected_flips.clone(),
                );
                claims
                    .entry(u64::from(row.epoch))
                    .or_default()
                    .push(serde_json::json!(made));
            }
        }
    });
    let mut rows = Vec::new();
    for_each_row(report, dir, files::METRICS, |_, line, row| {
        if row["event"] == "epoch_end" {
            rows.push((line, row));
        }
    });
    for (line, row) in rows {
        let epoch = row["epoch"].as_u64().unwrap_or(0);
        let correct = |key: &str| {
            selections
                .get(&epoch)
                .and_then(|by_key| by_key.get(key))
                .is_some_and(|s| s.result["label_match"] == true && !s.result["verdict"].is_null())
        };
        let expected: Vec<(String, String, usize, usize)> = claims
            .get(&(epoch.saturating_sub(1)))
            .into_iter()
            .flatten()
            .filter_map(|c| {
                let (id, key, claimed): (String, String, Vec<TicketKey>) =
                    serde_json::from_value(c.clone()).ok()?;
                let hits = claimed.iter().filter(|k| correct(k.as_str())).count();
                Some((id, key, claimed.len(), hits))
            })
            .collect();
        let written: Vec<(String, String, usize, usize)> = row["predictions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                let s = |k: &str| p[k].as_str().unwrap_or_default().to_string();
                let n = |k: &str| p[k].as_u64().unwrap_or(0) as usize;
                (s("reflection_id"), s("key"), n("claimed"), n("hits"))
            })
            .collect();
        if written != expected {
            report.fail(
                "predictions_recomputed",
                files::METRICS,
                Some(line),
                format!("epoch {epoch}: written {written:?} ≠ recomputed {expected:?}"),
            );
        }
    }
}
