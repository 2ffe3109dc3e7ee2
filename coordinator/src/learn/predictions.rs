//! Checked predictions (`reflection.gate` on): an applied op may claim which of its evidence
//! tickets it will get right (`expected_flips`). Each claim is settled by the ticket's first
//! decision in a later epoch (right or wrong against its label); once every claim of an op is
//! settled, the op's figures go to that epoch's `metrics.jsonl` epoch row (`predictions`), in
//! the order the ops were applied. An op without claims is never tracked: absent predictions
//! change nothing.

use serde::{Deserialize, Serialize};
use stageb_shared::domain::TicketKey;

/// One applied op's claims, while they are being settled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prediction {
    pub reflection_id: String,
    /// The epoch the op was applied in; its claims are settled in later epochs.
    pub epoch: u32,
    /// The rule the op touched (`G3`) and its kind (`add`, `update`, …).
    pub key: String,
    pub op: String,
    pub claimed: Vec<TicketKey>,
    pub hits: Vec<TicketKey>,
    pub misses: Vec<TicketKey>,
}

impl Prediction {
    fn settled(&self) -> bool {
        self.hits.len() + self.misses.len() == self.claimed.len()
    }
}

/// A settled prediction, as the epoch row shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictionCheck {
    pub reflection_id: String,
    pub epoch_applied: u32,
    pub key: String,
    pub op: String,
    pub claimed: usize,
    pub hits: usize,
    /// `hits / claimed`.
    pub hit_rate: f64,
    /// The claimed tickets decided wrongly.
    pub missed: Vec<TicketKey>,
}

/// The open predictions of a run (reflector state: the step checkpoint carries them).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Predictions {
    open: Vec<Prediction>,
}

impl Predictions {
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Track `prediction` (one without claims is ignored).
    pub fn add(&mut self, prediction: Prediction) {
        if !prediction.claimed.is_empty() {
            self.open.push(prediction);
        }
    }

    /// Ticket `key` was decided in `epoch`, right or not: it settles every open claim on it
    /// made in an earlier epoch.
    pub fn note(&mut self, key: &TicketKey, epoch: u32, correct: bool) {
        for p in self.open.iter_mut().filter(|p| p.epoch < epoch) {
            let open = p.claimed.contains(key) && !p.hits.contains(key) && !p.misses.contains(key);
            if open {
                let side = if correct { &mut p.hits } else { &mut p.misses };
                side.push(key.clone());
            }
        }
    }

    /// The predictions whose claims are all settled, taken out in the order they were made.
    pub fn take_settled(&mut self) -> Vec<PredictionCheck> {
        let (settled, open): (Vec<_>, Vec<_>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(Prediction::settled);
        self.open = open;
        settled
            .into_iter()
            .map(|p| PredictionCheck {
                hit_rate: p.hits.len() as f64 / p.claimed.len() as f64,
                claimed: p.claimed.len(),
                hits: p.hits.len(),
                missed: p.misses,
                reflection_id: p.reflection_id,
                epoch_applied: p.epoch,
                key: p.key,
                op: p.op,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> TicketKey {
        TicketKey(s.into())
    }

    #[test]
    fn claims_are_settled_by_the_next_epochs_decisions_and_counted_exactly() {
        let mut p = Predictions::default();
        p.add(Prediction {
            reflection_id: "r1".into(),
            epoch: 1,
            key: "G2".into(),
            op: "add".into(),
            claimed: vec![key("a::fail"), key("b::fail")],
            hits: vec![],
            misses: vec![],
        });
        p.note(&key("a::fail"), 1, true);
        assert!(
            p.take_settled().is_empty(),
            "a decision of the same epoch settles nothing"
        );
        p.note(&key("a::fail"), 2, true);
        assert!(p.take_settled().is_empty(), "b is still open");
        p.note(&key("b::fail"), 2, false);
        p.note(&key("b::fail"), 3, true);
        let checks = p.take_settled();
        assert_eq!(checks.len(), 1);
        assert_eq!((checks[0].claimed, checks[0].hits), (2, 1));
        assert_eq!(
            checks[0].missed,
            vec![key("b::fail")],
            "the first later decision counts"
        );
        assert!(p.is_empty());
    }
}
