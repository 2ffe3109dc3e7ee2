//! Running missions in the test process: rank 0 and in-process workers over loopback gRPC
//! through the real cluster runtime (real scheduler and leases, real artifacts), most simply
//! as a [`ScriptedMission`]; rank 0's service alone on loopback for worker-side and edge specs;
//! `stageb` child processes and waiting for them; reading what a run wrote.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use stageb::roles::{self, CoordinatorSettings};
use stageb_coordinator::cluster::edge::EdgeLimits;
use stageb_coordinator::cluster::scheduler::Scheduler;
use stageb_coordinator::cluster::server::{self, EdgeConfig, ModelPin, ServiceConfig};
use stageb_coordinator::run::{RunInputs, RunSummary};
use stageb_shared::auth::AuthToken;
use stageb_worker::client::WorkerOptions;
use stageb_worker::engine::{Engine, ModelFingerprint};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::behaviour::Behaviour;
use super::engine::{Script, ScriptedEngine};
use super::missions::{
    TicketSpec, copy_demo_mission, write_config, write_stage_a, write_toy_guidance,
    write_toy_mission,
};

/// Rank 0's settings for an in-process run, starting per `start`: an ephemeral loopback port, a
/// generated token, no progress display, 30 s for workers to join, 10 s to drain (override
/// with struct update syntax).
pub fn coordinator_settings(start: roles::StartMode) -> CoordinatorSettings {
    CoordinatorSettings {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: Some(AuthToken::generate()),
        tls: None,
        edge_limits: Default::default(),
        worker_grace: Duration::from_secs(30),
        progress_every: Duration::from_secs(60),
        show_progress: false,
        progress: None,
        start,
        drain_timeout: Duration::from_secs(10),
        expected_workers: 0,
        worker_numerics: None,
        rank0_runs_no_worker: false,
        model_digest: None,
        workers_device: None,
        local_max_jobs: None,
    }
}

/// Runs `config_path` through the real coordinator and `workers` in-process workers over
/// loopback gRPC with a generated token, starting per `start`, stopping early when
/// `interrupt` resolves.
pub fn try_run<E, F>(
    config_path: &Path,
    workers: usize,
    make_engine: F,
    start: roles::StartMode,
    interrupt: impl std::future::Future<Output = ()>,
) -> Result<RunSummary, roles::ClusterError>
where
    E: Engine + 'static,
    F: Fn(usize) -> E + Send + Sync + 'static,
{
    try_run_watched(config_path, workers, make_engine, start, interrupt, None)
}

/// [`try_run`] publishing the run's progress to `progress` (for tests that watch it).
pub fn try_run_watched<E, F>(
    config_path: &Path,
    workers: usize,
    make_engine: F,
    start: roles::StartMode,
    interrupt: impl std::future::Future<Output = ()>,
    progress: Option<stageb_coordinator::run::ProgressHandle>,
) -> Result<RunSummary, roles::ClusterError>
where
    E: Engine + 'static,
    F: Fn(usize) -> E + Send + Sync + 'static,
{
    let inputs = roles::prepare_inputs(config_path, "embedded")?;
    let settings = CoordinatorSettings {
        progress,
        expected_workers: workers,
        ..coordinator_settings(start)
    };
    run_prepared(inputs, workers, make_engine, settings, interrupt)
}

/// Runs prepared `inputs` through the real coordinator with `settings` and `workers`
/// in-process workers over loopback gRPC, stopping early when `interrupt` resolves (for specs
/// that prepare the inputs or the settings themselves).
pub fn run_prepared<E, F>(
    inputs: RunInputs,
    workers: usize,
    make_engine: F,
    settings: CoordinatorSettings,
    interrupt: impl std::future::Future<Output = ()>,
) -> Result<RunSummary, roles::ClusterError>
where
    E: Engine + 'static,
    F: Fn(usize) -> E + Send + Sync + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(roles::run_coordinator_until(
        inputs,
        settings,
        move |start| {
            roles::spawn_local_workers(workers, start, None, Default::default(), move |i| {
                Ok(make_engine(i))
            })
        },
        interrupt,
    ))
}

