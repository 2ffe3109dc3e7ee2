//! What rank 0 is doing now and how long the rest should take: the live state the progress
//! display draws (`src/progress.rs` in the binary) and the `stageb_phase` metric exports.
//!
//! The run loop names its phase as it enters it (`rollouts step 3/6`, `writing`), reflection
//! names each call's cycle and pass (`reflecting cycle 2 (decision)`), and rank 0's drain after
//! SIGTERM marks the run `draining`.
//!
//! The ETA is the work left times each kind's measured time. Rollouts: the tickets not yet
//! answered, at the time per ticket measured so far. Reflection: the model calls still
//! expected (the calls a finished round made on average, times the rounds left, never more
//! than each epoch's call budget leaves), at the time per call measured over finished rounds
//! (a round's gate rollouts and writing included). Until a round has finished, reflection's
//! cost is unknown and the ETA is a lower bound ([`Eta::at_least`], shown as `>=`): scaling the
//! first round's elapsed time by the rounds left made it swing (124 s, 553 s, then 63 s within
//! four minutes of one demo run). A round under way is never counted as finished, so the ETA
//! stays above zero while reflection still runs.
//!
//! Lives outside `run` and `learn` because both write to it: data still flows run →
//! reflection, and neither imports the other for this.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageb_shared::observe;

/// A reflection call's pass, as the progress line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReflectPass {
    Decision,
    Ops,
    Revision,
    /// The gate split rolled out under a candidate guidance.
    Gate,
}

impl ReflectPass {
    pub fn as_str(self) -> &'static str {
        match self {
            ReflectPass::Decision => "decision",
            ReflectPass::Ops => "ops",
            ReflectPass::Revision => "revision",
            ReflectPass::Gate => "gate",
        }
    }
}

/// What rank 0 is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Phase {
    /// Before the first step (waiting for the model, resuming).
    #[default]
    Starting,
    /// Step `step` of the epoch's `steps`: its rollouts queued, answered and decided.
    Rollouts { step: u64, steps: u64 },
    /// A call of reflection cycle `cycle` (the run's cycle counter).
    Reflecting { cycle: u64, pass: ReflectPass },
    /// Closing an epoch or the run: metrics rows, cleanup, `need_review.json`, the summary.
    Writing,
    /// The run is over.
    Done,
}

impl Phase {
    /// The `phase` label of `stageb_phase` (a closed set: [`PHASE_LABELS`]).
    pub fn label(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Rollouts { .. } => "rollouts",
            Phase::Reflecting { pass, .. } => pass.as_str(),
            Phase::Writing => "writing",
            Phase::Done => "done",
        }
    }
}

/// Every value of `stageb_phase`'s `phase` label; exactly one is 1 at a time.
pub const PHASE_LABELS: &[&str] = &[
    "starting", "rollouts", "decision", "ops", "revision", "writing", "draining", "done",
];

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Rollouts { step, steps } => write!(f, "rollouts step {step}/{steps}"),
            Phase::Reflecting { cycle, pass } => {
                write!(f, "reflecting cycle {cycle} ({})", pass.as_str())
            }
            other => f.write_str(other.label()),
        }
    }
}

/// Time the run has spent so far, by kind of work, for the ETA.
#[derive(Debug, Clone, Default)]
pub struct Timing {
    /// Seconds spent in finished rollout waits (a step's queueing to its last answer).
    pub rollout_secs: f64,
    /// Tickets answered during those waits (this attempt).
    pub rollout_tickets: u64,
    /// When the rollout wait under way began.
    pub rollout_since: Option<Instant>,
    /// Reflection rounds finished (this attempt) and the seconds they took.
    pub rounds_measured: u64,
    pub round_secs: f64,
    /// Model calls made in those rounds.
    pub round_calls: u64,
    /// Reflection rounds finished over the whole run (a resumed run starts past its checkpoint).
    pub rounds_done: u64,
    /// Reflection rounds the run has: `epochs × rounds_per_epoch`.
    pub rounds_total: u64,
    /// Reflection rounds an epoch has: one after every step and the epoch end's draining one.
    pub rounds_per_epoch: u64,
    /// When the reflection round under way began, and the calls it made so far.
    pub round_since: Option<Instant>,
    pub calls_in_round: u64,
    /// Model calls an epoch may make (`reflection.max_calls_per_epoch`; `None`: no cap).
    pub call_cap: Option<u64>,
    /// Calls made in epoch `calls_epoch` (this attempt).
    pub calls_this_epoch: u64,
    pub calls_epoch: u32,
}

