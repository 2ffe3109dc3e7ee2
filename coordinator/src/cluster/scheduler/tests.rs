//! The lease table's specs: leasing, fencing, expiry, duplicates, sessions and bounds.

use super::*;
use stageb_shared::domain::ChatMessage;

fn rollout_job(seeds: Vec<u64>) -> JobPayload {
    JobPayload::Rollout {
        messages: vec![ChatMessage::user("x")],
        decodes: vec![DecodeJob {
            decode_index: 0,
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.0,
            max_new_tokens: 8,
            seeds,
        }],
        constrained: true,
    }
}

fn output_for(seeds: &[u64]) -> JobOutput {
    JobOutput::Rollout {
        candidates: seeds
            .iter()
            .enumerate()
            .map(|(i, s)| CandidateText {
                decode_index: 0,
                sample_index: i as u32,
                seed: *s,
                text: "Verdict: 通过\nReason: ok".into(),
                completion_tokens: 5,
                finish_reason: "stop".into(),
            })
            .collect(),
        prompt_tokens: 10,
        prefix_tokens: 0,
        prefill_us: 1,
        decode_us: 1,
    }
}

fn scheduler(ttl_ms: u64) -> (Scheduler, mpsc::UnboundedReceiver<Completion>) {
    Scheduler::new(SchedulerConfig {
        lease_ttl: Duration::from_millis(ttl_ms),
        ..Default::default()
    })
}

#[tokio::test]
async fn first_valid_submit_wins_and_a_repeat_is_a_duplicate() {
    let (s, mut rx) = scheduler(10_000);
    let job = s.enqueue(rollout_job(vec![1, 2]));
    let (_, session) = s.register().unwrap();
    let (leases, _) = s.lease(&session, 1, Duration::ZERO).await.unwrap();
    let lease = leases[0].0;
    assert_eq!(
        s.submit(&session, lease, Ok(output_for(&[1, 2]))).unwrap(),
        SubmitOutcome::Accepted
    );
    assert_eq!(
        s.submit(&session, lease, Ok(output_for(&[1, 2]))).unwrap(),
        SubmitOutcome::Duplicate
    );
    let c = rx.try_recv().unwrap();
    assert_eq!(c.job, job);
    assert!(
        rx.try_recv().is_err(),
        "a duplicate must not produce a second completion"
    );
}

#[tokio::test]
async fn a_lease_held_by_another_session_is_fenced_and_not_completed() {
    let (s, mut rx) = scheduler(10_000);
    s.enqueue(rollout_job(vec![1]));
    let (_, holder) = s.register().unwrap();
    let (_, thief) = s.register().unwrap();
    let (leases, _) = s.lease(&holder, 1, Duration::ZERO).await.unwrap();
    assert_eq!(
        s.submit(&thief, leases[0].0, Ok(output_for(&[1]))).unwrap(),
        SubmitOutcome::Fenced
    );
    assert_eq!(
        s.submit(&thief, 999, Ok(output_for(&[1]))).unwrap(),
        SubmitOutcome::Fenced
    );
    assert!(rx.try_recv().is_err());
    assert_eq!(
        s.submit(&holder, leases[0].0, Ok(output_for(&[1])))
            .unwrap(),
        SubmitOutcome::Accepted
    );
}

#[tokio::test]
async fn an_expired_lease_is_fenced_and_its_job_re_leased() {
    // The second lease must live until its submit: a 20 ms TTL let it expire first on a loaded
    // machine. The sleep only has to exceed the TTL to expire the first lease.
    let (s, mut rx) = scheduler(250);
    s.enqueue(rollout_job(vec![1]));
    let (_, dead) = s.register().unwrap();
    let (_, alive) = s.register().unwrap();
    let (first, _) = s.lease(&dead, 1, Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.reap_expired(), 1);
    let (second, _) = s.lease(&alive, 1, Duration::ZERO).await.unwrap();
    assert_eq!(second.len(), 1);
    assert_ne!(first[0].0, second[0].0, "lease ids are never reused");
    // The late result of the dead worker is refused; the live one completes the job once.
    assert_eq!(
        s.submit(&dead, first[0].0, Ok(output_for(&[1]))).unwrap(),
        SubmitOutcome::Fenced
    );
    assert_eq!(
        s.submit(&alive, second[0].0, Ok(output_for(&[1]))).unwrap(),
        SubmitOutcome::Accepted
    );
    let c = rx.try_recv().unwrap();
    assert_eq!(c.provenance.unwrap().attempt, 2);
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn heartbeats_keep_a_lease_alive() {
    // Four beats half a TTL apart outlast two TTLs; a beat that wakes up to 150 ms late on a
    // loaded machine still comes before the deadline (at 60/30 ms, 30 ms late was too late).
    let (s, _rx) = scheduler(300);
    s.enqueue(rollout_job(vec![1]));
    let (_, w) = s.register().unwrap();
    let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let (invalid, _) = s.heartbeat(&w, &[leases[0].0]).unwrap();
        assert!(invalid.is_empty());
        assert_eq!(s.reap_expired(), 0);
    }
}

