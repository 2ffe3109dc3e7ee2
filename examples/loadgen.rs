//! Load generator for rank 0 (bench and soak code, never the product path): N simulated
//! workers in one process, speaking the real protocol to a real `stageb coordinator` over
//! loopback gRPC, answering jobs with a simulated engine.
//!
//! Each simulated worker is the product worker's own session loop
//! ([`stageb_worker::client::run_worker_with`]: register, heartbeats reporting each lease's
//! progress, lease, submit, `DRAIN`/`STOP`, fenced leases abandoned, re-registration naming
//! `previous_session` when the session is lost) with a simulated engine plugged in where the
//! model would be: a continuous batch whose jobs end when their drawn latency has passed. No
//! model runs, so a thousand of them share a 2-core machine. Answers are pure functions of
//! each job (its seeds, its schema), so two runs of the same mission write the same artifacts
//! whatever the faults in between.
//!
//! Latency per job is drawn from a seeded distribution (fixed, or lognormal with a long tail).
//! Measured client-side, through the loop's call observer: Lease RPC time when it returned a
//! job (lease wait; apart, the calls that found work queued, by the response's
//! `waited_for_work_us`) and Submit RPC time, p50/p99, jobs answered, wall time; one JSON
//! object on stdout at the end. Exits when rank 0 says `STOP` (0), `DRAIN` (75), or stays
//! unreachable past `--reconnect-s` or refuses a worker (3). `RUST_LOG` shows the worker
//! loop's own logs on stderr.
//!
//! `cargo build --release --example loadgen`; `target/release/examples/loadgen --help`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use stageb_shared::auth::AuthToken;
use stageb_shared::pb;
use stageb_shared::seed::splitmix64;
use stageb_shared::telemetry::{LogFormat, init_tracing};
use stageb_worker::client::{
    CallObserver, ClientHooks, JobLimits, WorkerEnd, WorkerError, WorkerOptions, run_worker_with,
};
use stageb_worker::engine::{
    CancelFlag, CandidateOutput, Engine, EngineError, FinishReason, GenerateOutput,
    GenerateRequest, Job, JobOutput, ModelFingerprint, RolloutOutput, RolloutRequest,
};

/// The process start: the origin of every offset in [`Stats`].
static START: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

const USAGE: &str = "loadgen --coordinator HOST:PORT [--token-file F] [--workers N]
  [--latency fixed:MS | lognormal:MEDIAN_MS:SIGMA] [--seed S] [--reconnect-s S]
  [--name PREFIX] [--max-context TOKENS] [--keepalive-s S] [--max-jobs K]";

/// Command line.
#[derive(Debug, Clone)]
struct Opts {
    coordinator: String,
    token: Option<AuthToken>,
    workers: usize,
    latency: Latency,
    seed: u64,
    reconnect: Duration,
    name: String,
    max_context: u32,
    /// HTTP/2 keepalive ping interval and ack timeout, as the real worker's (20 s): how long
    /// a silently partitioned connection takes to be noticed.
    keepalive: Duration,
    /// Jobs a simulated worker holds at once (1..=16), as the real worker's `--max-jobs`:
    /// it leases up to this many and serves them side by side, each with its own latency.
    max_jobs: usize,
}

/// How long a simulated job takes.
#[derive(Debug, Clone, Copy)]
enum Latency {
    Fixed(f64),
    /// Median in ms and sigma of the underlying normal (1.0 gives p99 ≈ 10× the median).
    LogNormal(f64, f64),
}

fn parse_latency(s: &str) -> Result<Latency, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let num = |p: &str| p.parse::<f64>().map_err(|e| format!("--latency {s}: {e}"));
    match parts.as_slice() {
        ["fixed", ms] => Ok(Latency::Fixed(num(ms)?)),
        ["lognormal", median, sigma] => Ok(Latency::LogNormal(num(median)?, num(sigma)?)),
        _ => Err(format!(
            "--latency {s}: expected fixed:MS or lognormal:MEDIAN_MS:SIGMA"
        )),
    }
}