/// A fresh run of `config_path` to its end on `workers` scripted engines sharing one script
/// of `behaviour` (for specs that write several runs' configs into one directory).
pub fn run_scripted(config_path: &Path, workers: usize, behaviour: &Behaviour) -> RunSummary {
    let script = Script::new(behaviour.clone());
    try_run(
        config_path,
        workers,
        move |_| ScriptedEngine::new(script.clone()),
        roles::StartMode::Fresh,
        std::future::pending(),
    )
    .expect("the run completes")
}

/// One scripted run to make: a mission written into a fresh temp dir, the scripted engine's
/// [`Behaviour`] and the number of in-process workers (1 unless told). Each setter reads as
/// what the spec needs, e.g.
/// `ScriptedMission::toy().always_stop(&keys).workers(2).run(json!({"runner": {"epochs": 2}}))`.
pub struct ScriptedMission {
    write: Box<dyn FnOnce(&Path)>,
    behaviour: Behaviour,
    workers: usize,
}

/// A finished scripted run: its summary, its run directory and the script its engines shared
/// (the reflector's call log). Destructure what the spec reads:
/// `let ScriptedRun { summary, run_dir, .. } = …`.
pub struct ScriptedRun {
    pub summary: RunSummary,
    pub run_dir: RunDir,
    pub script: Arc<Script>,
}

/// A run directory made in a temp dir: it reads as a [`Path`] and keeps the temp dir until the
/// last handle goes.
#[derive(Clone)]
pub struct RunDir {
    path: PathBuf,
    _tmp: Arc<TempDir>,
}

impl RunDir {
    fn new(path: PathBuf, tmp: TempDir) -> Self {
        RunDir {
            path,
            _tmp: Arc::new(tmp),
        }
    }
}

impl Deref for RunDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for RunDir {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

/// Ticket keys given to a [`ScriptedMission`] setter: any list of strings.
pub trait Keys {
    fn key_set(self) -> BTreeSet<String>;
}

impl<I: IntoIterator<Item = K>, K: Into<String>> Keys for I {
    fn key_set(self) -> BTreeSet<String> {
        self.into_iter().map(Into::into).collect()
    }
}

impl ScriptedMission {
    fn writing(write: impl FnOnce(&Path) + 'static) -> Self {
        ScriptedMission {
            write: Box::new(write),
            behaviour: Behaviour::default(),
            workers: 1,
        }
    }

    /// The synthetic 16-ticket mission of [`write_toy_mission`].
    pub fn toy() -> Self {
        Self::writing(write_toy_mission)
    }

    /// The 48-ticket demo mission ([`copy_demo_mission`]).
    pub fn demo() -> Self {
        Self::writing(copy_demo_mission)
    }

    /// A mission of `tickets` under the toy guidance.
    pub fn of(tickets: Vec<TicketSpec>) -> Self {
        Self::writing(move |dir| {
            write_stage_a(dir, &tickets);
            write_toy_guidance(dir);
        })
    }

    /// This many in-process workers.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// No rollout noise: every sample follows the rules.
    pub fn quiet(mut self) -> Self {
        self.behaviour.quiet = true;
        self
    }

    /// These tickets are declared no-evidence by every decision pass that sees them.
    pub fn always_stop(mut self, keys: impl Keys) -> Self {
        self.behaviour.always_stop = keys.key_set();
        self
    }

    /// These tickets are declared no-evidence the first time a decision pass sees them.
    pub fn stop_first_sighting(mut self, keys: impl Keys) -> Self {
        self.behaviour.stop_first_sighting = keys.key_set();
        self
    }

    /// These tickets are never cited as evidence by an ops pass.
    pub fn never_cover(mut self, keys: impl Keys) -> Self {
        self.behaviour.never_cover = keys.key_set();
        self
    }

    /// The first `calls` decision calls answer with text that is not JSON.
    pub fn invalid_json_decisions(mut self, calls: usize) -> Self {
        self.behaviour.invalid_json_decisions = calls;
        self
    }

    /// The first ops call proposes a third-state rule; the revision call corrects it.
    pub fn third_state_op_then_revise(mut self) -> Self {
        self.behaviour.third_state_op_then_revise = true;
        self
    }