#[tokio::test]
async fn a_lease_held_by_heartbeats_alone_ends_with_its_lifetime() {
    // A peer that leases and only heartbeats used to keep the job for ever (speculation needs
    // completed jobs first). Heartbeats extend a lease only up to its lifetime; then the job
    // goes back to the queue and an honest worker answers it.
    let (s, mut rx) = Scheduler::new(SchedulerConfig {
        // Beats 100 ms apart may come 300 ms late before the TTL alone would end the lease.
        lease_ttl: Duration::from_millis(400),
        lease_lifetime: LeaseLifetime {
            cold: Duration::from_millis(1000),
            ..LeaseLifetime::default()
        },
        ..Default::default()
    });
    let job = s.enqueue(rollout_job(vec![1]));
    let (_, holder) = s.register().unwrap();
    let (_, honest) = s.register().unwrap();
    let (leases, _) = s.lease(&holder, 1, Duration::ZERO).await.unwrap();
    let held = leases[0].0;
    let mut dropped = false;
    for _ in 0..16 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (invalid, _) = s.heartbeat(&holder, &[held]).unwrap();
        s.reap_expired();
        dropped |= invalid.contains(&held);
    }
    assert!(dropped, "the holder is told to drop the job");
    assert_eq!(s.stats().leases_past_lifetime, 1);
    let (leases, _) = s.lease(&honest, 1, Duration::ZERO).await.unwrap();
    assert_eq!(leases.len(), 1, "the job is leased again");
    assert_eq!(
        s.submit(&honest, leases[0].0, Ok(output_for(&[1])))
            .unwrap(),
        SubmitOutcome::Accepted
    );
    assert_eq!(rx.try_recv().unwrap().job, job);
    assert_eq!(
        s.submit(&holder, held, Ok(output_for(&[1]))).unwrap(),
        SubmitOutcome::Fenced
    );
}

#[tokio::test]
async fn a_result_with_the_wrong_shape_is_refused_and_the_lease_stays() {
    let (s, mut rx) = scheduler(10_000);
    s.enqueue(rollout_job(vec![1, 2]));
    let (_, w) = s.register().unwrap();
    let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    assert!(matches!(
        s.submit(&w, leases[0].0, Ok(output_for(&[1]))),
        Err(SubmitError::Mismatch(_))
    ));
    assert!(matches!(
        s.submit(&w, leases[0].0, Ok(output_for(&[1, 3]))),
        Err(SubmitError::Mismatch(_))
    ));
    assert!(rx.try_recv().is_err());
    assert_eq!(
        s.submit(&w, leases[0].0, Ok(output_for(&[1, 2]))).unwrap(),
        SubmitOutcome::Accepted
    );
}

#[tokio::test]
async fn unknown_sessions_are_refused() {
    let (s, _rx) = scheduler(10_000);
    assert!(matches!(
        s.lease("nope", 1, Duration::ZERO).await,
        Err(SubmitError::UnknownSession)
    ));
    assert!(matches!(
        s.heartbeat("nope", &[]),
        Err(SubmitError::UnknownSession)
    ));
}

#[tokio::test]
async fn worker_errors_are_retried_then_reported() {
    let (s, mut rx) = scheduler(10_000);
    s.enqueue(rollout_job(vec![1]));
    let (_, w) = s.register().unwrap();
    for _ in 0..3 {
        let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
        let err = JobFailure {
            code: "ENGINE_ERROR".into(),
            message: "boom".into(),
        };
        assert_eq!(
            s.submit(&w, leases[0].0, Err(err)).unwrap(),
            SubmitOutcome::Accepted
        );
    }
    let c = rx.try_recv().unwrap();
    assert_eq!(c.result.unwrap_err().code, "ENGINE_ERROR");
    let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    assert!(leases.is_empty());
}

