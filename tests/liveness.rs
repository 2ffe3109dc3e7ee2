//! Liveness by progress: a worker whose engine hangs inside a forward keeps heartbeating, but
//! its leases' progress stands still. Rank 0 revokes them (after the floor while the worker's
//! pace is unknown, else a multiple of its longest recent stall), leases their jobs again, and
//! the run ends with the same artifacts as a clean run. The worker is told, and counts it.

use crate::support;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use stageb::roles::StartMode;
use stageb_coordinator::cluster::scheduler::{
    ControlSignal, ProgressRule, Scheduler, SchedulerConfig, SpeculationConfig,
};
use stageb_coordinator::run::RunSummary;
use stageb_shared::pb;
use stageb_worker::client::run_worker;
use stageb_worker::engine::{
    CancelFlag, Engine, EngineError, GenerateOutput, GenerateRequest, Job, JobOutput,
    ModelFingerprint, RolloutOutput, RolloutRequest,
};
use support::compare::assert_same_artifacts;
use support::{
    Behaviour, Script, ScriptedEngine, assert_audit_ok, copy_demo_mission, rollout_job,
    serve_for_workers, try_run, worker_options,
};

/// Longest a hung forward of [`Stepped`] waits to be released before it gives up (a broken
/// rule then fails the spec instead of hanging the suite).
const HANG_CAP: Duration = Duration::from_secs(120);

/// The scripted engine as a batching engine: `admit` adds a job to the batch and each `step`
/// answers the oldest one. At step `hang_at` (counted per engine, from 1) the forward hangs:
/// it answers nothing until every job in the batch is cancelled (a real hung forward would not
/// notice even that; the double lets the worker end), then returns them all as cancelled. It
/// hangs once.
struct Stepped {
    inner: ScriptedEngine,
    batch: VecDeque<(u64, Job, CancelFlag)>,
    steps: u64,
    hang_at: Option<u64>,
    /// Hangs that happened, across the engines of a run.
    hangs: Arc<AtomicUsize>,
}

impl Stepped {
    fn new(script: Arc<Script>, hang_at: Option<u64>, hangs: Arc<AtomicUsize>) -> Self {
        Stepped {
            inner: ScriptedEngine::new(script),
            batch: VecDeque::new(),
            steps: 0,
            hang_at,
            hangs,
        }
    }

    fn run(&mut self, job: &Job) -> Result<JobOutput, EngineError> {
        match job {
            Job::Rollout(r) => self.inner.rollout(r).map(JobOutput::Rollout),
            Job::Generate(g) => self.inner.generate(g).map(JobOutput::Generate),
        }
    }

    /// The hung forward: wait until every job in the batch is cancelled.
    fn hang(&mut self) -> Vec<(u64, Result<JobOutput, EngineError>)> {
        self.hangs.fetch_add(1, Ordering::SeqCst);
        let since = Instant::now();
        while !self.batch.iter().all(|(_, _, c)| c.is_cancelled()) && since.elapsed() < HANG_CAP {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.batch
            .drain(..)
            .map(|(key, _, _)| (key, Err(EngineError::Cancelled)))
            .collect()
    }
}

impl Engine for Stepped {
    fn fingerprint(&self) -> &ModelFingerprint {
        self.inner.fingerprint()
    }
    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        self.inner.rollout(request)
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.inner.generate(request)
    }
    fn batches(&self) -> bool {
        true
    }
    fn admit(&mut self, key: u64, job: &Job, cancel: CancelFlag) -> Result<(), EngineError> {
        self.batch.push_back((key, job.clone(), cancel));
        Ok(())
    }
    fn step(&mut self) -> Vec<(u64, Result<JobOutput, EngineError>)> {
        self.steps += 1;
        if self.hang_at == Some(self.steps) && !self.batch.is_empty() {
            return self.hang();
        }
        let mut ended: Vec<_> = Vec::new();
        while let Some(i) = self.batch.iter().position(|(_, _, c)| c.is_cancelled()) {
            let (key, _, _) = self.batch.remove(i).expect("a position in the batch");
            ended.push((key, Err(EngineError::Cancelled)));
        }
        if let Some((key, job, _)) = self.batch.pop_front() {
            ended.push((key, self.run(&job)));
        }
        ended
    }
}

/// What one run of the demo gave.
struct Ran {
    summary: RunSummary,
    took: Duration,
    hangs: usize,
}

