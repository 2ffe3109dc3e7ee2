//! Load generator for rank 0 (bench and soak code, never the product path): N simulated
//! workers in one process, speaking the real protocol to a real `stageb coordinator` over
//! loopback gRPC, answering jobs with a scripted engine.
//!
//! Why it exists: the product worker runs an LLM on a blocking thread per worker, so a
//! thousand of them cannot share a 2-core machine. Here each simulated worker is one async
//! task on the generated client; it honours the protocol like `worker/src/client.rs`
//! (heartbeats naming the leases in hand, `DRAIN`/`STOP`, fenced leases abandoned,
//! re-registration naming `previous_session` when the session is lost) so rank 0 sees what a
//! real cluster would send it. Answers are pure functions of each job (its seeds, its schema),
//! so two runs of the same mission write the same artifacts whatever the faults in between.
//!
//! Latency per job is simulated by a sleep drawn from a seeded distribution (fixed, or
//! lognormal with a long tail). Measured client-side: Lease RPC time when it returned a job
//! (lease wait; apart, the calls that found work queued, by the response's
//! `waited_for_work_us`) and Submit RPC time, p50/p99, jobs answered, wall time; one JSON object on
//! stdout at the end. Exits when rank 0 says `STOP` (0), `DRAIN` (75), or stays unreachable
//! past `--reconnect-s` (3).
//!
//! `cargo build --release --example loadgen`; `target/release/examples/loadgen --help`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use stageb_shared::auth::AUTH_HEADER;
use stageb_shared::pb;
use stageb_shared::seed::splitmix64;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

/// The process start: the origin of every offset in [`Stats`].
static START: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

const USAGE: &str = "loadgen --coordinator HOST:PORT [--token-file F] [--workers N]
  [--latency fixed:MS | lognormal:MEDIAN_MS:SIGMA] [--seed S] [--reconnect-s S]
  [--name PREFIX] [--max-context TOKENS] [--keepalive-s S] [--max-jobs K]";

/// Command line.
#[derive(Debug, Clone)]
struct Opts {
    coordinator: String,
    token: Option<String>,
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
                opts.token = Some(text.trim().to_string());
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
fn rollout_answer(job: &pb::RolloutJob) -> pb::submit_request::Result {
    let mut candidates = Vec::new();
    for d in &job.decodes {
        for (s, &seed) in d.seeds.iter().enumerate() {
            let text = if splitmix64(seed).is_multiple_of(2) {
                "Verdict: 通过\nReason: 未触发任何不通过规则，判通过"
            } else {
                "Verdict: 不通过\nReason: 摘要触发不通过规则，判不通过"
            };
            candidates.push(pb::Candidate {
                decode_index: d.decode_index,
                sample_index: s as u32,
                seed,
                text: text.to_string(),
                completion_tokens: text.chars().count() as u32,
                finish_reason: "stop".into(),
            });
        }
    }
    let prompt: usize = job.messages.iter().map(|m| m.content.chars().count()).sum();
    pb::submit_request::Result::Rollout(pb::RolloutResult {
        candidates,
        prompt_tokens: prompt as u32,
        prefill_us: 0,
        decode_us: 0,
        ..Default::default()
    })
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

fn generate_answer(job: &pb::GenerateJob) -> pb::submit_request::Result {
    let schema: Value = serde_json::from_str(&job.json_schema).unwrap_or(Value::Null);
    let text = minimal_instance(&schema).to_string();
    pb::submit_request::Result::Generate(pb::GenerateResult {
        completion_tokens: text.chars().count() as u32,
        text,
        prompt_tokens: 1,
        prefix_tokens: 0,
        finish_reason: "stop".into(),
        latency_us: 0,
        ..Default::default()
    })
}

fn answer(kind: &pb::job::Kind) -> pb::submit_request::Result {
    match kind {
        pb::job::Kind::Rollout(job) => rollout_answer(job),
        pb::job::Kind::Generate(job) => generate_answer(job),
    }
}

#[derive(Clone)]
struct Bearer(Option<String>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            let value = v.parse().map_err(|_| Status::internal("bad token"))?;
            request.metadata_mut().insert(AUTH_HEADER, value);
        }
        Ok(request)
    }
}

type Client = pb::coordinator_client::CoordinatorClient<
    tonic::service::interceptor::InterceptedService<Channel, Bearer>,
>;

