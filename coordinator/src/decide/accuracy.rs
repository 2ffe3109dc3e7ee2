//! Accuracy metrics from selection outcomes (the `metrics.jsonl` rows, docs/ARTIFACTS.md).
//!
//! `pass` is the positive class: `fp` = predicted pass with gt fail, `fn` = predicted fail with
//! gt pass. A ticket without a verdict (hard failure) counts as an error on its label's side:
//! `fn` when gt is pass, `fp` when gt is fail. Each row has two views: `include_manual_review`
//! (every ticket) and `exclude_manual_review` (tickets not in manual review: not hard failures,
//! not routed to need-review).
//!
//! Rows are pure functions of an ordered list of [`Outcome`]s, so `stageb audit` can recompute
//! `metrics.jsonl` from `selections.jsonl`:
//! - a window row (`event: "logging_steps"`) after every `logging_steps` tickets of an epoch,
//!   over those tickets;
//! - at epoch end, a partial window row (`event: "epoch_end_partial"`) for the leftover tickets,
//!   then the epoch row (`event: "epoch_end"`) over the whole epoch.
//!
//! Timing (`elapsed_seconds`, `groups_per_second`, ETAs) is passed in by the caller and nested
//! under `timing`, so determinism checks drop one key. `acc` of an empty view is `0.0`.

use serde::{Deserialize, Serialize};
use stageb_shared::SCHEMA_VERSION;
use stageb_shared::domain::{TicketKey, Verdict};
use std::collections::{BTreeMap, BTreeSet};

use crate::decide::split::Split;
use std::time::Duration;

/// One ticket's selection outcome, as metrics need it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub ticket_key: TicketKey,
    pub gt: Verdict,
    /// `None` = no selected verdict (hard failure).
    pub verdict: Option<Verdict>,
    pub in_manual_review: bool,
    /// The ticket's held-out split when `reflection.gate` is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<Split>,
}

/// One split's counts in an epoch row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SplitCounts {
    pub tickets: usize,
    pub exclude_manual_review: Counts,
    pub include_manual_review: Counts,
}

/// Each split's counts (`train`, `gate`, `final`), when the outcomes carry splits.
pub fn split_counts(outcomes: &[Outcome]) -> Option<BTreeMap<String, SplitCounts>> {
    outcomes.iter().find(|o| o.split.is_some())?;
    let per_split = Split::ALL.into_iter().map(|split| {
        let of: Vec<Outcome> = outcomes
            .iter()
            .filter(|o| o.split == Some(split))
            .cloned()
            .collect();
        let counts = SplitCounts {
            tickets: of.len(),
            exclude_manual_review: counts(&of, ManualReview::Exclude),
            include_manual_review: counts(&of, ManualReview::Include),
        };
        (split.as_str().to_string(), counts)
    });
    Some(per_split.collect())
}

/// One view's counts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    pub acc: f64,
    #[serde(rename = "fn")]
    pub fn_: usize,
    pub fp: usize,
    pub n: usize,
}

/// Which tickets a view counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManualReview {
    Include,
    Exclude,
}

/// Counts over `outcomes` for one view.
pub fn counts(outcomes: &[Outcome], view: ManualReview) -> Counts {
    let mut n = 0;
    let mut correct = 0;
    let mut fp = 0;
    let mut fn_ = 0;
    for o in outcomes {
        if view == ManualReview::Exclude && o.in_manual_review {
            continue;
        }
        n += 1;
        match (o.verdict, o.gt) {
            (Some(v), gt) if v == gt => correct += 1,
            (Some(Verdict::Pass), Verdict::Fail) | (None, Verdict::Fail) => fp += 1,
            (Some(Verdict::Fail), Verdict::Pass) | (None, Verdict::Pass) => fn_ += 1,
            (Some(_), _) => {}
        }
    }
    let acc = if n == 0 {
        0.0
    } else {
        correct as f64 / n as f64
    };
    Counts { acc, fn_, fp, n }
}

/// Kind of a metrics row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsEvent {
    LoggingSteps,
    EpochEndPartial,
    EpochEnd,
}

/// Caller-measured timing, excluded from determinism checks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub elapsed_seconds: f64,
    pub groups_per_second: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds_epoch: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds_run: Option<f64>,
}

/// One row of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsRow {
    pub event: MetricsEvent,
    pub epoch: u32,
    /// 1-based, inclusive.
    pub epoch_step_start: usize,
    /// 1-based, inclusive.
    pub epoch_step_end: usize,
    pub global_step: u64,
    pub logging_steps: usize,
    pub exclude_manual_review: Counts,
    pub include_manual_review: Counts,
    /// Epoch rows with `reflection.gate` on: the counts of each split (`final` is the
    /// headline: no decision was ever made on it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub splits: Option<BTreeMap<String, SplitCounts>>,
    /// Epoch rows with `reflection.gate` on: the applied ops whose claimed flips
    /// (`expected_flips`) this epoch's decisions settled (`learn::predictions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predictions: Option<Vec<serde_json::Value>>,
    /// Epoch rows with `reflection.gate.ablation_every` due: each learned rule's
    /// contribution on the gate split (leave-one-rule-out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ablation: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<Timing>,
    pub schema_version: u32,
}

