//! One row of `reflection.jsonl` as a type: the reflector writes a [`ReflectionRow`] when a
//! cycle closes, and the report and the audit read it back with the same type
//! (docs/ARTIFACTS.md, `reflection.jsonl`).
//!
//! Keys are written in the order of the fields. A phase's keys are absent when the cycle ended
//! before that phase (`Option` fields skipped when `None`); a key the row always has is always
//! written, `null` included where a value can be missing (`calls[].parse_error`).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use stageb_shared::domain::TicketKey;
use stageb_shared::reflection_schema::{self, ProposedOp};

use crate::guidance::{AppliedOp, SkippedOp};
use crate::learn::gate_decision::GateFigures;
use crate::learn::op_check::{AcceptedOp, RejectedOp};

/// One reflection cycle, as `reflection.jsonl` holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReflectionRow {
    // Opening: who the cycle is and what it started from.
    pub schema_version: u32,
    pub epoch: u32,
    /// Tickets decided when the cycle ran.
    pub global_step: u64,
    /// 0-based, run-wide.
    pub reflection_cycle: u64,
    pub reflection_id: String,
    /// 0 for first-time cases, k for retry bucket k.
    pub retry_attempt: u32,
    /// Ticket keys of the batch, in batch order.
    pub batch: Vec<TicketKey>,
    pub guidance_step_before: u64,
    pub guidance_hash_before: String,

    // Packing: cases that did not fit the prompt budget (only when there were some).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped_by_token_budget: Option<Vec<TicketKey>>,

    // Decision pass (when it produced a usable answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_gradient: Option<BTreeSet<TicketKey>>,
    /// `L`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learnable: Option<BTreeSet<TicketKey>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<DecisionRecord>,

    // Ops pass and its revision round (when it ran).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proposals: Option<Vec<Proposal>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_ops: Option<Vec<AcceptedOp>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected_ops: Option<Vec<RejectedOp>>,
    /// The gate's evaluation of the accepted ops (`reflection.gate.check_edits`): refused ops
    /// moved from `accepted_ops` to `rejected_ops` as `gate_regression`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<GateFigures>,

    // Apply (the op lists only when a guidance version was written) and coverage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_ops: Option<Vec<AppliedOp>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_at_apply: Option<Vec<SkippedOp>>,
    /// Whether a guidance version was written. Here when the ops pass ran; a cycle that ended
    /// before it writes `applied: false` at the row's end instead (`applied_at_close`).
    /// Read back, this field holds the key wherever it stood: use [`Self::applied`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<bool>,
    /// `E` = evidence of the applied ops ∩ `L`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub covered: Option<BTreeSet<TicketKey>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage: Option<CoverageCounts>,
    /// `L \ E`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncovered: Option<Vec<TicketKey>>,

    // Closing: always written.
    pub warnings: Vec<String>,
    pub routing: Routing,
    pub guidance_step_after: u64,
    pub guidance_hash_after: String,
    pub token_usage: TokenUsage,
    /// One entry per model call attempt.
    pub calls: Vec<CallRecord>,
    /// `applied: false` as the last key, for a cycle that ended before the ops pass (set by
    /// [`Self::close`]). Written only; reading puts the key in [`Self::applied`].
    #[serde(
        rename = "applied",
        default,
        skip_deserializing,
        skip_serializing_if = "Option::is_none"
    )]
    applied_at_close: Option<bool>,
}

/// The decision pass's answer and what rank 0 made of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecisionRecord {
    /// As the model wrote them.
    pub no_evidence_group_ids: Vec<String>,
    /// The ids that resolved to ticket keys of the batch (first-mention order).
    pub resolved: Vec<TicketKey>,
    /// The ids that did not (ignored).
    pub unknown_ids: Vec<String>,
    pub decision_analysis: String,
}

/// One round of the ops pass, as the model answered it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    /// 0 for the ops pass, 1 for the revision round.
    pub round: u32,
    /// Advisory (logged, never used).
    pub has_evidence: bool,
    pub evidence_analysis: String,
    /// As proposed, before validation.
    pub operations: Vec<ProposedOp>,
    /// The model's own coverage claim (advisory, `null` when it made none).
    pub coverage_advisory: Option<reflection_schema::Coverage>,
}

/// Coverage of the learnable cases by the applied ops, as counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CoverageCounts {
    pub learnable: u64,
    pub covered: u64,
    /// `covered / learnable`; 0.0 when nothing was learnable.
    pub ratio: f64,
}

