//! End-to-end tests with the real engine and the real model (SmolLM2-135M Q4_1 through
//! candle), over real gRPC: the first milestone of the product, checked on every CI run.
//!
//! The model path comes from `STAGEB_MODEL` (set by `scripts/ci/test.sh`) or the fetch script's
//! cache. A missing model is a loud failure, not a skip: a skipped end-to-end test would let a
//! broken CI setup look green.
//!
//! The tests share the machine's two cores, so they take a lock and run one at a time.

use crate::support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use stageb::roles::{self, CoordinatorSettings};
use stageb_worker::engine::{EngineOptions, ModelEngine};
use support::{
    Proc, assert_audit_ok, coordinator_command, coordinator_settings, read_json, real_model,
    wait_for_exit,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The knobs the tests vary; everything else keeps the real model's work small (2 candidates
/// of 24 tokens each).
struct Knobs<'a> {
    /// The first tickets of this Stage-A file (the small demo's six by default).
    source: &'a str,
    tickets: usize,
    epochs: u32,
    run_name: &'a str,
    /// Extra `runner` keys, e.g. `", lease_ttl_s: 3"`.
    runner_extra: &'a str,
    reflection_tokens: u32,
    /// Extra `reflection` keys, e.g. `", gate: {enabled: true}"`.
    reflection_extra: &'a str,
    max_calls: u32,
    min_verdict_agreement: f64,
}

impl Default for Knobs<'_> {
    fn default() -> Self {
        Knobs {
            source: "examples/demo/small/stage_a.jsonl",
            tickets: 3,
            epochs: 1,
            run_name: "run",
            runner_extra: "",
            reflection_tokens: 64,
            reflection_extra: "",
            max_calls: 1,
            min_verdict_agreement: 0.67,
        }
    }
}

/// A mission of the first tickets of `k.source` with a config built from `k`.
fn write_mission(dir: &Path, k: &Knobs) -> PathBuf {
    let src = std::fs::read_to_string(workspace().join(k.source)).unwrap();
    let lines: Vec<&str> = src
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(k.tickets)
        .collect();
    std::fs::write(dir.join("stage_a.jsonl"), lines.join("\n") + "\n").unwrap();
    std::fs::copy(
        workspace().join("examples/demo/guidance.json"),
        dir.join("guidance.json"),
    )
    .unwrap();
    let config = format!(
        "seed: 17\n\
         stage_a_paths: [{dir}/stage_a.jsonl]\n\
         model: {{model_name_or_path: {model}}}\n\
         guidance: {{path: {dir}/guidance.json, retention: 3, reset_on_rerun: true}}\n\
         output: {{root: {dir}/runs, run_name: {run_name}}}\n\
         sampler:\n  samples_per_decode: 1\n  grid:\n\
         \x20   - {{temperature: 0.3, top_p: 0.9, max_new_tokens: 24, repetition_penalty: 1.05}}\n\
         \x20   - {{temperature: 0.9, top_p: 0.9, max_new_tokens: 24, repetition_penalty: 1.05}}\n\
         manual_review: {{min_verdict_agreement: {agreement}}}\n\
         runner: {{epochs: {epochs}, per_rank_rollout_batch_size: 1, logging_steps: 2{runner_extra}}}\n\
         reflection: {{batch_size: 2, max_operations: 2, temperature: 0.3, top_p: 0.9, max_new_tokens: {tokens},\n\
         \x20            max_reflection_length: 3000, token_budget: 3000, max_calls_per_epoch: {calls}{reflection_extra}}}\n\
         selection: {{policy: top_label, tie_break: temperature}}\n",
        dir = dir.display(),
        model = real_model().display(),
        run_name = k.run_name,
        agreement = k.min_verdict_agreement,
        epochs = k.epochs,
        runner_extra = k.runner_extra,
        tokens = k.reflection_tokens,
        reflection_extra = k.reflection_extra,
        calls = k.max_calls,
    );
    let path = dir.join("config.yaml");
    std::fs::write(&path, config).unwrap();
    path
}

fn mission_dir(root: &Path, run_name: &str) -> PathBuf {
    root.join("runs").join(run_name).join("挡风板安装检查")
}

/// Run a config in this process with `workers` local workers on the real engine.
fn run_embedded(config: &Path, workers: usize) -> stageb_coordinator::run::RunSummary {
    run_embedded_with(config, workers, |engine| engine)
}

