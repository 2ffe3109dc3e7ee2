//! Reflection cycles (`reflection.jsonl`): per-epoch totals over every cycle, and a readable
//! view of the first [`super::ROW_CAP`] cycles (batch, learnable vs stop-gradient, coverage,
//! accepted and rejected ops with reasons, token usage).
//!
//! Rows carry every raw model output; only counts and clipped op texts are kept.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use stageb_coordinator::artifacts::files;

use super::load::{FileStatus, stream_jsonl};
use super::outcomes::bump;
use super::{ROW_CAP, clip};

/// Longest op text or rejection detail shown, in characters.
const TEXT_CAP: usize = 240;
/// Most ops (accepted or rejected) listed per cycle; the rest are counted.
const OPS_CAP: usize = 12;
/// Most batch keys listed per cycle.
const BATCH_CAP: usize = 8;

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default)]
pub struct TokenUsage {
    pub calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default)]
pub struct Coverage {
    pub learnable: u64,
    pub covered: u64,
    pub ratio: f64,
}

#[derive(Deserialize)]
struct Row {
    epoch: u32,
    #[serde(default)]
    reflection_cycle: u64,
    #[serde(default)]
    reflection_id: String,
    #[serde(default)]
    retry_attempt: u64,
    #[serde(default)]
    batch: Vec<String>,
    #[serde(default)]
    stop_gradient: Option<Vec<String>>,
    #[serde(default)]
    learnable: Option<Vec<String>>,
    #[serde(default)]
    accepted_ops: Vec<AcceptedOp>,
    #[serde(default)]
    rejected_ops: Vec<RejectedOp>,
    #[serde(default)]
    applied_ops: Vec<serde::de::IgnoredAny>,
    #[serde(default)]
    applied: bool,
    #[serde(default)]
    coverage: Option<Coverage>,
    #[serde(default)]
    warnings: Vec<String>,
    #[serde(default)]
    token_usage: TokenUsage,
    #[serde(default)]
    calls: Vec<Call>,
    #[serde(default)]
    guidance_step_before: u64,
    #[serde(default)]
    guidance_step_after: u64,
}

#[derive(Deserialize)]
struct AcceptedOp {
    #[serde(default)]
    op: Value,
}

#[derive(Deserialize)]
struct RejectedOp {
    #[serde(default)]
    proposed: Value,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    detail: String,
}

#[derive(Deserialize)]
struct Call {
    #[serde(default)]
    ok: bool,
    #[serde(default)]
    runtime: Option<CallRuntime>,
}

#[derive(Deserialize)]
struct CallRuntime {
    #[serde(default)]
    latency_us: Option<u64>,
}

/// One guidance op as proposed, for display.
#[derive(Debug, Clone, Default)]
pub struct OpView {
    pub kind: String,
    pub key: Option<String>,
    pub merged_from: Vec<String>,
    pub text: Option<String>,
    pub evidence: usize,
}

