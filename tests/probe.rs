//! `stageb probe`, the hidden diagnostics the GPU check runs (docs/GPU-TEST.md,
//! `scripts/gpu/gpu-check.sh`), on the committed Qwen3 parity fixture: its logits and greedy
//! tokens are transformers' (the fixture's `reference.json`, f32), the prompts it writes have
//! the asked lengths, and the rollout workload runs every candidate to the fixed length.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

/// The fixture's weights are not committed: `scripts/fetch-model.sh` writes them.
fn fixture() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("worker/tests/fixtures/parity/qwen3");
    assert!(
        dir.join("model-00001-of-00002.safetensors").is_file(),
        "{}: weights missing; run scripts/fetch-model.sh to write them",
        dir.display()
    );
    dir
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn probe(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_stageb"))
        .arg("probe")
        .args(args)
        .env_remove("STAGEB_DEVICE")
        .env_remove("STAGEB_NUMERICS")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stageb probe {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn probe_logits_gives_the_transformers_f32_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture();
    let reference = read(&model.join("reference.json"));
    for prompt in reference["prompts"].as_array().unwrap() {
        let name = prompt["name"].as_str().unwrap();
        let ids = tmp.path().join(format!("{name}.json"));
        let out = tmp.path().join(format!("{name}.out.json"));
        std::fs::write(&ids, prompt["ids"].to_string()).unwrap();
        let want = &prompt["f32"];
        let steps = want["greedy"].as_array().unwrap().len().to_string();
        probe(&[
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--ids",
            ids.to_str().unwrap(),
            "--steps",
            &steps,
            "--device",
            "cpu",
            "--numerics",
            "f32",
            "--out",
            out.to_str().unwrap(),
        ]);
        let got = read(&out);
        let (logits, expected) = (floats(&got["logits"]), floats(&want["logits"]));
        assert_eq!(logits.len(), expected.len(), "{name}: vocabulary");
        let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = logits
            .iter()
            .zip(&expected)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff / scale < 1e-4,
            "{name}: relative error {}",
            diff / scale
        );
        assert_eq!(got["greedy"], want["greedy"], "{name}: greedy tokens");
        assert_eq!(
            got["prompt_tokens"],
            json!(prompt["ids"].as_array().unwrap().len())
        );
        assert_eq!(got["fingerprint"]["dtype"], "cpu-f32");
    }
}

#[test]
fn probe_ids_and_rollout_write_what_the_gpu_check_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture();
    let (ids, out) = (tmp.path().join("ids.json"), tmp.path().join("r.json"));
    let model = model.to_str().unwrap();
    let ids_arg = ids.to_str().unwrap();
    probe(
        &[
            "ids",
            "--model",
            model,
            "--tickets",
            "3",
            "--tokens",
            "40",
            "--jitter",
            "5",
        ]
        .into_iter()
        .chain(["--out", ids_arg])
        .collect::<Vec<_>>(),
    );
    let prompts = read(&ids);
    let lens: Vec<usize> = prompts
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_array().unwrap().len())
        .collect();
    // 40 - (37 i mod 6) for i = 0, 1, 2.
    assert_eq!(lens, [40, 39, 38]);
    assert_ne!(prompts[0], prompts[1].clone(), "tickets differ");
    probe(&[
        "rollout",
        "--model",
        model,
        "--ids",
        ids_arg,
        "--tickets",
        "2",
        "--candidates",
        "2",
        "--new-tokens",
        "5",
        "--reps",
        "2",
        "--device",
        "cpu",
        "--numerics",
        "f32",
        "--out",
        out.to_str().unwrap(),
    ]);
    let r = read(&out);
    assert_eq!(r["probe"], "rollout");
    assert_eq!(r["tickets"], 2);
    let passes = r["passes"].as_array().unwrap();
    assert_eq!(passes.len(), 2);
    for p in passes {
        assert_eq!(p["complete"], true);
        assert_eq!(p["tickets_done"], 2);
        assert!(p["tickets_per_min"].as_f64().unwrap() > 0.0);
        for t in p["tickets"].as_array().unwrap() {
            // Stop tokens are ignored: 2 candidates x exactly 5 tokens.
            assert_eq!(t["generated_tokens"], 10);
        }
    }
    assert!(r["best"].is_u64());
    assert_eq!(r["budget_exhausted"], false);
}

/// The GPU check of 2026-11-29 asked for 8 tickets in flight and got about 3: the probe left
/// the engine at the CPU's 2 GiB KV budget instead of the device's default, as a worker sets
/// it. Now the probe sets it as a worker does (`--kv-cache-mib`, else the device's default),
/// reports it, and the tickets in flight are those the budget holds.
#[test]
fn regression_the_probe_s_tickets_in_flight_are_those_its_kv_budget_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture();
    let ids = tmp.path().join("ids.json");
    let (model, ids_arg) = (model.to_str().unwrap(), ids.to_str().unwrap());
    // 1,200-token prompts: 75 KV blocks of 16 positions (8 KiB each in f32 at the fixture's
    // shape) and a few a row, so 1 MiB (128 blocks) holds one ticket and not two.
    probe(&[
        "ids",
        "--model",
        model,
        "--tickets",
        "2",
        "--tokens",
        "1200",
        "--out",
        ids_arg,
    ]);
    let rollout = |jobs: &str, kv: Option<&str>, name: &str| {
        let out = tmp.path().join(name);
        let mut args = vec![
            "rollout",
            "--model",
            model,
            "--ids",
            ids_arg,
            "--jobs",
            jobs,
            "--candidates",
            "2",
            "--new-tokens",
            "16",
            "--device",
            "cpu",
            "--numerics",
            "f32",
            "--out",
        ];
        args.push(out.to_str().unwrap());
        if let Some(mib) = kv {
            args.extend(["--kv-cache-mib", mib]);
        }
        let status = Command::new(env!("CARGO_BIN_EXE_stageb"))
            .arg("probe")
            .args(&args)
            .env_remove("STAGEB_DEVICE")
            .env_remove("STAGEB_NUMERICS")
            .env_remove("STAGEB_KV_CACHE_MIB")
            .env_remove("STAGEB_MAX_JOBS")
            .env("STAGEB_ENGINE_SWITCHES", "paged=on")
            .status()
            .unwrap();
        assert!(status.success(), "stageb probe {args:?}");
        let r = read(&out);
        let held = |k: &str| r[k].as_u64().unwrap();
        (held("kv_budget_bytes"), held("kv_peak_bytes"))
    };
    // What one ticket holds at its peak, alone.
    let (_, one) = rollout("1", None, "alone.json");
    assert!(one > 0);
    // A budget for one ticket: the second waits for the first, whatever --jobs says.
    assert_eq!(rollout("2", Some("1"), "one.json"), (1 << 20, one));
    // The device's default (the CPU's 2 GiB): both are held at once.
    assert_eq!(rollout("2", None, "default.json"), (2 << 30, 2 * one));
}
