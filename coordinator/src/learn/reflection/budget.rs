//! The epoch's reflection budgets: the model calls an epoch may make
//! (`reflection.max_calls_per_epoch`, [`CallBudget`]) and the reflections an epoch may apply
//! (`reflection.change_cap_per_epoch`, [`ChangeCap`]). [`EpochBudget`] holds both with their
//! caps: they are counted here, reset here at the epoch's start and compared here; the caps
//! come from the config, the counts go into checkpoints.

use serde::{Deserialize, Serialize};

/// Model calls this epoch, against `reflection.max_calls_per_epoch` (`None`: no cap).
/// Serialized as the bare count, as checkpoints have always stored it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CallBudget {
    spent: u32,
}

impl CallBudget {
    /// Whether one more call fits under `cap`.
    pub fn left(&self, cap: Option<u32>) -> bool {
        cap.is_none_or(|cap| self.spent < cap)
    }

    /// Calls still allowed under `cap` (`None`: no cap).
    pub fn remaining(&self, cap: Option<u32>) -> Option<u32> {
        cap.map(|cap| cap.saturating_sub(self.spent))
    }

    /// Charge one call (the caller has checked [`CallBudget::left`]).
    pub fn charge(&mut self) {
        self.spent += 1;
    }

    /// Whether upcoming cycle `j` (0: the next) is likely to get its calls: the budget covers
    /// the running cycle's two calls, and two for each cycle up to and including `j`.
    pub fn covers_cycle_ahead(&self, cap: Option<u32>, j: usize) -> bool {
        let needed = self.spent as u64 + 2 * (j as u64 + 2);
        cap.is_none_or(|cap| needed <= cap as u64)
    }
}

/// Reflections applied this epoch, against `reflection.change_cap_per_epoch` (`None`: no cap).
/// Serialized as the bare count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ChangeCap {
    applied: u32,
}

impl ChangeCap {
    /// Has the epoch applied `cap` reflections already?
    pub fn reached(&self, cap: Option<u32>) -> bool {
        cap.is_some_and(|cap| self.applied >= cap)
    }

    /// Count one applied reflection.
    pub fn count_applied(&mut self) {
        self.applied += 1;
    }
}

/// The epoch's two budgets with their caps: what the cycle asks before a call or an apply.
#[derive(Debug, Clone)]
pub(super) struct EpochBudget {
    calls: CallBudget,
    changes: ChangeCap,
    call_cap: Option<u32>,
    change_cap: Option<u32>,
}

impl EpochBudget {
    /// The budgets under `call_cap` and `change_cap`, with the counts spent so far this epoch.
    pub(super) fn new(
        (call_cap, change_cap): (Option<u32>, Option<u32>),
        calls: CallBudget,
        changes: ChangeCap,
    ) -> Self {
        EpochBudget {
            calls,
            changes,
            call_cap,
            change_cap,
        }
    }

    /// A new epoch: nothing spent, nothing applied.
    pub(super) fn reset(&mut self) {
        self.calls = CallBudget::default();
        self.changes = ChangeCap::default();
    }

    /// Whether one more call fits this epoch.
    pub(super) fn calls_left(&self) -> bool {
        self.calls.left(self.call_cap)
    }

    /// Calls the epoch can still make (`None`: no cap): none once the change cap is reached,
    /// as a cycle then makes no call.
    pub(super) fn calls_remaining(&self) -> Option<u32> {
        if self.change_cap_reached() {
            return Some(0);
        }
        self.calls.remaining(self.call_cap)
    }

    /// Calls a fresh epoch may make (`reflection.max_calls_per_epoch`; `None`: no cap).
    pub(super) fn calls_per_epoch(&self) -> Option<u32> {
        self.call_cap
    }

    /// Charge one call (the caller has checked [`EpochBudget::calls_left`]).
    pub(super) fn charge_call(&mut self) {
        self.calls.charge();
    }

    /// Has the epoch applied its cap of reflections already?
    pub(super) fn change_cap_reached(&self) -> bool {
        self.changes.reached(self.change_cap)
    }

    /// Count one applied reflection.
    pub(super) fn count_applied(&mut self) {
        self.changes.count_applied();
    }

    /// Whether upcoming cycle `j` (0: the next) is likely to get its calls: the change cap is
    /// not reached and the call budget covers this cycle's two calls and theirs.
    pub(super) fn covers_cycle_ahead(&self, j: usize) -> bool {
        !self.change_cap_reached() && self.calls.covers_cycle_ahead(self.call_cap, j)
    }

    /// The counts, as a checkpoint stores them.
    pub(super) fn counts(&self) -> (CallBudget, ChangeCap) {
        (self.calls, self.changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capped_call_budget_runs_out_at_its_cap() {
        let mut b = CallBudget::default();
        assert!(b.left(Some(2)));
        b.charge();
        b.charge();
        assert!(!b.left(Some(2)));
        assert!(b.left(None));
    }

    #[test]
    fn a_cycle_ahead_needs_two_calls_for_itself_and_each_before_it() {
        let mut b = CallBudget::default();
        b.charge();
        // 1 spent + the running cycle's 2 + the next cycle's 2 = 5.
        assert!(b.covers_cycle_ahead(Some(5), 0));
        assert!(!b.covers_cycle_ahead(Some(4), 0));
        assert!(!b.covers_cycle_ahead(Some(6), 1));
        assert!(b.covers_cycle_ahead(None, 100));
    }

    #[test]
    fn no_cycle_ahead_gets_calls_once_the_change_cap_is_reached() {
        let mut b = EpochBudget::new((None, Some(1)), CallBudget::default(), ChangeCap::default());
        assert!(b.covers_cycle_ahead(3));
        b.count_applied();
        assert!(b.change_cap_reached());
        assert!(!b.covers_cycle_ahead(0));
        assert!(b.calls_left(), "the call budget is another budget");
    }

    #[test]
    fn a_new_epoch_starts_both_budgets_afresh_under_the_same_caps() {
        let mut b = EpochBudget::new(
            (Some(1), Some(1)),
            CallBudget::default(),
            ChangeCap::default(),
        );
        b.charge_call();
        b.count_applied();
        assert!(!b.calls_left() && b.change_cap_reached());
        b.reset();
        assert!(b.calls_left() && !b.change_cap_reached());
        b.charge_call();
        assert!(!b.calls_left(), "still capped at one call");
    }

    #[test]
    fn the_calls_remaining_are_the_cap_less_those_spent_and_none_past_the_change_cap() {
        let mut b = EpochBudget::new(
            (Some(3), Some(1)),
            CallBudget::default(),
            ChangeCap::default(),
        );
        b.charge_call();
        assert_eq!(b.calls_remaining(), Some(2));
        assert_eq!(b.calls_per_epoch(), Some(3));
        b.count_applied();
        assert_eq!(
            b.calls_remaining(),
            Some(0),
            "a cycle past the change cap makes no call"
        );
        let resumed = EpochBudget::new((Some(3), None), b.counts().0, ChangeCap::default());
        assert_eq!(
            resumed.calls_remaining(),
            Some(2),
            "a checkpoint's count is kept"
        );
        let open = EpochBudget::new((None, None), CallBudget::default(), ChangeCap::default());
        assert_eq!(open.calls_remaining(), None);
    }

    #[test]
    fn budgets_serialize_as_their_bare_counts() {
        let mut b = CallBudget::default();
        b.charge();
        assert_eq!(serde_json::to_string(&b).unwrap(), "1");
        let c: ChangeCap = serde_json::from_str("3").unwrap();
        assert!(c.reached(Some(3)));
        assert!(!c.reached(None));
    }
}
