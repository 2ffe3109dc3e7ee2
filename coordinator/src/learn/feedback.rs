//! Hit/miss feedback bookkeeping: which *rule* a decided ticket's feedback belongs to
//! (docs/design/reflection.md, "Hit/miss feedback"): never a newer rule under a reused key.
//!
//! Feedback is owed to the rules of the last applied reflection at the time a ticket is
//! decided, but it is written later: stable tickets at the step's end, gradient candidates only
//! once they are covered, possibly cycles later. Meanwhile a key can be deleted or merged away
//! and then taken again by a new rule (keys reuse the smallest free `G<i>`). Feedback earned by
//! the old `G2` must never be credited to the new `G2`, so rules are identified here by
//! [`RuleRef`] = key + *generation*: the generation of a key is bumped every time the key is
//! removed, and a buffered reference whose generation is no longer current resolves to
//! nothing.

use crate::guidance::RuleKey;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One rule as feedback refers to it: its key and the key's generation at that time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RuleRef {
    pub key: RuleKey,
    pub generation: u64,
}

/// Hit/miss feedback a gradient ticket owes the rules that were active when it was decided;
/// committed only if the ticket ends up a contributor.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingFeedback {
    pub rules: Vec<RuleRef>,
    pub label_match: bool,
}

/// Generations of keys, the rules of the last applied reflection, and the immediate feedback
/// of stable tickets waiting for the step's end. Serialized in the step checkpoint.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FeedbackLedger {
    generations: BTreeMap<RuleKey, u64>,
    last_applied: Vec<RuleRef>,
    immediate_hits: Vec<RuleRef>,
    immediate_misses: Vec<RuleRef>,
}

impl FeedbackLedger {
    fn reference(&self, key: RuleKey) -> RuleRef {
        RuleRef {
            key,
            generation: self.generations.get(&key).copied().unwrap_or(0),
        }
    }

    /// A reflection was applied: `removed` keys (deleted or merged away) end their rule, even
    /// when the same apply creates a new rule under the key; `touched` become the rules that
    /// later decisions give feedback to.
    pub fn on_applied(&mut self, touched: &[RuleKey], removed: &[RuleKey]) {
        self.on_removed(removed);
        self.last_applied = touched.iter().map(|k| self.reference(*k)).collect();
    }

    /// Rules removed outside a reflection (lifecycle cleanup).
    pub fn on_removed(&mut self, removed: &[RuleKey]) {
        for k in removed {
            *self.generations.entry(*k).or_insert(0) += 1;
        }
        let current = |r: &RuleRef| self.generations.get(&r.key).copied().unwrap_or(0);
        let last: Vec<RuleRef> = self
            .last_applied
            .iter()
            .copied()
            .filter(|r| r.generation == current(r))
            .collect();
        self.last_applied = last;
    }

    /// The rules a ticket decided now owes feedback to.
    pub fn owed_now(&self) -> Vec<RuleRef> {
        self.last_applied.clone()
    }

    /// Keys of the last applied reflection's rules (still alive).
    pub fn last_applied_keys(&self) -> Vec<RuleKey> {
        self.last_applied.iter().map(|r| r.key).collect()
    }

    /// A stable ticket was decided: its feedback is immediate (written at the step's end).
    pub fn credit_stable(&mut self, label_match: bool) {
        let owed = self.owed_now();
        if label_match {
            self.immediate_hits.extend(owed);
        } else {
            self.immediate_misses.extend(owed);
        }
    }

    /// The keys of `refs` whose rule still exists as it was (generation unchanged).
    pub fn resolve(&self, refs: &[RuleRef]) -> Vec<RuleKey> {
        refs.iter()
            .filter(|r| r.generation == self.reference(r.key).generation)
            .map(|r| r.key)
            .collect()
    }

    /// Immediate (hits, misses) to write now, resolved; the buffer is emptied.
    pub fn take_immediate(&mut self) -> (Vec<RuleKey>, Vec<RuleKey>) {
        let hits = std::mem::take(&mut self.immediate_hits);
        let misses = std::mem::take(&mut self.immediate_misses);
        (self.resolve(&hits), self.resolve(&misses))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regression_feedback_never_reaches_a_new_rule_under_a_reused_key() {
        let mut ledger = FeedbackLedger::default();
        // Reflection 1 adds G2; a gradient ticket decided now buffers feedback for it.
        ledger.on_applied(&[RuleKey::G(2)], &[]);
        let buffered = PendingFeedback {
            rules: ledger.owed_now(),
            label_match: false,
        };
        ledger.credit_stable(true);
        // Reflection 2 deletes G2 and adds a new rule, which takes the free key G2.
        ledger.on_applied(&[RuleKey::G(2)], &[RuleKey::G(2)]);
        assert_eq!(ledger.resolve(&buffered.rules), Vec::<RuleKey>::new());
        assert_eq!(ledger.take_immediate(), (vec![], vec![]));
        // Feedback owed from now on does reach the new G2.
        ledger.credit_stable(true);
        assert_eq!(ledger.take_immediate(), (vec![RuleKey::G(2)], vec![]));
    }

    #[test]
    fn a_merged_away_key_loses_its_feedback_and_updates_keep_theirs() {
        let mut ledger = FeedbackLedger::default();
        ledger.on_applied(&[RuleKey::G1, RuleKey::G(3)], &[]);
        let owed = ledger.owed_now();
        // G1 is updated (still the same rule), G3 merged into G1.
        ledger.on_applied(&[RuleKey::G1], &[RuleKey::G(3)]);
        assert_eq!(ledger.resolve(&owed), vec![RuleKey::G1]);
    }

    #[test]
    fn cleanup_ends_the_last_applied_rules_it_removes() {
        let mut ledger = FeedbackLedger::default();
        ledger.on_applied(&[RuleKey::G1, RuleKey::G(2)], &[]);
        ledger.on_removed(&[RuleKey::G1]);
        assert_eq!(ledger.last_applied_keys(), vec![RuleKey::G(2)]);
    }
}
