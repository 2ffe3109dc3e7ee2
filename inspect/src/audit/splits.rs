//! What `reflection.gate` promises: every selection row carries the split the run seed gives
//! its group (and none when the gate is off), no gate or final ticket reached reflection (a
//! batch, the decision pass, an op's evidence) or the need-review queue, which only reflection
//! fills, each epoch row's checked predictions follow from the ops applied in the epoch
//! before and this epoch's decisions, and each gate decision follows from its figures.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;
use stageb_coordinator::artifacts::files;
use stageb_coordinator::decide::split::Splits;
use stageb_coordinator::learn::need_review::NeedReviewRow;
use stageb_coordinator::learn::reflection::ReflectionRow;
use stageb_shared::config::GateConfig;
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

/// The claims (`expected_flips`) of the ops each epoch's cycles applied, in the order applied.
pub type Claims = BTreeMap<u64, Vec<Claim>>;

/// One applied op's claimed flips.
pub struct Claim {
    reflection_id: String,
    key: String,
    claimed: Vec<TicketKey>,
}

/// One pass over `reflection.jsonl`: no held-out ticket in any cycle's inputs or evidence (nor
/// in need-review), and the claims of the applied ops, for [`expected_predictions`].
pub fn check_reflection_rows(
    report: &mut AuditReport,
    dir: &Path,
    held_out: &BTreeSet<TicketKey>,
    queue: &[NeedReviewRow],
    gate: &GateConfig,
) -> Claims {
    let mut claims = Claims::new();
    for_each_row(report, dir, files::REFLECTION, |report, line, row| {
        let Ok(row) = serde_json::from_value::<ReflectionRow>(row) else {
            return; // reported by the reflection checks
        };
        if let Some(leak) = reflected(&row).find(|k| held_out.contains(*k)) {
            report.fail(
                "held_out_isolation",
                files::REFLECTION,
                Some(line),
                format!("held-out ticket {leak} reached reflection"),
            );
        }
        if let Err(why) = check_gate_decision(&row, gate) {
            report.fail("gate_decision", files::REFLECTION, Some(line), why);
        }
        let accepted = row.accepted();
        for applied in row.applied_op_list() {
            let Some(op) = accepted.get(applied.index) else {
                continue;
            };
            if !op.expected_flips.is_empty() {
                claims.entry(u64::from(row.epoch)).or_default().push(Claim {
                    reflection_id: row.reflection_id.clone(),
                    key: applied.key.to_string(),
                    claimed: op.expected_flips.clone(),
                });
            }
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
    claims
}

/// A cycle's gate record agrees with the config and with itself: present only when the gate
/// checks edits, under the configured tolerance and threshold, its decision the one its
/// figures give, and a refused candidate left nothing accepted or applied.
fn check_gate_decision(row: &ReflectionRow, gate: &GateConfig) -> Result<(), String> {
    let Some(f) = &row.gate else {
        return Ok(());
    };
    let cycle = row.reflection_cycle;
    if !(gate.enabled && gate.check_edits) {
        return Err(format!(
            "cycle {cycle} has a gate record but the config checks no edits"
        ));
    }
    if f.tolerance != gate.tolerance || f.min_p_better != gate.min_p_better {
        return Err(format!(
            "cycle {cycle}: gate thresholds differ from the config"
        ));
    }
    let counted = |c: usize| {
        if f.tickets == 0 {
            0.0
        } else {
            c as f64 / f.tickets as f64
        }
    };
    let within = f.candidate_accuracy + 1e-12 >= f.parent_accuracy - f.tolerance;
    let sure = f.p_better.is_none_or(|p| p >= f.min_p_better);
    let consistent = counted(f.parent_correct) == f.parent_accuracy
        && counted(f.candidate_correct) == f.candidate_accuracy
        && f.candidate_correct + f.broken == f.parent_correct + f.fixed
        && (f.p_better.is_some() == (f.min_p_better > 0.0));
    if !consistent || f.passed != (within && sure) {
        return Err(format!(
            "cycle {cycle}: the gate's decision does not follow from its figures"
        ));
    }
    if !f.passed && (row.applied() || !row.accepted().is_empty()) {
        return Err(format!(
            "cycle {cycle}: a refused candidate was applied or left accepted"
        ));
    }
    Ok(())
}

/// Every ticket a cycle showed the model or cited: its batch, `L`, the stop-gradient cases and
/// the applied ops' evidence.
fn reflected(row: &ReflectionRow) -> impl Iterator<Item = &TicketKey> {
    let evidence = row.applied_op_list().iter().flat_map(|op| &op.evidence);
    row.batch
        .iter()
        .chain(row.learnable.iter().flatten())
        .chain(row.stop_gradient.iter().flatten())
        .chain(evidence)
}

/// The `predictions` of epoch `epoch`'s `metrics.jsonl` row (at `line`), recomputed.
pub fn check_row_predictions(
    report: &mut AuditReport,
    line: usize,
    row: &Value,
    claims: &Claims,
    selections: &Selections,
) {
    let epoch = row["epoch"].as_u64().unwrap_or(0);
    let (written, expected) = (
        written_predictions(row),
        expected_predictions(claims, epoch, selections),
    );
    if written != expected {
        report.fail(
            "predictions_recomputed",
            files::METRICS,
            Some(line),
            format!("epoch {epoch}: written {written:?} ≠ recomputed {expected:?}"),
        );
    }
}

/// What epoch `epoch`'s row must say under `predictions`, as (reflection id, rule key, claimed,
/// hits): the ops applied in the epoch before with claims, in the order applied, each claim a
/// hit when the ticket's verdict in this epoch matches its label.
fn expected_predictions(
    claims: &Claims,
    epoch: u64,
    selections: &Selections,
) -> Vec<(String, String, usize, usize)> {
    let correct = |key: &TicketKey| {
        selections
            .get(&epoch)
            .and_then(|by_key| by_key.get(key.as_str()))
            .is_some_and(|s| s.result["label_match"] == true && !s.result["verdict"].is_null())
    };
    claims
        .get(&epoch.saturating_sub(1))
        .into_iter()
        .flatten()
        .map(|c| {
            let hits = c.claimed.iter().filter(|k| correct(k)).count();
            (
                c.reflection_id.clone(),
                c.key.clone(),
                c.claimed.len(),
                hits,
            )
        })
        .collect()
}

/// What an epoch row says under `predictions`, in [`expected_predictions`]' terms.
fn written_predictions(row: &Value) -> Vec<(String, String, usize, usize)> {
    row["predictions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap_or_default().to_string();
            let n = |k: &str| p[k].as_u64().unwrap_or(0) as usize;
            (s("reflection_id"), s("key"), n("claimed"), n("hits"))
        })
        .collect()
}
