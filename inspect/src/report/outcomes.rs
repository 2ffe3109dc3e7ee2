//! What the rollouts decided, per epoch: accuracy (`metrics.jsonl` epoch rows, else
//! `summary.json`), vote strength and candidate counts (`selections.jsonl`), malformed
//! candidates by violation code and hard failures (`failure_malformed.jsonl`).
//!
//! One streaming pass per file, aggregated into per-epoch counters: the report's size and
//! memory do not grow with the number of tickets.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use stageb_coordinator::artifacts::files;
use stageb_coordinator::artifacts::rows::{FailureRow, SelectionRow, failure_reason};
use stageb_coordinator::learn::reflection::RuleAblation;

use super::load::{FileStatus, stream_jsonl};

/// Distinct names (violation codes, failure reasons) kept per epoch before the rest are
/// counted together: a damaged file must not turn a legend into a wall.
const MAX_NAMES: usize = 40;
/// The name the rest are counted under.
pub const OTHER: &str = "(other)";

/// An accuracy block of a metrics row (`pass` is the positive class).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default)]
pub struct Confusion {
    pub acc: f64,
    #[serde(rename = "fn")]
    pub false_negatives: u64,
    #[serde(rename = "fp")]
    pub false_positives: u64,
    pub n: u64,
}

/// The `timing` object of a metrics window row.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Timing {
    pub elapsed_seconds: f64,
    pub groups_per_second: f64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MetricsRow {
    pub event: String,
    pub epoch: u32,
    #[serde(default)]
    pub epoch_step_end: u64,
    #[serde(default)]
    pub global_step: u64,
    #[serde(default)]
    pub include_manual_review: Confusion,
    #[serde(default)]
    pub exclude_manual_review: Confusion,
    #[serde(default)]
    pub timing: Option<Timing>,
    /// Per held-out split (`reflection.gate` on), by split name.
    #[serde(default)]
    pub splits: Option<BTreeMap<String, SplitAccuracy>>,
    /// Applied ops whose claimed flips this epoch settled (`reflection.gate` on).
    #[serde(default)]
    pub predictions: Option<Vec<PredictionCheck>>,
    /// Each learned rule's contribution on the gate split, when the epoch ran the ablation.
    #[serde(default)]
    pub ablation: Option<Vec<RuleAblation>>,
}

/// One settled prediction of an epoch row.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct PredictionCheck {
    pub reflection_id: String,
    pub epoch_applied: u32,
    pub key: String,
    pub op: String,
    pub claimed: u64,
    pub hits: u64,
}

/// One split's block of an epoch row.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default)]
pub struct SplitAccuracy {
    pub tickets: u64,
    pub include_manual_review: Confusion,
    pub exclude_manual_review: Confusion,
}

/// One epoch's accuracy, with and without the tickets in need-review.
#[derive(Debug, Clone)]
pub struct EpochAccuracy {
    pub epoch: u32,
    pub include: Confusion,
    pub exclude: Confusion,
    /// Per split, when the run held some tickets out (empty otherwise).
    pub splits: BTreeMap<String, SplitAccuracy>,
    /// The predictions this epoch settled.
    pub predictions: Vec<PredictionCheck>,
    /// The rule ablation of this epoch (empty when none ran).
    pub ablation: Vec<RuleAblation>,
}

/// A metrics window row's timing: how far the epoch had got, and when.
#[derive(Debug, Clone, Copy)]
pub struct TimingWindow {
    pub epoch: u32,
    pub epoch_step_end: u64,
    pub global_step: u64,
    pub timing: Timing,
}

/// Per-epoch counts from `selections.jsonl` and `failure_malformed.jsonl`.
#[derive(Debug, Clone, Default)]
pub struct EpochOutcome {
    pub tickets: u64,
    pub correct: u64,
    /// Candidates voted on: pass + fail + malformed over the epoch's selections.
    pub candidates: u64,
    /// Malformed candidates by the selections' vote counts.
    pub malformed: u64,
    pub low_agreement: u64,
    pub needs_manual_review: u64,
    /// Tickets by vote strength in thousandths (exact for any candidate count up to 1000).
    pub vote_strength: BTreeMap<u32, u64>,
    /// Tickets without a vote strength (no format-ok candidate).
    pub no_vote: u64,
    /// `format_error` rows by violation code.
    pub malformed_by_code: BTreeMap<String, u64>,
    /// Hard failures: `no_valid_candidates`, `engine_error:<CODE>`.
    pub hard_failures: BTreeMap<String, u64>,
}

