//! What rank 0 is doing now and how long the rest should take: the live state the progress
//! display draws (`src/progress.rs` in the binary) and the `stageb_phase` metric exports.
//!
//! The run loop names its phase as it enters it (`rollouts step 3/6`, `writing`), reflection
//! names each call's cycle and pass (`reflecting cycle 2 (decision)`), and rank 0's drain after
//! SIGTERM marks the run `draining`.
//!
//! The ETA is the work left times each kind's measured time. Rollouts: the tickets not yet
//! answered, at the time per ticket measured so far. Reflection: the calls still expected, at
//! the time per call measured over finished cycles (a cycle's gate rollouts included). The
//! calls are counted from the structure of the work, as the reflector reports it
//! ([`ReflectionWork`]): the cases waiting in its queue and those the epoch's undecided tickets
//! should bring (at the share of decided tickets that became cases so far) make cycles of
//! `batch_size`, the retry buckets hold their own cycles, each cycle makes the calls a
//! finished cycle made on average, and no epoch makes more calls than its budget leaves (the
//! budget says how many: a resumed run's count comes from its checkpoint). Later epochs are
//! counted the same way over all their tickets, each under a fresh budget.
//!
//! Until a cycle that made a call has finished, reflection's cost is unknown and the ETA is a
//! lower bound ([`Eta::at_least`], shown as `>=`): scaling the first round's elapsed time by
//! the rounds left made it swing (124 s, 553 s, then 63 s within four minutes of one demo run),
//! and counting the calls a round made on average times the rounds left read 2.5 times the
//! time actually left (an epoch's last round drains what is left of its queue, often little).
//! While reflection runs the ETA stays above zero.
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

/// Time the run has spent so far, by kind of work, for the ETA (this attempt's).
#[derive(Debug, Clone, Default)]
pub struct Timing {
    /// Seconds spent in finished rollout waits (a step's queueing to its last answer).
    pub rollout_secs: f64,
    /// Tickets answered during those waits and the one under way.
    pub rollout_tickets: u64,
    /// When the rollout wait under way began, and the tickets answered in it (not decided yet).
    pub rollout_since: Option<Instant>,
    pub answered_in_wait: u64,
    /// Gradient candidates queued for reflection.
    pub cases_queued: u64,
    /// Reflection cycles finished that made a model call.
    pub cycles_with_calls: u64,
    /// Seconds those cycles took and the calls they made.
    pub cycle_secs: f64,
    pub cycle_calls: u64,
    /// When the cycle under way began, and the calls it made so far.
    pub cycle_since: Option<Instant>,
    pub calls_in_cycle: u64,
    /// When the reflection round under way (a step boundary's, or an epoch end's) began.
    pub round_since: Option<Instant>,
}

/// What waits for reflection, as the reflector reports it from its queue and its epoch budget
/// (counts only: the ETA's input).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReflectionWork {
    /// Cases waiting in the pending queue: they leave in batches of `batch_size`.
    pub pending: u64,
    /// Cycles the retry buckets hold (each at its own, smaller batch size).
    pub retry_cycles: u64,
    /// `reflection.batch_size`.
    pub batch_size: u64,
    /// Calls the epoch under way can still make (`None`: no cap; 0 once a budget is spent).
    pub calls_left: Option<u64>,
    /// Calls a fresh epoch may make (`None`: no cap).
    pub calls_per_epoch: Option<u64>,
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
    /// What waits for reflection, as the reflector last reported it.
    pub reflection: ReflectionWork,
    /// Every phase entered, in order, when set to `Some` (tests and diagnostics; off in runs).
    pub phase_log: Option<Vec<Phase>>,
}

/// Shared between the run loop, reflection, rank 0's drain and the progress reporter.
pub type ProgressHandle = Arc<Mutex<ProgressSnapshot>>;