/// The demo on two batching workers, worker 0's forward hanging at its step `hang_at`
/// (`None`: a clean run). Heartbeats every second, no-progress floor 2 s, 4 stalls; no
/// straggler copies (this spec is about revoking); a TTL of 30 s that heartbeats keep alive,
/// so only the rule by progress can free a hung lease. Interrupted after `give_up`.
fn run_demo(dir: &std::path::Path, name: &str, hang_at: Option<u64>, give_up: Duration) -> Ran {
    let config = support::write_config(
        dir,
        json!({
            "output": {"run_name": name},
            "runner": {"epochs": 1, "heartbeat_interval_s": 1, "lease_ttl_s": 30,
                       "no_progress_floor_ms": 2000, "no_progress_multiple": 4,
                       "speculation_multiple": 0, "pipeline_steps": 0},
        }),
    );
    let script = Script::new(Behaviour::default());
    let hangs = Arc::new(AtomicUsize::new(0));
    let counted = hangs.clone();
    let started = Instant::now();
    let summary = try_run(
        &config,
        2,
        move |i| Stepped::new(script.clone(), hang_at.filter(|_| i == 0), hangs.clone()),
        StartMode::Fresh,
        async move { tokio::time::sleep(give_up).await },
    )
    .expect("the run completes");
    Ran {
        summary,
        took: started.elapsed(),
        hangs: counted.load(Ordering::SeqCst),
    }
}