/// Connect with backoff (100 ms doubling to 2 s) for at most `window`.
async fn connect(opts: &Opts, window: Duration) -> Option<Client> {
    let url = format!("http://{}", opts.coordinator.trim_start_matches("http://"));
    let endpoint = Endpoint::from_shared(url)
        .ok()?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(opts.keepalive)
        .keep_alive_timeout(opts.keepalive);
    let start = Instant::now();
    let mut backoff = Duration::from_millis(100);
    loop {
        if let Ok(channel) = endpoint.connect().await {
            let bearer = Bearer(opts.token.as_ref().map(|t| format!("Bearer {t}")));
            return Some(pb::coordinator_client::CoordinatorClient::with_interceptor(
                channel, bearer,
            ));
        }
        if start.elapsed() >= window {
            return None;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
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

/// How a simulated worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    RunOver,
    Drained,
    Unreachable,
    Refused,
}

/// State one session's job loop shares with its heartbeat task.
#[derive(Default)]
struct Shared {
    held: Mutex<BTreeSet<u64>>,
    done: AtomicU64,
    /// 0 continue, 1 drain, 2 stop: the strongest control heard.
    directive: AtomicU8,
    /// Lease ids rank 0 reported fenced while in hand.
    fenced: Mutex<BTreeSet<u64>>,
}

impl Shared {
    fn note(&self, control: i32) {
        let level = match pb::Control::try_from(control) {
            Ok(pb::Control::Drain) => 1,
            Ok(pb::Control::Stop) => 2,
            _ => 0,
        };
        self.directive.fetch_max(level, Ordering::Relaxed);
    }

    fn asked_end(&self) -> Option<End> {
        match self.directive.load(Ordering::Relaxed) {
            0 => None,
            1 => Some(End::Drained),
            _ => Some(End::RunOver),
        }
    }
}

/// Register, naming the lost session if any.
async fn register(
    client: &mut Client,
    opts: &Opts,
    index: usize,
    previous: &str,
) -> Result<pb::RegisterResponse, Status> {
    let request = pb::RegisterRequest {
        run_id: String::new(),
        previous_session: previous.to_string(),
        worker: Some(pb::WorkerInfo {
            name: format!("{}:{index}", opts.name),
            device: "cpu".into(),
            model_fingerprint: "loadgen-scripted-v1|none|none|cpu".into(),
            capacity: opts.max_jobs as u32,
            version: "loadgen".into(),
            max_context: opts.max_context,
        }),
    };
    Ok(client.register(request).await?.into_inner())
}

/// Heartbeats beside the job loop: keep held leases alive, hear control and fenced leases.
fn spawn_heartbeat(
    mut client: Client,
    session: String,
    every: Duration,
    shared: Arc<Shared>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let lease_ids: Vec<u64> = shared.held.lock().unwrap().iter().copied().collect();
            let request = pb::HeartbeatRequest {
                session: session.clone(),
                lease_ids,
                jobs_done: shared.done.load(Ordering::Relaxed),
                // The load generator computes nothing: its leases are kept by heartbeats.
                progress: Vec::new(),
            };
            let Ok(resp) = client.heartbeat(request).await.map(|r| r.into_inner()) else {
                continue;
            };
            shared.note(resp.control);
            let held = shared.held.lock().unwrap();
            let in_hand = resp.fenced_lease_ids.iter().filter(|id| held.contains(id));
            shared.fenced.lock().unwrap().extend(in_hand);
        }
    })
}

