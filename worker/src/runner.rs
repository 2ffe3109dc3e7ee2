//! The engine thread of a worker: the jobs a session leased go in, their results come out as
//! each one ends. A batching engine ([`Engine::batches`]) runs every job in hand in one
//! continuous batch (a job joins at the next step, leaves the step its last row ends); any
//! other engine runs them one at a time in arrival order. Each job carries its own
//! [`CancelFlag`], so a fenced lease stops its job alone.
//!
//! The thread owns no session state: the lease loop ([`crate::client`]) decides how many jobs
//! to hold (the KV budget and `--max-jobs`) and submits the results.
//!
//! On a batching engine the thread also counts each job's progress ([`StepCount`]): every
//! step of the batch that returns counts for every job in it. The heartbeat reports the counts
//! to rank 0, which revokes a lease whose count stands still too long (an engine hung inside a
//! forward). An engine that runs one job to its end in one call shows no progress until then.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageb_shared::observe;
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{CancelFlag, Engine, EngineError, Job, JobOutput};

/// A leased job handed to the engine thread.
pub struct Incoming {
    /// The lease id: the key the result comes back under.
    pub key: u64,
    pub job: Result<Job, EngineError>,
    pub cancel: CancelFlag,
    /// Counts the batch steps the job has been through (a batching engine only).
    pub steps: StepCount,
}

/// The forward steps a job has been through on a batching engine: the engine thread counts,
/// the heartbeat reads. Shared, cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct StepCount(Arc<AtomicU64>);

impl StepCount {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn add_one(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// A job that ended: its output or why not, and how long it was in the engine.
pub struct Outgoing {
    pub key: u64,
    pub result: Result<JobOutput, EngineError>,
    pub took: Duration,
    /// What the engine's prefix store held when the job ended (`None`: it has none).
    pub prefix_bytes: Option<u64>,
}

/// Runs jobs from `inbox` on `engine` until `inbox` closes and nothing is left in hand;
/// every job's end goes to `outbox`. Blocking: call it on its own thread.
pub fn run_engine<E: Engine>(
    engine: Arc<Mutex<E>>,
    inbox: Receiver<Incoming>,
    outbox: UnboundedSender<Outgoing>,
) {
    let mut queue: VecDeque<(Incoming, Instant)> = VecDeque::new();
    let mut started: Vec<(u64, Instant, StepCount)> = Vec::new();
    let mut open = true;
    loop {
        let idle = queue.is_empty() && started.is_empty();
        if idle && !open {
            return;
        }
        // Idle: wait for work. Busy: take whatever arrived, without waiting.
        let mut arrived = Vec::new();
        if idle {
            match inbox.recv() {
                Ok(job) => arrived.push(job),
                Err(_) => return,
            }
        }
        loop {
            match inbox.try_recv() {
                Ok(job) => arrived.push(job),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        queue.extend(arrived.into_iter().map(|j| (j, Instant::now())));
        let mut engine = engine.lock().unwrap_or_else(|e| e.into_inner());
        let mut ended = if engine.batches() {
            batch_step(&mut *engine, &mut queue, &mut started)
        } else {
            one_job(&mut *engine, &mut queue)
        };
        let prefix_bytes = engine.prefix_cache_bytes();
        drop(engine);
        ended.iter_mut().for_each(|o| o.prefix_bytes = prefix_bytes);
        for out in ended {
            if outbox.send(out).is_err() {
                return;
            }
        }
    }
}

/// Admits the queued jobs into the batch and runs one step.
fn batch_step<E: Engine + ?Sized>(
    engine: &mut E,
    queue: &mut VecDeque<(Incoming, Instant)>,
    started: &mut Vec<(u64, Instant, StepCount)>,
) -> Vec<Outgoing> {
    let mut ended = Vec::new();
    for (inc, t0) in queue.drain(..) {
        let admitted = inc
            .job
            .and_then(|job| engine.admit(inc.key, &job, inc.cancel));
        match admitted {
            Ok(()) => started.push((inc.key, t0, inc.steps)),
            Err(e) => ended.push(Outgoing {
                key: inc.key,
                result: Err(e),
                took: t0.elapsed(),
                prefix_bytes: None,
            }),
        }
    }
    let ended_now = engine.step();
    // The step returned: progress for every job in the batch (a hung forward never gets here).
    started.iter().for_each(|(_, _, steps)| steps.add_one());
    let (rows, jobs) = engine.last_step_size();
    if rows > 0 {
        metrics::histogram!(observe::WORKER_STEP_ROWS).record(rows as f64);
        metrics::histogram!(observe::WORKER_STEP_JOBS).record(jobs as f64);
    }
    if let Some(kv) = engine.kv_blocks() {
        metrics::gauge!(observe::WORKER_KV_BLOCKS, "state" => "used").set(kv.used as f64);
        metrics::gauge!(observe::WORKER_KV_BLOCKS, "state" => "free").set(kv.free as f64);
    }
    for (key, result) in ended_now {
        let took = match started.iter().position(|(k, _, _)| *k == key) {
            Some(i) => started.swap_remove(i).1.elapsed(),
            None => Duration::ZERO,
        };
        ended.push(Outgoing {
            key,
            result,
            took,
            prefix_bytes: None,
        });
    }
    ended
}

/// Runs the oldest queued job to its end (an engine that does not batch).
fn one_job<E: Engine + ?Sized>(
    engine: &mut E,
    queue: &mut VecDeque<(Incoming, Instant)>,
) -> Vec<Outgoing> {
    let Some((inc, t0)) = queue.pop_front() else {
        return Vec::new();
    };
    engine.set_cancel(inc.cancel);
    let result = inc.job.and_then(|job| match job {
        Job::Rollout(r) => engine.rollout(&r).map(JobOutput::Rollout),
        Job::Generate(g) => engine.generate(&g).map(JobOutput::Generate),
    });
    vec![Outgoing {
        key: inc.key,
        result,
        took: t0.elapsed(),
        prefix_bytes: None,
    }]
}
