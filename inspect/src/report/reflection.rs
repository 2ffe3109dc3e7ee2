//! Reflection cycles (`reflection.jsonl`): per-epoch totals over every cycle, and a readable
//! view of the first [`super::ROW_CAP`] cycles (batch, learnable vs stop-gradient, coverage,
//! accepted and rejected ops with reasons, token usage).
//!
//! Rows are read with the type the reflector writes them with ([`ReflectionRow`]); a line that
//! does not match it is a note in the section. Rows carry every raw model output; only counts
//! and clipped op texts are kept.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use stageb_coordinator::artifacts::files;
use stageb_coordinator::guidance::{GuidanceOp, RuleKey};
use stageb_coordinator::learn::gate_decision::GateFigures;
use stageb_coordinator::learn::op_check::{RejectReason, RejectedOp};
use stageb_coordinator::learn::reflection::row::{CoverageCounts, ReflectionRow, TokenUsage};
use stageb_shared::domain::TicketKey;
use stageb_shared::reflection_schema::ProposedOp;

use super::load::{FileStatus, stream_jsonl};
use super::outcomes::bump;
use super::{ROW_CAP, clip};

/// Longest op text or rejection detail shown, in characters.
const TEXT_CAP: usize = 240;
/// Most ops (accepted or rejected) listed per cycle; the rest are counted.
const OPS_CAP: usize = 12;
/// Most batch keys listed per cycle.
const BATCH_CAP: usize = 8;

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
    /// An accepted op (validated: its keys are rule keys, its evidence ticket keys).
    fn accepted(op: &GuidanceOp) -> OpView {
        let merged_from: &[RuleKey] = match op {
            GuidanceOp::Merge { merged_from, .. } => merged_from,
            _ => &[],
        };
        OpView {
            kind: op.kind().to_string(),
            key: op.key().map(|k| k.to_string()),
            merged_from: merged_from
                .iter()
                .take(OPS_CAP)
                .map(|k| k.to_string())
                .collect(),
            text: op.text().map(|t| clip(t, TEXT_CAP)),
            evidence: op.evidence().len(),
        }
    }

    /// A rejected op, exactly as the model proposed it.
    fn proposed(op: &ProposedOp) -> OpView {
        OpView {
            kind: op.op.clone(),
            key: op.key.clone(),
            merged_from: op
                .merged_from
                .iter()
                .flatten()
                .take(OPS_CAP)
                .cloned()
                .collect(),
            text: op.text.as_deref().map(|t| clip(t, TEXT_CAP)),
            evidence: op.evidence.len(),
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
    pub coverage: Option<CoverageCounts>,
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

/// One gate check (`reflection.gate.check_edits`): the candidate guidance against its parent
/// on the gate split.
#[derive(Debug, Clone)]
pub struct GateView {
    pub cycle: u64,
    pub epoch: u32,
    pub figures: GateFigures,
    /// Ops of the candidate (applied when it passed, refused as `gate_regression` if not).
    pub ops: usize,
}

#[derive(Debug, Clone, Default)]
pub struct Reflection {
    pub per_epoch: BTreeMap<u32, EpochReflection>,
    /// The first [`ROW_CAP`] gate checks, in cycle order.
    pub gates: Vec<GateView>,
    /// Gate checks in all, and how many refused their candidate.
    pub gate_checks: u64,
    pub gate_refused: u64,
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// Warnings by name (`uncovered=3` counts as `uncovered`).
    pub warnings: BTreeMap<String, u64>,
    pub cycles: Vec<CycleView>,
    pub total_cycles: u64,
    pub file: FileStatus,
}

pub fn collect(dir: &Path) -> Reflection {
    let mut out = Reflection::default();
    out.file = stream_jsonl::<ReflectionRow>(dir, files::REFLECTION, |row| {
        out.total_cycles += 1;
        add_to_epoch(out.per_epoch.entry(row.epoch).or_default(), &row);
        for r in row.rejected() {
            bump(&mut out.rejected_by_reason, r.reason.code());
        }
        for w in &row.warnings {
            bump(&mut out.warnings, w.split('=').next().unwrap_or(w));
        }
        if let Some(figures) = &row.gate {
            out.gate_checks += 1;
            out.gate_refused += u64::from(!figures.passed);
            if out.gates.len() < ROW_CAP {
                out.gates.push(gate_view(&row, figures.clone()));
            }
        }
        if out.cycles.len() < ROW_CAP {
            out.cycles.push(view(row));
        }
    });
    out
}

fn gate_view(row: &ReflectionRow, figures: GateFigures) -> GateView {
    let ops = if figures.passed {
        row.accepted().len()
    } else {
        let refused = |r: &&RejectedOp| r.reason == RejectReason::GateRegression;
        row.rejected().iter().filter(refused).count()
    };
    GateView {
        cycle: row.reflection_cycle,
        epoch: row.epoch,
        figures,
        ops,
    }
}

fn add_to_epoch(e: &mut EpochReflection, row: &ReflectionRow) {
    let len = |v: &Option<BTreeSet<TicketKey>>| v.as_ref().map_or(0, |v| v.len() as u64);
    e.cycles += 1;
    e.applied_cycles += u64::from(row.applied());
    e.learnable += len(&row.learnable);
    e.stop_gradient += len(&row.stop_gradient);
    e.covered += row.coverage.map_or(0, |c| c.covered);
    e.accepted_ops += row.accepted().len() as u64;
    e.rejected_ops += row.rejected().len() as u64;
    e.applied_ops += row.applied_op_list().len() as u64;
    e.calls += row.token_usage.calls;
    e.failed_calls += row.calls.iter().filter(|c| !c.ok).count() as u64;
    e.prompt_tokens += row.token_usage.prompt_tokens;
    e.completion_tokens += row.token_usage.completion_tokens;
    e.latency_us += row
        .calls
        .iter()
        .filter_map(|c| c.runtime.latency_us)
        .sum::<u64>();
}

fn view(row: ReflectionRow) -> CycleView {
    CycleView {
        cycle: row.reflection_cycle,
        epoch: row.epoch,
        reflection_id: clip(&row.reflection_id, 40),
        retry_attempt: u64::from(row.retry_attempt),
        batch_len: row.batch.len(),
        batch: row
            .batch
            .iter()
            .take(BATCH_CAP)
            .map(|k| clip(k.as_str(), 80))
            .collect(),
        learnable: row.learnable.as_ref().map(|l| l.len()),
        stop_gradient: row.stop_gradient.as_ref().map(|s| s.len()),
        coverage: row.coverage,
        applied: row.applied(),
        step_before: row.guidance_step_before,
        step_after: row.guidance_step_after,
        accepted_len: row.accepted().len(),
        accepted: row
            .accepted()
            .iter()
            .take(OPS_CAP)
            .map(|a| OpView::accepted(&a.op))
            .collect(),
        rejected_len: row.rejected().len(),
        rejected: row
            .rejected()
            .iter()
            .take(OPS_CAP)
            .map(|r| RejectedView {
                op: OpView::proposed(&r.proposed),
                reason: clip(r.reason.code(), 60),
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