/// Time a run has left, as far as it was measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Eta {
    pub left: Duration,
    /// Reflection has not been timed yet: the run has at least `left` to go.
    pub at_least: bool,
}

/// Live view for the progress display.
#[derive(Debug, Clone, Default)]
pub struct ProgressSnapshot {
    pub epoch: u32,
    pub epochs: u32,
    pub done: u64,
    pub total: u64,
    pub candidates: u64,
    pub live_workers: usize,
    pub phase: Phase,
    /// Rank 0 was interrupted and drains (no new leases): shown instead of the phase.
    pub draining: bool,
    pub timing: Timing,
    /// Every phase entered, in order, when set to `Some` (tests and diagnostics; off in runs).
    pub phase_log: Option<Vec<Phase>>,
}

/// Shared between the run loop, reflection, rank 0's drain and the progress reporter.
pub type ProgressHandle = Arc<Mutex<ProgressSnapshot>>;

/// Smallest time left counted for a reflection round under way (it is not over yet).
const ROUND_FLOOR_SECS: f64 = 1.0;

impl ProgressSnapshot {
    /// What the progress line shows: `draining`, else the phase.
    pub fn phase_text(&self) -> String {
        if self.draining {
            format!("draining (was {})", self.phase)
        } else {
            self.phase.to_string()
        }
    }

    /// Enters `phase`: logged, and exported as `stageb_phase`.
    pub fn enter(&mut self, phase: Phase) {
        if self.phase == phase {
            return;
        }
        self.phase = phase;
        if let Some(log) = &mut self.phase_log {
            log.push(phase);
        }
        self.export_phase();
    }

    /// Marks the run as draining (rank 0 interrupted).
    pub fn start_draining(&mut self) {
        self.draining = true;
        self.export_phase();
    }

    fn export_phase(&self) {
        let current = if self.draining {
            "draining"
        } else {
            self.phase.label()
        };
        for label in PHASE_LABELS {
            let on = if *label == current { 1.0 } else { 0.0 };
            ::metrics::gauge!(observe::PHASE, "phase" => *label).set(on);
        }
        match self.phase {
            Phase::Rollouts { step, .. } => {
                ::metrics::gauge!(observe::ROLLOUT_STEP).set(step as f64);
            }
            Phase::Reflecting { cycle, .. } => {
                ::metrics::gauge!(observe::REFLECTION_CYCLE).set(cycle as f64);
            }
            _ => {}
        }
    }

    /// A step's rollout wait begins.
    pub fn begin_rollouts(&mut self, now: Instant) {
        self.timing.rollout_since = Some(now);
    }

    /// One ticket's answer arrived.
    pub fn ticket_answered(&mut self) {
        self.done += 1;
        self.timing.rollout_tickets += 1;
    }

    /// The step's last answer arrived.
    pub fn end_rollouts(&mut self, now: Instant) {
        if let Some(t) = self.timing.rollout_since.take() {
            self.timing.rollout_secs += now.saturating_duration_since(t).as_secs_f64();
        }
    }

    /// A reflection round (a step boundary's, or an epoch end's draining one) begins.
    pub fn begin_round(&mut self, now: Instant) {
        self.timing.round_since = Some(now);
        self.timing.calls_in_round = 0;
    }

