//! The engine thread of a worker: the jobs a session leased go in, their results come out as
//! each one ends. A batching engine ([`Engine::batches`]) runs every job in hand in one
//! continuous batch (a job joins at the next step, leaves the step its last row ends); any
//! other engine runs them one at a time in arrival order. Each job carries its own
//! [`CancelFlag`], so a fenced lease stops its job alone.
//!
//! The thread owns no session state: the lease loop ([`crate::client`]) decides how many jobs
//! to hold (the KV budget and `--max-jobs`) and submits the results.
//!
//! On a batching engine the thread also keeps each job's progress ([`ProgressCount`]): every
//! step of the batch that returns counts for every job in it, and after each step the thread
//! copies what the engine says of each job ([`Engine::job_progress`]: tokens decoded, rows
//! finished, prompt tokens prefilled). The heartbeat reports them to rank 0, which revokes a
//! lease whose counts all stand still too long (an engine hung inside a forward). An engine
//! that runs one job to its end in one call shows no progress until then.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageb_shared::observe;
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{CancelFlag, Engine, EngineError, Job, JobOutput, JobProgress};

/// A leased job handed to the engine thread.
pub struct Incoming {
    /// The lease id: the key the result comes back under.
    pub key: u64,
    pub job: Result<Job, EngineError>,
    pub cancel: CancelFlag,
    /// The job's progress in the batch (a batching engine only).
    pub progress: ProgressCount,
}

/// How far a job has got on a batching engine: the engine thread writes, the heartbeat reads.
/// Shared, cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct ProgressCount(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    steps: AtomicU64,
    tokens: AtomicU64,
    rows_finished: AtomicU32,
    prompt_done: AtomicU32,
}

/// A job's progress counters at one moment ([`ProgressCount::get`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Batch steps the job has been through.
    pub steps: u64,
    /// Tokens its rows decoded, all rows together (0 where the engine does not say).
    pub tokens: u64,
    /// Its rows that ended (0 where the engine does not say).
    pub rows_finished: u32,
    /// Its prompt tokens in the KV cache (0 where the engine does not say).
    pub prompt_done: u32,
}

impl ProgressCount {
    pub fn get(&self) -> Progress {
        let c = &self.0;
        Progress {
            steps: c.steps.load(Ordering::Relaxed),
            tokens: c.tokens.load(Ordering::Relaxed),
            rows_finished: c.rows_finished.load(Ordering::Relaxed),
            prompt_done: c.prompt_done.load(Ordering::Relaxed),
        }
    }

    /// One more step returned; `seen`: what the engine says of the job now.
    fn stepped(&self, seen: Option<JobProgress>) {
        let c = &self.0;
        c.steps.fetch_add(1, Ordering::Relaxed);
        if let Some(p) = seen {
            c.tokens.store(p.tokens, Ordering::Relaxed);
            c.rows_finished.store(p.rows_finished, Ordering::Relaxed);
            c.prompt_done.store(p.prompt_done, Ordering::Relaxed);
        }
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
    let mut started: Vec<(u64, Instant, ProgressCount)> = Vec::new();
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
    started: &mut Vec<(u64, Instant, ProgressCount)>,
) -> Vec<Outgoing> {
    let mut ended = Vec::new();
    for (inc, t0) in queue.drain(..) {
        let admitted = inc
            .job
            .and_then(|job| engine.admit(inc.key, &job, inc.cancel));
        match admitted {
            Ok(()) => started.push((inc.key, t0, inc.progress)),
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
    for (key, _, progress) in started.iter() {
        progress.stepped(engine.job_progress(*key));
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{
        GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput, RolloutRequest,
    };

    /// A batch that never ends a job; each step decodes `per_step` tokens for each job in it,
    /// and says so when `tells`.
    struct Endless {
        fingerprint: ModelFingerprint,
        keys: Vec<u64>,
        steps: u64,
        per_step: u64,
        tells: bool,
    }

    impl Endless {
        fn new(per_step: u64, tells: bool) -> Self {
            Endless {
                fingerprint: ModelFingerprint {
                    weights_sha256: "w".into(),
                    candle_version: "c".into(),
                    dtype: "d".into(),
                    device: "cpu".into(),
                    architecture: "endless".into(),
                },
                keys: Vec::new(),
                steps: 0,
                per_step,
                tells,
            }
        }
    }

    impl Engine for Endless {
        fn fingerprint(&self) -> &ModelFingerprint {
            &self.fingerprint
        }
        fn rollout(&mut self, _: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
            Err(EngineError::Model("batches only".into()))
        }
        fn generate(&mut self, _: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
            Err(EngineError::Model("batches only".into()))
        }
        fn batches(&self) -> bool {
            true
        }
        fn admit(&mut self, key: u64, _: &Job, _: CancelFlag) -> Result<(), EngineError> {
            self.keys.push(key);
            Ok(())
        }
        fn step(&mut self) -> Vec<(u64, Result<JobOutput, EngineError>)> {
            self.steps += 1;
            Vec::new()
        }
        fn job_progress(&self, key: u64) -> Option<JobProgress> {
            (self.tells && self.keys.contains(&key)).then(|| JobProgress {
                prompt_done: 100,
                tokens: self.steps * self.per_step,
                rows: 2,
                rows_finished: u32::from(self.steps >= 3),
            })
        }
    }

    fn incoming(key: u64) -> (Incoming, Instant) {
        let job = Job::Generate(GenerateRequest {
            messages: Vec::new(),
            json_schema: None,
            seed: 1,
            temperature: 0.0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            max_new_tokens: 8,
        });
        let progress = ProgressCount::default();
        let cancel = CancelFlag::default();
        (
            Incoming {
                key,
                job: Ok(job),
                cancel,
                progress,
            },
            Instant::now(),
        )
    }

    /// Runs `steps` steps of `engine` with job 7 admitted at the first; its progress after.
    fn progress_after(mut engine: Endless, steps: usize) -> Progress {
        let (job, t0) = incoming(7);
        let count = job.progress.clone();
        let mut queue = VecDeque::from([(job, t0)]);
        let mut started = Vec::new();
        for _ in 0..steps {
            assert!(batch_step(&mut engine, &mut queue, &mut started).is_empty());
        }
        count.get()
    }

    #[test]
    fn each_step_copies_what_the_engine_says_of_the_job_beside_the_step_count() {
        let seen = progress_after(Endless::new(2, true), 3);
        let expected = Progress {
            steps: 3,
            tokens: 6,
            rows_finished: 1,
            prompt_done: 100,
        };
        assert_eq!(seen, expected);
    }

    #[test]
    fn an_engine_that_says_nothing_of_its_jobs_shows_steps_alone() {
        let seen = progress_after(Endless::new(2, false), 3);
        let steps_only = Progress {
            steps: 3,
            ..Progress::default()
        };
        assert_eq!(seen, steps_only);
    }
}
