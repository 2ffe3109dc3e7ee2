//! The rows of the per-ticket JSONL files, one type each: `selections.jsonl`
//! ([`SelectionRow`]), `trajectories.jsonl` ([`TrajectoryRow`]) and `failure_malformed.jsonl`
//! ([`FailureRow`]). Rank 0's loop writes them (`crate::run::ticket`); `stageb report` and
//! `stageb audit` read them back with the same types. `docs/ARTIFACTS.md` says what each key
//! means.
//!
//! # Bytes
//! A row's keys come out in field order, and that order is part of the format (reruns and
//! resumed runs are compared byte for byte): never reorder fields. Every key is always written
//! (an absent value is `null`), except inside [`RowRuntime`], whose two halves are present only
//! when known, and a selection row's `split`, present only with `reflection.gate` on. Sampling knobs are `f32` in the config and `f64` here, as the rows always wrote
//! them (`0.3` as `0.30000001192092896`).
//!
//! # Reading
//! Readers take damaged and hand-edited files: a key missing from a row reads as its default
//! (`#[serde(default)]`), and only a value of the wrong type makes a row unreadable. The
//! label is an `Option` for that reason alone: rank 0 always writes it.

use serde::{Deserialize, Serialize};
use stageb_shared::domain::Verdict;

use crate::cluster::scheduler::{JobFailure, Provenance};
use crate::decide::eligibility::Eligibility;
use crate::decide::selection::Selection;
use crate::decide::split::Split;

/// The first keys of a selection row and of a trajectory row: the ticket and the epoch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TicketHead {
    pub schema_version: u32,
    pub group_id: String,
    pub mission: String,
    pub ticket_key: String,
    pub gt_label: Option<Verdict>,
    pub epoch: u32,
}

/// One row of `selections.jsonl`: a ticket's decision in one epoch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectionRow {
    #[serde(flatten)]
    pub ticket: TicketHead,
    /// 1-based position of the ticket in its epoch.
    pub epoch_step: u64,
    /// Tickets decided so far in the run, this one included.
    pub global_step: u64,
    /// Rollout steps started so far in the run.
    pub schedule_step: u64,
    pub result: SelectionResult,
    pub eligibility: Eligibility,
    /// The guidance head once the ticket was decided.
    pub guidance_hash: String,
    /// The ticket's held-out split (`train`, `gate`, `final`); written only with
    /// `reflection.gate` on, so rows of runs without it are unchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<Split>,
    pub runtime: RowRuntime,
}

/// The `result` object of a selection row: the decision's fields, then stageb's audit fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectionResult {
    #[serde(flatten)]
    pub selection: Selection,
    /// The guidance step the ticket's rollouts were prompted with.
    pub guidance_step: u64,
    /// The last reflection that changed the guidance before the ticket was decided.
    pub reflection_change: Option<String>,
    /// Reflection cycles run before the ticket was decided.
    pub reflection_cycle: u64,
    pub eligible: bool,
    /// `engine_error:<CODE>` or `no_valid_candidates` when the ticket has no verdict.
    pub ineligible_reason: Option<String>,
}

/// One row of `trajectories.jsonl`: one candidate of a ticket.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrajectoryRow {
    #[serde(flatten)]
    pub ticket: TicketHead,
    pub global_step: u64,
    pub guidance_step: u64,
    pub reflection_cycle: u64,
    pub result: CandidateResult,
    /// The rollout job's runtime, repeated on each of its candidates' rows.
    pub runtime: RowRuntime,
}

/// The `result` object of a trajectory row.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CandidateResult {
    /// `decode_index × samples_per_decode + sample_index`.
    pub candidate_index: u32,
    pub decode_index: u32,
    pub sample_index: u32,
    pub decode: DecodeRecord,
    /// The raw text the model wrote.
    pub text: String,
    /// What the contract parser read (`None`: malformed).
    pub verdict: Option<Verdict>,
    pub reason: String,
    pub format_ok: bool,
    pub violation: Option<ViolationRecord>,
    pub finish_reason: String,
    pub completion_tokens: u32,
    /// The candidate's verdict against the label (`None`: malformed).
    pub label_match: Option<bool>,
    /// The ticket's vote signals, repeated on each candidate.
    pub vote_strength: Option<f64>,
    pub low_agreement: bool,
    pub needs_manual_review: bool,
}

/// How a candidate was decoded: its grid entry and its seed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DecodeRecord {
    pub temperature: f64,
    pub top_p: f64,
    pub max_new_tokens: u32,
    pub repetition_penalty: f64,
    pub seed: u64,
}

/// A broken contract: the parser's code and detail.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ViolationRecord {
    pub code: String,
    pub detail: String,
}

/// The keys of a failure row's `reason`.
pub mod failure_reason {
    /// A candidate broke the output contract (one row per malformed candidate).
    pub const FORMAT_ERROR: &str = "format_error";
    /// The ticket's rollout job failed (a hard failure).
    pub const ENGINE_ERROR: &str = "engine_error";
    /// No candidate of the ticket kept the contract (a hard failure).
    pub const NO_VALID_CANDIDATES: &str = "no_valid_candidates";
}

/// One row of `failure_malformed.jsonl`: a malformed candidate (`format_error`, with its
/// candidate, violation and raw text) or a ticket without a verdict (`engine_error` with the
/// job's error, or `no_valid_candidates`); the keys a kind does not use are `null`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FailureRow {
    pub schema_version: u32,
    pub ticket_key: String,
    pub group_id: String,
    pub mission: String,
    pub gt_label: Option<Verdict>,
    pub epoch: u32,
    pub global_step: u64,
    pub epoch_step: u64,
    pub guidance_step: u64,
    pub guidance_hash: String,
    /// One of [`failure_reason`].
    pub reason: String,
    pub candidate_index: Option<u32>,
    pub decode_index: Option<u32>,
    pub violation: Option<ViolationRecord>,
    pub raw_text: Option<String>,
    pub error: Option<JobFailure>,
}

/// Where and how fast a row was produced: the one object determinism checks drop. `{}` when
/// neither half is known.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RowRuntime {
    /// Which worker answered, under which lease and attempt.
    #[serde(flatten)]
    pub provenance: Option<Provenance>,
    /// A rollout's token counts and model time (trajectory rows only).
    #[serde(flatten)]
    pub rollout: Option<RolloutTiming>,
}

/// The token counts and model time of one rollout job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutTiming {
    pub prompt_tokens: u32,
    /// Prompt tokens the worker's prefix cache reused (rows written before the key existed
    /// read as 0).
    #[serde(default)]
    pub prefix_tokens: u32,
    pub prefill_us: u64,
    pub decode_us: u64,
}

#[cfg(test)]
mod tests;
