//! The job vocabulary shared by the lease table, the journal and the result checks: what a
//! job asks for ([`JobPayload`]), what a worker answers ([`JobOutput`]), and how a submission
//! ends ([`SubmitOutcome`], [`SubmitError`]).

use stageb_shared::domain::ChatMessage;

pub type JobId = u64;
pub type LeaseId = u64;

/// The `worker_id` in the provenance of an answer replayed from the journal.
pub const REPLAY_WORKER: &str = "journal-replay";

/// How one group of candidates is decoded, with one seed per sample.
pub use stageb_shared::domain::DecodeGroup as DecodeJob;

/// Serialized (externally tagged) only to digest it: see [`super::journal::payload_digest`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum JobPayload {
    Rollout {
        messages: Vec<ChatMessage>,
        decodes: Vec<DecodeJob>,
        constrained: bool,
    },
    Generate {
        messages: Vec<ChatMessage>,
        json_schema: Option<String>,
        seed: u64,
        temperature: f32,
        top_p: f32,
        repetition_penalty: f32,
        max_new_tokens: u32,
    },
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CandidateText {
    pub decode_index: u32,
    pub sample_index: u32,
    pub seed: u64,
    pub text: String,
    pub completion_tokens: u32,
    pub finish_reason: String,
}

/// Serialized as a job journal row's `output` (`kind`: `rollout` | `generate`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum JobOutput {
    Rollout {
        candidates: Vec<CandidateText>,
        prompt_tokens: u32,
        /// Prompt tokens the worker reused from its prefix cache (journals written before
        /// the field existed read as 0).
        #[serde(default)]
        prefix_tokens: u32,
        prefill_us: u64,
        decode_us: u64,
    },
    Generate {
        text: String,
        prompt_tokens: u32,
        /// Prompt tokens the worker reused from its generations' prefix cache (journals and
        /// workers from before the field existed: 0).
        #[serde(default)]
        prefix_tokens: u32,
        completion_tokens: u32,
        finish_reason: String,
        latency_us: u64,
    },
}

/// A job that could not be run (after retries where retrying makes sense). Also the `error`
/// of a hard failure's `failure_malformed.jsonl` row.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct JobFailure {
    pub code: String,
    pub message: String,
}

/// Who produced a result: runtime provenance, excluded from determinism comparisons (the
/// first keys of a row's `runtime`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Provenance {
    pub worker_id: String,
    pub lease_id: LeaseId,
    pub attempt: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub job: JobId,
    pub result: Result<JobOutput, JobFailure>,
    pub provenance: Option<Provenance>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitOutcome {
    Accepted,
    Duplicate,
    Fenced,
}

/// What a worker is told to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlSignal {
    Continue,
    Drain,
    Stop,
}

/// Why a submission's content was refused (the lease stays valid only if nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("unknown session")]
    UnknownSession,
    #[error("result does not match the job: {0}")]
    Mismatch(String),
    /// The table is full (too many live sessions); the caller may retry later.
    #[error("{0}")]
    Exhausted(String),
}
