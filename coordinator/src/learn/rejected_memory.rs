//! Rejected edits remembered across cycles (`reflection.gate.remember_rejected`, with the gate
//! on). An op rejected for what it is (its text, its target or its kind; not for its evidence,
//! the cycle's cap or the guidance of the moment) is kept as a normalized hash with its reason,
//! the most recent `remember_rejected` of them. The ops prompt lists them as already rejected,
//! and a re-proposal is refused before validation (`already_rejected`) and never sent back for a
//! revision round, so no call is spent on it.
//!
//! The hash covers the op's kind, its key, its merged keys and its text with white space
//! collapsed and ASCII letters lower-cased; the evidence and the rationale are left out (the
//! same edit backed by other tickets is the same edit).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use stageb_shared::digest::sha256_hex;
use stageb_shared::reflection_schema::ProposedOp;
use stageb_shared::text;

use crate::learn::op_check::{RejectReason, RejectedOp};

/// Characters of an op's text kept for the prompt's list.
const SHOWN_TEXT_CHARS: usize = 120;

/// One remembered rejection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remembered {
    /// [`edit_hash`] of the op.
    pub hash: String,
    /// The op as the prompt shows it (kind, key, text cut to [`SHOWN_TEXT_CHARS`]).
    pub shown: String,
    /// The reason code it was first rejected with.
    pub reason: String,
    /// The reflection cycle that rejected it.
    pub cycle: u64,
}

/// The most recent rejected edits, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedMemory {
    entries: VecDeque<Remembered>,
}

impl RejectedMemory {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The remembered rejection of the same edit as `op`, if any.
    pub fn find(&self, op: &ProposedOp) -> Option<&Remembered> {
        let hash = edit_hash(op);
        self.entries.iter().find(|e| e.hash == hash)
    }

    /// Remember the ops of `rejected` that were refused for what they are, keeping the most
    /// recent `cap` (0 keeps nothing).
    pub fn remember(&mut self, rejected: &[RejectedOp], cycle: u64, cap: usize) {
        for r in rejected.iter().filter(|r| judges_the_edit(r.reason)) {
            let hash = edit_hash(&r.proposed);
            self.entries.retain(|e| e.hash != hash);
            self.entries.push_back(Remembered {
                hash,
                shown: shown(&r.proposed),
                reason: r.reason.code().to_string(),
                cycle,
            });
        }
        while self.entries.len() > cap {
            self.entries.pop_front();
        }
    }

    /// Oldest first.
    pub fn entries(&self) -> impl Iterator<Item = &Remembered> {
        self.entries.iter()
    }
}

/// The normalized hash of an edit (see the module header).
pub fn edit_hash(op: &ProposedOp) -> String {
    let norm = |s: &str| {
        s.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_ascii_lowercase()
    };
    let mut merged: Vec<String> = op.merged_from.iter().flatten().map(|k| norm(k)).collect();
    merged.sort();
    let parts = [
        norm(&op.op),
        norm(op.key.as_deref().unwrap_or_default()),
        merged.join(","),
        norm(op.text.as_deref().unwrap_or_default()),
    ];
    sha256_hex(parts.join("\u{0}").as_bytes())
}

/// Rejections that judge the edit itself, so a re-proposal would deserve the same answer in
/// any cycle; the others depend on the cycle (its evidence, its cap, the guidance then).
fn judges_the_edit(reason: RejectReason) -> bool {
    use RejectReason::*;
    matches!(
        reason,
        UnknownOp
            | MissingKey
            | InvalidKey
            | ScaffoldKey
            | G0Delete
            | MissingText
            | LabelLeak
            | ThirdStateText
            | StageALeak
            | TextTooLong
            | NotARule
            | ScriptMismatch
            | TextTooShort
            | CopiesCaseSummary
            | G0NotFocus
            | DuplicateOfScaffold
            | GateRegression
    )
}

fn shown(op: &ProposedOp) -> String {
    let mut s = op.op.clone();
    if let Some(key) = &op.key {
        s.push(' ');
        s.push_str(key);
    }
    if let Some(t) = &op.text {
        s.push_str(": ");
        s.push_str(&text::truncate_chars(t, SHOWN_TEXT_CHARS));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(kind: &str, key: Option<&str>, text: &str, evidence: &[&str]) -> ProposedOp {
        ProposedOp {
            op: kind.into(),
            key: key.map(str::to_string),
            text: Some(text.into()),
            rationale: Some("because".into()),
            evidence: evidence.iter().map(|s| s.to_string()).collect(),
            merged_from: None,
            expected_flips: None,
        }
    }

    fn rejected(op: ProposedOp, reason: RejectReason) -> RejectedOp {
        RejectedOp {
            index: 0,
            proposed: op,
            reason,
            detail: String::new(),
        }
    }

    #[test]
    fn the_same_edit_is_found_whatever_its_evidence_spacing_or_case() {
        let mut memory = RejectedMemory::default();
        let first = op("add", None, "Rule  A", &["g1::fail"]);
        memory.remember(&[rejected(first, RejectReason::NotARule)], 3, 16);
        let again = op("add", None, " rule a ", &["g2::pass"]);
        let found = memory.find(&again).expect("the same edit");
        assert_eq!((found.reason.as_str(), found.cycle), ("not_a_rule", 3));
        assert!(
            memory
                .find(&op("update", Some("G2"), "rule a", &[]))
                .is_none()
        );
    }

    #[test]
    fn only_rejections_of_the_edit_itself_are_kept_and_only_the_most_recent() {
        let mut memory = RejectedMemory::default();
        let cap_reached = rejected(
            op("add", None, "x", &[]),
            RejectReason::MaxOperationsExceeded,
        );
        memory.remember(&[cap_reached], 1, 16);
        assert!(
            memory.is_empty(),
            "the cycle's cap says nothing of the edit"
        );
        for i in 0..5 {
            let r = rejected(
                op("add", None, &format!("t{i}"), &[]),
                RejectReason::TextTooShort,
            );
            memory.remember(&[r], i, 3);
        }
        let kept: Vec<u64> = memory.entries().map(|e| e.cycle).collect();
        assert_eq!(kept, [2, 3, 4]);
    }
}