/// Sleep for the job's latency, returning early (false) if rank 0 fences the lease or says
/// `STOP` meanwhile (the real engine checks its cancel flag at every decode step).
async fn work(shared: &Shared, lease_id: u64, took: Duration) -> bool {
    let until = Instant::now() + took;
    loop {
        if shared.fenced.lock().unwrap().contains(&lease_id)
            || shared.asked_end() == Some(End::RunOver)
        {
            return false;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        tokio::time::sleep(left.min(Duration::from_millis(100))).await;
    }
}

/// Run one leased job and submit its answer; what it measured comes back. The lease is in
/// `shared.held` already (put there when it was leased, so heartbeats cover it at once).
async fn serve_job(
    mut client: Client,
    session: String,
    job: pb::Job,
    shared: Arc<Shared>,
    took: Duration,
) -> Stats {
    let mut stats = Stats::default();
    let Some(kind) = job.kind else {
        shared.held.lock().unwrap().remove(&job.lease_id);
        return stats;
    };
    let finished = work(&shared, job.lease_id, took).await;
    if !finished {
        shared.held.lock().unwrap().remove(&job.lease_id);
        stats.abandoned += 1;
        return stats;
    }
    let request = pb::SubmitRequest {
        session,
        lease_id: job.lease_id,
        result: Some(answer(&kind)),
    };
    let started = Instant::now();
    let reply = client.submit(request).await;
    shared.held.lock().unwrap().remove(&job.lease_id);
    let Ok(reply) = reply else { return stats };
    stats.submit_us.push(started.elapsed().as_micros() as u64);
    shared.done.fetch_add(1, Ordering::Relaxed);
    match pb::SubmitStatus::try_from(reply.into_inner().status) {
        Ok(pb::SubmitStatus::Accepted) => {
            stats.accepted += 1;
            stats.last_accept_us = START.elapsed().as_micros() as u64;
        }
        Ok(pb::SubmitStatus::Duplicate) => stats.duplicate += 1,
        _ => stats.fenced += 1,
    }
    stats
}

/// Lease and serve jobs under one session, up to `max_jobs` at once; `None` when the session
/// was lost. Told `DRAIN`, it leases nothing more and finishes the jobs in hand.
async fn serve_session(
    client: &Client,
    session: &pb::RegisterResponse,
    max_jobs: usize,
    sleeper: &mut Sleeper,
    stats: &mut Stats,
) -> Option<End> {
    let mut client = client.clone();
    let shared = Arc::new(Shared::default());
    let every = Duration::from_millis(session.heartbeat_interval_ms.max(100) as u64);
    let heartbeat = spawn_heartbeat(
        client.clone(),
        session.session.clone(),
        every,
        shared.clone(),
    );
    let mut running = tokio::task::JoinSet::new();
    let ended = loop {
        while let Some(done) = running.try_join_next() {
            stats.absorb(done.expect("a simulated job panicked"));
        }
        if let Some(end) = shared.asked_end() {
            break Some(end);
        }
        if running.len() >= max_jobs {
            if let Some(done) = running.join_next().await {
                stats.absorb(done.expect("a simulated job panicked"));
            }
            continue;
        }
        let request = pb::LeaseRequest {
            session: session.session.clone(),
            max_jobs: (max_jobs - running.len()) as u32,
            // With jobs in hand, come back soon to lease more as they end.
            wait_ms: if running.is_empty() { 5_000 } else { 200 },
        };
        let started = Instant::now();
        let Ok(resp) = client.lease(request).await.map(|r| r.into_inner()) else {
            break None;
        };
        if !resp.jobs.is_empty() {
            let took = started.elapsed().as_micros() as u64;
            stats.lease_wait_us.push(took);
            if resp.waited_for_work_us == 0 {
                stats.lease_queued_us.push(took);
            }
            let now = START.elapsed().as_micros() as u64;
            stats.first_job_us.get_or_insert(now);
        }
        shared.note(resp.control);
        for job in resp.jobs {
            shared.held.lock().unwrap().insert(job.lease_id);
            let (c, s) = (client.clone(), session.session.clone());
            running.spawn(serve_job(c, s, job, shared.clone(), sleeper.next()));
        }
        stats.peak_in_hand = stats.peak_in_hand.max(running.len());
    };
    while let Some(done) = running.join_next().await {
        stats.absorb(done.expect("a simulated job panicked"));
    }
    heartbeat.abort();
    ended
}

/// One simulated worker: connect, register, serve sessions until rank 0 ends it.
async fn simulated_worker(opts: Arc<Opts>, index: usize) -> (End, Stats) {
    let mut stats = Stats::default();
    let mut sleeper = Sleeper {
        latency: opts.latency,
        state: splitmix64(opts.seed ^ splitmix64(index as u64)),
    };
    let mut previous = String::new();
    loop {
        let Some(mut client) = connect(&opts, opts.reconnect).await else {
            return (End::Unreachable, stats);
        };
        let session = match register(&mut client, &opts, index, &previous).await {
            Ok(s) => s,
            Err(s)
                if matches!(
                    s.code(),
                    Code::Unavailable | Code::Unknown | Code::Cancelled
                ) =>
            {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(s) if s.code() == Code::ResourceExhausted => {
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
            Err(s) => {
                eprintln!("loadgen worker {index}: refused: {}", s.message());
                return (End::Refused, stats);
            }
        };
        stats.registrations += 1;
        previous = session.session.clone();
        if let Some(end) =
            serve_session(&client, &session, opts.max_jobs, &mut sleeper, &mut stats).await
        {
            return (end, stats);
        }
        stats.sessions_lost += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let opts = match parse_args() {
        Ok(o) => Arc::new(o),
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let start = *START;
    let tasks: Vec<_> = (0..opts.workers)
        .map(|i| tokio::spawn(simulated_worker(opts.clone(), i)))
        .collect();
    let (mut ends, mut stats) = (Vec::new(), Stats::default());
    for task in tasks {
        let (end, s) = task.await.expect("simulated worker panicked");
        ends.push(end);
        stats.absorb(s);
    }
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
