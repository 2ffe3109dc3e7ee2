//! Stopping like a citizen of a scheduler: rank 0 drains on SIGTERM, workers
//! act on rank 0's word, and a dead job stops holding its device.
//!
//! - A drained rank 0 journals every answer in flight when the signal came, so the resumed run
//!   recomputes nothing that was running (before, in-flight work was dropped and the run ended
//!   like a crash).
//! - A worker abandons a job whose lease rank 0 fenced, at the next decode step, and never
//!   submits it (before, it decoded to the end and its result was refused).
//! - `STOP` cancels the job in hand; `DRAIN` lets it finish and then the worker leaves as
//!   interrupted, not as done.
//! - The process exits 75 (interrupted, resumable) and under `--log-format json` every line of
//!   its stderr is JSON, the closing error included.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use stageb::roles::{ClusterError, StartMode};
use stageb_coordinator::cluster::scheduler::{ControlSignal, Scheduler, SchedulerConfig};
use stageb_worker::client::{WorkerEnd, WorkerOptions, run_worker};
use stageb_worker::engine::{
    CancelFlag, Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint,
    RolloutOutput, RolloutRequest,
};
use support::{
    Behaviour, Script, ScriptedEngine, assert_audit_ok, copy_demo_mission, fingerprint,
    journal_rows, real_model, rollout_job, serve_for_workers, try_run, worker_options,
};

/// The scripted engine, slowed down so jobs are still running when the signal arrives, and
/// counting rollouts started and finished. It presents the real model's weights digest, so
/// rank 0 pins the run by the config's model file, as in production.
struct SlowEngine {
    inner: ScriptedEngine,
    fingerprint: ModelFingerprint,
    delay: Duration,
    started: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
}

impl Engine for SlowEngine {
    fn fingerprint(&self) -> &ModelFingerprint {
        &self.fingerprint
    }
    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        let out = self.inner.rollout(request);
        self.finished.fetch_add(1, Ordering::SeqCst);
        out
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.inner.generate(request)
    }
}

