//! Rule ablation (`reflection.gate.ablation_every`): at the end of every
//! N-th epoch, each learned rule (`G1` and after) is left out of the epoch's final guidance in
//! turn, the gate split is rolled out under each such guidance (the gate phase's rollouts and
//! its outcomes of the epoch, so the full guidance usually costs nothing), and the rule's
//! contribution is the gate accuracy with it minus without it, with a 90% paired-bootstrap
//! interval. The result goes to the epoch's `metrics.jsonl` row (`ablation`) and the report.
//! It changes nothing: no rule is removed for it.

use serde::{Deserialize, Serialize};
use stageb_shared::seed::derived_seed;

use super::ReflectionError;
use super::gate::Gate;
use crate::cluster::dispatch::Dispatch;
use crate::guidance::{GuidanceRepo, MissionGuidance, RuleKey};
use crate::learn::gate_decision::{self, Contribution};

/// One learned rule's contribution on the gate split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuleAblation {
    pub key: String,
    /// Gate tickets evaluated.
    pub tickets: usize,
    /// Gate accuracy with every rule, and with this one left out.
    pub accuracy_with: f64,
    pub accuracy_without: f64,
    /// `accuracy_with − accuracy_without`, with its 90% interval.
    pub contribution: Contribution,
}

impl Gate {
    /// Whether `epoch`'s end runs the ablation: the gate on with tickets, and every N-th epoch.
    pub(super) fn ablation_due(&self, epoch: u32) -> bool {
        let gate = &self.config;
        let every = gate.ablation_every;
        gate.enabled && every > 0 && epoch.is_multiple_of(every) && self.has_tickets()
    }

    /// Each learned rule of `guidance` left out in turn (key order); empty when none is due
    /// or there is no learned rule.
    pub(super) async fn ablate(
        &mut self,
        epoch: u32,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<Vec<RuleAblation>, ReflectionError> {
        let full = guidance.current();
        let learned: Vec<RuleKey> = full
            .experiences
            .keys()
            .copied()
            .filter(|k| !k.is_scaffold() && !k.is_g0())
            .collect();
        if !self.ablation_due(epoch) || learned.is_empty() {
            return Ok(Vec::new());
        }
        let variants: Vec<MissionGuidance> = learned.iter().map(|k| without(full, *k)).collect();
        let mut guidances = vec![full];
        guidances.extend(variants.iter());
        let outcomes = self.outcomes_of(epoch, &guidances, dispatch).await?;
        let with = &outcomes[0];
        let accuracy = |v: &[bool]| v.iter().filter(|c| **c).count() as f64 / v.len() as f64;
        Ok(learned
            .iter()
            .zip(&outcomes[1..])
            .map(|(key, left_out)| {
                let seed = derived_seed(
                    self.run_seed,
                    "reflection.gate/ablation",
                    &[&epoch.to_le_bytes(), key.to_string().as_bytes()],
                );
                RuleAblation {
                    key: key.to_string(),
                    tickets: with.len(),
                    accuracy_with: accuracy(with),
                    accuracy_without: accuracy(left_out),
                    contribution: gate_decision::contribution(with, left_out, seed),
                }
            })
            .collect())
    }
}

/// `g` with the rule `key` left out.
fn without(g: &MissionGuidance, key: RuleKey) -> MissionGuidance {
    let mut out = g.clone();
    out.experiences.remove(&key);
    out.metadata.remove(&key);
    out
}
