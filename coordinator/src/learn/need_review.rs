//! The stop-gradient queue: rows of `need_review_queue.jsonl` and their deterministic
//! aggregation into `need_review.json` (seed 003; docs/ARTIFACTS.md describes both files).
//!
//! Three routes lead here: the decision pass declared a ticket unlearnable after seeing its
//! label (`reflection_no_evidence_after_gt`), its bounded retries or the epoch's calls ran out
//! (`budget_exhausted`), or the epoch's change cap was reached before its ops pass
//! (`change_cap_reached`). Hard failures never do. Rows are keyed by ticket key and
//! non-sticky (one epoch's routing says nothing about the next): `need_review.json` therefore
//! has, next to the full history, the view of the final epoch (`final_epoch_items`), which is
//! what is still in review when the run ends.
//!
//! `pred_verdict`/`pred_reason` are the *final* selection (after the fail-first override); the
//! original took the winning candidate before the override (B10).

use crate::decide::selection::Selection;
use serde::{Deserialize, Serialize};
use stageb_shared::SCHEMA_VERSION;
use stageb_shared::domain::{TicketKey, Verdict};
use std::collections::BTreeMap;

/// Why a ticket is in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NeedReviewReason {
    /// The decision pass listed it in `no_evidence_group_ids`.
    ReflectionNoEvidenceAfterGt,
    /// Its retries (or the epoch's reflection calls) were used up while uncovered.
    BudgetExhausted,
    /// The epoch's `change_cap_per_epoch` was reached before its ops pass: no further guidance
    /// change was possible this epoch (not a budget the ticket used up).
    ChangeCapReached,
}

impl NeedReviewReason {
    pub fn code(self) -> &'static str {
        match self {
            NeedReviewReason::ReflectionNoEvidenceAfterGt => "reflection_no_evidence_after_gt",
            NeedReviewReason::BudgetExhausted => "budget_exhausted",
            NeedReviewReason::ChangeCapReached => "change_cap_reached",
        }
    }
}

/// Who the ticket is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketIdentity {
    pub ticket_key: TicketKey,
    pub group_id: String,
    pub mission: String,
    pub gt_label: Verdict,
}

/// When it was routed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingPoint {
    pub epoch: u32,
    pub reflection_cycle: u64,
    /// `None` when no reflection ran (budget exhausted before a call).
    pub reflection_id: Option<String>,
}

/// One row of `need_review_queue.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NeedReviewRow {
    pub ticket_key: TicketKey,
    pub group_id: String,
    pub mission: String,
    pub gt_label: Verdict,
    /// Final verdict after overrides (B10).
    pub pred_verdict: Option<Verdict>,
    pub pred_reason: Option<String>,
    pub reason_code: NeedReviewReason,
    pub epoch: u32,
    pub reflection_cycle: u64,
    pub reflection_id: Option<String>,
    /// The decision pass's analysis for stop-gradient rows, else `None`.
    pub uncertainty_note: Option<String>,
    pub schema_version: u32,
}

impl NeedReviewRow {
    /// A row for `ticket` routed at `at`, predicting what `selection` finally chose.
    pub fn from_selection(
        ticket: &TicketIdentity,
        selection: &Selection,
        reason_code: NeedReviewReason,
        at: &RoutingPoint,
        uncertainty_note: Option<String>,
    ) -> Self {
        NeedReviewRow {
            ticket_key: ticket.ticket_key.clone(),
            group_id: ticket.group_id.clone(),
            mission: ticket.mission.clone(),
            gt_label: ticket.gt_label,
            pred_verdict: selection.verdict,
            pred_reason: selection.verdict.map(|_| selection.reason.clone()),
            reason_code,
            epoch: at.epoch,
            reflection_cycle: at.reflection_cycle,
            reflection_id: at.reflection_id.clone(),
            uncertainty_note,
            schema_version: SCHEMA_VERSION,
        }
    }
}

