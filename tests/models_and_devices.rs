//! Models users have and the devices their workers land on, as a user meets them through the
//! `stageb` binary: a GPU asked of a CPU build is refused before anything starts (exit 2,
//! `E_INVALID_DEVICE`), never a silent CPU run; the GPU ordinal rule itself is unit-tested over
//! a table of launcher environments in `shared/src/placement.rs`. The settings that default by
//! device (`runner.pipeline_*`) take the device's values when unset and change no artifact byte.

use crate::support;

use std::process::{Command, Output};

use serde_json::json;
use stageb::roles;
use stageb_shared::config::DeviceKind;
#[cfg(not(feature = "cuda"))]
use support::harness::real_model;

fn stageb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stageb"))
        .args(args)
        .env_remove("STAGEB_DEVICE")
        .output()
        .unwrap()
}

#[cfg(not(feature = "cuda"))]
fn assert_invalid_device(out: &Output, what: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: {err}");
    assert!(err.contains("E_INVALID_DEVICE"), "{what}: {err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_gpu_asked_of_a_cpu_build_is_refused_before_any_lease() {
    let model = real_model();
    let model = model.to_str().unwrap();
    // `run` places every local worker before it loads anything or binds a port.
    let out = stageb(&[
        "run",
        "--config",
        "examples/demo/small/config.yaml",
        "--workers",
        "2",
        "--device",
        "cuda:1",
    ]);
    assert_invalid_device(&out, "run --device cuda:1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("built without the `cuda` feature"), "{err}");
    // A worker refuses before it dials: the coordinator address is never reached.
    let out = stageb(&[
        "worker",
        "--coordinator",
        "127.0.0.1:9",
        "--model",
        model,
        "--device",
        "cuda:0",
    ]);
    assert_invalid_device(&out, "worker --device cuda:0");
}

/// The Qwen3-VL-shaped checkpoint of the parity fixtures
/// (`scripts/fixtures/make-parity-fixtures.py`; weights written by `scripts/fetch-model.sh`):
/// `model_type: qwen3_vl`, settings under `text_config`, a vision tower, bf16 shards and its
/// template in `chat_template.jinja`.
fn qwen3_vl_fixture() -> std::path::PathBuf {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("worker/tests/fixtures/parity/qwen3_vl");
    assert!(p.join("config.json").is_file(), "{} missing", p.display());
    assert!(
        p.join("model.safetensors").is_file(),
        "{}: weights missing (not committed); run scripts/fetch-model.sh to write them",
        p.display()
    );
    p
}

/// The small demo mission's config with `model` as its model and every path absolute.
fn small_demo_config(dir: &std::path::Path, model: &std::path::Path) -> std::path::PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/examples/demo/small/config.yaml")).unwrap();
    let text = text
        .replace(
            ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            model.to_str().unwrap(),
        )
        .replace("examples/", &format!("{root}/examples/"))
        .replace(
            "root: runs",
            &format!("root: {}", dir.join("runs").display()),
        );
    let path = dir.join("config.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_qwen3_vl_checkpoint_runs_the_small_demo_end_to_end_in_f32_and_bf16() {
    let model = qwen3_vl_fixture();
    for numerics in ["f32", "bf16"] {
        let tmp = tempfile::tempdir().unwrap();
        let config = small_demo_config(tmp.path(), &model);
        let out = stageb(&[
            "run",
            "--threads",
            "2",
            "--device",
            "cpu",
            "--numerics",
            numerics,
            "--config",
            config.to_str().unwrap(),
        ]);
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{numerics}: stageb run failed:\n{log}"
        );
        let run_dir = tmp.path().join("runs/demo-small/挡风板安装检查");
        support::harness::assert_audit_ok(&run_dir);
        // Every candidate kept the two-line contract, whatever the random weights said.
        let summary = std::fs::read_to_string(run_dir.join("summary.json")).unwrap();
        let malformed =
            std::fs::read_to_string(run_dir.join("failure_malformed.jsonl")).unwrap_or_default();
        assert_eq!(malformed.lines().count(), 0, "{numerics}: {malformed}");
        // The run is pinned to the numerics it ran with: a bf16 worker never joins an f32 run.
        let manifest = std::fs::read_to_string(run_dir.join("manifest.json")).unwrap();
        assert!(
            manifest.contains(&format!("|cpu-{numerics}|cpu\"")),
            "{numerics}: {manifest}\n{summary}"
        );
    }
}

/// Placeholder markers typed into a prompt are text (text from inputs is
/// never parsed as special tokens), so the text tower runs it; only a template that writes a
/// placeholder token itself is refused (`ModelEngine::prompt_ids`).
#[test]
fn image_placeholder_markers_typed_into_a_prompt_are_text_and_run() {
    let tmp = tempfile::tempdir().unwrap();
    let prompt = tmp.path().join("prompt.txt");
    std::fs::write(
        &prompt,
        "看图：<|vision_start|><|image_pad|><|vision_end|> 通过吗？",
    )
    .unwrap();
    let model = qwen3_vl_fixture();
    let out = stageb(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--candidates",
        "1",
        "--max-new-tokens",
        "24",
        "--prompt-file",
        prompt.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("placeholder token"), "{err}");
}

/// The toy mission's run `name` in `dir`, rank 0 told its workers compute on `device`; the
/// run directory.
fn toy_run_on(dir: &std::path::Path, name: &str, device: Option<DeviceKind>) -> std::path::PathBuf {
    let config = support::write_config(dir, json!({"output": {"run_name": name}}));
    let inputs = roles::prepare_inputs(&config, "embedded").expect("inputs");
    let script = support::Script::new(Default::default());
    let settings = roles::CoordinatorSettings {
        workers_device: device,
        ..support::coordinator_settings(roles::StartMode::Fresh)
    };
    support::run_prepared(
        inputs,
        2,
        move |_| support::ScriptedEngine::new(script.clone()),
        settings,
        std::future::pending(),
    )
    .expect("the run completes")
    .run_dir
}

#[test]
fn on_a_gpu_the_settings_left_unset_take_its_defaults_and_no_artifact_byte_changes() {
    let dir = tempfile::tempdir().unwrap();
    support::write_toy_mission(dir.path());
    let cpu = toy_run_on(dir.path(), "cpu", Some(DeviceKind::Cpu));
    let gpu = toy_run_on(dir.path(), "gpu", Some(DeviceKind::Cuda));
    let unknown = toy_run_on(dir.path(), "unknown", None);
    let tuning = |run: &std::path::Path| {
        support::read_json(run, "manifest.json")["runtime"]["tuning"].clone()
    };
    let from_device = |value: u32| json!({"value": value, "from": "device_default"});
    // The CPU's are the two-core defaults every CPU run had: nothing queued ahead.
    assert_eq!(
        tuning(&cpu),
        json!({"device": "cpu", "max_jobs": null,
               "pipeline_steps": from_device(0), "pipeline_cycles": from_device(0)})
    );
    // A GPU's queue work ahead, and the manifest's config holds the values in force.
    assert_eq!(
        tuning(&gpu),
        json!({"device": "cuda", "max_jobs": null,
               "pipeline_steps": from_device(1), "pipeline_cycles": from_device(4)})
    );
    let config = &support::read_json(&gpu, "manifest.json")["config"]["runner"];
    assert_eq!(
        (&config["pipeline_steps"], &config["pipeline_cycles"]),
        (&json!(1), &json!(4))
    );
    // Rank 0 not knowing the device takes the CPU's, and says so.
    assert_eq!(tuning(&unknown)["device"], json!(null));
    assert_eq!(tuning(&unknown)["pipeline_steps"], from_device(0));
    // Queued ahead or not, the run computes the same bytes.
    support::compare::assert_same_artifacts(&cpu, &gpu);
}