/// A span of epoch steps a row covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSpan {
    pub event: MetricsEvent,
    /// 1-based, inclusive.
    pub start: usize,
    /// 1-based, inclusive.
    pub end: usize,
}

/// The window spans of an epoch of `n` tickets: full windows of `logging_steps`, then the
/// leftover partial window (if any). `logging_steps == 0` is treated as 1.
pub fn window_spans(n: usize, logging_steps: usize) -> Vec<WindowSpan> {
    let size = logging_steps.max(1);
    (0..n)
        .step_by(size)
        .map(|start| {
            let end = (start + size).min(n);
            let event = if end - start == size {
                MetricsEvent::LoggingSteps
            } else {
                MetricsEvent::EpochEndPartial
            };
            WindowSpan {
                event,
                start: start + 1,
                end,
            }
        })
        .collect()
}

/// The row of one span. `window` are exactly the outcomes of steps `span.start..=span.end`;
/// `global_step` is the run's global step when the row was written (the caller's step
/// counter: step composition is defined by ticket count, so it is reproducible).
pub fn row(
    epoch: u32,
    span: WindowSpan,
    window: &[Outcome],
    global_step: u64,
    logging_steps: usize,
    timing: Option<Timing>,
) -> MetricsRow {
    MetricsRow {
        event: span.event,
        epoch,
        epoch_step_start: span.start,
        epoch_step_end: span.end,
        global_step,
        logging_steps,
        exclude_manual_review: counts(window, ManualReview::Exclude),
        include_manual_review: counts(window, ManualReview::Include),
        splits: None,
        predictions: None,
        ablation: None,
        timing,
        schema_version: SCHEMA_VERSION,
    }
}

/// The epoch row over all of the epoch's outcomes.
pub fn epoch_row(
    epoch: u32,
    outcomes: &[Outcome],
    global_step: u64,
    logging_steps: usize,
) -> MetricsRow {
    let span = WindowSpan {
        event: MetricsEvent::EpochEnd,
        start: 1,
        end: outcomes.len(),
    };
    MetricsRow {
        splits: split_counts(outcomes),
        ..row(epoch, span, outcomes, global_step, logging_steps, None)
    }
}

/// Every row of an epoch without timing: the windows, then the epoch row. This is what an
/// auditor compares with `metrics.jsonl` after dropping `timing`. `global_step_at(end)` gives
/// the global step at which the ticket with 1-based epoch step `end` was decided (the epoch
/// row uses the last one). The runtime writes window rows as it goes, with `in_manual_review`
/// as known at that moment (need-review routing at epoch end only reaches the partial and
/// epoch rows); an auditor passes outcomes accordingly.
pub fn epoch_rows(
    epoch: u32,
    outcomes: &[Outcome],
    logging_steps: usize,
    global_step_at: impl Fn(usize) -> u64,
) -> Vec<MetricsRow> {
    let mut rows: Vec<MetricsRow> = window_spans(outcomes.len(), logging_steps)
        .into_iter()
        .map(|span| {
            let window = &outcomes[span.start - 1..span.end];
            row(
                epoch,
                span,
                window,
                global_step_at(span.end),
                logging_steps,
                None,
            )
        })
        .collect();
    rows.push(epoch_row(
        epoch,
        outcomes,
        global_step_at(outcomes.len()),
        logging_steps,
    ));
    rows
}

/// The runtime's incremental view of [`epoch_rows`]: push outcomes in epoch order, take a
/// window row when one is due, mark need-review routing at epoch end, then the partial and
/// epoch rows. The rows equal the pure functions' (plus timing).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Accumulator {
    epoch: u32,
    logging_steps: usize,
    outcomes: Vec<Outcome>,
    /// Outcomes already covered by a window row.
    windowed: usize,
    /// Tickets of the whole epoch, when known (for `eta_seconds_epoch`).
    epoch_size: Option<usize>,
}

impl Accumulator {
    /// `logging_steps == 0` is treated as 1.
    pub fn new(epoch: u32, logging_steps: u64) -> Self {
        Accumulator {
            epoch,
            logging_steps: usize::try_from(logging_steps.max(1)).unwrap_or(usize::MAX),
            outcomes: Vec::new(),
            windowed: 0,
            epoch_size: None,
        }
    }