/// [`run_embedded`] with each worker's real engine wrapped by `wrap` (a test double around it).
fn run_embedded_with<E: stageb_worker::engine::Engine + 'static>(
    config: &Path,
    workers: usize,
    wrap: fn(ModelEngine) -> E,
) -> stageb_coordinator::run::RunSummary {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let inputs = roles::prepare_inputs(config, "embedded").expect("inputs");
        let settings = CoordinatorSettings {
            worker_grace: Duration::from_secs(120),
            progress_every: Duration::from_secs(30),
            drain_timeout: roles::DEFAULT_DRAIN_TIMEOUT,
            ..coordinator_settings(roles::StartMode::Fresh)
        };
        let model = real_model();
        roles::run_coordinator(inputs, settings, move |start| {
            roles::spawn_local_workers(workers, start, None, Default::default(), move |_| {
                let options = EngineOptions {
                    threads: Some(1),
                    ..EngineOptions::default()
                };
                ModelEngine::load(&model, &options)
                    .map(wrap)
                    .map_err(|e| e.to_string())
            })
        })
        .await
        .expect("run")
    })
}

/// Rows of a JSONL file with the `runtime` objects (which worker, which lease, how long)
/// removed: what must be identical whatever the number of workers.
fn rows_without_runtime(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("runtime");
            v
        })
        .collect()
}

/// The first milestone: a real model answering through the coordinator writes every artifact;
/// one selection per ticket, one trajectory per candidate, metrics recomputed from selections
/// match (the audit checks them all), and constrained decoding makes every candidate of the
/// real model contract-valid. The same config with 3 workers gives byte-identical selections
/// and trajectories once the `runtime` objects are removed. The held-out splits are on (one
/// group each of train, gate and final): the audit checks their isolation, and the final
/// split is scored.
#[test]
fn real_model_run_is_complete_audited_and_world_size_invariant() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let knobs = Knobs {
        tickets: 3,
        run_name: "invariance",
        reflection_extra: ", gate: {enabled: true, gate_fraction: 0.34, final_fraction: 0.34}",
        ..Knobs::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let config = write_mission(tmp.path(), &knobs);
    let started = Instant::now();
    let one = run_embedded(&config, 1);
    eprintln!("1 worker: {:?}", started.elapsed());
    let dir_one = mission_dir(tmp.path(), knobs.run_name);
    for f in [
        "manifest.json",
        "trajectories.jsonl",
        "selections.jsonl",
        "metrics.jsonl",
        "failure_malformed.jsonl",
        "need_review_queue.jsonl",
        "need_review.json",
        "reflection.jsonl",
        "guidance.json",
        "summary.json",
    ] {
        assert!(dir_one.join(f).exists(), "missing artifact {f}");
    }
    assert_eq!(one.tickets, 3);
    // One worker batches the three tickets (two rows each): summary.json says how full its
    // steps were.
    let batching = one.runtime_facts().batching;
    assert!(
        batching.job_steps > 0 && batching.mean_rows_per_step > 1.0,
        "runtime.batching: {batching:?}"
    );
    let selections = rows_without_runtime(&dir_one.join("selections.jsonl"));
    let trajectories = rows_without_runtime(&dir_one.join("trajectories.jsonl"));
    assert_eq!(selections.len(), 3, "one selection per ticket");
    let splits: std::collections::BTreeSet<&str> = selections
        .iter()
        .map(|s| s["split"].as_str().unwrap_or("none"))
        .collect();
    assert_eq!(
        splits,
        ["final", "gate", "train"].into(),
        "one group per split"
    );
    let metrics = std::fs::read_to_string(dir_one.join("metrics.jsonl")).unwrap();
    let epoch_row: Value = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|r| r["event"] == "epoch_end")
        .unwrap();
    assert_eq!(epoch_row["splits"]["final"]["tickets"], 1, "{epoch_row}");
    assert_eq!(trajectories.len(), 3 * 2, "one trajectory per candidate");
    assert_audit_ok(&dir_one);
    for t in &trajectories {
        assert_eq!(
            t["result"]["format_ok"], true,
            "malformed candidate under constraints: {}",
            t["result"]["text"]
        );
    }

    let tmp3 = tempfile::tempdir().unwrap();
    let config3 = write_mission(tmp3.path(), &knobs);
    let started = Instant::now();
    run_embedded(&config3, 3);
    eprintln!("3 workers: {:?}", started.elapsed());
    let dir_three = mission_dir(tmp3.path(), knobs.run_name);
    assert_audit_ok(&dir_three);
    assert_eq!(
        rows_without_runtime(&dir_three.join("selections.jsonl")),
        selections,
        "selections differ between 1 and 3 workers"
    );
    assert_eq!(
        rows_without_runtime(&dir_three.join("trajectories.jsonl")),
        trajectories,
        "trajectories differ between 1 and 3 workers"
    );
}