impl CoverageCounts {
    pub fn of(learnable: usize, covered: usize) -> Self {
        let ratio = if learnable == 0 {
            0.0
        } else {
            covered as f64 / learnable as f64
        };
        CoverageCounts {
            learnable: learnable as u64,
            covered: covered as u64,
            ratio,
        }
    }
}

/// The tickets this cycle sent to need-review, under the reason they went with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Out of retries or out of calls (also written, empty, when nothing was routed).
    BudgetExhausted(Vec<TicketKey>),
    /// The epoch's change cap was reached before the cycle made a call.
    ChangeCapReached(Vec<TicketKey>),
}

/// Token usage summed over the cycle's calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    pub calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl TokenUsage {
    /// The sums over `calls`, wide: the scheduler bounds each worker-reported count (see
    /// `result_check::MAX_REPORTED_TOKENS`), so no run can overflow them.
    pub fn of(calls: &[CallRecord]) -> Self {
        TokenUsage {
            calls: calls.len() as u64,
            prompt_tokens: calls.iter().map(|c| u64::from(c.prompt_tokens)).sum(),
            completion_tokens: calls.iter().map(|c| u64::from(c.completion_tokens)).sum(),
        }
    }
}

/// Which pass a model call served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallPass {
    Decision,
    Ops,
    OpsRevision,
}

impl CallPass {
    /// The name in the row, in metrics labels, in seeds and in warnings (`{pass}_error`).
    pub fn as_str(self) -> &'static str {
        match self {
            CallPass::Decision => "decision",
            CallPass::Ops => "ops",
            CallPass::OpsRevision => "ops_revision",
        }
    }
}

/// One model call attempt: what came back, its token usage and where it ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRecord {
    pub pass: CallPass,
    pub attempt: u32,
    pub seed: u64,
    pub ok: bool,
    /// `null` when the output parsed.
    pub parse_error: Option<CallError>,
    /// `""` for a failed job.
    pub raw_output: String,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub finish_reason: String,
    pub runtime: CallRuntime,
}

/// Why a call's output could not be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CallError {
    /// The output came back but does not parse (`EMPTY`, `NOT_JSON_OBJECT`, `TRUNCATED_JSON`,
    /// `INVALID_JSON`, `SCHEMA_MISMATCH`).
    Unparseable { code: String, detail: String },
    /// The job failed (the worker's failure code) or returned the wrong kind of result.
    Failed { code: String, message: String },
}

/// Where and how long a call ran (runtime facts: not part of a run's determinism).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRuntime {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Only for completed generations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us: Option<u64>,
    /// Leading prompt tokens the worker's prefix cache supplied (completed generations only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_tokens: Option<u32>,
}

/// The opening of a row: everything a cycle knows before its first phase.
pub struct RowOpening {
    pub epoch: u32,
    pub global_step: u64,
    pub reflection_cycle: u64,
    pub reflection_id: String,
    pub retry_attempt: u32,
    pub batch: Vec<TicketKey>,
    pub guidance_step: u64,
    pub guidance_hash: String,
}

impl ReflectionRow {
    /// A row for a cycle that has only started: no phase has run, no call was made, nothing
    /// was routed and the guidance is as it was. The phases fill in their keys;
    /// [`Self::close`] writes the closing ones.
    pub fn open(o: RowOpening) -> Self {
        ReflectionRow {
            schema_version: stageb_shared::SCHEMA_VERSION,
            epoch: o.epoch,
            global_step: o.global_step,
            reflection_cycle: o.reflection_cycle,
            reflection_id: o.reflection_id,
            retry_attempt: o.retry_attempt,
            batch: o.batch,
            guidance_step_before: o.guidance_step,
            guidance_hash_before: o.guidance_hash.clone(),
            dropped_by_token_budget: None,
            stop_gradient: None,
            learnable: None,
            decision: None,
            proposals: None,
            accepted_ops: None,
            rejected_ops: None,
            gate: None,
            applied_ops: None,
            skipped_at_apply: None,
            applied: None,
            covered: None,
            coverage: None,
            uncovered: None,
            warnings: Vec::new(),
            routing: Routing::BudgetExhausted(Vec::new()),
            guidance_step_after: o.guidance_step,
            guidance_hash_after: o.guidance_hash,
            token_usage: TokenUsage::default(),
            calls: Vec::new(),
            applied_at_close: None,
        }
    }

