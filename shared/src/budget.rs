//! The input budget: how much a run accepts from its inputs, checked by `stageb validate` and
//! by the run alike, before anything is leased. Beyond it an input is refused with
//! [`ErrorCode::InputBudget`](crate::error::ErrorCode::InputBudget) (`E_INPUT_BUDGET`) at its
//! file and line, never after a partial run.
//!
//! Why: 10 million tiny Stage-A records grew `validate` to 3 GB (~540 B per record) before it
//! was killed, and a 100,000-rule guidance file passed `validate` and then failed every ticket
//! (every prompt too long for the model). The caps are far above what a QC mission holds (the
//! Python original's missions have hundreds to a few thousand groups and tens of rules) and low
//! enough that rank 0's memory for them stays in the hundreds of MiB.
//!
//! | what | cap | where |
//! |---|---|---|
//! | tickets per run (all Stage-A files) | [`MAX_TICKETS`] | `ingest::load_tickets`, at the first record beyond |
//! | Stage-A line | `ingest::MAX_LINE_BYTES` (1 MiB) | `ingest` |
//! | guidance file | [`MAX_GUIDANCE_FILE_BYTES`] | guidance loading (seed and the run's own) |
//! | rules per mission | [`MAX_RULES`] | guidance loading |
//! | one rule's text | [`MAX_RULE_CHARS`] | guidance loading |
//! | all rules' text together | [`MAX_GUIDANCE_CHARS`] | guidance loading |
//! | candidates per ticket and decode | `wire::MAX_CANDIDATES_PER_JOB` (256) | config |
//!
//! Prompt tokens: a rollout prompt is the system prompt, the rules and one ticket; the rules'
//! cap keeps the guidance part under ~32k characters, and the run fits every generated length
//! into the model's context (`limits`); a prompt that is still too long fails its job with
//! `PROMPT_TOO_LONG` on the worker, counted per ticket as a hard failure.

/// Tickets one run accepts.
pub const MAX_TICKETS: usize = 100_000;

/// Bytes a guidance file may have (seed or a run's `guidance.json`).
pub const MAX_GUIDANCE_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// Rules (`S*`, `G*`) one mission's guidance may hold.
pub const MAX_RULES: usize = 256;

/// Characters one rule's text may have.
pub const MAX_RULE_CHARS: usize = 4_000;

/// Characters all of one mission's rules may have together: they go into every prompt.
pub const MAX_GUIDANCE_CHARS: usize = 32_000;