fn revoked(summary: &RunSummary) -> u64 {
    summary.runtime["scheduler"]["leases_revoked_no_progress"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn a_worker_hung_inside_a_forward_loses_its_leases_and_the_run_matches_a_clean_one() {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    let clean = run_demo(dir.path(), "clean", None, Duration::from_secs(300));
    // Worker 0 answers four jobs, then hangs with the rest of its batch.
    let hung = run_demo(dir.path(), "hung", Some(5), Duration::from_secs(300));

    assert_eq!(hung.hangs, 1, "worker 0's forward hung");
    assert!(revoked(&hung.summary) >= 1, "{}", hung.summary.runtime);
    assert_eq!(revoked(&clean.summary), 0, "{}", clean.summary.runtime);
    assert_same_artifacts(&clean.summary.run_dir, &hung.summary.run_dir);
    assert_audit_ok(&hung.summary.run_dir);
}

/// Before anything is timed the bound is the floor (2 s here; progress is seen at heartbeats,
/// 1 s apart): the hung run takes at most the clean run's time plus the floor, two heartbeats
/// and 8 s of slack for a loaded machine. Without the rule the hung lease would live until its
/// lifetime (30 minutes before any job is timed).
#[test]
fn a_hang_at_the_very_start_is_revoked_at_the_floor_and_the_run_ends_within_clean_plus_12_s() {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    let clean = run_demo(dir.path(), "clean", None, Duration::from_secs(300));
    let bound = clean.took + Duration::from_secs(2 + 2 + 8);
    let hung = run_demo(dir.path(), "hung", Some(1), bound + Duration::from_secs(30));

    assert_eq!(hung.hangs, 1, "worker 0's first forward hung");
    assert!(revoked(&hung.summary) >= 1, "{}", hung.summary.runtime);
    assert!(
        hung.took <= bound,
        "took {:?}; a clean run took {:?}",
        hung.took,
        clean.took
    );
    assert_same_artifacts(&clean.summary.run_dir, &hung.summary.run_dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_worker_is_told_its_lease_was_revoked_and_counts_it() {
    let (scheduler, mut completions) = Scheduler::new(SchedulerConfig {
        progress: ProgressRule {
            multiple: 4,
            floor: Duration::from_millis(300),
            heartbeat: Duration::from_millis(50),
        },
        speculation: SpeculationConfig::OFF,
        ..SchedulerConfig::default()
    });
    let scheduler = Arc::new(scheduler);
    scheduler.enqueue(rollout_job(vec![1]));
    let server = serve_for_workers(scheduler.clone(), Duration::from_millis(50)).await;
    let hangs = Arc::new(AtomicUsize::new(0));
    let engine = Stepped::new(Script::new(Behaviour::default()), Some(1), hangs.clone());
    let opts = worker_options(server.addr.to_string());
    let worker = tokio::spawn(run_worker(engine, opts, std::future::pending()));

    // The job is revoked from the hung worker and leased again (the worker itself takes it
    // back once its engine gave the cancelled job back), and answered.
    let done = tokio::time::timeout(Duration::from_secs(20), completions.recv())
        .await
        .expect("the job is answered after all")
        .unwrap();
    assert!(
        done.result.is_err(),
        "rollout_job's prompt has no summaries: an error answer"
    );
    scheduler.set_control(ControlSignal::Stop);
    let summary = tokio::time::timeout(Duration::from_secs(10), worker)
        .await
        .expect("the worker leaves after STOP")
        .unwrap()
        .expect("a clean exit");
    assert_eq!(hangs.load(Ordering::SeqCst), 1);
    assert_eq!(summary.leases_revoked, 1, "{summary:?}");
    assert_eq!(summary.jobs_cancelled, 1, "{summary:?}");
    assert_eq!(scheduler.stats().leases_revoked_no_progress, 1);
}

/// A batching engine that plods: each step takes `pause`, and a job is answered at its
/// `steps`-th step.
struct Plodding {
    inner: ScriptedEngine,
    batch: VecDeque<(u64, Job, u32)>,
    pause: Duration,
    steps: u32,
}

impl Engine for Plodding {
    fn fingerprint(&self) -> &ModelFingerprint {
        self.inner.fingerprint()
    }
    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        self.inner.rollout(request)
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.inner.generate(request)
    }
    fn batches(&self) -> bool {
        true
    }
    fn admit(&mut self, key: u64, job: &Job, _: CancelFlag) -> Result<(), EngineError> {
        self.batch.push_back((key, job.clone(), 0));
        Ok(())
    }
    fn step(&mut self) -> Vec<(u64, Result<JobOutput, EngineError>)> {
        std::thread::sleep(self.pause);
        self.batch.iter_mut().for_each(|(_, _, n)| *n += 1);
        let mut ended = Vec::new();
        while let Some(i) = self.batch.iter().position(|(_, _, n)| *n >= self.steps) {
            let (key, job, _) = self.batch.remove(i).expect("a position in the batch");
            let Job::Rollout(r) = job else {
                unreachable!("rollouts only")
            };
            ended.push((key, self.inner.rollout(&r).map(JobOutput::Rollout)));
        }
        ended
    }
}

/// The other side of the rule: a job that takes twice the floor, on an engine whose steps
/// keep coming, keeps its lease (its progress reaches rank 0 with the heartbeats).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_job_whose_steps_keep_coming_keeps_its_lease() {
    let (scheduler, mut completions) = Scheduler::new(SchedulerConfig {
        progress: ProgressRule {
            multiple: 4,
            floor: Duration::from_millis(600),
            heartbeat: Duration::from_millis(50),
        },
        speculation: SpeculationConfig::OFF,
        ..SchedulerConfig::default()
    });
    let scheduler = Arc::new(scheduler);
    scheduler.enqueue(rollout_job(vec![1]));
    let server = serve_for_workers(scheduler.clone(), Duration::from_millis(50)).await;
    let engine = Plodding {
        inner: ScriptedEngine::new(Script::new(Behaviour::default())),
        batch: VecDeque::new(),
        pause: Duration::from_millis(100),
        steps: 12,
    };
    let opts = worker_options(server.addr.to_string());
    let worker = tokio::spawn(run_worker(engine, opts, std::future::pending()));
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(20), completions.recv())
        .await
        .expect("the job is answered")
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(1200),
        "twelve steps of 100 ms"
    );
    scheduler.set_control(ControlSignal::Stop);
    let summary = tokio::time::timeout(Duration::from_secs(10), worker)
        .await
        .expect("the worker leaves after STOP")
        .unwrap()
        .expect("a clean exit");
    assert_eq!((summary.leases_revoked, summary.jobs_cancelled), (0, 0));
    let stats = scheduler.stats();
    assert_eq!(
        (stats.leases_revoked_no_progress, stats.leases_issued),
        (0, 1)
    );
}

/// A worker's side of the wire, by hand: registered with rank 0 and holding one lease.
struct ByHand {
    client: pb::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    session: String,
    lease: u64,
    /// When the last heartbeat was sent: rank 0 noted its progress no sooner.
    last_beat: Instant,
}

