//! Running missions in the test process: rank 0 and in-process workers over loopback gRPC
//! through the real cluster runtime (real scheduler and leases, real artifacts), and reading
//! what the run wrote.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use stageb::cluster::{self, CoordinatorSettings};
use stageb_coordinator::run::RunSummary;
use stageb_shared::auth::AuthToken;

use super::engine::ScriptedEngine;
use super::missions::write_config;

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

/// Run the mission in `dir` (`stage_a.jsonl`, `guidance.json`) with `overrides` merged into
/// [`base_config`] (see [`try_run`]). Returns the summary and the run directory.
pub fn run_mission<F>(
    dir: &Path,
    overrides: Value,
    workers: usize,
    make_engine: F,
) -> (RunSummary, PathBuf)
where
    F: Fn(usize) -> ScriptedEngine + Send + Sync + 'static,
{
    let config_path = write_config(dir, overrides);
    let summary = try_run(
        &config_path,
        workers,
        make_engine,
        cluster::StartMode::Fresh,
        std::future::pending(),
    )
    .expect("the run completes");
    let run_dir = summary.run_dir.clone();
    (summary, run_dir)
}

/// Rows of a JSONL artifact of the run.
pub fn read_jsonl(run_dir: &Path, name: &str) -> Vec<Value> {
    let text =
        std::fs::read_to_string(run_dir.join(name)).unwrap_or_else(|e| panic!("read {name}: {e}"));
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{name}: {e}: {l}")))
        .collect()
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
