//! The held-out splits of `reflection.gate`: every group id is train (reflection learns from
//! it), gate or final (decided like the others, never shown to reflection). Groups are ranked
//! by a seeded hash of their id; the first `round(gate_fraction × groups)` are gate, the next
//! `round(final_fraction × groups)` final. So both labels of a resubmitted group share a side,
//! the counts are exact, and the assignment depends only on the run seed and the group ids
//! (never on the order tickets arrive in, the worker count or a resume).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use stageb_shared::config::GateConfig;
use stageb_shared::seed::derived_seed;

/// Which side of the held-out line a ticket is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    Train,
    Gate,
    Final,
}

impl Split {
    pub const ALL: [Split; 3] = [Split::Train, Split::Gate, Split::Final];

    pub fn as_str(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Gate => "gate",
            Split::Final => "final",
        }
    }

    /// Gate and final tickets never reach reflection.
    pub fn held_out(self) -> bool {
        self != Split::Train
    }
}

/// The split of every group of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Splits(BTreeMap<String, Split>);

impl Splits {
    /// Assign `groups` (duplicates count once) under `config` and the run seed.
    pub fn assign<'a>(
        run_seed: u64,
        groups: impl IntoIterator<Item = &'a str>,
        config: &GateConfig,
    ) -> Self {
        let mut ranked: Vec<(u64, &str)> = groups
            .into_iter()
            .map(|g| {
                (
                    derived_seed(run_seed, "reflection.gate/split", &[g.as_bytes()]),
                    g,
                )
            })
            .collect();
        ranked.sort_unstable();
        ranked.dedup_by(|a, b| a.1 == b.1);
        let n = ranked.len() as f64;
        let gate = (config.gate_fraction * n).round() as usize;
        let held = gate + (config.final_fraction * n).round() as usize;
        let splits = ranked
            .into_iter()
            .enumerate()
            .map(|(i, (_, g))| {
                let split = match i {
                    i if i < gate => Split::Gate,
                    i if i < held => Split::Final,
                    _ => Split::Train,
                };
                (g.to_string(), split)
            })
            .collect();
        Splits(splits)
    }

    /// The split of `group` (train for a group the run did not start with).
    pub fn of(&self, group: &str) -> Split {
        self.0.get(group).copied().unwrap_or(Split::Train)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many groups each split holds.
    fn sizes(splits: &Splits) -> BTreeMap<Split, usize> {
        let mut sizes = BTreeMap::new();
        for split in splits.0.values() {
            *sizes.entry(*split).or_default() += 1;
        }
        sizes
    }

    fn gate(gate_fraction: f64, final_fraction: f64) -> GateConfig {
        GateConfig {
            enabled: true,
            gate_fraction,
            final_fraction,
            remember_rejected: 0,
            ..GateConfig::default()
        }
    }

    #[test]
    fn counts_are_exact_and_a_group_keeps_its_side_whatever_the_order() {
        let groups: Vec<String> = (0..50).map(|i| format!("QC-{i:03}")).collect();
        let forward = Splits::assign(7, groups.iter().map(String::as_str), &gate(0.2, 0.1));
        let backward = Splits::assign(
            7,
            groups.iter().rev().chain(&groups).map(String::as_str),
            &gate(0.2, 0.1),
        );
        assert_eq!(forward, backward, "order and repeats change nothing");
        let sizes = sizes(&forward);
        assert_eq!(sizes[&Split::Gate], 10);
        assert_eq!(sizes[&Split::Final], 5);
        assert_eq!(sizes[&Split::Train], 35);
        let other_seed = Splits::assign(8, groups.iter().map(String::as_str), &gate(0.2, 0.1));
        assert_ne!(forward, other_seed, "the run seed decides the split");
    }

    #[test]
    fn unknown_groups_are_train() {
        let splits = Splits::assign(1, ["a", "b"], &gate(0.5, 0.0));
        assert_eq!(splits.of("zzz"), Split::Train);
        assert!(!Split::Train.held_out() && Split::Gate.held_out() && Split::Final.held_out());
    }
}