impl OpView {
    fn of(op: &Value) -> OpView {
        let s = |k: &str| op.get(k).and_then(Value::as_str).map(str::to_string);
        let list = |k: &str| {
            op.get(k)
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string))
                .into_iter()
                .flatten()
        };
        OpView {
            kind: s("op").unwrap_or_else(|| "?".into()),
            key: s("key"),
            merged_from: list("merged_from").take(OPS_CAP).collect(),
            text: s("text").map(|t| clip(&t, TEXT_CAP)),
            evidence: list("evidence").count(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RejectedView {
    pub op: OpView,
    pub reason: String,
    pub detail: String,
}

/// One cycle, as the report lists it.
#[derive(Debug, Clone, Default)]
pub struct CycleView {
    pub cycle: u64,
    pub epoch: u32,
    pub reflection_id: String,
    pub retry_attempt: u64,
    pub batch: Vec<String>,
    pub batch_len: usize,
    /// `None` when the decision pass did not succeed.
    pub learnable: Option<usize>,
    pub stop_gradient: Option<usize>,
    pub coverage: Option<Coverage>,
    pub applied: bool,
    pub step_before: u64,
    pub step_after: u64,
    pub accepted: Vec<OpView>,
    pub accepted_len: usize,
    pub rejected: Vec<RejectedView>,
    pub rejected_len: usize,
    pub tokens: TokenUsage,
    pub warnings: Vec<String>,
}

/// Per-epoch totals over every cycle.
#[derive(Debug, Clone, Copy, Default)]
pub struct EpochReflection {
    pub cycles: u64,
    pub applied_cycles: u64,
    pub learnable: u64,
    pub stop_gradient: u64,
    pub covered: u64,
    pub accepted_ops: u64,
    pub rejected_ops: u64,
    pub applied_ops: u64,
    pub calls: u64,
    pub failed_calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub latency_us: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Reflection {
    pub per_epoch: BTreeMap<u32, EpochReflection>,
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// Warnings by name (`uncovered=3` counts as `uncovered`).
    pub warnings: BTreeMap<String, u64>,
    pub cycles: Vec<CycleView>,
    pub total_cycles: u64,
    pub file: FileStatus,
}

pub fn collect(dir: &Path) -> Reflection {
    let mut out = Reflection::default();
    out.file = stream_jsonl::<Row>(dir, files::REFLECTION, |row| {
        out.total_cycles += 1;
        add_to_epoch(out.per_epoch.entry(row.epoch).or_default(), &row);
        for r in &row.rejected_ops {
            bump(&mut out.rejected_by_reason, &r.reason);
        }
        for w in &row.warnings {
            bump(&mut out.warnings, w.split('=').next().unwrap_or(w));
        }
        if out.cycles.len() < ROW_CAP {
            out.cycles.push(view(row));
        }
    });
    out
}

fn add_to_epoch(e: &mut EpochReflection, row: &Row) {
    let len = |v: &Option<Vec<String>>| v.as_ref().map_or(0, |v| v.len() as u64);
    e.cycles += 1;
    e.applied_cycles += u64::from(row.applied);
    e.learnable += len(&row.learnable);
    e.stop_gradient += len(&row.stop_gradient);
    e.covered += row.coverage.map_or(0, |c| c.covered);
    e.accepted_ops += row.accepted_ops.len() as u64;
    e.rejected_ops += row.rejected_ops.len() as u64;
    e.applied_ops += row.applied_ops.len() as u64;
    e.calls += row.token_usage.calls;
    e.failed_calls += row.calls.iter().filter(|c| !c.ok).count() as u64;
    e.prompt_tokens += row.token_usage.prompt_tokens;
    e.completion_tokens += row.token_usage.completion_tokens;
    e.latency_us += row
        .calls
        .iter()
        .filter_map(|c| c.runtime.as_ref()?.latency_us)
        .sum::<u64>();
}

fn view(row: Row) -> CycleView {
    CycleView {
        cycle: row.reflection_cycle,
        epoch: row.epoch,
        reflection_id: clip(&row.reflection_id, 40),
        retry_attempt: row.retry_attempt,
        batch_len: row.batch.len(),
        batch: row
            .batch
            .iter()
            .take(BATCH_CAP)
            .map(|k| clip(k, 80))
            .collect(),
        learnable: row.learnable.as_ref().map(Vec::len),
        stop_gradient: row.stop_gradient.as_ref().map(Vec::len),
        coverage: row.coverage,
        applied: row.applied,
        step_before: row.guidance_step_before,
        step_after: row.guidance_step_after,
        accepted_len: row.accepted_ops.len(),
        accepted: row
            .accepted_ops
            .iter()
            .take(OPS_CAP)
            .map(|a| OpView::of(&a.op))
            .collect(),
        rejected_len: row.rejected_ops.len(),
        rejected: row
            .rejected_ops
            .iter()
            .take(OPS_CAP)
            .map(|r| RejectedView {
                op: OpView::of(&r.proposed),
                reason: clip(&r.reason, 60),
                detail: clip(&r.detail, TEXT_CAP),
            })
            .collect(),
        tokens: row.token_usage,
        warnings: row
            .warnings
            .iter()
            .take(OPS_CAP)
            .map(|w| clip(w, 80))
            .collect(),
    }
}