#[test]
fn a_drained_run_journals_every_answer_in_flight_and_resumes_from_them() {
    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    // The config names a readable model: rank 0 knows the weights and the context at start,
    // and only the first worker completes the fingerprint (the case that left it unrecorded).
    // Only the model's header and digest are read here.
    let model = real_model();
    let config = support::write_config(
        dir.path(),
        serde_json::json!({"model": {"model_name_or_path": model}}),
    );
    let fingerprint = ModelFingerprint {
        weights_sha256: stageb_worker::engine::weights_sha256(&model).unwrap(),
        // Rank 0 hashed these weights itself, so the numerics must be ones this build makes.
        candle_version: stageb_worker::engine::CANDLE_VERSION.into(),
        dtype: "cpu-q8-fixed-order".into(),
        device: "cpu".into(),
        architecture: "scripted".into(),
    };
    let (started, finished) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let script = Script::new(Behaviour::default());
    let engines = {
        let (started, finished, script) = (started.clone(), finished.clone(), script.clone());
        let fingerprint = fingerprint.clone();
        move |_| {
            // Loading a model takes a while: rank 0 is well into its start by then.
            std::thread::sleep(Duration::from_millis(500));
            SlowEngine {
                inner: ScriptedEngine::new(script.clone()),
                fingerprint: fingerprint.clone(),
                delay: Duration::from_millis(400),
                started: started.clone(),
                finished: finished.clone(),
            }
        }
    };
    // The signal comes while both workers are inside a rollout (the 5th and 6th started).
    let signal = {
        let started = started.clone();
        async move {
            while started.load(Ordering::SeqCst) < 6 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let stopped = try_run(&config, 2, engines, StartMode::Fresh, signal);
    let Err(ClusterError::Interrupted {
        run_dir,
        answers,
        abandoned,
        ..
    }) = stopped
    else {
        panic!("the run is interrupted, not {stopped:?}");
    };
    assert_eq!(abandoned, 0, "the drain waited for both jobs");
    assert!(answers >= 1, "answers arrived during the drain");
    let done = finished.load(Ordering::SeqCst);
    assert_eq!(
        started.load(Ordering::SeqCst),
        done,
        "nothing was leased after the signal, and nothing started was dropped"
    );
    assert_eq!(
        journal_rows(&run_dir),
        done,
        "every finished rollout is in the journal"
    );
    // The model was on record before the first job, so a resume can refuse another model.
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(
        manifest["model"]["fingerprint"].as_str(),
        Some(fingerprint.id().as_str()),
        "an early stop still leaves the model pinned"
    );

    let resumed = try_run(
        &config,
        2,
        move |_| SlowEngine {
            inner: ScriptedEngine::new(script.clone()),
            fingerprint: fingerprint.clone(),
            delay: Duration::ZERO,
            started: Arc::default(),
            finished: Arc::default(),
        },
        StartMode::Resume,
        std::future::pending(),
    )
    .expect("the resumed run completes");
    assert_eq!(
        resumed.runtime["scheduler"]["replayed"].as_u64(),
        Some(done as u64),
        "the resumed run recomputes none of the drained answers"
    );
    assert_audit_ok(&resumed.run_dir);
}

/// An engine that decodes "forever" (until cancelled or 20 s pass), checking the flag between
/// steps like the real one.
struct EndlessEngine {
    fingerprint: ModelFingerprint,
    cancel: CancelFlag,
    cancelled: Arc<AtomicUsize>,
}

impl Engine for EndlessEngine {
    fn fingerprint(&self) -> &ModelFingerprint {
        &self.fingerprint
    }
    fn rollout(&mut self, _: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            if self.cancel.is_cancelled() {
                self.cancelled.fetch_add(1, Ordering::SeqCst);
                return Err(EngineError::Cancelled);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(EngineError::Model("never cancelled".into()))
    }
    fn generate(&mut self, _: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        Err(EngineError::InvalidRequest("not used".into()))
    }
    fn set_cancel(&mut self, flag: CancelFlag) {
        self.cancel = flag;
    }
}

fn endless_worker(addr: SocketAddr, cancelled: Arc<AtomicUsize>) -> (EndlessEngine, WorkerOptions) {
    let engine = EndlessEngine {
        fingerprint: fingerprint("endless"),
        cancel: CancelFlag::default(),
        cancelled,
    };
    (engine, worker_options(addr.to_string()))
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Regression: a worker whose lease had expired decoded to the end and submitted a result
/// rank 0 could only refuse, holding the device the whole time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_lease_cancels_its_job_at_the_next_step_and_stop_cancels_the_next() {
    // Leases expire long before the first heartbeat can extend them.
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig {
        lease_ttl: Duration::from_millis(300),
        ..SchedulerConfig::default()
    });
    let scheduler = Arc::new(scheduler);
    scheduler.enqueue(rollout_job(vec![1]));
    let server = serve_for_workers(scheduler.clone(), Duration::from_millis(700)).await;
    let cancelled = Arc::new(AtomicUsize::new(0));
    let (engine, opts) = endless_worker(server.addr, cancelled.clone());
    let worker = tokio::spawn(run_worker(engine, opts, std::future::pending()));

    // The heartbeat finds the lease fenced: the job is abandoned, and re-leased (same worker).
    wait_for("the fenced job to be cancelled", || {
        cancelled.load(Ordering::SeqCst) >= 1
    })
    .await;
    wait_for("the job to be leased again", || {
        scheduler.stats().leases_issued >= 2
    })
    .await;
    scheduler.set_control(ControlSignal::Stop);
    let summary = tokio::time::timeout(Duration::from_secs(10), worker)
        .await
        .expect("the worker leaves soon after STOP")
        .unwrap()
        .expect("a clean exit");
    assert_eq!(summary.end, WorkerEnd::RunOver);
    assert!(summary.jobs_cancelled >= 2, "{summary:?}");
    assert_eq!(summary.jobs_done + summary.jobs_failed, 0);
    let stats = scheduler.stats();
    assert_eq!(
        (
            stats.submits_accepted,
            stats.submits_fenced,
            stats.job_errors
        ),
        (0, 0, 0),
        "a cancelled job is never submitted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_told_to_drain_takes_nothing_new_and_leaves_as_interrupted() {
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig::default());
    let scheduler = Arc::new(scheduler);
    scheduler.set_control(ControlSignal::Drain);
    scheduler.enqueue(rollout_job(vec![1]));
    let server = serve_for_workers(scheduler.clone(), Duration::from_millis(200)).await;
    let (engine, opts) = endless_worker(server.addr, Arc::default());
    let summary = tokio::time::timeout(
        Duration::from_secs(10),
        run_worker(engine, opts, std::future::pending()),
    )
    .await
    .expect("the worker leaves")
    .expect("a clean exit");
    assert_eq!(summary.end, WorkerEnd::Drained);
    assert_eq!(
        scheduler.stats().leases_issued,
        0,
        "nothing leased while draining"
    );
}

/// Regression: a worker that lost its session (a failed call) registered again while its old
/// session still held a lease; that job waited out the lease TTL before anyone could run it.
#[test]
fn a_worker_registering_again_has_its_old_leases_fenced_at_once() {
    let (scheduler, _completions) = Scheduler::new(SchedulerConfig::default());
    let job = scheduler.enqueue(rollout_job(vec![1]));
    let (_, old) = scheduler.register().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (leased, _) = rt
        .block_on(scheduler.lease(&old, 1, Duration::ZERO))
        .unwrap();
    assert_eq!(leased.len(), 1);
    let (_, new, fenced) = scheduler.register_replacing(&old).unwrap();
    assert_eq!(fenced, vec![leased[0].0]);
    assert!(!scheduler.has_session(&old), "the old session is retired");
    let (again, _) = rt
        .block_on(scheduler.lease(&new, 1, Duration::ZERO))
        .unwrap();
    assert_eq!(again.len(), 1, "job {job} is back in the queue at once");
    // Nobody else can retire a session by naming a secret it does not hold.
    let (_, _, none) = scheduler.register_replacing("not-a-session").unwrap();
    assert!(none.is_empty());
    assert_eq!(scheduler.in_flight(), 1);
}

/// `stageb coordinator` waiting for workers, then SIGTERM: exit 75, and with JSON logs every
/// stderr line (the closing error too) is a JSON object. Regression: the signal handlers were
/// installed at the first poll of the shutdown future, so a SIGTERM during start-up (right
/// after "run started" here, or while a model loads) killed the process outright.
#[cfg(unix)]
#[test]
fn sigterm_exits_75_and_every_log_line_is_json() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let dir = tempfile::tempdir().unwrap();
    copy_demo_mission(dir.path());
    let config = support::write_config(dir.path(), serde_json::json!({}));
    let mut child = Command::new(env!("CARGO_BIN_EXE_stageb"))
        .args(["--log-format", "json", "coordinator", "--config"])
        .arg(&config)
        .args(["--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start stageb");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let ready = line.contains("run started");
        seen.push(line);
        if ready {
            break;
        }
    }
    let pid = child.id().to_string();
    let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(status.success());
    seen.extend(lines.map(|l| l.unwrap()));
    let code = child.wait().unwrap().code();
    assert_eq!(
        code,
        Some(75),
        "interrupted, resumable; log:\n{}",
        seen.join("\n")
    );
    for line in &seen {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok_and(|v| v.is_object()),
            "not a JSON line: {line}"
        );
    }
    let last = seen.last().expect("a closing line");
    assert!(
        last.contains("--resume"),
        "the closing line says how to go on: {last}"
    );
}
