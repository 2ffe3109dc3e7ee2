//! The rule by progress: its bound (the floor, then the worker's pace), revoking a lease whose
//! progress stands still, fencing what its worker sends late, and the earlier second copy.

use super::super::*;
use super::*;
use stageb_shared::domain::ChatMessage;

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

fn rollout_job(seed: u64) -> JobPayload {
    JobPayload::Rollout {
        messages: vec![ChatMessage::user("x")],
        decodes: vec![DecodeJob {
            decode_index: 0,
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.0,
            max_new_tokens: 8,
            seeds: vec![seed],
        }],
        constrained: true,
    }
}

fn output(seed: u64) -> JobOutput {
    JobOutput::Rollout {
        candidates: vec![CandidateText {
            decode_index: 0,
            sample_index: 0,
            seed,
            text: "Verdict: 通过\nReason: ok".into(),
            completion_tokens: 5,
            finish_reason: "stop".into(),
        }],
        prompt_tokens: 10,
        prefix_tokens: 0,
        prefill_us: 1,
        decode_us: 1,
    }
}

/// A scheduler with a long TTL (only the rule by progress ends a lease here), no straggler
/// copies unless `speculate`, and `rule`.
fn scheduler(
    rule: ProgressRule,
    speculate: bool,
) -> (Scheduler, mpsc::UnboundedReceiver<Completion>) {
    Scheduler::new(SchedulerConfig {
        lease_ttl: Duration::from_secs(60),
        progress: rule,
        speculation: if speculate {
            SpeculationConfig::default()
        } else {
            SpeculationConfig::OFF
        },
        ..SchedulerConfig::default()
    })
}

fn rule(multiple: u32, floor: Duration) -> ProgressRule {
    ProgressRule {
        multiple,
        floor,
        heartbeat: MS,
    }
}

/// One leased job: (session, lease id, when the lease was issued).
async fn leased(s: &Scheduler, seed: u64) -> (String, LeaseId, Instant) {
    s.enqueue(rollout_job(seed));
    let (_, w) = s.register().unwrap();
    let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    let id = leases[0].0;
    let issued = s.lock().leases[&id].issued;
    (w, id, issued)
}

/// Reports `steps` alone (as an older worker does) for lease `id` of `w` as seen at `at`,
/// then revokes what stood still.
fn beat_at(s: &Scheduler, w: &str, id: LeaseId, steps: u64, at: Instant) -> usize {
    counts_at(s, w, id, LeaseProgress::steps(steps), at)
}

/// Reports every counter of lease `id` of `w` as seen at `at`, then revokes what stood still.
fn counts_at(s: &Scheduler, w: &str, id: LeaseId, counts: LeaseProgress, at: Instant) -> usize {
    let mut g = s.lock();
    Scheduler::note_progress(&mut g, w, id, counts, at);
    s.revoke_stalled(&mut g, at, None, &mut Vec::new())
}

/// Counters of a job: `steps` steps, `tokens` tokens decoded, `prompt` prompt tokens in.
fn counts(steps: u64, tokens: u64, prompt: u32) -> LeaseProgress {
    LeaseProgress {
        steps,
        tokens,
        rows_finished: 0,
        prompt_done: prompt,
    }
}

#[test]
fn the_bound_is_the_floor_until_the_pace_is_known_then_a_multiple_of_the_longest_stall() {
    let rule = ProgressRule {
        multiple: 8,
        floor: 120 * S,
        heartbeat: 5 * S,
    };
    assert_eq!(rule.revoke_after(None), Some(120 * S), "nothing timed yet");
    assert_eq!(rule.revoke_after(Some(S)), Some(120 * S), "a fast worker");
    assert_eq!(rule.revoke_after(Some(30 * S)), Some(240 * S), "a slow one");
    assert_eq!(rule.speculate_after(Some(30 * S)), Some(120 * S));
    let no_floor = ProgressRule {
        floor: Duration::ZERO,
        ..rule
    };
    assert_eq!(
        no_floor.revoke_after(None),
        Some(10 * S),
        "progress is seen at heartbeats: never below two of them"
    );
    assert_eq!(ProgressRule::OFF.revoke_after(Some(S)), None);
}

#[test]
fn the_pace_is_the_longest_of_the_recent_stalls() {
    let mut stalls = Stalls::default();
    assert_eq!(stalls.longest(), None);
    stalls.record(9 * S);
    for _ in 0..STALL_WINDOW - 1 {
        stalls.record(S);
    }
    assert_eq!(stalls.longest(), Some(9 * S));
    stalls.record(2 * S);
    assert_eq!(
        stalls.longest(),
        Some(2 * S),
        "the old stall left the window"
    );
}

