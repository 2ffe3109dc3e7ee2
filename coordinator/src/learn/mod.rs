//! Learning from gradient candidates: the two-pass reflection and everything that judges what
//! it proposes.
//!
//! - [`dispatch`]: where jobs go and answers come back, with the run's worker grace.
//! - [`reflection`]: the driver (decision pass → need-review, ops pass → guidance edits) and
//!   the `reflection.jsonl` row it writes ([`reflection::ReflectionRow`]).
//! - [`op_check`]: validation of the ops a reflection proposes (stable reject codes).
//! - [`gate_decision`]: the gate's verdict on a candidate guidance (tolerance, paired bootstrap).
//! - [`predictions`]: the claims of applied ops (`expected_flips`), checked an epoch later.
//! - [`rejected_memory`]: rejected edits remembered across cycles (with `reflection.gate`).
//! - [`rule_text`]: whether a proposed rule text is a rule (no label leak, not a number, …).
//! - [`feedback`]: which rule (key and generation) buffered hit/miss feedback belongs to.
//! - [`need_review`]: the stop-gradient queue and its deterministic aggregation.

pub mod feedback;
pub mod gate_decision;
pub mod need_review;
pub mod op_check;
pub mod predictions;
pub mod reflection;
pub mod rejected_memory;
pub mod rule_text;
