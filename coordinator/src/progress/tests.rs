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
    assert_eq!(p.eta(t0 + secs(26)), Some(secs(80 + 70)));
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
    assert_eq!(p.eta(t0 + secs(100)), Some(secs(6 + 10)));
    // A round running past its mean still has time left, and so does the one after it.
    let late = p.eta(t0 + secs(200)).unwrap();
    assert!(late >= secs(11), "{late:?}");
    p.end_round(t0 + secs(200));
    p.begin_round(t0 + secs(200));
    let last = p.eta(t0 + secs(200)).unwrap();
    assert!(
        last > Duration::ZERO,
        "the last round is still to run: {last:?}"
    );
}

#[test]
fn before_any_round_finished_the_one_under_way_is_assumed_to_take_as_long_again() {
    let mut p = run();
    let t0 = Instant::now();
    p.begin_rollouts(t0);
    for _ in 0..48 {
        p.ticket_answered();
    }
    p.end_rollouts(t0 + secs(10));
    p.timing.rounds_total = 2;
    p.begin_round(t0 + secs(10));
    // 30 s into the first round: it is assumed as long again (at least 1 s), then one more.
    assert_eq!(p.eta(t0 + secs(40)), Some(secs(1 + 30)));
}