/// `need_review.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NeedReviewSummary {
    pub mission: String,
    /// Number of rows (full history, every epoch).
    pub n: usize,
    /// Distinct tickets.
    pub n_tickets: usize,
    /// Row count per reason code (sorted by code).
    pub by_reason_code: BTreeMap<String, usize>,
    /// Per ticket key (sorted): its latest row (highest epoch, then cycle).
    pub latest_by_ticket: BTreeMap<TicketKey, NeedReviewRow>,
    /// Every row, sorted by (epoch, ticket_key, reason_code, reflection_cycle).
    pub items: Vec<NeedReviewRow>,
    /// The run's last epoch.
    pub final_epoch: u32,
    /// Distinct tickets routed in the final epoch.
    pub n_final_epoch_tickets: usize,
    /// The rows of the final epoch (same order as `items`): what is in review at the end.
    pub final_epoch_items: Vec<NeedReviewRow>,
    pub schema_version: u32,
}

/// Aggregate queue rows of a run whose last epoch is `final_epoch`. The result depends only on
/// the set of rows, not their order.
pub fn aggregate(mission: &str, rows: &[NeedReviewRow], final_epoch: u32) -> NeedReviewSummary {
    let mut items = rows.to_vec();
    items.sort_by(|a, b| {
        let key = |r: &NeedReviewRow| {
            (
                r.epoch,
                r.ticket_key.clone(),
                r.reason_code.code(),
                r.reflection_cycle,
                r.reflection_id.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
    let mut by_reason_code = BTreeMap::new();
    let mut latest_by_ticket: BTreeMap<TicketKey, NeedReviewRow> = BTreeMap::new();
    for row in &items {
        *by_reason_code
            .entry(row.reason_code.code().to_string())
            .or_insert(0) += 1;
        // `items` is sorted by epoch first, so the last row seen per ticket is the latest
        // epoch; within an epoch, the later cycle.
        let replace = latest_by_ticket.get(&row.ticket_key).is_none_or(|cur| {
            (row.epoch, row.reflection_cycle) >= (cur.epoch, cur.reflection_cycle)
        });
        if replace {
            latest_by_ticket.insert(row.ticket_key.clone(), row.clone());
        }
    }
    let final_epoch_items: Vec<NeedReviewRow> = items
        .iter()
        .filter(|r| r.epoch == final_epoch)
        .cloned()
        .collect();
    let n_final_epoch_tickets = final_epoch_items
        .iter()
        .map(|r| &r.ticket_key)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    NeedReviewSummary {
        mission: mission.to_string(),
        n: items.len(),
        n_tickets: latest_by_ticket.len(),
        by_reason_code,
        latest_by_ticket,
        items,
        final_epoch,
        n_final_epoch_tickets,
        final_epoch_items,
        schema_version: SCHEMA_VERSION,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::fail_first::extract_mission_evidence;
    use crate::decide::selection::{VoteCandidate, select};

    fn ticket(key: &str) -> TicketIdentity {
        let (gid, label) = key.split_once("::").unwrap();
        TicketIdentity {
            ticket_key: TicketKey(key.into()),
            group_id: gid.into(),
            mission: "m".into(),
            gt_label: if label == "pass" {
                Verdict::Pass
            } else {
                Verdict::Fail
            },
        }
    }

    fn row(key: &str, epoch: u32, cycle: u64, reason: NeedReviewReason) -> NeedReviewRow {
        NeedReviewRow {
            ticket_key: TicketKey(key.into()),
            group_id: key.split("::").next().unwrap().into(),
            mission: "m".into(),
            gt_label: Verdict::Fail,
            pred_verdict: Some(Verdict::Pass),
            pred_reason: Some("r".into()),
            reason_code: reason,
            epoch,
            reflection_cycle: cycle,
            reflection_id: Some(format!("rid{cycle}")),
            uncertainty_note: None,
            schema_version: SCHEMA_VERSION,
        }
    }

    #[test]
    fn regression_b10_pred_verdict_is_after_the_override() {
        let ev = extract_mission_evidence(&[("image_1".into(), "光纤/缺失".into())], "光纤");
        let c = [VoteCandidate {
            candidate_index: 0,
            temperature: 0.1,
            verdict: Some(Verdict::Pass),
            reason: "ok".into(),
        }];
        let s = select(&c, &ev, Verdict::Pass, 0.67);
        let at = RoutingPoint {
            epoch: 1,
            reflection_cycle: 3,
            reflection_id: Some("abc".into()),
        };
        let r = NeedReviewRow::from_selection(
            &ticket("QC-001::pass"),
            &s,
            NeedReviewReason::ReflectionNoEvidenceAfterGt,
            &at,
            Some("分析".into()),
        );
        assert_eq!(r.pred_verdict, Some(Verdict::Fail));
        assert!(r.pred_reason.as_deref().unwrap().contains("判不通过"));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["reason_code"], "reflection_no_evidence_after_gt");
        assert_eq!(json["ticket_key"], "QC-001::pass");
        assert_eq!(json["gt_label"], "pass");
        assert_eq!(json["schema_version"], SCHEMA_VERSION);
    }

    #[test]
    fn aggregation_is_sorted_counted_and_order_independent() {
        let rows = vec![
            row("b::fail", 2, 5, NeedReviewReason::BudgetExhausted),
            row(
                "a::fail",
                1,
                1,
                NeedReviewReason::ReflectionNoEvidenceAfterGt,
            ),
            row(
                "b::fail",
                1,
                2,
                NeedReviewReason::ReflectionNoEvidenceAfterGt,
            ),
            row("a::fail", 1, 0, NeedReviewReason::BudgetExhausted),
        ];
        let s = aggregate("m", &rows, 2);
        assert_eq!(s.n, 4);
        assert_eq!(s.n_tickets, 2);
        assert_eq!(
            s.by_reason_code.into_iter().collect::<Vec<_>>(),
            vec![
                ("budget_exhausted".to_string(), 2),
                ("reflection_no_evidence_after_gt".to_string(), 2)
            ]
        );
        let order: Vec<(u32, &str)> = s
            .items
            .iter()
            .map(|r| (r.epoch, r.ticket_key.as_str()))
            .collect();
        assert_eq!(
            order,
            vec![
                (1, "a::fail"),
                (1, "a::fail"),
                (1, "b::fail"),
                (2, "b::fail")
            ]
        );
        assert_eq!(
            s.items[0].reason_code,
            NeedReviewReason::BudgetExhausted,
            "reason_code breaks the tie"
        );
        assert_eq!(s.latest_by_ticket[&TicketKey("b::fail".into())].epoch, 2);
        assert_eq!(
            s.latest_by_ticket[&TicketKey("a::fail".into())].reflection_cycle,
            1
        );
        let mut reversed = rows.clone();
        reversed.reverse();
        assert_eq!(
            serde_json::to_string(&aggregate("m", &reversed, 2)).unwrap(),
            serde_json::to_string(&aggregate("m", &rows, 2)).unwrap()
        );
    }

    #[test]
    fn regression_need_review_json_shows_the_final_epoch() {
        // The history alone reads as a sticky queue: a ticket routed in epoch 1 and learned in
        // epoch 2 is not in review at the end of a 2-epoch run.
        let rows = vec![
            row("a::fail", 1, 0, NeedReviewReason::BudgetExhausted),
            row("b::fail", 2, 4, NeedReviewReason::ChangeCapReached),
            row("b::fail", 1, 1, NeedReviewReason::BudgetExhausted),
        ];
        let s = aggregate("m", &rows, 2);
        assert_eq!(s.final_epoch, 2);
        assert_eq!(s.n_final_epoch_tickets, 1);
        let keys: Vec<&str> = s
            .final_epoch_items
            .iter()
            .map(|r| r.ticket_key.as_str())
            .collect();
        assert_eq!(keys, vec!["b::fail"]);
        assert_eq!(
            serde_json::to_value(&s.final_epoch_items[0]).unwrap()["reason_code"],
            "change_cap_reached"
        );
        assert_eq!(aggregate("m", &rows, 3).final_epoch_items.len(), 0);
    }

    #[test]
    fn empty_queue_aggregates_to_zero() {
        let s = aggregate("m", &[], 1);
        assert_eq!((s.n, s.n_tickets), (0, 0));
        assert!(s.items.is_empty() && s.latest_by_ticket.is_empty() && s.by_reason_code.is_empty());
    }

    #[test]
    fn rows_round_trip_through_json() {
        let r = row("a::fail", 1, 0, NeedReviewReason::BudgetExhausted);
        let back: NeedReviewRow =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