#[tokio::test]
async fn a_submit_after_the_deadline_is_fenced_before_the_reaper_runs() {
    let (s, mut rx) = scheduler(20);
    s.enqueue(rollout_job(vec![1]));
    let (_, late) = s.register().unwrap();
    let (leases, _) = s.lease(&late, 1, Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(40)).await;
    // No reap_expired() call: the deadline alone decides.
    assert_eq!(
        s.submit(&late, leases[0].0, Ok(output_for(&[1]))).unwrap(),
        SubmitOutcome::Fenced
    );
    assert!(rx.try_recv().is_err(), "a fenced result completes nothing");
    let (again, _) = s.lease(&late, 1, Duration::ZERO).await.unwrap();
    assert_eq!(again.len(), 1, "the job went back to the queue at once");
    assert_eq!(s.stats().leases_expired, 1);
}

#[tokio::test]
async fn a_heartbeat_after_the_deadline_does_not_revive_the_lease() {
    let (s, _rx) = scheduler(20);
    s.enqueue(rollout_job(vec![1]));
    let (_, w) = s.register().unwrap();
    let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(40)).await;
    let (invalid, _) = s.heartbeat(&w, &[leases[0].0]).unwrap();
    assert_eq!(invalid, vec![leases[0].0]);
    assert_eq!(
        s.submit(&w, leases[0].0, Ok(output_for(&[1]))).unwrap(),
        SubmitOutcome::Fenced
    );
}

#[tokio::test]
async fn idle_sessions_are_forgotten_but_not_while_they_hold_a_lease() {
    let (s, _rx) = Scheduler::new(SchedulerConfig {
        lease_ttl: Duration::from_secs(10),
        session_idle_ttl: Duration::from_millis(20),
        ..Default::default()
    });
    s.enqueue(rollout_job(vec![1]));
    let (_, holder) = s.register().unwrap();
    let (_, idle) = s.register().unwrap();
    let (leases, _) = s.lease(&holder, 1, Duration::ZERO).await.unwrap();
    assert_eq!(leases.len(), 1);
    tokio::time::sleep(Duration::from_millis(40)).await;
    s.reap_expired();
    assert!(s.has_session(&holder), "a session holding a lease stays");
    assert!(!s.has_session(&idle), "an idle session is forgotten");
    assert_eq!(s.stats().sessions_expired, 1);
    assert!(matches!(
        s.heartbeat(&idle, &[]),
        Err(SubmitError::UnknownSession)
    ));
}

#[tokio::test]
async fn registrations_beyond_the_session_cap_are_refused() {
    let (s, _rx) = Scheduler::new(SchedulerConfig {
        max_sessions: 3,
        ..Default::default()
    });
    for _ in 0..3 {
        s.register().unwrap();
    }
    assert!(matches!(s.register(), Err(SubmitError::Exhausted(_))));
    assert_eq!(s.sessions(), 3);
}