/// The learning loop on the real model: two epochs over a small subset with reflection in
/// JSON-schema mode. Every completed reflection output parses into the typed schema, every
/// rejected op carries a reason, the guidance chain verifies and every artifact invariant holds.
/// `min_verdict_agreement: 1.0` makes any split vote a gradient candidate, so the model is
/// actually asked to reflect.
#[test]
fn real_model_learning_loop_runs_two_epochs_with_sound_reflection() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let knobs = Knobs {
        tickets: 4,
        epochs: 2,
        run_name: "learning",
        reflection_tokens: 96,
        max_calls: 2,
        min_verdict_agreement: 1.0,
        ..Knobs::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let config = write_mission(tmp.path(), &knobs);
    let started = Instant::now();
    // Two one-thread workers keep both of CI's cores busy; the artifacts do not depend on
    // the number of workers (the world-size spec above).
    run_embedded(&config, 2);
    eprintln!("2 epochs: {:?}", started.elapsed());
    let dir = mission_dir(tmp.path(), knobs.run_name);
    assert_eq!(
        rows_without_runtime(&dir.join("selections.jsonl")).len(),
        4 * 2,
        "one selection per ticket per epoch"
    );
    assert_audit_ok(&dir);
    assert_reflection_outputs_are_sound(&dir);
}

/// Pipelining: the next step's rollouts queued ahead while reflection runs, and the next
/// reflection cycles' calls queued ahead while a cycle runs, change no byte on the real model.
/// Ten demo tickets make a step of eight and one of two; every split vote is a gradient
/// candidate, so the first boundary reflects while the second step is queued ahead, and six
/// calls an epoch leave room for a cycle after the first. The pipelined run goes on two
/// workers, and in the long suite once more on one (scheduling differs between the two; three
/// workers, one thread each on CI's two cores, took 74–123 s against the one worker's 34–69 s);
/// the reference runs on two, which keeps both of CI's cores busy.
#[test]
fn real_model_artifacts_are_the_same_with_the_next_step_queued_ahead() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let mut dirs = Vec::new();
    let mut runs = vec![
        ("sequential", ", pipeline_steps: 0", 2),
        ("ahead-2", ", pipeline_steps: 1, pipeline_cycles: 2", 2),
    ];
    if support::full_depth() {
        runs.push(("ahead", ", pipeline_steps: 1, pipeline_cycles: 2", 1));
    }
    for (run_name, runner_extra, workers) in runs {
        let knobs = Knobs {
            source: "examples/demo/stage_a.jsonl",
            tickets: 10,
            run_name,
            runner_extra,
            reflection_tokens: 96,
            max_calls: 6,
            min_verdict_agreement: 1.0,
            ..Knobs::default()
        };
        let started = Instant::now();
        let summary = run_embedded(&write_mission(tmp.path(), &knobs), workers);
        let pipeline = summary.runtime_facts().pipeline;
        eprintln!("{run_name}: {:?}, {pipeline:?}", started.elapsed());
        let ahead = u64::from(run_name != "sequential");
        assert_eq!(
            (pipeline.steps_ahead, pipeline.jobs_ahead),
            (ahead, 2 * ahead)
        );
        let calls = pipeline.reflection;
        assert_eq!(
            calls.calls_ahead > 0,
            ahead == 1,
            "a next cycle's call: {calls:?}"
        );
        dirs.push(mission_dir(tmp.path(), run_name));
    }
    for pipelined in &dirs[1..] {
        assert_audit_ok(pipelined);
        support::compare::assert_same_artifacts(&dirs[0], pipelined);
    }
}

