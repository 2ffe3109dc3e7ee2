//! The held-out splits of `reflection.gate`: every selection row carries the split the run
//! seed gives its group (and none when the gate is off), and no gate or final ticket reached
//! reflection (a batch, the decision pass, an op's evidence) or the need-review queue, which
//! only reflection fills.

use std::collections::BTreeSet;
use std::path::Path;

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
