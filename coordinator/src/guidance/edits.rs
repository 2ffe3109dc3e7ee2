//! The guidance op vocabulary: the ops a reflection proposes ([`GuidanceOp`]) and the per-op
//! outcome of applying them ([`AppliedOp`], [`SkippedOp`]).
//!
//! These are data, not behavior: they are serialized into every version of the chain (so the
//! chain can be replayed) and into the ops-pass schema, and are shared by op application
//! ([`super::apply`]), the errors ([`super::GuidanceError::NothingApplied`]) and the version
//! records. Validation of model output into these ops is [`crate::learn::op_check`]; applying them is
//! [`super::apply_ops`].

use super::model::RuleKey;
use serde::{Deserialize, Serialize};
use stageb_shared::domain::TicketKey;

/// A validated guidance operation (the output of [`crate::learn::op_check::validate_ops`]). Serialized as
/// the ops-pass schema: `{"op": "add"|"update"|"delete"|"merge", …}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum GuidanceOp {
    Add {
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rationale: Option<String>,
        evidence: Vec<TicketKey>,
    },
    Update {
        key: RuleKey,
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rationale: Option<String>,
        evidence: Vec<TicketKey>,
    },
    Delete {
        key: RuleKey,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rationale: Option<String>,
        evidence: Vec<TicketKey>,
    },
    Merge {
        key: RuleKey,
        merged_from: Vec<RuleKey>,
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rationale: Option<String>,
        evidence: Vec<TicketKey>,
    },
}

impl GuidanceOp {
    pub fn kind(&self) -> &'static str {
        match self {
            GuidanceOp::Add { .. } => "add",
            GuidanceOp::Update { .. } => "update",
            GuidanceOp::Delete { .. } => "delete",
            GuidanceOp::Merge { .. } => "merge",
        }
    }

    pub fn evidence(&self) -> &[TicketKey] {
        match self {
            GuidanceOp::Add { evidence, .. }
            | GuidanceOp::Update { evidence, .. }
            | GuidanceOp::Delete { evidence, .. }
            | GuidanceOp::Merge { evidence, .. } => evidence,
        }
    }

    /// The target key, when the op names one (`add` does not).
    pub fn key(&self) -> Option<RuleKey> {
        match self {
            GuidanceOp::Add { .. } => None,
            GuidanceOp::Update { key, .. }
            | GuidanceOp::Delete { key, .. }
            | GuidanceOp::Merge { key, .. } => Some(*key),
        }
    }

    pub fn text(&self) -> Option<&str> {
        match self {
            GuidanceOp::Add { text, .. }
            | GuidanceOp::Update { text, .. }
            | GuidanceOp::Merge { text, .. } => Some(text),
            GuidanceOp::Delete { .. } => None,
        }
    }
}

/// What an applied op did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpEffect {
    Created,
    Updated,
    Deleted,
    Merged,
}

/// An op that changed the guidance, with the key it resolved to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedOp {
    /// Position in the op list given to [`apply_ops`](super::apply_ops).
    pub index: usize,
    pub op: String,
    pub key: RuleKey,
    pub effect: OpEffect,
    /// Keys removed by a merge (those that existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged_away: Vec<RuleKey>,
    pub evidence: Vec<TicketKey>,
}

/// Why an op was not applied (ops validation rejects these earlier; apply re-checks so that
/// guidance invariants never depend on the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    ScaffoldKey,
    G0Delete,
    MissingKey,
    EmptyText,
    DuplicateOfScaffold,
    DuplicateText,
    /// The text equals the rule's current text ([`loose_form`]): nothing would change, so the
    /// op gets no step, no version, no hit and covers no evidence.
    ///
    /// [`loose_form`]: super::loose_form
    Unchanged,
}

/// An op that did not change the guidance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedOp {
    pub index: usize,
    pub op: String,
    pub reason: SkipReason,
    pub detail: String,
}