/// Rank 0 (no-progress floor `floor`, 4 stalls, heartbeats every 50 ms, no straggler copies)
/// with one job queued, and a hand-driven worker holding its lease.
async fn one_lease_by_hand(floor: Duration) -> (support::Loopback, ByHand) {
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig {
        progress: ProgressRule {
            multiple: 4,
            floor,
            heartbeat: Duration::from_millis(50),
        },
        speculation: SpeculationConfig::OFF,
        ..SchedulerConfig::default()
    });
    let scheduler = Arc::new(scheduler);
    scheduler.enqueue(rollout_job(vec![1]));
    let server = serve_for_workers(scheduler, Duration::from_millis(50)).await;
    let url = format!("http://{}", server.addr);
    let mut client = pb::coordinator_client::CoordinatorClient::connect(url)
        .await
        .unwrap();
    let worker = pb::WorkerInfo {
        name: "by-hand".into(),
        device: "cpu".into(),
        model_fingerprint: "fp".into(),
        capacity: 1,
        version: "test".into(),
        max_context: 8192,
    };
    let session = client
        .register(pb::RegisterRequest {
            worker: Some(worker),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .session;
    let leased = client
        .lease(pb::LeaseRequest {
            session: session.clone(),
            max_jobs: 1,
            wait_ms: 1000,
        })
        .await
        .unwrap()
        .into_inner();
    let lease = leased.jobs[0].lease_id;
    let hand = ByHand {
        client,
        session,
        lease,
        last_beat: Instant::now(),
    };
    (server, hand)
}

impl ByHand {
    /// Heartbeats every 50 ms, the `n`-th reporting `progress(n)`, for `beats` beats or until
    /// the lease is fenced; `Some(beat)` when it was revoked for want of progress.
    async fn beat(
        &mut self,
        beats: u64,
        progress: impl Fn(u64) -> pb::LeaseProgress,
    ) -> Option<u64> {
        for n in 0..beats {
            self.last_beat = Instant::now();
            let answer = self
                .client
                .heartbeat(pb::HeartbeatRequest {
                    session: self.session.clone(),
                    lease_ids: vec![self.lease],
                    jobs_done: 0,
                    progress: vec![progress(n)],
                })
                .await
                .unwrap()
                .into_inner();
            if !answer.fenced_lease_ids.is_empty() {
                assert_eq!(answer.revoked_lease_ids, vec![self.lease]);
                return Some(n);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}

/// A progress entry of `lease` as a worker of this build sends it.
fn counts(lease: u64, steps: u64, tokens: u64, prompt_done: u32) -> pb::LeaseProgress {
    pb::LeaseProgress {
        lease_id: lease,
        steps,
        tokens,
        rows_finished: 0,
        prompt_done,
    }
}

/// An engine whose step count is stuck but whose tokens (or prompt tokens) grow is decoding
/// (prefilling): rank 0 keeps its lease past many times the floor, and revokes it once every
/// counter stands still.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_tokens_grow_while_its_steps_stand_still_keeps_it_until_all_stand_still() {
    let (_server, mut hand) = one_lease_by_hand(Duration::from_millis(400)).await;
    let lease = hand.lease;
    // Two seconds of prefill by chunks, then two of decoding: the steps never move.
    let prefill = hand
        .beat(40, |n| counts(lease, 1, 0, 64 * (n as u32 + 1)))
        .await;
    assert_eq!(prefill, None, "the prompt count grew");
    let decode = hand.beat(40, |n| counts(lease, 1, n + 1, 2560)).await;
    assert_eq!(decode, None, "the tokens grew");
    let moved = hand.last_beat;
    let stood = hand.beat(400, |_| counts(lease, 1, 40, 2560)).await;
    assert!(stood.is_some(), "every counter stood still: revoked");
    assert!(
        moved.elapsed() >= Duration::from_millis(400),
        "not before the floor"
    );
}

/// An older worker fills the steps alone: its lease lives while they grow and is revoked at
/// the bound once they stand still, as before the other counters existed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_workers_steps_alone_keep_and_lose_a_lease_as_before() {
    let (_server, mut hand) = one_lease_by_hand(Duration::from_millis(400)).await;
    let lease = hand.lease;
    let steps = |steps| pb::LeaseProgress {
        lease_id: lease,
        steps,
        ..Default::default()
    };
    assert_eq!(hand.beat(30, |n| steps(n + 1)).await, None, "steps grew");
    let moved = hand.last_beat;
    assert!(hand.beat(400, |_| steps(30)).await.is_some(), "revoked");
    assert!(
        moved.elapsed() >= Duration::from_millis(400),
        "not before the floor"
    );
}