/// JSON-schema mode guarantees that an output which *completed* parses into the typed schema;
/// only an output cut at `max_new_tokens` may fail, and it is recorded with a code and retried.
fn assert_reflection_outputs_are_sound(run_dir: &Path) {
    let text = std::fs::read_to_string(run_dir.join("reflection.jsonl")).unwrap();
    let mut calls = 0;
    for line in text.lines() {
        let row: Value = serde_json::from_str(line).unwrap();
        for call in row["calls"].as_array().into_iter().flatten() {
            calls += 1;
            if call["ok"] != true {
                assert!(
                    call["parse_error"]["code"].is_string(),
                    "a failed call without a code: {call}"
                );
                if call["prompt_tokens"].as_u64().unwrap_or(0) > 0 {
                    assert_eq!(
                        call["finish_reason"], "length",
                        "a completed JSON-mode output did not parse: {call}"
                    );
                }
            }
        }
        for rejected in row["rejected_ops"].as_array().into_iter().flatten() {
            assert!(
                rejected["reason"].as_str().is_some_and(|r| !r.is_empty()),
                "rejected op without a reason: {rejected}"
            );
        }
    }
    eprintln!("{calls} reflection calls checked");
    assert!(
        calls > 0,
        "the run never reflected, so the learning loop went untested"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn_worker(port: u16, log: &Path) -> Proc {
    let log = std::fs::File::create(log).unwrap();
    Proc(
        Command::new(env!("CARGO_BIN_EXE_stageb"))
            .args([
                "worker",
                "--coordinator",
                &format!("127.0.0.1:{port}"),
                "--threads",
                "1",
            ])
            .arg("--model")
            .arg(real_model())
            .env_remove("STAGEB_TOKEN")
            .env_remove("STAGEB_TOKEN_FILE")
            // `job leased` is a debug line: the fault test strikes on it.
            .env("RUST_LOG", "info,stageb_worker=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// A worker killed with SIGKILL mid-epoch: its lease expires, the ticket is re-leased to the
/// surviving worker, the run completes, exactly one selection per ticket, nothing duplicated.
#[test]
fn a_worker_killed_mid_epoch_loses_only_its_lease() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let knobs = Knobs {
        tickets: 4,
        run_name: "fault",
        runner_extra: ", lease_ttl_s: 3, heartbeat_interval_s: 1",
        // Leases are under test here, not learning: keep reflection calls short.
        reflection_tokens: 16,
        ..Knobs::default()
    };
    let config = write_mission(tmp.path(), &knobs);
    let port = free_port();
    let coordinator_log = tmp.path().join("coordinator.log");
    let mut stageb = Command::new(env!("CARGO_BIN_EXE_stageb"));
    let listen = format!("127.0.0.1:{port}");
    let mut coordinator = Proc(
        coordinator_command(&mut stageb, &config, &listen, "60")
            .spawn()
            .unwrap(),
    );
    // Forward the coordinator's log to a file.
    let stderr = coordinator.0.stderr.take().unwrap();
    let log_path = coordinator_log.clone();
    std::thread::spawn(move || {
        let mut file = std::fs::File::create(log_path).unwrap();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            use std::io::Write;
            let _ = writeln!(file, "{line}");
        }
    });
    let victim_log = tmp.path().join("victim.log");
    let mut victim = spawn_worker(port, &victim_log);

    // Strike while the victim holds a lease: right after it logs `job leased` (a ticket takes
    // far longer than the 20 ms poll; a fixed sleep raced the int8 engine, which finished the
    // whole mission first). The survivor starts only then: started together, it could register
    // first, take every ticket as its fair share and finish the run before the victim leased
    // anything (seen once in CI, 2026-11-27).
    let deadline = Instant::now() + Duration::from_secs(300);
    while !std::fs::read_to_string(&victim_log)
        .unwrap_or_default()
        .contains("job leased")
    {
        assert!(Instant::now() < deadline, "the victim never took a lease");
        std::thread::sleep(Duration::from_millis(20));
    }
    let survivor = spawn_worker(port, &tmp.path().join("survivor.log"));
    victim.0.kill().unwrap(); // SIGKILL
    let _ = victim.0.wait();
    // The rest of the run: at most a lease TTL plus the remaining tickets on one worker.
    let status = wait_for_exit(
        &mut coordinator,
        Duration::from_secs(900),
        "the run did not complete after the kill",
    );
    drop(survivor);
    let log = std::fs::read_to_string(&coordinator_log).unwrap_or_default();
    assert_eq!(status.code(), Some(0), "coordinator failed:\n{log}");
    let dir = mission_dir(tmp.path(), knobs.run_name);
    assert_audit_ok(&dir);
    let summary = read_json(&dir, "summary.json");
    let expired = summary["runtime"]["scheduler"]["leases_expired"]
        .as_u64()
        .unwrap();
    assert!(
        expired >= 1,
        "the killed worker's lease should have expired and been re-leased; log:\n{log}"
    );
    let selections = rows_without_runtime(&dir.join("selections.jsonl"));
    assert_eq!(selections.len(), 4, "exactly one selection per ticket");
    let keys: std::collections::BTreeSet<_> = selections
        .iter()
        .map(|s| s["ticket_key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(keys.len(), 4, "no ticket written twice");
}

/// `stageb run` as a user runs it, killed with SIGKILL mid-run (rank 0 and its worker die
/// together, nothing is flushed or closed), then started again with `--resume`: the run
/// completes, replays what the killed attempt had finished, and its selections and trajectories
/// equal those of an uninterrupted run (which also ran on another thread count).
#[test]
fn rank_0_killed_mid_run_resumes_to_the_uninterrupted_artifacts() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let knobs = Knobs {
        tickets: 4,
        run_name: "resume",
        reflection_tokens: 16,
        ..Knobs::default()
    };
    let whole_tmp = tempfile::tempdir().unwrap();
    run_embedded(&write_mission(whole_tmp.path(), &knobs), 1);
    let whole = mission_dir(whole_tmp.path(), knobs.run_name);

    let tmp = tempfile::tempdir().unwrap();
    let config = write_mission(tmp.path(), &knobs);
    let dir = mission_dir(tmp.path(), knobs.run_name);
    let stageb = |extra: &[&str], log: &str| {
        Command::new(env!("CARGO_BIN_EXE_stageb"))
            .args(["run", "--config"])
            .arg(&config)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(tmp.path().join(log)).unwrap())
            .spawn()
            .unwrap()
    };
    let mut first = Proc(stageb(&[], "first.log"));
    let journal = dir.join("jobs.jsonl");
    let deadline = Instant::now() + Duration::from_secs(300);
    while std::fs::read_to_string(&journal).map_or(0, |s| s.lines().count()) < 2 {
        assert!(
            first.0.try_wait().unwrap().is_none(),
            "the first attempt ended before it could be killed"
        );
        assert!(Instant::now() < deadline, "no answers journaled in time");
        std::thread::sleep(Duration::from_millis(50));
    }
    first.0.kill().unwrap(); // SIGKILL: no handler runs
    let _ = first.0.wait();
    assert!(
        !dir.join("summary.json").exists(),
        "killed before the run completed"
    );

    let refused = stageb(&[], "refused.log").wait().unwrap();
    assert_eq!(
        refused.code(),
        Some(2),
        "a plain start over the killed run is refused"
    );
    let resumed = stageb(&["--resume"], "resumed.log").wait().unwrap();
    let log = std::fs::read_to_string(tmp.path().join("resumed.log")).unwrap_or_default();
    assert_eq!(resumed.code(), Some(0), "resume failed:\n{log}");
    assert_audit_ok(&dir);
    let manifest = read_json(&dir, "manifest.json");
    assert_eq!(manifest["runtime"]["resumed"], true);
    assert!(
        manifest["runtime"]["replayed_answers"].as_u64().unwrap() >= 2,
        "the killed attempt's answers are replayed: {}",
        manifest["runtime"]
    );
    for f in ["selections.jsonl", "trajectories.jsonl"] {
        assert_eq!(
            rows_without_runtime(&dir.join(f)),
            rows_without_runtime(&whole.join(f)),
            "{f} differs from the uninterrupted run's"
        );
    }
}

/// `stageb generate` as the README shows it: 8 candidates from the real model, every one a
/// valid two-line verdict; `--json` prints one object per candidate with its seed, token counts
/// and the model fingerprint; the same `--seed` prints the same bytes again.
#[test]
fn generate_prints_eight_contract_valid_candidates_reproducibly() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let prompt = tmp.path().join("prompt.txt");
    std::fs::write(
        &prompt,
        "工单 QC-1：挡风板安装牢固，螺丝齐全，方向正确。Check the BBU windshield panel.",
    )
    .unwrap();
    let generate = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_stageb"))
            .arg("generate")
            .arg("--model")
            .arg(real_model())
            .arg("--prompt-file")
            .arg(&prompt)
            .args(["--candidates", "8"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "generate failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let json = generate(&["--json", "--seed", "5"]);
    let rows: Vec<Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 8, "one JSON object per candidate:\n{json}");
    let mut seeds = std::collections::BTreeSet::new();
    for row in &rows {
        let text = row["text"].as_str().unwrap();
        let parsed = stageb_shared::contract::parse(text)
            .unwrap_or_else(|v| panic!("candidate breaks the contract ({v:?}): {text:?}"));
        assert_eq!(
            row["verdict"],
            serde_json::to_value(parsed.verdict).unwrap()
        );
        assert_eq!(row["reason"], parsed.reason.as_str());
        assert!(row["completion_tokens"].as_u64().unwrap() > 0);
        assert!(row["prompt_tokens"].as_u64().unwrap() > 0);
        assert_eq!(row["model_fingerprint"]["architecture"], "llama");
        seeds.insert(row["seed"].as_u64().unwrap());
    }
    assert_eq!(seeds.len(), 8, "each candidate has its own seed");
    assert_eq!(
        generate(&["--json", "--seed", "5"]),
        json,
        "same seed, same bytes"
    );
    // Count the candidates by their headers: a sampled reason may itself contain "Verdict: ".
    let text = generate(&["--seed", "5"]);
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("--- candidate "))
            .count(),
        8,
        "{text}"
    );
}

/// The small mission over mutual TLS with rank 0 and two workers as separate processes, the way
/// a cluster job runs it: `stageb tls-init` makes the job's CA and certificate, the coordinator
/// requires client certificates, both workers present theirs and verify the coordinator as
/// `stageb-coordinator`. The run completes, every ticket is decided once, the audit passes.
#[test]
fn small_mission_completes_over_mutual_tls_with_separate_processes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let knobs = Knobs {
        tickets: 3,
        run_name: "mtls",
        reflection_tokens: 16,
        ..Knobs::default()
    };
    let config = write_mission(tmp.path(), &knobs);
    let tls_dir = tmp.path().join("tls");
    let init = Command::new(env!("CARGO_BIN_EXE_stageb"))
        .arg("tls-init")
        .arg(&tls_dir)
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    let port = free_port();
    let with_tls = |cmd: &mut Command| {
        cmd.env("STAGEB_TLS_CERT", tls_dir.join("node.pem"))
            .env("STAGEB_TLS_KEY", tls_dir.join("node.key"))
            .env_remove("STAGEB_TOKEN")
            .env_remove("STAGEB_TOKEN_FILE");
    };
    let coordinator_log = tmp.path().join("coordinator.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stageb"));
    cmd.args(["coordinator", "--config"])
        .arg(&config)
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--worker-grace-s",
            "120",
        ])
        .arg("--tls-client-ca")
        .arg(tls_dir.join("ca.pem"))
        .arg("--no-report")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&coordinator_log).unwrap());
    with_tls(&mut cmd);
    let mut coordinator = Proc(cmd.spawn().unwrap());
    let workers: Vec<Proc> = (0..2)
        .map(|i| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_stageb"));
            cmd.args([
                "worker",
                "--coordinator",
                &format!("127.0.0.1:{port}"),
                "--threads",
                "1",
                "--tls-server-name",
                "stageb-coordinator",
            ])
            .arg("--model")
            .arg(real_model())
            .arg("--tls-ca")
            .arg(tls_dir.join("ca.pem"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(tmp.path().join(format!("worker{i}.log"))).unwrap());
            with_tls(&mut cmd);
            Proc(cmd.spawn().unwrap())
        })
        .collect();
    let status = wait_for_exit(
        &mut coordinator,
        Duration::from_secs(600),
        "the run did not complete",
    );
    drop(workers);
    let log = std::fs::read_to_string(&coordinator_log).unwrap_or_default();
    assert_eq!(status.code(), Some(0), "coordinator failed:\n{log}");
    assert!(
        log.contains("MutualTls"),
        "rank 0 served mutual TLS:\n{log}"
    );
    assert_eq!(
        log.matches("worker registered").count(),
        2,
        "both workers joined over mTLS:\n{log}"
    );
    let dir = mission_dir(tmp.path(), knobs.run_name);
    assert_audit_ok(&dir);
    assert!(!dir.join("report.html").exists(), "--no-report writes none");
    assert_eq!(rows_without_runtime(&dir.join("selections.jsonl")).len(), 3);
    let manifest = read_json(&dir, "manifest.json");
    assert_eq!(manifest["runtime"]["model_pinned_by"], "config");
}

