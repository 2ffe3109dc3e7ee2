//! Specs of the progress state: how phases read, and an ETA that counts reflection.

use std::time::{Duration, Instant};

use super::*;

/// A run of 2 epochs × 3 steps of 8 tickets: 48 tickets, 2 × (3 + 1) reflection rounds.
fn run() -> ProgressSnapshot {
    ProgressSnapshot {
        total: 48,
        timing: Timing {
            rounds_total: 8,
            ..Timing::default()
        },
        ..ProgressSnapshot::default()
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn phases_read_as_the_progress_line_shows_them() {
    let mut p = ProgressSnapshot::default();
    assert_eq!(p.phase_text(), "starting");
    p.enter(Phase::Rollouts { step: 3, steps: 6 });
    assert_eq!(p.phase_text(), "rollouts step 3/6");
    p.enter(Phase::Reflecting {
        cycle: 2,
        pass: ReflectPass::Decision,
    });
    assert_eq!(p.phase_text(), "reflecting cycle 2 (decision)");
    p.start_draining();
    assert_eq!(
        p.phase_text(),
        "draining (was reflecting cycle 2 (decision))"
    );
    assert!(PHASE_LABELS.contains(&p.phase.label()));
}

#[test]
fn the_phase_log_keeps_every_change_once() {
    let mut p = ProgressSnapshot {
        phase_log: Some(Vec::new()),
        ..ProgressSnapshot::default()
    };
    let ops = Phase::Reflecting {
        cycle: 0,
        pass: ReflectPass::Ops,
    };
    p.enter(ops);
    p.enter(ops); // a JSON retry of the same pass
    p.enter(Phase::Writing);
    assert_eq!(p.phase_log, Some(vec![ops, Phase::Writing]));
}

#[test]
fn the_eta_is_unknown_until_a_ticket_was_answered() {
    let mut p = run();
    let t0 = Instant::now();
    p.begin_rollouts(t0);
    assert_eq!(p.eta(t0 + secs(5)), None);
}

#[test]
fn the_eta_scales_rollouts_by_the_time_per_ticket_and_rounds_by_their_mean() {
    let mut p = run();
    let t0 = Instant::now();
    p.begin_rollouts(t0);
    for _ in 0..8 {
        p.ticket_answered();
    }
    p.end_rollouts(t0 + secs(16)); // 2 s per ticket
    p.begin_round(t0 + secs(16));
    p.end_round(t0 + secs(26)); // a round of 10 s
    // 40 tickets × 2 s + 7 rounds × 10 s
    assert_eq!(left(&p, t0 + secs(26)), secs(80 + 70));
}

/// Regression: once every ticket was answered the line read `eta=0s` for
/// the minutes the last reflection rounds still took.
#[test]
fn the_eta_stays_above_zero_while_reflection_is_still_to_run() {
    let mut p = run();
    let t0 = Instant::now();
    p.begin_rollouts(t0);
    for _ in 0..48 {
        p.ticket_answered();
    }
    p.end_rollouts(t0 + secs(96));
    p.timing.rounds_done = 6;
    p.timing.rounds_measured = 6;
    p.timing.round_secs = 60.0; // 10 s per round so far
    p.begin_round(t0 + secs(96));
    // In the 7th round: what its mean leaves of it, then the epoch end's round.
    assert_eq!(left(&p, t0 + secs(100)), secs(6 + 10));
    // A round running past its mean still has time left, and so does the one after it.
    let late = left(&p, t0 + secs(200));
    assert!(late >= secs(11), "{late:?}");
    p.end_round(t0 + secs(200));
    p.begin_round(t0 + secs(200));
    let last = left(&p, t0 + secs(200));
    assert!(
        last > Duration::ZERO,
        "the last round is still to run: {last:?}"
    );
}

/// Regression: before any round had finished, the first round's elapsed time was scaled by
/// every round left, so the demo's ETA climbed 50 s every 10 s through its first reflection
/// round (124 s, 553 s, then 63 s within four minutes). Now it is a lower bound that does
/// not grow while the round runs.
#[test]
fn before_any_round_finished_the_eta_is_a_lower_bound_that_does_not_grow() {
    let mut p = run();
    let t0 = Instant::now();
    p.begin_rollouts(t0);
    for _ in 0..8 {
        p.ticket_answered();
    }
    p.end_rollouts(t0 + secs(16)); // 2 s per ticket, 40 tickets left
    p.begin_round(t0 + secs(16));
    let early = p.eta(t0 + secs(20)).unwrap();
    let late = p.eta(t0 + secs(200)).unwrap();
    assert!(early.at_least && late.at_least);
    assert_eq!(early.left, secs(80 + 1));
    assert_eq!(late.left, early.left);
}

/// A run of 2 epochs × 3 steps with a call budget, one round timed: 2 calls in 20 s.
fn timed_run(cap: Option<u64>) -> (ProgressSnapshot, Instant) {
    let mut p = run();
    p.epoch = 1;
    p.timing.rounds_per_epoch = 4;
    p.timing.call_cap = cap;
    let t0 = Instant::now();
    p.begin_rollouts(t0);
    for _ in 0..48 {
        p.ticket_answered();
    }
    p.end_rollouts(t0 + secs(48));
    p.begin_round(t0 + secs(48));
    p.call_made();
    p.call_made();
    p.end_round(t0 + secs(68));
    (p, t0 + secs(68))
}

#[test]
fn reflection_left_is_the_calls_still_expected_at_the_time_per_call() {
    let (p, now) = timed_run(None);
    let eta = p.eta(now).unwrap();
    assert!(!eta.at_least);
    // 7 rounds left × 2 calls × 10 s a call.
    assert_eq!(eta.left, secs(7 * 2 * 10));
}

#[test]
fn an_epochs_call_budget_bounds_the_calls_expected_in_it() {
    // 3 calls an epoch: this epoch has 1 left, the next one 3 (not 4 rounds × 2).
    let (p, now) = timed_run(Some(3));
    assert_eq!(p.eta(now).unwrap().left, secs((1 + 3) * 10));
}

#[test]
fn a_round_under_way_counts_the_calls_it_has_not_made_yet() {
    let (mut p, now) = timed_run(None);
    p.begin_round(now);
    p.call_made();
    // This round: 1 more call; then 2 rounds of this epoch and 4 of the next, 2 calls each;
    // 10 s a call.
    assert_eq!(left(&p, now + secs(5)), secs((1 + 6 * 2) * 10));
}

fn left(p: &ProgressSnapshot, now: Instant) -> Duration {
    p.eta(now).expect("an eta").left
}