#[tokio::test]
async fn a_lease_that_never_moves_is_revoked_at_the_floor_counted_from_its_issue() {
    let (s, _rx) = scheduler(rule(4, 500 * MS), false);
    let (w, id, t0) = leased(&s, 1).await;
    assert_eq!(beat_at(&s, &w, id, 0, t0 + 100 * MS), 0);
    assert_eq!(beat_at(&s, &w, id, 0, t0 + 499 * MS), 0, "before the floor");
    assert_eq!(beat_at(&s, &w, id, 0, t0 + 500 * MS), 1, "at the floor");
    let stats = s.stats();
    assert_eq!(
        (stats.leases_revoked_no_progress, stats.leases_expired),
        (1, 1)
    );
}

#[tokio::test]
async fn once_timed_the_bound_follows_the_workers_own_pace() {
    let (s, _rx) = scheduler(rule(4, 500 * MS), false);
    let (w, id, t0) = leased(&s, 1).await;
    // A slow worker: a step each second (stalls of 1 s), so the bound is 4 s, not the floor.
    for n in 1..=3 {
        assert_eq!(beat_at(&s, &w, id, n, t0 + S * n as u32), 0);
    }
    let moved = t0 + 3 * S;
    assert_eq!(beat_at(&s, &w, id, 3, moved + 3900 * MS), 0, "3.9 s still");
    assert_eq!(beat_at(&s, &w, id, 3, moved + 4 * S), 1, "4 s still");
}

#[tokio::test]
async fn a_lease_whose_steps_stand_still_but_whose_tokens_grow_is_not_revoked() {
    let (s, _rx) = scheduler(rule(4, 500 * MS), false);
    let (w, id, t0) = leased(&s, 1).await;
    // One step in, then tokens only: an engine whose step counter is stuck, still decoding.
    assert_eq!(counts_at(&s, &w, id, counts(1, 0, 10), t0 + 100 * MS), 0);
    for n in 1..=10u32 {
        let at = t0 + 100 * MS + 200 * MS * n;
        let moving = counts(1, u64::from(n), 10);
        assert_eq!(counts_at(&s, &w, id, moving, at), 0, "tokens grew at {n}");
    }
    assert_eq!(s.stats().leases_revoked_no_progress, 0);
}

#[tokio::test]
async fn a_long_prefill_counts_as_progress_and_so_do_rows_finishing() {
    let (s, _rx) = scheduler(rule(4, 500 * MS), false);
    let (w, id, t0) = leased(&s, 1).await;
    // Two seconds of prefill, a chunk every 400 ms: no step returned, no token decoded.
    for n in 1..=5u32 {
        let prefill = counts(0, 0, 512 * n);
        assert_eq!(counts_at(&s, &w, id, prefill, t0 + 400 * MS * n), 0);
    }
    let rows = LeaseProgress {
        rows_finished: 1,
        ..counts(0, 0, 2560)
    };
    assert_eq!(
        counts_at(&s, &w, id, rows, t0 + 2400 * MS),
        0,
        "a row ended"
    );
    // 400 ms stalls: the bound is 1.6 s from the last move.
    let still = t0 + 2400 * MS;
    assert_eq!(counts_at(&s, &w, id, rows, still + 1599 * MS), 0);
    assert_eq!(counts_at(&s, &w, id, rows, still + 1600 * MS), 1);
}

#[tokio::test]
async fn a_lease_whose_every_counter_stands_still_is_revoked_at_the_bound() {
    let (s, _rx) = scheduler(rule(4, 500 * MS), false);
    let (w, id, t0) = leased(&s, 1).await;
    let seen = counts(3, 40, 100);
    assert_eq!(counts_at(&s, &w, id, seen, t0 + 100 * MS), 0);
    assert_eq!(
        counts_at(&s, &w, id, seen, t0 + 599 * MS),
        0,
        "before the floor"
    );
    assert_eq!(
        counts_at(&s, &w, id, seen, t0 + 600 * MS),
        1,
        "at the floor"
    );
    assert_eq!(s.stats().leases_revoked_no_progress, 1);
}

#[tokio::test]
async fn a_counter_going_backwards_then_back_up_is_no_move() {
    let (s, _rx) = scheduler(rule(4, 500 * MS), false);
    let (w, id, t0) = leased(&s, 1).await;
    assert_eq!(counts_at(&s, &w, id, counts(5, 50, 10), t0 + 100 * MS), 0);
    // A worker's claim that drops a count and raises it to where it was moves nothing.
    assert_eq!(counts_at(&s, &w, id, counts(5, 10, 10), t0 + 300 * MS), 0);
    assert_eq!(counts_at(&s, &w, id, counts(5, 50, 10), t0 + 500 * MS), 0);
    assert_eq!(counts_at(&s, &w, id, counts(5, 50, 10), t0 + 600 * MS), 1);
}