    /// The closing keys: routing, the guidance after the cycle, the calls' token usage, and
    /// `applied: false` at the end when no phase wrote `applied`.
    pub fn close(&mut self, routing: Routing, guidance_step: u64, guidance_hash: &str) {
        self.routing = routing;
        self.guidance_step_after = guidance_step;
        self.guidance_hash_after = guidance_hash.to_string();
        self.token_usage = TokenUsage::of(&self.calls);
        if self.applied.is_none() {
            self.applied_at_close = Some(false);
        }
    }

    /// Whether the cycle wrote a guidance version.
    pub fn applied(&self) -> bool {
        self.applied == Some(true)
    }

    /// The accepted ops (none when the ops pass did not run).
    pub fn accepted(&self) -> &[AcceptedOp] {
        self.accepted_ops.as_deref().unwrap_or_default()
    }

    /// The rejected ops (none when the ops pass did not run).
    pub fn rejected(&self) -> &[RejectedOp] {
        self.rejected_ops.as_deref().unwrap_or_default()
    }

    /// The ops that changed the guidance (none when no version was written).
    pub fn applied_op_list(&self) -> &[AppliedOp] {
        self.applied_ops.as_deref().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> TicketKey {
        TicketKey(s.to_string())
    }

    fn opened() -> ReflectionRow {
        ReflectionRow::open(RowOpening {
            epoch: 1,
            global_step: 6,
            reflection_cycle: 0,
            reflection_id: "rb0de3f4f5f13".into(),
            retry_attempt: 0,
            batch: vec![key("A::fail")],
            guidance_step: 1,
            guidance_hash: "sha256:00".into(),
        })
    }

    fn call() -> CallRecord {
        CallRecord {
            pass: CallPass::Decision,
            attempt: 0,
            seed: 12848283631510886964,
            ok: true,
            parse_error: None,
            raw_output: "{}".into(),
            prompt_tokens: 1182,
            completion_tokens: 72,
            finish_reason: "stop".into(),
            runtime: CallRuntime {
                worker_id: Some("w1".into()),
                lease_id: Some(7),
                attempt: Some(1),
                latency_us: Some(2711159),
                prefix_tokens: None,
            },
        }
    }

    fn line(row: &ReflectionRow) -> String {
        serde_json::to_string(row).unwrap()
    }

    fn keys(row: &ReflectionRow) -> Vec<String> {
        let value = serde_json::to_value(row).unwrap();
        value.as_object().unwrap().keys().cloned().collect()
    }

    #[test]
    fn a_cycle_without_learnable_cases_is_written_as_the_old_json_literal_wrote_it() {
        let mut row = opened();
        row.stop_gradient = Some([key("A::fail")].into());
        row.learnable = Some(BTreeSet::new());
        row.decision = Some(DecisionRecord {
            no_evidence_group_ids: vec!["A::fail".into()],
            resolved: vec![key("A::fail")],
            unknown_ids: vec![],
            decision_analysis: "方向".into(),
        });
        row.calls.push(call());
        row.close(Routing::BudgetExhausted(vec![]), 1, "sha256:00");
        assert_eq!(
            line(&row),
            concat!(
                r#"{"schema_version":1,"epoch":1,"global_step":6,"reflection_cycle":0,"#,
                r#""reflection_id":"rb0de3f4f5f13","retry_attempt":0,"batch":["A::fail"],"#,
                r#""guidance_step_before":1,"guidance_hash_before":"sha256:00","#,
                r#""stop_gradient":["A::fail"],"learnable":[],"decision":{"#,
                r#""no_evidence_group_ids":["A::fail"],"resolved":["A::fail"],"unknown_ids":[],"#,
                r#""decision_analysis":"方向"},"warnings":[],"routing":{"budget_exhausted":[]},"#,
                r#""guidance_step_after":1,"guidance_hash_after":"sha256:00","#,
                r#""token_usage":{"calls":1,"prompt_tokens":1182,"completion_tokens":72},"#,
                r#""calls":[{"pass":"decision","attempt":0,"seed":12848283631510886964,"#,
                r#""ok":true,"parse_error":null,"raw_output":"{}","prompt_tokens":1182,"#,
                r#""completion_tokens":72,"finish_reason":"stop","runtime":{"worker_id":"w1","#,
                r#""lease_id":7,"attempt":1,"latency_us":2711159}}],"applied":false}"#,
            )
        );
    }

    #[test]
    fn a_cycle_that_ended_before_any_phase_has_only_the_opening_and_closing_keys() {
        let mut row = opened();
        row.warnings.push("epoch_change_cap_reached".into());
        row.close(
            Routing::ChangeCapReached(vec![key("A::fail")]),
            1,
            "sha256:00",
        );
        assert_eq!(
            keys(&row),
            [
                "schema_version",
                "epoch",
                "global_step",
                "reflection_cycle",
                "reflection_id",
                "retry_attempt",
                "batch",
                "guidance_step_before",
                "guidance_hash_before",
                "warnings",
                "routing",
                "guidance_step_after",
                "guidance_hash_after",
                "token_usage",
                "calls",
                "applied",
            ]
        );
        assert!(line(&row).contains(r#""routing":{"change_cap_reached":["A::fail"]}"#));
        assert!(!row.applied());
    }

    /// The ops pass writes `applied` where the apply phase set it, before the coverage keys,
    /// and not again at the end.
    fn after_the_ops_pass() -> ReflectionRow {
        let mut row = opened();
        row.dropped_by_token_budget = Some(vec![key("B::pass")]);
        row.stop_gradient = Some(BTreeSet::new());
        row.learnable = Some([key("A::fail")].into());
        row.decision = Some(DecisionRecord {
            no_evidence_group_ids: vec![],
            resolved: vec![],
            unknown_ids: vec!["第9组".into()],
            decision_analysis: String::new(),
        });
        row.proposals = Some(vec![]);
        row.accepted_ops = Some(vec![]);
        row.rejected_ops = Some(vec![]);
        row.applied = Some(false);
        row.covered = Some(BTreeSet::new());
        row.coverage = Some(CoverageCounts::of(1, 0));
        row.uncovered = Some(vec![key("A::fail")]);
        row.calls.push(call());
        row.close(Routing::BudgetExhausted(vec![]), 1, "sha256:00");
        row
    }

    #[test]
    fn a_cycle_that_ran_the_ops_pass_writes_applied_before_the_coverage_keys() {
        let row = after_the_ops_pass();
        let keys = keys(&row);
        let at = |k: &str| keys.iter().position(|x| x == k).unwrap();
        assert_eq!(keys.iter().filter(|k| *k == "applied").count(), 1);
        assert_eq!(
            keys[at("dropped_by_token_budget")..at("warnings")],
            [
                "dropped_by_token_budget",
                "stop_gradient",
                "learnable",
                "decision",
                "proposals",
                "accepted_ops",
                "rejected_ops",
                "applied",
                "covered",
                "coverage",
                "uncovered",
            ]
        );
        assert_eq!(keys.last().unwrap(), "calls");
    }

    #[test]
    fn a_coverage_ratio_is_always_written_as_a_float() {
        let written = |c: CoverageCounts| serde_json::to_string(&c).unwrap();
        assert_eq!(
            written(CoverageCounts::of(0, 0)),
            r#"{"learnable":0,"covered":0,"ratio":0.0}"#
        );
        assert_eq!(
            written(CoverageCounts::of(2, 2)),
            r#"{"learnable":2,"covered":2,"ratio":1.0}"#
        );
        assert_eq!(
            written(CoverageCounts::of(3, 1)),
            r#"{"learnable":3,"covered":1,"ratio":0.3333333333333333}"#
        );
    }

    #[test]
    fn a_written_row_reads_back_as_itself() {
        let row = after_the_ops_pass();
        let back: ReflectionRow = serde_json::from_str(&line(&row)).unwrap();
        assert_eq!(back, row);
        assert_eq!(line(&back), line(&row));
    }

    #[test]
    fn an_early_row_reads_back_unapplied() {
        let mut row = opened();
        row.close(
            Routing::BudgetExhausted(vec![key("A::fail")]),
            1,
            "sha256:00",
        );
        let back: ReflectionRow = serde_json::from_str(&line(&row)).unwrap();
        assert_eq!(back.applied, Some(false));
        assert!(!back.applied());
        assert!(back.accepted().is_empty() && back.applied_op_list().is_empty());
    }

    #[test]
    fn both_kinds_of_call_error_read_back() {
        let read = |s: &str| serde_json::from_str::<CallError>(s).unwrap();
        assert_eq!(
            read(r#"{"code":"TRUNCATED_JSON","detail":"eof"}"#),
            CallError::Unparseable {
                code: "TRUNCATED_JSON".into(),
                detail: "eof".into()
            }
        );
        assert_eq!(
            read(r#"{"code":"PROMPT_TOO_LONG","message":"too long"}"#),
            CallError::Failed {
                code: "PROMPT_TOO_LONG".into(),
                message: "too long".into()
            }
        );
    }
}
