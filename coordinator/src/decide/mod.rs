//! Decisions rank 0 makes from rollout results, all pure and deterministic.
//!
//! - [`selection`]: one verdict per ticket by majority vote, with the fail-first override.
//! - [`fail_first`]: the mission-scoped fail-first guardrail (negative evidence in Stage-A
//!   summaries).
//! - [`eligibility`]: which tickets carry learnable signal (gradient candidates).
//! - [`accuracy`]: accuracy windows and epoch rows (`metrics.jsonl`), recomputable from
//!   selections.
//! - [`split`]: the held-out splits of `reflection.gate` (train, gate, final).

pub mod accuracy;
pub mod eligibility;
pub mod fail_first;
pub mod selection;
pub mod split;