    /// Every first-round ops call also proposes the same non-rule.
    pub fn repeat_bad_op(mut self) -> Self {
        self.behaviour.repeat_bad_op = true;
        self
    }

    /// Every ops call proposes the rule `text` and nothing else.
    pub fn propose_only(mut self, text: impl Into<String>) -> Self {
        self.behaviour.propose_only = Some(text.into());
        self
    }

    /// Runs the mission with `overrides` merged into [`super::missions::base_config`], every
    /// worker on the scripted engine.
    pub fn run(self, overrides: Value) -> ScriptedRun {
        self.run_with(overrides, |script, _| ScriptedEngine::new(script))
    }

    /// [`ScriptedMission::run`] with each worker's engine made by `engine` from the shared
    /// script and the worker's index (for wrappers of the scripted engine).
    pub fn run_with<E, F>(self, overrides: Value, engine: F) -> ScriptedRun
    where
        E: Engine + 'static,
        F: Fn(Arc<Script>, usize) -> E + Send + Sync + 'static,
    {
        let dir = tempfile::tempdir().expect("temp dir");
        (self.write)(dir.path());
        let config_path = write_config(dir.path(), overrides);
        let script = Script::new(self.behaviour);
        let shared = script.clone();
        let summary = try_run(
            &config_path,
            self.workers,
            move |i| engine(shared.clone(), i),
            roles::StartMode::Fresh,
            std::future::pending(),
        )
        .expect("the run completes");
        ScriptedRun {
            run_dir: RunDir::new(summary.run_dir.clone(), dir),
            summary,
            script,
        }
    }
}

/// A copy of the run directory `run_dir` in a fresh temp dir (to damage or poison).
pub fn copy_of_run(run_dir: &Path) -> RunDir {
    let tmp = tempfile::tempdir().expect("temp dir");
    let to = tmp.path().join("run");
    copy_dir(run_dir, &to);
    RunDir::new(to, tmp)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Rows of a JSONL artifact of the run.
pub fn read_jsonl(run_dir: &Path, name: &str) -> Vec<Value> {
    let text =
        std::fs::read_to_string(run_dir.join(name)).unwrap_or_else(|e| panic!("read {name}: {e}"));
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{name}: {e}: {l}")))
        .collect()
}

/// A JSON artifact of the run (`summary.json`, `guidance.json`, …).
pub fn read_json(run_dir: &Path, name: &str) -> Value {
    let bytes = std::fs::read(run_dir.join(name)).unwrap_or_else(|e| panic!("read {name}: {e}"));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A JSON array of strings as a set.
pub fn str_set(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// `stageb audit` finds nothing wrong with the run directory.
pub fn assert_audit_ok(run_dir: &Path) {
    let report = stageb_inspect::audit::audit(run_dir);
    let lines: Vec<String> = report.violations.iter().map(|v| v.to_string()).collect();
    assert!(
        report.ok(),
        "audit of {} found {} violation(s):\n{}",
        run_dir.display(),
        lines.len(),
        lines.join("\n")
    );
}

/// The names of the checks `stageb audit` finds broken in `run_dir` (tamper specs).
pub fn audit_checks(run_dir: &Path) -> Vec<&'static str> {
    stageb_inspect::audit::audit(run_dir)
        .violations
        .into_iter()
        .map(|v| v.check)
        .collect()
}

/// Rewrite the JSONL file at `path` row by row with `edit` (tamper specs).
pub fn rewrite_jsonl(path: &Path, edit: impl FnOnce(&mut Vec<Value>)) {
    let mut rows: Vec<Value> = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    edit(&mut rows);
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(path, text).unwrap();
}

/// A minimal rollout job: one decode group with one candidate per seed (scheduler-level tests
/// that need a payload rank 0 accepts answers for).
pub fn rollout_job(seeds: Vec<u64>) -> stageb_coordinator::cluster::scheduler::JobPayload {
    stageb_coordinator::cluster::scheduler::JobPayload::Rollout {
        messages: vec![stageb_shared::domain::ChatMessage::user("x")],
        decodes: vec![stageb_coordinator::cluster::scheduler::DecodeJob {
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

/// Rows in the run's job journal (`jobs.jsonl`); 0 when there is none.
pub fn journal_rows(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("jobs.jsonl")).map_or(0, |t| t.lines().count())
}

/// The real test model (fetched by `scripts/fetch-model.sh`; `scripts/ci/test.sh` sets
/// `STAGEB_MODEL`). A missing model is a loud failure, not a skip.
pub fn real_model() -> PathBuf {
    let p = std::env::var_os("STAGEB_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        p.exists(),
        "model {} not found: run scripts/fetch-model.sh (or scripts/ci/test.sh)",
        p.display()
    );
    p
}

/// Rank 0's gRPC service on an ephemeral loopback port, serving until `stop` is sent or
/// dropped.
pub struct Loopback {
    pub addr: SocketAddr,
    pub stop: oneshot::Sender<()>,
    pub task: JoinHandle<Result<(), tonic::transport::Error>>,
}

/// Serves `scheduler` as `service` behind `edge` on 127.0.0.1 (an ephemeral port).
pub async fn serve_loopback(
    scheduler: Arc<Scheduler>,
    service: &ServiceConfig,
    edge: EdgeConfig,
) -> Loopback {
    let service = server::build_service(scheduler, service);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server::serve(listener, service, edge, async {
        let _ = stopped.await;
    }));
    Loopback { addr, stop, task }
}

/// The service of run `run_id` with no token, the model pinned by the first worker and
/// heartbeats every `heartbeat` (override with struct update syntax).
pub fn open_service(run_id: &str, heartbeat: Duration) -> ServiceConfig {
    ServiceConfig {
        run_id: run_id.into(),
        token: None,
        model: ModelPin::by_first_worker(),
        heartbeat_interval: heartbeat,
    }
}

/// A rank 0 service for worker-side specs: no token, the model pinned by the first worker,
/// heartbeats every `heartbeat`, a 200 ms shutdown grace.
pub async fn serve_for_workers(scheduler: Arc<Scheduler>, heartbeat: Duration) -> Loopback {
    let service = open_service("run", heartbeat);
    let edge = EdgeConfig {
        limits: EdgeLimits {
            shutdown_grace: Duration::from_millis(200),
            ..EdgeLimits::default()
        },
        ..Default::default()
    };
    serve_loopback(scheduler, &service, edge).await
}

/// Options of a worker under test dialing `coordinator`: no token, no TLS, 30 s to first
/// contact, 5 s to reconnect (override with struct update syntax).
pub fn worker_options(coordinator: String) -> WorkerOptions {
    WorkerOptions {
        coordinator,
        token: None,
        tls: None,
        name: "worker-under-test".into(),
        device: "cpu".into(),
        run_id: String::new(),
        connect_timeout: Duration::from_secs(30),
        reconnect_timeout: Duration::from_secs(5),
        limits: Default::default(),
    }
}

/// A made-up model fingerprint for engines that load no model.
pub fn fingerprint(architecture: &str) -> ModelFingerprint {
    ModelFingerprint {
        weights_sha256: "w".into(),
        candle_version: "c".into(),
        dtype: "d".into(),
        device: "cpu".into(),
        architecture: architecture.into(),
    }
}

/// Adds to `cmd` (the `stageb` binary, or a wrapper that execs it) the arguments of
/// `stageb coordinator` on `config` listening on `listen`, waiting `grace_s` seconds for
/// workers: no token from the environment, info logs on a piped stderr.
pub fn coordinator_command<'c>(
    cmd: &'c mut Command,
    config: &Path,
    listen: &str,
    grace_s: &str,
) -> &'c mut Command {
    cmd.args(["coordinator", "--config"])
        .arg(config)
        .args(["--listen", listen, "--worker-grace-s", grace_s])
        .env_remove("STAGEB_TOKEN")
        .env_remove("STAGEB_TOKEN_FILE")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
}

/// A child process killed when the test ends, however it ends.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits up to `within` for `proc` to exit; the test fails saying `late` if it does not.
pub fn wait_for_exit(proc: &mut Proc, within: Duration, late: &str) -> ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = proc.0.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "{late}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