/// The Python original's production config (`tests/fixtures/config/bbu_line.yaml`: every key
/// it carries, `stage_b_distillation`, `guidance_lifecycle`, `default_domain`, grid `stop`
/// lists, `seed: null`, `reflection.max_new_tokens: 12000`, `token_budget` and
/// `max_reflection_length: 24000`) run on the 8k-context demo model. Only what must point at
/// this machine changes: the model path, the input/output/prompt paths, and `runner.epochs`
/// (one epoch over two tickets keeps CI short). Before the run fitted its lengths to
/// the model's context, every reflection call of this config failed with `PROMPT_TOO_LONG` and
/// the guidance never changed, silently.
#[test]
fn the_originals_production_config_runs_on_an_8k_model_with_fitted_limits() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Two fail tickets the model passes unanimously (`挡风板装反了`, `未拧紧` carry no trigger
    // word), so reflection has learnable cases to work on.
    let src = std::fs::read_to_string(workspace().join("examples/demo/stage_a.jsonl")).unwrap();
    let tickets: Vec<&str> = src
        .lines()
        .filter(|l| {
            l.contains("QC-DEMO-20260101-1453811") || l.contains("QC-DEMO-20260102-1821596")
        })
        .collect();
    assert_eq!(tickets.len(), 2);
    std::fs::write(dir.join("stage_a.jsonl"), tickets.join("\n") + "\n").unwrap();
    std::fs::copy(
        workspace().join("examples/demo/guidance.json"),
        dir.join("guidance.json"),
    )
    .unwrap();
    std::fs::write(
        dir.join("decision.txt"),
        "你是质检规则学习中的判定助手。逐组判断案例能否由规则学到，按要求输出 JSON。",
    )
    .unwrap();
    std::fs::write(
        dir.join("ops.txt"),
        "你是质检规则编辑助手。根据案例修改检查规则，使判定与参考答案一致，按要求输出 JSON。",
    )
    .unwrap();
    let original =
        std::fs::read_to_string(workspace().join("tests/fixtures/config/bbu_line.yaml")).unwrap();
    let d = dir.display();
    let config = original
        .replace(
            "models/SmolLM2-135M-Instruct-Q4_1.gguf",
            &real_model().display().to_string(),
        )
        .replace(
            "output_post/stage_a/bbu_line.jsonl",
            &format!("{d}/stage_a.jsonl"),
        )
        .replace(
            "output_post/stage_b/initial_guidance.json",
            &format!("{d}/guidance.json"),
        )
        .replace("root: output_post/stage_b", &format!("root: {d}/runs"))
        .replace(
            "configs/prompts/stage_b_reflection_decision_prompt.txt",
            &format!("{d}/decision.txt"),
        )
        .replace(
            "configs/prompts/stage_b_reflection_ops_prompt.txt",
            &format!("{d}/ops.txt"),
        )
        .replace("epochs: 3", "epochs: 1");
    assert!(config.contains("max_new_tokens: 12000") && config.contains("token_budget: 24000"));
    let path = dir.join("bbu_line.yaml");
    std::fs::write(&path, config).unwrap();

    // `stageb validate` says the same before anything runs.
    let validate = |config: &Path| {
        Command::new(env!("CARGO_BIN_EXE_stageb"))
            .arg("validate")
            .arg(config)
            .output()
            .unwrap()
    };
    let checked = validate(&path);
    let said = String::from_utf8_lossy(&checked.stdout);
    assert!(checked.status.success(), "{said}");
    assert!(
        said.contains("context: 8192 tokens (from the model file)"),
        "{said}"
    );
    assert!(
        said.contains(
            "warning: reflection.max_new_tokens asks for 12000 tokens, the run uses 4096"
        ),
        "{said}"
    );
    // A length the model cannot hold is bad input, at its line.
    let too_long = dir.join("too_long.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let model_line = text
        .lines()
        .find(|l| l.trim_start().starts_with("model_name_or_path:"))
        .unwrap();
    std::fs::write(
        &too_long,
        text.replace(model_line, &format!("{model_line}\n  max_model_len: 9000")),
    )
    .unwrap();
    let refused = validate(&too_long);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{err}");
    assert!(
        err.contains("too_long.yaml:9: model.max_model_len asks for 9000 tokens")
            && err.contains("E_INVALID_CONFIG_VALUE"),
        "{err}"
    );

    // As a user runs it: `stageb run`, its log kept.
    let started = Instant::now();
    let status = Command::new(env!("CARGO_BIN_EXE_stageb"))
        .args(["run", "--threads", "2", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("run.log")).unwrap())
        .status()
        .unwrap();
    eprintln!("original config, 1 epoch: {:?}", started.elapsed());
    let log = std::fs::read_to_string(dir.join("run.log")).unwrap();
    assert!(status.success(), "stageb run failed:\n{log}");
    let run_dir = dir.join("runs/12-18/挡风板安装检查");
    assert_audit_ok(&run_dir);
    assert!(
        run_dir.join("report.html").is_file(),
        "stageb run writes its report beside the artifacts"
    );
    // Said once at start: which key, asked, used, why; then the limits used.
    for key in [
        "reflection.max_new_tokens",
        "reflection.max_reflection_length",
        "reflection.token_budget",
    ] {
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(key)).collect();
        assert_eq!(lines.len(), 1, "{key} in the log:\n{log}");
        assert!(
            lines[0].contains("asked") && lines[0].contains("used"),
            "{}",
            lines[0]
        );
    }
    assert!(log.contains("effective limits"), "{log}");
    let summary = read_json(&run_dir, "summary.json");
    assert_eq!(summary["tickets"], 2);

    let manifest = read_json(&run_dir, "manifest.json");
    let limits = &manifest["effective_limits"];
    assert_eq!(limits["context"], 8192, "{limits}");
    assert_eq!(limits["context_source"], "model");
    assert_eq!(limits["reflection_max_new_tokens"], 4096);
    assert_eq!(limits["reflection_token_budget"], 4096);
    assert_eq!(
        limits["rollout_max_new_tokens"],
        serde_json::json!([1024, 1024, 1024])
    );
    let lowered: Vec<&str> = limits["adjusted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["key"].as_str().unwrap())
        .collect();
    assert_eq!(
        lowered,
        [
            "reflection.max_new_tokens",
            "reflection.max_reflection_length",
            "reflection.token_budget"
        ]
    );
    // The config is recorded as written.
    assert_eq!(manifest["config"]["reflection"]["max_new_tokens"], 12000);

    // Reflection really ran: at least one decision pass came back and parsed.
    let calls: Vec<Value> = std::fs::read_to_string(run_dir.join("reflection.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let parsed_decisions = calls
        .iter()
        .filter(|row| row["decision"].is_object() && !row["decision"].is_null())
        .count();
    assert!(
        parsed_decisions >= 1,
        "no decision pass parsed: {}",
        calls
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        !calls
            .iter()
            .any(|row| row.to_string().contains("PROMPT_TOO_LONG")),
        "a reflection call was too long for the context"
    );
    assert_eq!(summary["warnings"], serde_json::json!([]), "{summary}");
}

/// A rollout prompt that cannot fit the run's context (here `model.max_model_len: 256`, below
/// the demo's prompts) is reported per ticket with its code, never silently dropped: each
/// ticket gets a `failure_malformed` row with `error.code == PROMPT_TOO_LONG`, a selection
/// without a verdict, and the run still completes with an audit that passes.
#[test]
fn a_rollout_prompt_longer_than_the_context_is_a_coded_failure_per_ticket() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let knobs = Knobs {
        tickets: 2,
        run_name: "short-context",
        ..Knobs::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let config = write_mission(tmp.path(), &knobs);
    let text = std::fs::read_to_string(&config).unwrap();
    let model_line = format!("model: {{model_name_or_path: {}}}", real_model().display());
    assert!(text.contains(&model_line));
    std::fs::write(
        &config,
        text.replace(
            &model_line,
            &format!(
                "model: {{model_name_or_path: {}, max_model_len: 256}}",
                real_model().display()
            ),
        ),
    )
    .unwrap();
    let summary = run_embedded(&config, 1);
    assert_eq!(
        summary.hard_failures, 2,
        "both tickets fail with their code"
    );
    let dir = mission_dir(tmp.path(), knobs.run_name);
    assert_audit_ok(&dir);
    let failures = rows_without_runtime(&dir.join("failure_malformed.jsonl"));
    assert_eq!(failures.len(), 2);
    for row in &failures {
        assert_eq!(row["error"]["code"], "PROMPT_TOO_LONG", "{row}");
    }
    let manifest = read_json(&dir, "manifest.json");
    assert_eq!(manifest["effective_limits"]["context"], 256);
    assert_eq!(manifest["effective_limits"]["context_source"], "config");
}

/// Held-out splits: the gate decision on the real model. The real engine rolls out every
/// ticket, the step's and the gate's (parent and candidate guidance); only the reflection
/// answers are scripted, so that an edit reaches the gate at all (the 135M model never writes a
/// valid rule): the decision pass keeps every case, the ops pass adds one rule citing them all.
struct RealRolloutsScriptedOps {
    real: ModelEngine,
}

impl stageb_worker::engine::Engine for RealRolloutsScriptedOps {
    fn fingerprint(&self) -> &stageb_worker::engine::ModelFingerprint {
        self.real.fingerprint()
    }

    fn max_context(&self) -> u32 {
        self.real.max_context()
    }

    fn limit_context(&mut self, tokens: u32) {
        self.real.limit_context(tokens)
    }

    fn rollout(
        &mut self,
        request: &stageb_worker::engine::RolloutRequest,
    ) -> Result<stageb_worker::engine::RolloutOutput, stageb_worker::engine::EngineError> {
        self.real.rollout(request)
    }

    fn generate(
        &mut self,
        request: &stageb_worker::engine::GenerateRequest,
    ) -> Result<stageb_worker::engine::GenerateOutput, stageb_worker::engine::EngineError> {
        let user = request
            .messages
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone())
            .unwrap_or_default();
        let keys: Vec<String> = support::ReflectionPrompt::parse(&user)
            .cases
            .into_iter()
            .map(|c| c.key)
            .collect();
        let decision = request
            .json_schema
            .as_ref()
            .is_some_and(|s| s.to_string().contains("no_evidence_group_ids"));
        let text = if decision {
            serde_json::json!({"no_evidence_group_ids": [],
                               "decision_analysis": "每个案例都有可学习的方向。"})
        } else {
            serde_json::json!({"has_evidence": true, "evidence_analysis": "按脚本给出的规则。",
                "operations": [{"op": "add", "evidence": keys, "rationale": "脚本给出的规则",
                    "text": "若摘要出现“挡风板”则判不通过；否则按其他规则判定"}]})
        }
        .to_string();
        Ok(stageb_worker::engine::GenerateOutput {
            prompt_tokens: user.chars().count() as u32,
            prefix_tokens: 0,
            completion_tokens: text.chars().count() as u32,
            text,
            finish: stageb_worker::engine::FinishReason::Stop,
            latency_us: 0,
            batch: Default::default(),
        })
    }
}

#[test]
fn real_model_gate_checks_an_edit_on_the_gate_split_before_applying_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let knobs = Knobs {
        tickets: 6,
        run_name: "gate",
        max_calls: 4,
        min_verdict_agreement: 1.0,
        reflection_extra: ", gate: {enabled: true, gate_fraction: 0.34, final_fraction: 0.0, \
                           min_p_better: 0.0}",
        ..Knobs::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let config = write_mission(tmp.path(), &knobs);
    let started = Instant::now();
    // Two workers for CI's two cores; the scripted ops answer from the request alone, so
    // which worker answers a call changes nothing.
    let summary = run_embedded_with(&config, 2, |real| RealRolloutsScriptedOps { real });
    eprintln!("gate run: {:?}", started.elapsed());
    let dir = mission_dir(tmp.path(), knobs.run_name);
    assert_audit_ok(&dir);
    let rows = rows_without_runtime(&dir.join("reflection.jsonl"));
    let gated: Vec<&Value> = rows.iter().filter(|r| r.get("gate").is_some()).collect();
    let row = gated.first().expect("the scripted edit reached the gate");
    let gate = &row["gate"];
    eprintln!("gate: {gate}");
    let gate_tickets = rows_without_runtime(&dir.join("selections.jsonl"))
        .iter()
        .filter(|s| s["split"] == "gate")
        .count();
    assert!(gate_tickets > 0);
    assert_eq!(
        gate["tickets"], gate_tickets,
        "every gate ticket evaluated: {gate}"
    );
    let refused = row["rejected_ops"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["reason"] == "gate_regression");
    assert_eq!(gate["passed"] == true, row["applied"] == true, "{row}");
    assert_eq!(gate["passed"] == false, refused, "{row}");
    assert!(summary.runtime["gate"]["checks"].as_u64().unwrap() >= 1);
}