    /// A reflection model call was made (decision, ops or revision pass).
    pub fn call_made(&mut self) {
        let t = &mut self.timing;
        if t.calls_epoch != self.epoch {
            t.calls_epoch = self.epoch;
            t.calls_this_epoch = 0;
        }
        t.calls_this_epoch += 1;
        t.calls_in_round += 1;
    }

    /// The round under way ended.
    pub fn end_round(&mut self, now: Instant) {
        if let Some(t) = self.timing.round_since.take() {
            self.timing.round_secs += now.saturating_duration_since(t).as_secs_f64();
            self.timing.rounds_measured += 1;
            self.timing.rounds_done += 1;
            self.timing.round_calls += std::mem::take(&mut self.timing.calls_in_round);
        }
    }

    /// Time the run has left at `now` (see the module header): `None` while no ticket has
    /// been answered, a lower bound while no reflection round has finished.
    pub fn eta(&self, now: Instant) -> Option<Eta> {
        let t = &self.timing;
        let since = |at: Option<Instant>| {
            at.map_or(0.0, |a| now.saturating_duration_since(a).as_secs_f64())
        };
        let tickets_left = self.total.saturating_sub(self.done);
        let rollouts = match (tickets_left, t.rollout_tickets) {
            (0, _) => 0.0,
            (_, 0) => return None,
            (left, n) => (t.rollout_secs + since(t.rollout_since)) / n as f64 * left as f64,
        };
        let in_round = t.round_since.is_some();
        let this_round_floor = if in_round { ROUND_FLOOR_SECS } else { 0.0 };
        let make = |secs: f64, at_least| Eta {
            left: Duration::from_secs_f64(secs.max(0.0)),
            at_least,
        };
        if t.rounds_measured == 0 {
            let untimed = t.rounds_total > t.rounds_done;
            return Some(make(rollouts + this_round_floor, untimed));
        }
        let reflection = self.reflection_left(since(t.round_since));
        Some(make(rollouts + reflection.max(this_round_floor), false))
    }

    /// Seconds of reflection left, once a round has been timed: the calls still expected at
    /// the measured time per call (or, while no finished round made a call, the rounds left at
    /// their mean time).
    fn reflection_left(&self, current: f64) -> f64 {
        let t = &self.timing;
        let in_round = u64::from(t.round_since.is_some());
        let after = t.rounds_total.saturating_sub(t.rounds_done + in_round);
        if t.round_calls == 0 {
            let mean = t.round_secs / t.rounds_measured as f64;
            let this_round = (mean - current).max(ROUND_FLOOR_SECS) * in_round as f64;
            return mean * after as f64 + this_round;
        }
        let per_call = t.round_secs / t.round_calls as f64;
        let per_round = t.round_calls as f64 / t.rounds_measured as f64;
        let per_epoch = t.rounds_per_epoch.max(1);
        // Rounds after the current one that belong to this epoch, then to later epochs.
        let into_epoch = (t.rounds_done + in_round) % per_epoch;
        let left_in_epoch = if into_epoch == 0 {
            0
        } else {
            per_epoch - into_epoch
        }
        .min(after);
        let later_epochs = (after - left_in_epoch) as f64 / per_epoch as f64;
        let current_left = (per_round - t.calls_in_round as f64).max(0.0) * in_round as f64;
        let spent = if t.calls_epoch == self.epoch {
            t.calls_this_epoch
        } else {
            0
        };
        let cap = |calls: f64, spent: u64| {
            t.call_cap
                .map_or(calls, |cap| calls.min(cap.saturating_sub(spent) as f64))
        };
        let calls = cap(current_left + per_round * left_in_epoch as f64, spent)
            + later_epochs * cap(per_round * per_epoch as f64, 0);
        calls * per_call
    }
}

/// Enters `phase` on `handle`.
pub fn enter(handle: &ProgressHandle, phase: Phase) {
    handle
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .enter(phase);
}

#[cfg(test)]
mod tests;