/// Smallest time left counted while reflection runs (it is not over yet).
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
        self.timing.answered_in_wait = 0;
    }

    /// One ticket's answer arrived.
    pub fn ticket_answered(&mut self) {
        self.done += 1;
        self.timing.rollout_tickets += 1;
        self.timing.answered_in_wait += 1;
    }

    /// The step's last answer arrived: its tickets are decided next.
    pub fn end_rollouts(&mut self, now: Instant) {
        if let Some(t) = self.timing.rollout_since.take() {
            self.timing.rollout_secs += now.saturating_duration_since(t).as_secs_f64();
        }
        self.timing.answered_in_wait = 0;
    }

    /// A reflection round (a step boundary's, or an epoch end's draining one) begins.
    pub fn begin_round(&mut self, now: Instant) {
        self.timing.round_since = Some(now);
    }

    /// The round under way ended.
    pub fn end_round(&mut self) {
        self.timing.round_since = None;
    }

    /// A gradient candidate joined the reflection queue.
    pub fn case_queued(&mut self) {
        self.timing.cases_queued += 1;
    }

    /// A reflection cycle begins (its batch has left the queue).
    pub fn begin_cycle(&mut self, now: Instant) {
        self.timing.cycle_since = Some(now);
        self.timing.calls_in_cycle = 0;
    }

    /// A reflection model call was made (decision, ops or revision pass, or a JSON retry).
    pub fn call_made(&mut self) {
        self.timing.calls_in_cycle += 1;
    }

    /// The cycle under way ended.
    pub fn end_cycle(&mut self, now: Instant) {
        let t = &mut self.timing;
        if let Some(since) = t.cycle_since.take() {
            t.cycle_secs += now.saturating_duration_since(since).as_secs_f64();
            let calls = std::mem::take(&mut t.calls_in_cycle);
            t.cycles_with_calls += u64::from(calls > 0);
            t.cycle_calls += calls;
        }
    }

    /// Time the run has left at `now` (see the module header): `None` while no ticket has
    /// been answered, a lower bound while reflection has calls to make that were not timed.
    pub fn eta(&self, now: Instant) -> Option<Eta> {
        let t = &self.timing;
        let tickets_left = self.total.saturating_sub(self.done);
        let rollouts = match (tickets_left, t.rollout_tickets) {
            (0, _) => 0.0,
            (_, 0) => return None,
            (left, n) => {
                let waiting = t
                    .rollout_since
                    .map_or(0.0, |a| now.saturating_duration_since(a).as_secs_f64());
                (t.rollout_secs + waiting) / n as f64 * left as f64
            }
        };
        let reflecting = t.round_since.is_some() || t.cycle_since.is_some();
        let floor = if reflecting { ROUND_FLOOR_SECS } else { 0.0 };
        let make = |secs: f64, at_least| Eta {
            left: Duration::from_secs_f64(secs.max(0.0)),
            at_least,
        };
        let timed = t.cycle_calls > 0;
        Some(match self.calls_left(timed) {
            Some(calls) if timed => {
                let per_call = t.cycle_secs / t.cycle_calls as f64;
                make(rollouts + (calls * per_call).max(floor), false)
            }
            Some(0.0) => make(rollouts + floor, false),
            // What a call costs, or how many are coming, is not known yet.
            _ => make(rollouts + floor, true),
        })
    }

    /// Model calls reflection still expects (see the module header): the cycle under way's
    /// rest and this epoch's cycles under what its budget leaves, then each later epoch's.
    /// `None` while no decided ticket says how many of them become cases. Before a cycle was
    /// timed (`timed` false) a cycle counts one call: only whether any is left matters then.
    fn calls_left(&self, timed: bool) -> Option<f64> {
        let t = &self.timing;
        let w = &self.reflection;
        let per_cycle = if timed {
            t.cycle_calls as f64 / t.cycles_with_calls.max(1) as f64
        } else {
            1.0
        };
        let epochs = u64::from(self.epochs.max(1));
        let epoch = u64::from(self.epoch.clamp(1, self.epochs.max(1)));
        let per_epoch = self.total / epochs;
        let decided = self.done.saturating_sub(t.answered_in_wait);
        let decided_this_epoch = decided.saturating_sub((epoch - 1) * per_epoch);
        let undecided = per_epoch.saturating_sub(decided_this_epoch);
        let decided_here = t.rollout_tickets.saturating_sub(t.answered_in_wait);
        let to_come = undecided + per_epoch * (epochs - epoch);
        let share = match (to_come, decided_here) {
            (0, _) => 0.0,
            (_, 0) => return None,
            (_, n) => t.cases_queued as f64 / n as f64,
        };
        let batch = w.batch_size.max(1) as f64;
        let cycles = |cases: f64| (cases / batch - 1e-9).ceil().max(0.0);
        let cap = |calls: f64, budget: Option<u64>| budget.map_or(calls, |b| calls.min(b as f64));
        let in_cycle = if t.cycle_since.is_some() {
            (per_cycle - t.calls_in_cycle as f64).max(0.0)
        } else {
            0.0
        };
        let this_epoch =
            cycles(w.pending as f64 + undecided as f64 * share) + w.retry_cycles as f64;
        let now = cap(in_cycle + this_epoch * per_cycle, w.calls_left);
        let later = cap(
            cycles(per_epoch as f64 * share) * per_cycle,
            w.calls_per_epoch,
        );
        Some(now + later * (epochs - epoch) as f64)
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
