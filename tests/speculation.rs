//! Straggler speculation: an idle worker may take a second copy of a job
//! that runs far longer than its kind's median; the first accepted answer wins, the other copy
//! is fenced, and the artifacts are the same bytes as without speculation.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use stageb::roles::StartMode;
use stageb_coordinator::cluster::scheduler::{
    CandidateText, JobOutput, Scheduler, SchedulerConfig, SpeculationConfig, SubmitOutcome,
};
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use support::compare::assert_same_artifacts;
use support::{
    Behaviour, Script, ScriptedEngine, assert_audit_ok, copy_demo_mission, rollout_job, try_run,
};

fn answer(seed: u64) -> JobOutput {
    JobOutput::Rollout {
        candidates: vec![CandidateText {
            decode_index: 0,
            sample_index: 0,
            seed,
            text: "Verdict: 通过\nReason: ok".into(),
            completion_tokens: 5,
            finish_reason: "stop".into(),
        }],
        prompt_tokens: 3,
        prefix_tokens: 0,
        prefill_us: 1,
        decode_us: 1,
    }
}

/// A scheduler that speculates past 50 ms, with three instant jobs done so the median is known.
async fn warmed_scheduler() -> (
    Scheduler,
    tokio::sync::mpsc::UnboundedReceiver<stageb_coordinator::cluster::scheduler::Completion>,
) {
    let (s, mut done) = Scheduler::new(SchedulerConfig {
        speculation: SpeculationConfig {
            multiple: 2,
            min_age: Duration::from_millis(50),
        },
        ..SchedulerConfig::default()
    });
    let (_, w) = s.register().unwrap();
    for seed in 100..103 {
        s.enqueue(rollout_job(vec![seed]));
        let (leased, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
        assert_eq!(
            s.submit(&w, leased[0].0, Ok(answer(seed))),
            Ok(SubmitOutcome::Accepted)
        );
        done.recv().await.unwrap();
    }
    (s, done)
}

#[tokio::test]
async fn a_straggler_gets_a_second_copy_and_the_first_answer_wins() {
    let (s, mut done) = warmed_scheduler().await;
    let (_, slow) = s.register().unwrap();
    let (_, idle) = s.register().unwrap();
    let id = s.enqueue(rollout_job(vec![7]));
    let (original, _) = s.lease(&slow, 1, Duration::ZERO).await.unwrap();
    let (none, _) = s.lease(&idle, 1, Duration::ZERO).await.unwrap();
    assert!(none.is_empty(), "not a straggler yet");
    tokio::time::sleep(Duration::from_millis(80)).await;
    let (copy, _) = s.lease(&idle, 1, Duration::ZERO).await.unwrap();
    assert_eq!(copy.len(), 1, "the idle worker gets a copy");
    assert_eq!(copy[0].1, original[0].1, "of the same job");
    assert_ne!(copy[0].0, original[0].0, "under its own lease");
    let (third, _) = s.lease(&slow, 1, Duration::ZERO).await.unwrap();
    assert!(third.is_empty(), "at most one copy per job");

    assert_eq!(
        s.submit(&idle, copy[0].0, Ok(answer(7))),
        Ok(SubmitOutcome::Accepted)
    );
    assert_eq!(done.recv().await.unwrap().job, id);
    let (fenced, _) = s.heartbeat(&slow, &[original[0].0]).unwrap();
    assert_eq!(fenced, vec![original[0].0], "the slow worker hears it lost");
    assert_eq!(
        s.submit(&slow, original[0].0, Ok(answer(7))),
        Ok(SubmitOutcome::Fenced)
    );
    assert!(done.try_recv().is_err(), "one completion per job");
    let stats = s.stats();
    assert_eq!(
        (
            stats.speculative_leases,
            stats.speculation_wins,
            stats.leases_fenced_by_speculation
        ),
        (1, 1, 1)
    );
    assert_eq!(s.in_flight(), 0);
}

#[tokio::test]
async fn when_the_original_answers_first_the_copy_is_fenced() {
    let (s, mut done) = warmed_scheduler().await;
    let (_, slow) = s.register().unwrap();
    let (_, idle) = s.register().unwrap();
    s.enqueue(rollout_job(vec![8]));
    let (original, _) = s.lease(&slow, 1, Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(80)).await;
    let (copy, _) = s.lease(&idle, 1, Duration::ZERO).await.unwrap();
    assert_eq!(copy.len(), 1);
    assert_eq!(
        s.submit(&slow, original[0].0, Ok(answer(8))),
        Ok(SubmitOutcome::Accepted)
    );
    done.recv().await.unwrap();
    assert_eq!(
        s.submit(&idle, copy[0].0, Ok(answer(8))),
        Ok(SubmitOutcome::Fenced)
    );
    assert!(done.try_recv().is_err());
    assert_eq!(s.stats().speculation_wins, 0);
}

#[tokio::test]
async fn a_lost_copy_does_not_requeue_a_job_its_original_still_runs() {
    let (s, mut done) = Scheduler::new(SchedulerConfig {
        lease_ttl: Duration::from_millis(300),
        speculation: SpeculationConfig {
            multiple: 1,
            min_age: Duration::from_millis(20),
        },
        ..SchedulerConfig::default()
    });
    let (_, w) = s.register().unwrap();
    for seed in 100..103 {
        s.enqueue(rollout_job(vec![seed]));
        let (leased, _) = s.lease(&w, 1, Duration::ZERO).await.unwrap();
        s.submit(&w, leased[0].0, Ok(answer(seed))).unwrap();
        done.recv().await.unwrap();
    }
    let (_, slow) = s.register().unwrap();
    let (_, flaky) = s.register().unwrap();
    s.enqueue(rollout_job(vec![9]));
    let (original, _) = s.lease(&slow, 1, Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(40)).await;
    let (copy, _) = s.lease(&flaky, 1, Duration::ZERO).await.unwrap();
    assert_eq!(copy.len(), 1);
    // The copy's worker vanishes; the original's keeps heartbeating.
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        s.heartbeat(&slow, &[original[0].0]).unwrap();
        s.reap_expired();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, other) = s.register().unwrap();
    let (nothing, _) = s.lease(&other, 1, Duration::ZERO).await.unwrap();
    assert!(nothing.is_empty(), "the job is not queued again");
    assert_eq!(
        s.submit(&slow, original[0].0, Ok(answer(9))),
        Ok(SubmitOutcome::Accepted)
    );
    assert!(done.recv().await.is_some());
}