#[tokio::test]
async fn counters_past_their_bounds_are_refused_regression_u32_max_prompt_tokens() {
    let (s, mut rx) = scheduler(10_000);
    s.enqueue(rollout_job(vec![1]));
    let (_, w) = s.register().unwrap();
    let (leases, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    let mut huge = output_for(&[1]);
    if let JobOutput::Rollout { prompt_tokens, .. } = &mut huge {
        *prompt_tokens = u32::MAX;
    }
    assert!(matches!(
        s.submit(&w, leases[0].0, Ok(huge)),
        Err(SubmitError::Mismatch(_))
    ));
    let mut whole_prompt_reused = output_for(&[1]);
    if let JobOutput::Rollout { prefix_tokens, .. } = &mut whole_prompt_reused {
        *prefix_tokens = 10; // = prompt_tokens: no token was left to prefill
    }
    assert!(matches!(
        s.submit(&w, leases[0].0, Ok(whole_prompt_reused)),
        Err(SubmitError::Mismatch(_))
    ));
    let mut odd = output_for(&[1]);
    if let JobOutput::Rollout { candidates, .. } = &mut odd {
        candidates[0].finish_reason = "x".repeat(7 << 20);
    }
    assert!(matches!(
        s.submit(&w, leases[0].0, Ok(odd)),
        Err(SubmitError::Mismatch(_))
    ));
    assert!(rx.try_recv().is_err());
}

/// Regression: with batching workers (`--max-jobs 8`) the first of three torchrun ranks to
/// register leased all six tickets of the small demo, and the other two ranks did nothing.
#[tokio::test]
async fn a_batching_worker_takes_only_its_share_while_peers_are_expected() {
    let (s, _rx) = Scheduler::new(SchedulerConfig {
        expected_workers: 3,
        ..Default::default()
    });
    for i in 0..6 {
        s.enqueue(rollout_job(vec![i]));
    }
    let (_, first) = s.register().unwrap();
    let (mine, _) = s.lease(&first, 8, Duration::ZERO).await.unwrap();
    assert_eq!(mine.len(), 2, "6 jobs among 3 expected workers");
    let (more, _) = s.lease(&first, 8, Duration::ZERO).await.unwrap();
    assert!(more.is_empty(), "a worker holding its share waits");
    for _ in 0..2 {
        let (_, peer) = s.register().unwrap();
        assert_eq!(s.lease(&peer, 8, Duration::ZERO).await.unwrap().0.len(), 2);
    }
    assert_eq!(s.in_flight(), 6);
}

#[tokio::test]
async fn the_share_follows_the_live_workers_and_an_idle_worker_always_gets_one() {
    let (s, _rx) = scheduler(10_000);
    for i in 0..10 {
        s.enqueue(rollout_job(vec![i]));
    }
    let (_, a) = s.register().unwrap();
    let (_, b) = s.register().unwrap();
    let (held, _) = s.lease(&a, 8, Duration::ZERO).await.unwrap();
    assert_eq!(held.len(), 5, "10 jobs between 2 live workers");
    // `a` finishes one: 9 outstanding, its share is 5 and it holds 4, so it takes one more.
    let (lease, _) = held[0];
    s.submit(&a, lease, Ok(output_for(&[0]))).unwrap();
    assert_eq!(s.lease(&a, 8, Duration::ZERO).await.unwrap().0.len(), 1);
    assert_eq!(s.lease(&b, 8, Duration::ZERO).await.unwrap().0.len(), 4);
    // Everything is leased: a third worker holding nothing is not given a job that is not
    // there, and nothing is taken twice.
    let (_, c) = s.register().unwrap();
    assert!(s.lease(&c, 8, Duration::ZERO).await.unwrap().0.is_empty());
}

#[tokio::test]
async fn a_lone_worker_batches_up_to_what_it_asks() {
    let (s, _rx) = scheduler(10_000);
    for i in 0..12 {
        s.enqueue(rollout_job(vec![i]));
    }
    let (_, only) = s.register().unwrap();
    assert_eq!(s.lease(&only, 8, Duration::ZERO).await.unwrap().0.len(), 8);
    assert_eq!(s.lease(&only, 8, Duration::ZERO).await.unwrap().0.len(), 4);
}

#[test]
fn batching_claims_are_summed_and_impossible_ones_left_out() {
    let (s, _rx) = scheduler(10_000);
    s.note_batching(10, 45);
    s.note_batching(5, 5);
    s.note_batching(0, 0); // a worker that does not batch
    s.note_batching(3, 2); // fewer rows than steps
    s.note_batching(1, 1 << 40); // more rows than 16 jobs of 256 rows can make
    let stats = s.stats();
    assert_eq!((stats.batch_job_steps, stats.batch_rows), (15, 50));
}

fn seeds_of(payload: &JobPayload) -> Vec<u64> {
    match payload {
        JobPayload::Rollout { decodes, .. } => decodes[0].seeds.clone(),
        JobPayload::Generate { .. } => Vec::new(),
    }
}

#[tokio::test]
async fn jobs_queued_ahead_are_leased_only_when_nothing_else_waits() {
    let (s, _rx) = scheduler(10_000);
    s.enqueue_ahead(rollout_job(vec![1]));
    s.enqueue(rollout_job(vec![2]));
    let (_, w) = s.register().unwrap();
    let (first, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    assert_eq!(seeds_of(&first[0].1), vec![2], "the job due now goes first");
    let (second, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    assert_eq!(seeds_of(&second[0].1), vec![1], "then the one queued ahead");
}

fn call_job(seed: u64) -> JobPayload {
    JobPayload::Generate {
        messages: vec![ChatMessage::user("reflect")],
        json_schema: None,
        seed,
        temperature: 0.7,
        top_p: 0.9,
        repetition_penalty: 1.0,
        max_new_tokens: 8,
    }
}

#[tokio::test]
async fn reflection_calls_queued_ahead_are_leased_before_rollouts_queued_ahead() {
    // The steps queued ahead wait for the boundary's chain of calls; calls queued ahead
    // behind them used to leave that chain waiting.
    let (s, _rx) = scheduler(10_000);
    s.enqueue_ahead(rollout_job(vec![1]));
    s.enqueue_ahead(call_job(5));
    s.enqueue_ahead(rollout_job(vec![2]));
    s.enqueue_ahead(call_job(6));
    s.enqueue(rollout_job(vec![3]));
    let (_, w) = s.register().unwrap();
    let (leased, _) = s.lease(&w, 5, Duration::ZERO).await.unwrap();
    let order: Vec<String> = leased
        .iter()
        .map(|(_, p)| match p {
            JobPayload::Generate { seed, .. } => format!("call {seed}"),
            rollout => format!("rollout {:?}", seeds_of(rollout)),
        })
        .collect();
    assert_eq!(
        order,
        [
            "rollout [3]",
            "call 5",
            "call 6",
            "rollout [1]",
            "rollout [2]"
        ],
        "due now, then calls ahead, then rollouts ahead, each in queue order"
    );
}

#[tokio::test]
async fn a_lease_says_how_long_it_waited_for_work_and_zero_when_work_was_queued() {
    let (s, _rx) = scheduler(10_000);
    let s = std::sync::Arc::new(s);
    let (_, w) = s.register().unwrap();
    s.enqueue(rollout_job(vec![1]));
    let at_once = s.lease_timed(&w, 1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(at_once.jobs.len(), 1);
    assert_eq!(at_once.waited_for_work, Duration::ZERO, "work was queued");
    let later = {
        let s = s.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            s.enqueue(rollout_job(vec![2]));
        })
    };
    let held = s.lease_timed(&w, 1, Duration::from_secs(5)).await.unwrap();
    later.await.unwrap();
    assert_eq!(held.jobs.len(), 1);
    assert!(
        held.waited_for_work >= Duration::from_millis(50),
        "{held:?}"
    );
}

#[tokio::test]
async fn a_withdrawn_job_is_never_leased_and_its_lease_is_fenced_without_a_completion() {
    let (s, mut rx) = scheduler(10_000);
    let leased = s.enqueue_ahead(rollout_job(vec![1]));
    let queued = s.enqueue_ahead(rollout_job(vec![2]));
    let (_, w) = s.register().unwrap();
    let (held, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
    assert_eq!(s.withdraw(&[leased, queued]), 2);
    assert_eq!(s.withdraw(&[leased]), 0, "withdrawn once");
    let (fenced, _) = s.heartbeat(&w, &[held[0].0]).unwrap();
    assert_eq!(
        fenced,
        vec![held[0].0],
        "the worker is told to drop the work"
    );
    assert_eq!(
        s.submit(&w, held[0].0, Ok(output_for(&[1]))).unwrap(),
        SubmitOutcome::Fenced
    );
    assert!(s.lease(&w, 8, Duration::ZERO).await.unwrap().0.is_empty());
    assert!(rx.try_recv().is_err(), "no completion for a withdrawn job");
    assert_eq!(s.stats().jobs_withdrawn, 2);
}

#[tokio::test]
async fn promoted_jobs_take_their_place_in_the_ordinary_queue() {
    let (s, _rx) = scheduler(10_000);
    let ahead = s.enqueue_ahead(rollout_job(vec![1]));
    s.enqueue_ahead(rollout_job(vec![3]));
    s.promote(&[ahead]);
    s.enqueue(rollout_job(vec![2]));
    let (_, w) = s.register().unwrap();
    let (leased, _) = s.lease(&w, 3, Duration::ZERO).await.unwrap();
    let order: Vec<Vec<u64>> = leased.iter().map(|(_, p)| seeds_of(p)).collect();
    assert_eq!(order, vec![vec![1], vec![2], vec![3]]);
}

#[tokio::test]
async fn worker_time_counts_live_sessions_and_the_ones_holding_a_lease() {
    // Two live workers, one of them holding a lease for the whole window: half the worker
    // time was busy, whatever the sampling delays.
    let (s, _rx) = scheduler(10_000);
    s.enqueue(rollout_job(vec![1]));
    let (_, busy) = s.register().unwrap();
    let (_, idle) = s.register().unwrap();
    let (leases, _) = s.lease(&busy, 1, Duration::ZERO).await.unwrap();
    assert_eq!(leases.len(), 1);
    s.reap_expired();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(40)).await;
        s.heartbeat(&idle, &[]).unwrap();
        s.reap_expired();
    }
    let stats = s.stats();
    assert!(stats.worker_ms >= 2 * 100, "{stats:?}");
    assert_eq!(stats.worker_busy_ms * 2, stats.worker_ms, "{stats:?}");
}