impl EpochOutcome {
    pub fn malformed_rows(&self) -> u64 {
        self.malformed_by_code.values().sum()
    }
}

#[derive(Debug, Clone, Default)]
pub struct Outcomes {
    pub accuracy: Vec<EpochAccuracy>,
    /// Where the accuracy came from (`metrics.jsonl` or `summary.json`), for the section note.
    pub accuracy_source: &'static str,
    pub windows: Vec<TimingWindow>,
    pub epochs: BTreeMap<u32, EpochOutcome>,
    pub files: Vec<FileStatus>,
}

/// Add one to `name`'s count, or to [`OTHER`]'s once `MAX_NAMES` names are known.
pub fn bump(map: &mut BTreeMap<String, u64>, name: &str) {
    if let Some(n) = map.get_mut(name) {
        *n += 1;
    } else if map.len() < MAX_NAMES {
        map.insert(name.to_string(), 1);
    } else {
        *map.entry(OTHER.to_string()).or_default() += 1;
    }
}

pub fn collect(dir: &Path, summary_epoch_rows: &[Value]) -> Outcomes {
    let mut out = Outcomes::default();
    let mut epoch_rows = Vec::new();
    let metrics = stream_jsonl::<MetricsRow>(dir, files::METRICS, |row| match row.event.as_str() {
        "epoch_end" => epoch_rows.push(row),
        _ => {
            if let Some(timing) = row.timing {
                out.windows.push(TimingWindow {
                    epoch: row.epoch,
                    epoch_step_end: row.epoch_step_end,
                    global_step: row.global_step,
                    timing,
                });
            }
        }
    });
    out.accuracy_source = files::METRICS;
    if epoch_rows.is_empty() {
        // The summary repeats the epoch rows: use it when metrics.jsonl is gone.
        epoch_rows = summary_epoch_rows
            .iter()
            .filter_map(|v| serde_json::from_value::<MetricsRow>(v.clone()).ok())
            .collect();
        out.accuracy_source = files::SUMMARY;
    }
    out.accuracy = epoch_rows
        .iter()
        .map(|r| EpochAccuracy {
            epoch: r.epoch,
            include: r.include_manual_review,
            exclude: r.exclude_manual_review,
            splits: r.splits.clone().unwrap_or_default(),
            predictions: r.predictions.clone().unwrap_or_default(),
            ablation: r.ablation.clone().unwrap_or_default(),
        })
        .collect();
    out.files.push(metrics);
    out.files.push(count_selections(dir, &mut out.epochs));
    out.files.push(count_failures(dir, &mut out.epochs));
    out
}

fn count_selections(dir: &Path, epochs: &mut BTreeMap<u32, EpochOutcome>) -> FileStatus {
    stream_jsonl::<SelectionRow>(dir, files::SELECTIONS, |row| {
        let e = epochs.entry(row.ticket.epoch).or_default();
        let r = &row.result.selection;
        e.tickets += 1;
        e.correct += u64::from(r.label_match);
        e.low_agreement += u64::from(r.low_agreement);
        e.needs_manual_review += u64::from(r.needs_manual_review);
        let votes = r.vote_counts;
        e.candidates += [votes.pass, votes.fail, votes.malformed]
            .into_iter()
            .map(u64::from)
            .sum::<u64>();
        e.malformed += u64::from(votes.malformed);
        match r.vote_strength {
            Some(v) if v.is_finite() => {
                let permille = (v.clamp(0.0, 1.0) * 1000.0).round() as u32;
                *e.vote_strength.entry(permille).or_default() += 1;
            }
            _ => e.no_vote += 1,
        }
    })
}

fn count_failures(dir: &Path, epochs: &mut BTreeMap<u32, EpochOutcome>) -> FileStatus {
    stream_jsonl::<FailureRow>(dir, files::FAILURE_MALFORMED, |row| {
        let e = epochs.entry(row.epoch).or_default();
        match row.reason.as_str() {
            failure_reason::FORMAT_ERROR => {
                let code = row.violation.map(|v| v.code);
                bump(
                    &mut e.malformed_by_code,
                    code.as_deref().unwrap_or("(none)"),
                );
            }
            failure_reason::ENGINE_ERROR => {
                let code = row.error.map(|v| v.code).unwrap_or_default();
                bump(&mut e.hard_failures, &format!("engine_error:{code}"));
            }
            other => bump(&mut e.hard_failures, other),
        }
    })
}