#[tokio::test]
async fn steps_alone_as_an_older_worker_sends_them_move_a_lease_as_before() {
    let (s, _rx) = scheduler(rule(4, 500 * MS), false);
    let (w, id, t0) = leased(&s, 1).await;
    let (old, old_id, _) = leased(&s, 2).await;
    for n in 1..=4u32 {
        let at = t0 + 300 * MS * n;
        assert_eq!(beat_at(&s, &old, old_id, u64::from(n), at), 0, "steps grew");
        assert_eq!(counts_at(&s, &w, id, counts(u64::from(n), 0, 0), at), 0);
    }
    // Both stood still since 1.2 s; 300 ms stalls give a bound of 1.2 s from there.
    let still = t0 + 1200 * MS;
    assert_eq!(beat_at(&s, &old, old_id, 4, still + 1199 * MS), 0);
    assert_eq!(
        beat_at(&s, &old, old_id, 4, still + 1200 * MS),
        2,
        "both, alike"
    );
}

#[tokio::test]
async fn a_lease_whose_worker_reports_no_progress_is_kept_by_heartbeats() {
    let (s, _rx) = scheduler(rule(4, 10 * MS), false);
    let (w, id, _) = leased(&s, 1).await;
    tokio::time::sleep(50 * MS).await;
    let answer = s.heartbeat_with(&w, &[id], &[]).unwrap();
    assert!(answer.invalid.is_empty());
    assert_eq!(s.reap_expired(), 0);
    assert_eq!(s.in_flight(), 1);
}

#[tokio::test]
async fn a_revoked_lease_is_told_fenced_and_its_job_answered_by_another_worker() {
    let (s, mut rx) = scheduler(rule(4, 150 * MS), false);
    let (hung, id, _) = leased(&s, 1).await;
    let started = Instant::now();
    let answer = loop {
        let answer = s
            .heartbeat_with(&hung, &[id], &[(id, LeaseProgress::steps(0))])
            .unwrap();
        if !answer.invalid.is_empty() || started.elapsed() > 5 * S {
            break answer;
        }
        tokio::time::sleep(20 * MS).await;
    };
    assert!(started.elapsed() >= 100 * MS, "not before the floor");
    assert_eq!((answer.invalid, answer.revoked), (vec![id], vec![id]));
    // A late heartbeat claiming progress does not revive it.
    let late = s
        .heartbeat_with(&hung, &[id], &[(id, LeaseProgress::steps(99))])
        .unwrap();
    assert_eq!(late.revoked, vec![id]);
    // Once the worker has dropped the lease, the note of its revocation goes.
    s.heartbeat_with(&hung, &[], &[]).unwrap();
    assert_eq!(
        s.revoked_notes(),
        0,
        "nothing kept for a lease no longer listed"
    );

    let (_, healthy) = s.register().unwrap();
    let (again, _) = s.lease(&healthy, 1, Duration::ZERO).await.unwrap();
    assert_eq!(again.len(), 1, "the job is leased again");
    assert_ne!(again[0].0, id, "under a new lease");
    assert_eq!(
        s.submit(&hung, id, Ok(output(1))),
        Ok(SubmitOutcome::Fenced),
        "the hung worker's late result is refused"
    );
    assert_eq!(
        s.submit(&healthy, again[0].0, Ok(output(1))),
        Ok(SubmitOutcome::Accepted)
    );
    assert!(rx.recv().await.unwrap().result.is_ok());
    assert!(rx.try_recv().is_err(), "one completion per job");
    assert_eq!(s.stats().leases_revoked_no_progress, 1);
}

#[tokio::test]
async fn an_idle_worker_copies_a_stalled_lease_at_half_the_bound_before_any_job_is_timed() {
    let (s, mut rx) = scheduler(rule(4, 400 * MS), true);
    let (hung, id, t0) = leased(&s, 1).await;
    let (_, idle) = s.register().unwrap();
    assert_eq!(beat_at(&s, &hung, id, 0, t0 + 10 * MS), 0);
    {
        let g = s.lock();
        assert_eq!(s.straggler(&g, &idle, t0 + 199 * MS), None);
        assert_eq!(
            s.straggler(&g, &idle, t0 + 200 * MS)
                .map(|(_, stalled)| stalled),
            Some(true)
        );
    }
    tokio::time::sleep(250 * MS).await;
    let (copy, _) = s.lease(&idle, 1, Duration::ZERO).await.unwrap();
    assert_eq!(copy.len(), 1, "the idle worker gets a copy");
    assert_eq!(
        s.submit(&idle, copy[0].0, Ok(output(1))),
        Ok(SubmitOutcome::Accepted)
    );
    assert!(rx.recv().await.is_some());
    let stats = s.stats();
    assert_eq!(
        (
            stats.speculative_leases,
            stats.speculative_leases_no_progress
        ),
        (1, 1)
    );
}