/// The scripted engine; worker 0 takes `slow` per rollout, the others 20 ms.
struct Paced {
    inner: ScriptedEngine,
    delay: Duration,
}

impl Engine for Paced {
    fn fingerprint(&self) -> &ModelFingerprint {
        self.inner.fingerprint()
    }
    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        std::thread::sleep(self.delay);
        self.inner.rollout(request)
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.inner.generate(request)
    }
}

fn run_with_one_slow_worker(
    dir: &std::path::Path,
    run_name: &str,
    multiple: u32,
) -> (stageb_coordinator::run::RunSummary, Duration) {
    let config = support::write_config(
        dir,
        json!({
            "output": {"run_name": run_name},
            // Steps queued ahead would hide part of the slow worker's time in both runs; this
            // spec is about straggler speculation alone.
            "runner": {"epochs": 1, "speculation_multiple": multiple, "speculation_min_ms": 200,
                       "pipeline_steps": 0},
        }),
    );
    let script: Arc<Script> = Script::new(Behaviour::default());
    let started = Instant::now();
    let summary = try_run(
        &config,
        3,
        move |i| Paced {
            inner: ScriptedEngine::new(script.clone()),
            delay: if i == 0 {
                Duration::from_millis(1500)
            } else {
                Duration::from_millis(20)
            },
        },
        StartMode::Fresh,
        std::future::pending(),
    )
    .expect("the run completes");
    (summary, started.elapsed())
}

#[test]
fn a_slow_worker_no_longer_sets_the_pace_and_the_artifacts_stay_the_same() {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    let (plain, plain_took) = run_with_one_slow_worker(dir.path(), "plain", 0);
    let (fast, fast_took) = run_with_one_slow_worker(dir.path(), "speculated", 3);
    eprintln!("one slow worker: {plain_took:?} without speculation, {fast_took:?} with");

    let stats = &fast.runtime["scheduler"];
    assert!(stats["speculative_leases"].as_u64().unwrap() > 0, "{stats}");
    assert!(stats["speculation_wins"].as_u64().unwrap() > 0, "{stats}");
    assert_eq!(plain.runtime["scheduler"]["speculative_leases"], 0);
    assert_same_artifacts(&plain.run_dir, &fast.run_dir);
    assert_audit_ok(&fast.run_dir);
    // The slow worker no longer sets the pace: copies of its jobs answered first and its own
    // leases were fenced (it dropped those jobs). How much faster that makes the run is a
    // benchmark's question (docs/PERFORMANCE.md), never a timed assertion here.
    let fenced = stats["leases_fenced_by_speculation"].as_u64().unwrap();
    assert!(fenced > 0, "{stats}");
}
