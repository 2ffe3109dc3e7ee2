//! Running missions in the test process: rank 0 and in-process workers over loopback gRPC
//! through the real cluster runtime (real scheduler and leases, real artifacts), and reading
//! what the run wrote.

use std::collections::BTreeSet;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use stageb::cluster::{self, CoordinatorSettings};
use stageb_coordinator::run::RunSummary;
use stageb_shared::auth::AuthToken;
use stageb_worker::engine::Engine;
use tempfile::TempDir;

use super::engine::{Behaviour, Script, ScriptedEngine};
use super::missions::{
    TicketSpec, copy_demo_mission, write_config, write_stage_a, write_toy_guidance,
    write_toy_mission,
};

/// Runs `config_path` through the real coordinator and `workers` in-process workers over
/// loopback gRPC with a generated token, starting per `start`, stopping early when
/// `interrupt` resolves.
pub fn try_run<E, F>(
    config_path: &Path,
    workers: usize,
    make_engine: F,
    start: cluster::StartMode,
    interrupt: impl std::future::Future<Output = ()>,
) -> Result<RunSummary, cluster::ClusterError>
where
    E: stageb_worker::engine::Engine + 'static,
    F: Fn(usize) -> E + Send + Sync + 'static,
{
    try_run_watched(config_path, workers, make_engine, start, interrupt, None)
}

/// [`try_run`] publishing the run's progress to `progress` (for tests that watch it).
pub fn try_run_watched<E, F>(
    config_path: &Path,
    workers: usize,
    make_engine: F,
    start: cluster::StartMode,
    interrupt: impl std::future::Future<Output = ()>,
    progress: Option<stageb_coordinator::run::ProgressHandle>,
) -> Result<RunSummary, cluster::ClusterError>
where
    E: stageb_worker::engine::Engine + 'static,
    F: Fn(usize) -> E + Send + Sync + 'static,
{
    let inputs = cluster::prepare_inputs(config_path, "embedded")?;
    let settings = CoordinatorSettings {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: Some(AuthToken::generate()),
        tls: None,
        edge_limits: Default::default(),
        worker_grace: Duration::from_secs(30),
        progress_every: Duration::from_secs(60),
        show_progress: false,
        progress,
        start,
        drain_timeout: Duration::from_secs(10),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(cluster::run_coordinator_until(
        inputs,
        settings,
        move |addr, token| {
            cluster::spawn_local_workers(workers, addr, token, None, move |i| Ok(make_engine(i)))
        },
        interrupt,
    ))
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
            cluster::StartMode::Fresh,
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
