//! Specs of the progress state: how phases read, and an ETA that counts reflection.

use std::time::{Duration, Instant};

use super::*;

/// A run of 2 epochs of 24 tickets in its first epoch, reflecting in batches of 4, no call cap.
fn run() -> ProgressSnapshot {
    ProgressSnapshot {
        total: 48,
        epochs: 2,
        epoch: 1,
        reflection: ReflectionWork {
            batch_size: 4,
            ..ReflectionWork::default()
        },
        ..ProgressSnapshot::default()
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A step of `tickets` answered at 1 s each from `t`, then decided: `cases` of them queued.
fn step(p: &mut ProgressSnapshot, t: Instant, tickets: u64, cases: u64) -> Instant {
    p.begin_rollouts(t);
    for _ in 0..tickets {
        p.ticket_answered();
    }
    let end = t + secs(tickets);
    p.end_rollouts(end);
    for _ in 0..cases {
        p.case_queued();
    }
    p.reflection.pending += cases;
    end
}

/// A cycle from `t` on the next batch, making `calls` calls at 10 s each.
fn cycle(p: &mut ProgressSnapshot, t: Instant, calls: u64) -> Instant {
    let batch = p.reflection.batch_size.min(p.reflection.pending);
    p.reflection.pending -= batch;
    p.begin_cycle(t);
    for _ in 0..calls {
        p.call_made();
    }
    let end = t + secs(10 * calls);
    p.end_cycle(end);
    end
}

fn calls(p: &ProgressSnapshot) -> f64 {
    p.calls_left(true)
        .expect("decided tickets say how many become cases")
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
fn rollouts_left_take_the_time_per_ticket_measured_so_far() {
    let mut p = run();
    let t0 = Instant::now();
    let now = step(&mut p, t0, 8, 0);
    let eta = p.eta(now).unwrap();
    // No ticket became a case: 40 tickets at 1 s, and no reflection to wait for.
    assert_eq!(eta.left, secs(40));
    assert!(!eta.at_least);
}

#[test]
fn the_cases_waiting_make_cycles_of_batch_size_each_making_the_calls_a_cycle_made() {
    let mut p = ProgressSnapshot {
        total: 24,
        epochs: 1,
        ..run()
    };
    let t0 = Instant::now();
    let t = step(&mut p, t0, 24, 10);
    let t = cycle(&mut p, t, 3);
    // 6 cases wait: 2 cycles of 4 × 3 calls, at 10 s a call.
    assert_eq!(calls(&p), 2.0 * 3.0);
    let eta = p.eta(t).unwrap();
    assert_eq!((eta.left, eta.at_least), (secs(60), false));
}

#[test]
fn the_undecided_tickets_and_later_epochs_bring_cases_at_the_share_seen_so_far() {
    let mut p = run();
    let t0 = Instant::now();
    let t = step(&mut p, t0, 12, 5);
    let t = cycle(&mut p, t, 2);
    // This epoch: 1 case waits and 12 tickets bring 5 more: 2 cycles. The next epoch's 24
    // tickets bring 10: 3 cycles. 5 cycles × 2 calls × 10 s, and 36 tickets at 1 s.
    assert_eq!(calls(&p), 10.0);
    assert_eq!(p.eta(t).unwrap().left, secs(100 + 36));
}

#[test]
fn tickets_answered_in_the_wait_under_way_are_not_decided_yet() {
    let mut p = run();
    let t0 = Instant::now();
    let t = step(&mut p, t0, 12, 5);
    cycle(&mut p, t, 2);
    let before = calls(&p);
    p.begin_rollouts(t + secs(20));
    for _ in 0..6 {
        p.ticket_answered();
    }
    // Their cases arrive when the step is decided: still counted as coming.
    assert_eq!(calls(&p), before);
}

#[test]
fn the_retry_buckets_add_their_own_cycles() {
    let mut p = run();
    let t0 = Instant::now();
    let t = step(&mut p, t0, 12, 5);
    cycle(&mut p, t, 2);
    let before = calls(&p);
    p.reflection.retry_cycles = 3;
    assert_eq!(calls(&p), before + 3.0 * 2.0);
}

#[test]
fn each_epochs_call_budget_caps_the_calls_expected_in_it() {
    let mut p = run();
    let t0 = Instant::now();
    let t = step(&mut p, t0, 12, 5);
    cycle(&mut p, t, 2);
    // Uncapped: 4 calls this epoch and 6 the next (see above). The budget leaves 3 of this
    // epoch's, and a fresh epoch gets 4.
    p.reflection.calls_left = Some(3);
    p.reflection.calls_per_epoch = Some(4);
    assert_eq!(calls(&p), 3.0 + 4.0);
    p.reflection.calls_left = Some(0);
    assert_eq!(
        calls(&p),
        4.0,
        "a spent budget (or change cap) ends this epoch's calls"
    );
}

/// Regression: counting the calls a finished round made on average times the rounds left read
/// 1,313 s on the demo with about 530 s left. An epoch's rounds are no equal shares of its
/// cycles: its last one drains what the others left, often little.
#[test]
fn calls_follow_the_cases_not_the_rounds_left() {
    // The demo's shape: 2 epochs of 48 tickets in steps of 32 and 16 (3 rounds an epoch).
    let mut p = ProgressSnapshot { total: 96, ..run() };
    let t0 = Instant::now();
    let mut t = step(&mut p, t0, 32, 14);
    for calls in [4, 3, 3] {
        t = cycle(&mut p, t, calls);
    }
    // 2 cases wait and 16 tickets bring 7: 3 cycles; the next epoch's 48 bring 21: 6 cycles.
    // 9 cycles × 10/3 calls: 30, where rounds × calls per round counted 5 × 10 = 50.
    assert!((calls(&p) - 30.0).abs() < 1e-9, "{}", calls(&p));
}

#[test]
fn a_cycle_under_way_counts_the_calls_it_has_not_made_yet() {
    let mut p = ProgressSnapshot {
        total: 24,
        epochs: 1,
        ..run()
    };
    let t0 = Instant::now();
    let t = step(&mut p, t0, 24, 8);
    let t = cycle(&mut p, t, 3);
    p.reflection.pending -= 4;
    p.begin_cycle(t);
    p.call_made();
    // This cycle: 2 calls more of its 3; nothing waits after it.
    assert_eq!(calls(&p), 2.0);
    assert_eq!(p.eta(t + secs(10)).unwrap().left, secs(20));
}

/// Regression: before any round had finished, the first round's elapsed time was scaled by
/// every round left, so the demo's ETA climbed 50 s every 10 s through its first reflection
/// round (124 s, 553 s, then 63 s within four minutes). Until a cycle's calls were timed it
/// is a lower bound that does not grow while the cycle runs.
#[test]
fn until_a_cycle_was_timed_the_eta_is_a_lower_bound_that_does_not_grow() {
    let mut p = run();
    let t0 = Instant::now();
    let t = step(&mut p, t0, 8, 4);
    p.begin_round(t);
    p.begin_cycle(t);
    p.call_made();
    let early = p.eta(t + secs(4)).unwrap();
    let late = p.eta(t + secs(200)).unwrap();
    assert!(early.at_least && late.at_least);
    // 40 tickets at 1 s, and reflection's floor.
    assert_eq!(early.left, secs(40 + 1));
    assert_eq!(late.left, early.left);
    p.end_cycle(t + secs(200));
    assert!(!p.eta(t + secs(200)).unwrap().at_least, "timed now");
}

#[test]
fn nothing_to_reflect_on_is_no_lower_bound() {
    let mut p = run();
    let t0 = Instant::now();
    let t = step(&mut p, t0, 8, 0);
    p.begin_round(t);
    let eta = p.eta(t).unwrap();
    assert!(!eta.at_least, "no case so far: none expected");
    assert_eq!(
        eta.left,
        secs(40 + 1),
        "the round under way still counts its floor"
    );
}

/// Regression: once every ticket was answered the line read `eta=0s` for the minutes the
/// last reflection rounds still took.
#[test]
fn the_eta_stays_above_zero_while_reflection_runs() {
    let mut p = ProgressSnapshot {
        total: 24,
        epochs: 1,
        ..run()
    };
    let t0 = Instant::now();
    let t = step(&mut p, t0, 24, 8);
    p.begin_round(t);
    let t = cycle(&mut p, t, 2);
    p.reflection.pending -= 4;
    p.begin_cycle(t);
    for _ in 0..5 {
        p.call_made(); // more calls than a cycle makes on average
    }
    let late = left(&p, t + secs(500));
    assert!(late >= secs(1), "{late:?}");
    p.end_cycle(t + secs(500));
    assert!(
        left(&p, t + secs(500)) > Duration::ZERO,
        "the round is not over"
    );
    p.end_round();
    assert_eq!(
        left(&p, t + secs(500)),
        Duration::ZERO,
        "the run's work is done"
    );
}

fn left(p: &ProgressSnapshot, now: Instant) -> Duration {
    p.eta(now).expect("an eta").left
}
