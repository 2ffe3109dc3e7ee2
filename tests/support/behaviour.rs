//! The scripted misbehaviours a spec can switch on, read by the scripted engine (rollout
//! noise) and the scripted reflector (stops, coverage, malformed answers). All off by default.

use std::collections::BTreeSet;

/// Scripted misbehaviours for individual tests (all off by default).
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    /// Declared no-evidence by every decision pass that sees them.
    pub always_stop: BTreeSet<String>,
    /// Declared no-evidence the first time a decision pass sees them only.
    pub stop_first_sighting: BTreeSet<String>,
    /// Never cited as evidence by any ops pass.
    pub never_cover: BTreeSet<String>,
    /// This many first decision calls answer with text that is not JSON.
    pub invalid_json_decisions: usize,
    /// No rollout noise at all.
    pub quiet: bool,
    /// Only the scripted stops above; wrongly decided cases without a direction are not
    /// declared no-evidence.
    pub no_natural_stops: bool,
    /// The first ops call also proposes an absence rule worded with a third-state word
    /// (`否则待定`, rejected by validation); the revision call re-sends every op, as its prompt
    /// asks, with that one corrected.
    pub third_state_op_then_revise: bool,
    /// Every first-round ops call also proposes the same non-rule (`add` with text `1.00`,
    /// rejected as `not_a_rule`), as the demo's small model does.
    pub repeat_bad_op: bool,
    /// Every ops call proposes this rule text (an `add`) and nothing else, citing the cases it
    /// fires on that are wrongly passed, else every case of the prompt: a scripted world for
    /// the gate (a rule that generalizes, one that overfits, one that changes nothing).
    pub propose_only: Option<String>,
}