    /// Tell the accumulator how many tickets the epoch has, enabling `eta_seconds_epoch`.
    pub fn with_epoch_size(mut self, n: usize) -> Self {
        self.epoch_size = Some(n);
        self
    }

    pub fn push(&mut self, outcome: Outcome) {
        self.outcomes.push(outcome);
    }

    pub fn outcomes(&self) -> &[Outcome] {
        &self.outcomes
    }

    /// The window row, if the outcomes pushed since the last window fill one.
    pub fn window_row_if_due(&mut self, global_step: u64, elapsed: Duration) -> Option<MetricsRow> {
        if self.outcomes.len() - self.windowed < self.logging_steps {
            return None;
        }
        let span = WindowSpan {
            event: MetricsEvent::LoggingSteps,
            start: self.windowed + 1,
            end: self.windowed + self.logging_steps,
        };
        Some(self.take_window(span, global_step, elapsed))
    }

    /// Flag routed tickets as in manual review (need-review at epoch end).
    pub fn mark_need_review<'a>(&mut self, keys: impl IntoIterator<Item = &'a TicketKey>) {
        let keys: BTreeSet<&TicketKey> = keys.into_iter().collect();
        for o in &mut self.outcomes {
            if keys.contains(&o.ticket_key) {
                o.in_manual_review = true;
            }
        }
    }

    /// The leftover window (`epoch_end_partial`), if any outcomes are not in a window yet.
    pub fn partial_row(&mut self, global_step: u64, elapsed: Duration) -> Option<MetricsRow> {
        if self.outcomes.len() == self.windowed {
            return None;
        }
        let span = WindowSpan {
            event: MetricsEvent::EpochEndPartial,
            start: self.windowed + 1,
            end: self.outcomes.len(),
        };
        Some(self.take_window(span, global_step, elapsed))
    }

    /// The epoch row (no timing).
    pub fn epoch_row(&self, global_step: u64) -> MetricsRow {
        epoch_row(self.epoch, &self.outcomes, global_step, self.logging_steps)
    }

    fn take_window(&mut self, span: WindowSpan, global_step: u64, elapsed: Duration) -> MetricsRow {
        self.windowed = span.end;
        let timing = self.timing(elapsed);
        row(
            self.epoch,
            span,
            &self.outcomes[span.start - 1..span.end],
            global_step,
            self.logging_steps,
            Some(timing),
        )
    }

    fn timing(&self, elapsed: Duration) -> Timing {
        let secs = elapsed.as_secs_f64();
        let done = self.outcomes.len() as f64;
        let rate = if secs > 0.0 { done / secs } else { 0.0 };
        let eta_seconds_epoch = self
            .epoch_size
            .filter(|_| rate > 0.0)
            .map(|n| (n.saturating_sub(self.outcomes.len())) as f64 / rate);
        Timing {
            elapsed_seconds: secs,
            groups_per_second: rate,
            eta_seconds_epoch,
            eta_seconds_run: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Verdict::{Fail, Pass};

    fn o(i: usize, gt: Verdict, v: Option<Verdict>, mr: bool) -> Outcome {
        Outcome {
            ticket_key: TicketKey(format!("g{i}::{gt}")),
            gt,
            verdict: v,
            in_manual_review: mr,
            split: None,
        }
    }

    #[test]
    fn pass_is_the_positive_class() {
        let outcomes = [
            o(1, Pass, Some(Pass), false),
            o(2, Fail, Some(Pass), false), // fp
            o(3, Pass, Some(Fail), false), // fn
            o(4, Fail, Some(Fail), false),
        ];
        let c = counts(&outcomes, ManualReview::Include);
        assert_eq!((c.fn_, c.fp, c.n), (1, 1, 4));
        assert_eq!(c.acc, 0.5);
    }

    #[test]
    fn null_verdict_is_fn_for_pass_and_fp_for_fail() {
        let c = counts(
            &[o(1, Pass, None, true), o(2, Fail, None, true)],
            ManualReview::Include,
        );
        assert_eq!((c.fn_, c.fp, c.n, c.acc), (1, 1, 2, 0.0));
    }

    #[test]
    fn exclude_view_drops_manual_review_tickets() {
        let outcomes = [o(1, Pass, Some(Pass), false), o(2, Fail, Some(Pass), true)];
        let ex = counts(&outcomes, ManualReview::Exclude);
        assert_eq!((ex.n, ex.fp, ex.acc), (1, 0, 1.0));
        let inc = counts(&outcomes, ManualReview::Include);
        assert_eq!((inc.n, inc.fp, inc.acc), (2, 1, 0.5));
        let empty = counts(&[o(1, Pass, Some(Pass), true)], ManualReview::Exclude);
        assert_eq!((empty.n, empty.acc), (0, 0.0));
    }

    #[test]
    fn windows_every_logging_steps_then_partial_then_epoch() {
        let outcomes: Vec<Outcome> = (1..=5)
            .map(|i| o(i, Pass, Some(if i == 5 { Fail } else { Pass }), false))
            .collect();
        let rows = epoch_rows(2, &outcomes, 2, |end| 10 + end as u64);
        let shape: Vec<(MetricsEvent, usize, usize, u64)> = rows
            .iter()
            .map(|r| (r.event, r.epoch_step_start, r.epoch_step_end, r.global_step))
            .collect();
        assert_eq!(
            shape,
            vec![
                (MetricsEvent::LoggingSteps, 1, 2, 12),
                (MetricsEvent::LoggingSteps, 3, 4, 14),
                (MetricsEvent::EpochEndPartial, 5, 5, 15),
                (MetricsEvent::EpochEnd, 1, 5, 15),
            ]
        );
        assert_eq!(rows[2].include_manual_review.fn_, 1);
        assert_eq!(rows[3].include_manual_review.n, 5);
        assert_eq!(rows[3].include_manual_review.acc, 0.8);
        // No leftovers → no partial row.
        assert_eq!(epoch_rows(1, &outcomes[..4], 2, |e| e as u64).len(), 3);
    }

    #[test]
    fn rows_serialize_with_the_original_field_names_and_separable_timing() {
        let outcomes = [o(1, Pass, Some(Pass), false)];
        let timing = Timing {
            elapsed_seconds: 1.5,
            groups_per_second: 0.6,
            eta_seconds_epoch: Some(3.0),
            eta_seconds_run: None,
        };
        let mut r = epoch_row(1, &outcomes, 1, 64);
        r.timing = Some(timing);
        let mut v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["event"], "epoch_end");
        assert_eq!(v["include_manual_review"]["fn"], 0);
        assert_eq!(v["timing"]["elapsed_seconds"], 1.5);
        assert_eq!(v["schema_version"], SCHEMA_VERSION);
        v.as_object_mut().unwrap().remove("timing");
        let untimed = serde_json::to_value(epoch_row(1, &outcomes, 1, 64)).unwrap();
        assert_eq!(v, untimed, "dropping `timing` leaves the deterministic row");
        let window = serde_json::to_value(
            epoch_rows(1, &[o(1, Pass, None, true)], 1, |e| e as u64)[0].clone(),
        )
        .unwrap();
        assert_eq!(window["event"], "logging_steps");
    }

    #[test]
    fn accumulator_rows_equal_the_pure_recomputation() {
        let outcomes: Vec<Outcome> = (1..=7)
            .map(|i| o(i, if i % 3 == 0 { Fail } else { Pass }, Some(Pass), false))
            .collect();
        let mut acc = Accumulator::new(3, 3).with_epoch_size(7);
        let mut rows = Vec::new();
        for (i, out) in outcomes.iter().enumerate() {
            acc.push(out.clone());
            if let Some(r) = acc.window_row_if_due(100 + i as u64 + 1, Duration::from_secs(2)) {
                assert!(r.timing.is_some());
                rows.push(r);
            }
        }
        acc.mark_need_review(&vec![TicketKey("g7::pass".into())]);
        rows.extend(acc.partial_row(107, Duration::from_secs(3)));
        rows.push(acc.epoch_row(107));
        for r in &mut rows {
            r.timing = None;
        }
        let mut final_outcomes = outcomes.clone();
        final_outcomes[6].in_manual_review = true;
        assert_eq!(
            rows,
            epoch_rows(3, &final_outcomes, 3, |end| 100 + end as u64)
        );
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[2].event, MetricsEvent::EpochEndPartial);
        assert_eq!(
            rows[2].exclude_manual_review.n, 0,
            "the routed ticket leaves the exclude view"
        );
        assert_eq!(rows[3].include_manual_review.n, 7);
    }

    #[test]
    fn accumulator_timing_reports_rate_and_eta() {
        let mut acc = Accumulator::new(1, 2).with_epoch_size(4);
        acc.push(o(1, Pass, Some(Pass), false));
        assert!(acc.window_row_if_due(1, Duration::from_secs(1)).is_none());
        acc.push(o(2, Pass, Some(Pass), false));
        let t = acc
            .window_row_if_due(2, Duration::from_secs(4))
            .unwrap()
            .timing
            .unwrap();
        assert_eq!(
            (t.elapsed_seconds, t.groups_per_second, t.eta_seconds_epoch),
            (4.0, 0.5, Some(4.0))
        );
        assert!(
            acc.partial_row(2, Duration::from_secs(4)).is_none(),
            "no leftovers"
        );
    }

    #[test]
    fn zero_logging_steps_is_one() {
        assert_eq!(window_spans(2, 0).len(), 2);
        assert!(window_spans(0, 5).is_empty());
    }
}