fn parse_args() -> Result<Opts, String> {
    let mut opts = Opts {
        coordinator: String::new(),
        token: None,
        workers: 1,
        latency: Latency::Fixed(0.0),
        seed: 1,
        reconnect: Duration::from_secs(30),
        name: format!("loadgen-{}", std::process::id()),
        max_context: 8192,
        keepalive: Duration::from_secs(20),
        max_jobs: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        let bad = |e: std::num::ParseIntError| format!("{flag}: {e}");
        match flag.as_str() {
            "--coordinator" => opts.coordinator = value()?,
            "--token-file" => {
                let path = value()?;
                let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
                opts.token = Some(AuthToken::new(text).map_err(|e| format!("{path}: {e}"))?);
            }
            "--workers" => opts.workers = value()?.parse().map_err(bad)?,
            "--latency" => opts.latency = parse_latency(&value()?)?,
            "--seed" => opts.seed = value()?.parse().map_err(bad)?,
            "--reconnect-s" => opts.reconnect = Duration::from_secs(value()?.parse().map_err(bad)?),
            "--name" => opts.name = value()?,
            "--max-context" => opts.max_context = value()?.parse().map_err(bad)?,
            "--keepalive-s" => opts.keepalive = Duration::from_secs(value()?.parse().map_err(bad)?),
            "--max-jobs" => opts.max_jobs = value()?.parse().map_err(bad)?,
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if opts.coordinator.is_empty() || opts.workers == 0 {
        return Err(USAGE.to_string());
    }
    if !(1..=16).contains(&opts.max_jobs) {
        return Err(format!("--max-jobs {}: expected 1 to 16", opts.max_jobs));
    }
    Ok(opts)
}

/// A seeded stream of job latencies (one per simulated worker).
struct Sleeper {
    latency: Latency,
    state: u64,
}

impl Sleeper {
    fn uniform(&mut self) -> f64 {
        self.state = splitmix64(self.state);
        ((self.state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn next(&mut self) -> Duration {
        let ms = match self.latency {
            Latency::Fixed(ms) => ms,
            Latency::LogNormal(median, sigma) => {
                // Box-Muller: one standard normal from two uniforms.
                let (u1, u2) = (self.uniform(), self.uniform());
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                median * (sigma * z).exp()
            }
        };
        Duration::from_secs_f64(ms.max(0.0) / 1000.0)
    }
}

/// The scripted rollout answer: one candidate per requested seed, its verdict a function of
/// the seed alone, in the two-line contract.
fn rollout_answer(job: &RolloutRequest) -> RolloutOutput {
    let mut candidates = Vec::new();
    for d in &job.decodes {
        for (s, &seed) in d.seeds.iter().enumerate() {
            let text = if splitmix64(seed).is_multiple_of(2) {
                "Verdict: 通过\nReason: 未触发任何不通过规则，判通过"
            } else {
                "Verdict: 不通过\nReason: 摘要触发不通过规则，判不通过"
            };
            candidates.push(CandidateOutput {
                decode_index: d.decode_index,
                sample_index: s as u32,
                seed,
                text: text.to_string(),
                completion_tokens: text.chars().count() as u32,
                finish: FinishReason::Stop,
            });
        }
    }
    let prompt: usize = job.messages.iter().map(|m| m.content.chars().count()).sum();
    RolloutOutput {
        candidates,
        prompt_tokens: prompt as u32,
        prefix_tokens: 0,
        prefill_us: 0,
        decode_us: 0,
        batch: Default::default(),
    }
}

/// The smallest instance of a JSON schema: required properties only, empty arrays and
/// strings, the minimum of numbers. Rank 0 may reject it in validation; it still exercises
/// reflection end to end.
fn minimal_instance(schema: &Value) -> Value {
    if let Some(first) = schema.get("enum").and_then(|e| e.get(0)) {
        return first.clone();
    }
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    let kind = match schema.get("type") {
        Some(Value::Array(kinds)) => kinds.first().and_then(Value::as_str).unwrap_or("null"),
        Some(Value::String(kind)) => kind.as_str(),
        _ => "object",
    };
    match kind {
        "object" => {
            let mut out = serde_json::Map::new();
            let required = schema.get("required").and_then(Value::as_array);
            for name in required.into_iter().flatten().filter_map(Value::as_str) {
                let sub = schema.pointer(&format!("/properties/{name}"));
                out.insert(name.into(), minimal_instance(sub.unwrap_or(&Value::Null)));
            }
            Value::Object(out)
        }
        "array" => json!([]),
        "string" => json!(""),
        "integer" | "number" => schema.get("minimum").cloned().unwrap_or(json!(0)),
        "boolean" => json!(false),
        _ => Value::Null,
    }
}

fn generate_answer(job: &GenerateRequest) -> GenerateOutput {
    let schema = job.json_schema.as_ref().unwrap_or(&Value::Null);
    let text = minimal_instance(schema).to_string();
    GenerateOutput {
        completion_tokens: text.chars().count() as u32,
        text,
        prompt_tokens: 1,
        prefix_tokens: 0,
        finish: FinishReason::Stop,
        latency_us: 0,
        batch: Default::default(),
    }
}

fn answer(job: &Job) -> JobOutput {
    match job {
        Job::Rollout(r) => JobOutput::Rollout(rollout_answer(r)),
        Job::Generate(g) => JobOutput::Generate(generate_answer(g)),
    }
}

/// Longest a step waits while the batch is full (no job can join before one ends): how soon
/// a fenced job is abandoned.
const FULL_WAIT: Duration = Duration::from_millis(100);
/// Longest a step waits while the batch has room: how late a job handed over may join.
const ROOM_WAIT: Duration = Duration::from_millis(10);

/// One job in the simulated batch, due at `due`.
struct Running {
    key: u64,
    job: Job,
    cancel: CancelFlag,
    due: Instant,
}

/// The simulated engine: a continuous batch whose jobs end when their drawn latency has
/// passed (a raised cancel flag ends one at the next step), answered by [`answer`].
struct Simulated {
    fingerprint: ModelFingerprint,
    max_context: u32,
    /// The most jobs the worker hands over at once: a full batch grows only when one ends.
    max_jobs: usize,
    sleeper: Sleeper,
    batch: Vec<Running>,
}

impl Simulated {
    fn new(opts: &Opts, index: usize) -> Self {
        Simulated {
            fingerprint: ModelFingerprint {
                weights_sha256: "loadgen-scripted-v1".into(),
                candle_version: "none".into(),
                dtype: "none".into(),
                device: "cpu".into(),
                architecture: "loadgen".into(),
            },
            max_context: opts.max_context,
            max_jobs: opts.max_jobs,
            sleeper: Sleeper {
                latency: opts.latency,
                state: splitmix64(opts.seed ^ splitmix64(index as u64)),
            },
            batch: Vec::new(),
        }
    }

    /// The jobs that ended by `now`: cancelled ones, and those due.
    fn ended(&mut self, now: Instant) -> Vec<(u64, Result<JobOutput, EngineError>)> {
        let mut ended = Vec::new();
        let mut i = 0;
        while i < self.batch.len() {
            let r = &self.batch[i];
            if r.cancel.is_cancelled() {
                ended.push((r.key, Err(EngineError::Cancelled)));
            } else if r.due <= now {
                ended.push((r.key, Ok(answer(&r.job))));
            } else {
                i += 1;
                continue;
            }
            self.batch.swap_remove(i);
        }
        ended
    }
}

impl Engine for Simulated {
    fn fingerprint(&self) -> &ModelFingerprint {
        &self.fingerprint
    }
    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        Ok(rollout_answer(request))
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        Ok(generate_answer(request))
    }
    fn max_context(&self) -> u32 {
        self.max_context
    }
    fn batches(&self) -> bool {
        true
    }
    fn admit(&mut self, key: u64, job: &Job, cancel: CancelFlag) -> Result<(), EngineError> {
        let due = Instant::now() + self.sleeper.next();
        let job = job.clone();
        self.batch.push(Running {
            key,
            job,
            cancel,
            due,
        });
        Ok(())
    }
    /// The jobs that ended; when none has, waits for the next to fall due (at most
    /// [`FULL_WAIT`], or [`ROOM_WAIT`] while another job could join) and looks again.
    fn step(&mut self) -> Vec<(u64, Result<JobOutput, EngineError>)> {
        let now = Instant::now();
        let ended = self.ended(now);
        let Some(next) = self.batch.iter().map(|r| r.due).min() else {
            return ended;
        };
        if !ended.is_empty() {
            return ended;
        }
        let most = if self.batch.len() >= self.max_jobs {
            FULL_WAIT
        } else {
            ROOM_WAIT
        };
        std::thread::sleep(next.saturating_duration_since(now).min(most));
        self.ended(Instant::now())
    }
}

/// What one simulated worker measured.
#[derive(Default)]
struct Stats {
    lease_wait_us: Vec<u64>,
    /// The lease waits of calls that found work queued (rank 0 held them for no work:
    /// `waited_for_work_us` 0): the cost of the call itself.
    lease_queued_us: Vec<u64>,
    submit_us: Vec<u64>,
    accepted: u64,
    duplicate: u64,
    fenced: u64,
    abandoned: u64,
    registrations: u64,
    sessions_lost: u64,
    /// The most jobs one simulated worker held at once.
    peak_in_hand: usize,
    /// Offsets from the process start (µs) of the first job leased and the last answer
    /// accepted: the span over which throughput is measured.
    first_job_us: Option<u64>,
    last_accept_us: u64,
}

impl Stats {
    fn absorb(&mut self, other: Stats) {
        self.lease_wait_us.extend(other.lease_wait_us);
        self.lease_queued_us.extend(other.lease_queued_us);
        self.submit_us.extend(other.submit_us);
        self.accepted += other.accepted;
        self.duplicate += other.duplicate;
        self.fenced += other.fenced;
        self.abandoned += other.abandoned;
        self.registrations += other.registrations;
        self.sessions_lost += other.sessions_lost;
        self.peak_in_hand = self.peak_in_hand.max(other.peak_in_hand);
        self.first_job_us = match (self.first_job_us, other.first_job_us) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_accept_us = self.last_accept_us.max(other.last_accept_us);
    }

    fn busy_s(&self) -> f64 {
        let first = self.first_job_us.unwrap_or(self.last_accept_us);
        (self.last_accept_us.saturating_sub(first)) as f64 / 1e6
    }
}

fn since_start_us() -> u64 {
    START.elapsed().as_micros() as u64
}

/// A simulated worker's [`Stats`], filled by its session loop as it calls rank 0.
#[derive(Default)]
struct Observed(Mutex<Stats>);

impl Observed {
    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CallObserver for Observed {
    fn registered(&self) {
        self.stats().registrations += 1;
    }
    fn leased(&self, took: Duration, jobs: usize, waited_for_work: Duration) {
        if jobs == 0 {
            return;
        }
        let took = took.as_micros() as u64;
        let mut stats = self.stats();
        stats.lease_wait_us.push(took);
        if waited_for_work.is_zero() {
            stats.lease_queued_us.push(took);
        }
        stats.first_job_us.get_or_insert_with(since_start_us);
    }
    fn holding(&self, jobs: usize) {
        let mut stats = self.stats();
        stats.peak_in_hand = stats.peak_in_hand.max(jobs);
    }
    fn submitted(&self, took: Duration, status: pb::SubmitStatus) {
        let mut stats = self.stats();
        stats.submit_us.push(took.as_micros() as u64);
        match status {
            pb::SubmitStatus::Accepted => {
                stats.accepted += 1;
                stats.last_accept_us = since_start_us();
            }
            pb::SubmitStatus::Duplicate => stats.duplicate += 1,
            _ => stats.fenced += 1,
        }
    }
    fn cancelled(&self) {
        self.stats().abandoned += 1;
    }
    fn session_lost(&self) {
        self.stats().sessions_lost += 1;
    }
}

/// How a simulated worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    RunOver,
    Drained,
    Unreachable,
    Refused,
}

/// One simulated worker: the worker's session loop on a [`Simulated`] engine until rank 0
/// ends it.
async fn simulated_worker(opts: Arc<Opts>, index: usize) -> (End, Stats) {
    let observed = Arc::new(Observed::default());
    let hooks = ClientHooks {
        keepalive: opts.keepalive,
        observer: observed.clone(),
    };
    let worker = WorkerOptions {
        coordinator: opts.coordinator.clone(),
        token: opts.token.clone(),
        tls: None,
        name: format!("{}:{index}", opts.name),
        device: "cpu".into(),
        run_id: String::new(),
        connect_timeout: opts.reconnect,
        reconnect_timeout: opts.reconnect,
        limits: JobLimits {
            max_jobs: opts.max_jobs,
            kv_cache_bytes: None,
        },
    };
    let engine = Simulated::new(&opts, index);
    let ended = run_worker_with(engine, worker, hooks, std::future::pending()).await;
    let end = match ended {
        Ok(summary) => match summary.end {
            WorkerEnd::Drained => End::Drained,
            WorkerEnd::RunOver | WorkerEnd::Interrupted => End::RunOver,
        },
        Err(WorkerError::Unreachable { .. }) => End::Unreachable,
        Err(e) => {
            eprintln!("loadgen worker {index}: refused: {e}");
            End::Refused
        }
    };
    let stats = std::mem::take(&mut *observed.stats());
    (end, stats)
}

/// p-th percentile (0..=100) in milliseconds, nearest rank.
fn percentile_ms(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1000.0
}

fn report(opts: &Opts, ends: &[End], mut stats: Stats, wall: Duration) -> Value {
    stats.lease_wait_us.sort_unstable();
    stats.lease_queued_us.sort_unstable();
    stats.submit_us.sort_unstable();
    let count = |e: End| ends.iter().filter(|&&x| x == e).count();
    let jobs = stats.accepted + stats.duplicate + stats.fenced;
    json!({
        "workers": opts.workers,
        "max_jobs": opts.max_jobs,
        "peak_jobs_in_hand": stats.peak_in_hand,
        "latency": format!("{:?}", opts.latency),
        "wall_s": wall.as_secs_f64(),
        "jobs_submitted": jobs,
        "jobs_accepted": stats.accepted,
        "jobs_duplicate": stats.duplicate,
        "jobs_fenced": stats.fenced,
        "jobs_abandoned": stats.abandoned,
        "busy_s": stats.busy_s(),
        // From this process's start to the first job leased (scripts/bench/bench-resume.sh starts
        // the load generator with rank 0: this is rank 0's time to its first lease).
        "first_job_s": stats.first_job_us.map(|us| us as f64 / 1e6),
        "jobs_per_s": stats.accepted as f64 / stats.busy_s().max(1e-9),
        "lease_wait_ms": {"p50": percentile_ms(&stats.lease_wait_us, 50.0),
                          "p99": percentile_ms(&stats.lease_wait_us, 99.0),
                          "max": percentile_ms(&stats.lease_wait_us, 100.0)},
        // The calls that found work queued: what a worker waits when there is work.
        "lease_queued_ms": {"count": stats.lease_queued_us.len(),
                            "p50": percentile_ms(&stats.lease_queued_us, 50.0),
                            "p99": percentile_ms(&stats.lease_queued_us, 99.0),
                            "max": percentile_ms(&stats.lease_queued_us, 100.0)},
        "submit_ms": {"p50": percentile_ms(&stats.submit_us, 50.0),
                      "p99": percentile_ms(&stats.submit_us, 99.0),
                      "max": percentile_ms(&stats.submit_us, 100.0)},
        "registrations": stats.registrations,
        "sessions_lost": stats.sessions_lost,
        "ends": {"run_over": count(End::RunOver), "drained": count(End::Drained),
                 "unreachable": count(End::Unreachable), "refused": count(End::Refused)},
    })
}

fn main() -> std::process::ExitCode {
    let opts = match parse_args() {
        Ok(o) => Arc::new(o),
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    if std::env::var_os("RUST_LOG").is_some() {
        init_tracing(LogFormat::Text);
    }
    let start = *START;
    // Each simulated worker's engine runs on a blocking thread of its own, as the product
    // worker's does: room for all of them.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(opts.workers + 16)
        .build()
        .expect("a tokio runtime");
    let (ends, stats) = runtime.block_on(async {
        let tasks: Vec<_> = (0..opts.workers)
            .map(|i| tokio::spawn(simulated_worker(opts.clone(), i)))
            .collect();
        let (mut ends, mut stats) = (Vec::new(), Stats::default());
        for task in tasks {
            let (end, s) = task.await.expect("simulated worker panicked");
            ends.push(end);
            stats.absorb(s);
        }
        (ends, stats)
    });
    println!("{}", report(&opts, &ends, stats, start.elapsed()));
    let code = if ends.contains(&End::Refused) || ends.contains(&End::Unreachable) {
        3
    } else if ends.contains(&End::Drained) {
        75
    } else {
        0
    };
    std::process::ExitCode::from(code)
}
