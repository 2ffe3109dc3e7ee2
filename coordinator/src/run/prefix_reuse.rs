//! How much prompt prefill the workers' prefix caches saved, summed over a run's rollouts for
//! `summary.json` `runtime.prefix_cache` (its `reflection` part is counted by the reflector,
//! [`CallPrefixReuse`]).
//!
//! Rank 0 keeps a step's rollouts together (one step's jobs are queued at once, in step
//! order, all with the same guidance), so consecutive rollouts on a worker share their system
//! prompt and guidance, and a worker reuses that head's KV. The numbers depend on which worker
//! got which ticket, so they are runtime facts, outside every determinism comparison.

use serde::{Deserialize, Serialize};

use crate::learn::reflection::CallPrefixReuse;

/// Totals over the rollouts workers computed in this attempt (answers replayed from the job
/// journal prefilled nothing and are left out).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefixReuse {
    /// Rollout answers counted.
    pub rollouts: u64,
    /// Those whose prefill started from a reused prefix.
    pub rollouts_with_hit: u64,
    /// `rollouts_with_hit / rollouts` (0 without rollouts).
    pub hit_rate: f64,
    /// Prompt tokens of those rollouts.
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV was reused instead of prefilled.
    pub prefill_tokens_saved: u64,
    /// The same for the reflection calls (the generations' own prefix store).
    pub reflection: CallPrefixReuse,
}

impl PrefixReuse {
    /// Counts one rollout answer of `prompt_tokens`, `prefix_tokens` of them reused (checked
    /// below `prompt_tokens` when the answer was accepted).
    pub fn add(&mut self, prompt_tokens: u32, prefix_tokens: u32) {
        self.rollouts += 1;
        self.rollouts_with_hit += u64::from(prefix_tokens > 0);
        self.prompt_tokens += u64::from(prompt_tokens);
        self.prefill_tokens_saved += u64::from(prefix_tokens.min(prompt_tokens));
        self.hit_rate = self.rollouts_with_hit as f64 / self.rollouts as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_is_rollouts_with_a_hit_over_rollouts() {
        let mut r = PrefixReuse::default();
        assert_eq!(r.hit_rate, 0.0);
        r.add(600, 0); // the first ticket of a worker
        r.add(610, 580);
        r.add(590, 580);
        r.add(620, 400); // guidance changed after token 400
        assert_eq!(
            r,
            PrefixReuse {
                rollouts: 4,
                rollouts_with_hit: 3,
                hit_rate: 0.75,
                prompt_tokens: 2420,
                prefill_tokens_saved: 1560,
                reflection: CallPrefixReuse::default(),
            }
        );
    }
}
