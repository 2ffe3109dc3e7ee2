//! Missions of the scripted tests: the synthetic toy mission (16 tickets whose defects only
//! learned rules can catch), a copy of the demo mission, and the config a run of them reads
//! (the demo's knobs with absolute paths into the test's temp dir, plus per-test overrides).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// Mission of every fixture here (the demo's).
pub const MISSION: &str = "挡风板安装检查";

/// A ticket of a synthetic mission.
pub struct TicketSpec {
    pub group_id: String,
    pub label: &'static str,
    pub per_image: Vec<String>,
}

/// Write `stage_a.jsonl` for `tickets` into `dir`.
pub fn write_stage_a(dir: &Path, tickets: &[TicketSpec]) {
    let mut text = String::new();
    for t in tickets {
        let per_image: serde_json::Map<String, Value> = t
            .per_image
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("image_{}", i + 1), json!(s)))
            .collect();
        let images: Vec<String> = (0..t.per_image.len())
            .map(|i| format!("{}_{i}.jpeg", t.group_id))
            .collect();
        let row = json!({"group_id": t.group_id, "mission": MISSION, "label": t.label,
                         "images": images, "per_image": per_image});
        text.push_str(&row.to_string());
        text.push('\n');
    }
    std::fs::write(dir.join("stage_a.jsonl"), text).expect("write stage_a.jsonl");
}

/// Seed guidance of the synthetic mission: the demo's `S1` and `G0`, no learned rule, so the
/// scripted engine starts by passing everything.
pub fn write_toy_guidance(dir: &Path) {
    let g = json!({MISSION: {
        "step": 1,
        "updated_at": "2026-01-01T00:00:00+00:00",
        "experiences": {
            "S1": "结论只能基于摘要中与挡风板相关的证据；光纤、尾纤、线缆、标签等其他对象的问题与挡风板无关，不影响判定。",
            "G0": "检查BBU设备是否按要求配备挡风板；挡风板安装方向是否正确；挡风板是否安装牢固。",
        },
        "metadata": {},
    }});
    std::fs::write(
        dir.join("guidance.json"),
        serde_json::to_string_pretty(&g).unwrap(),
    )
    .expect("write guidance.json");
}

/// The confirmation every synthetic pass ticket carries and no fail ticket does.
pub const TOY_CONFIRMATION: &str = "安装方向正确";

/// Defects of the synthetic fail tickets: none contains a fail-first trigger word, so only
/// learned rules can fail them, and no two share a phrase, so each needs its own evidence.
pub const TOY_DEFECTS: &[&str] = &[
    "挡风板装反了",
    "挡风板有晃动",
    "挡风板一侧螺丝未拧紧",
    "挡风板边缘翘起",
    "挡风板表面有裂纹",
    "挡风板卡扣脱落",
    "挡风板与机框之间不贴合",
    "挡风板没有固定",
];

/// The synthetic mission: 8 pass tickets with a fully confirmed panel and 8 fail tickets
/// (`QC-TOY-F{i}::fail`, defect `TOY_DEFECTS[i]` in a remark only). The engine passes every
/// ticket until rules are learned, so every fail ticket is a gradient candidate in epoch 1.
pub fn write_toy_mission(dir: &Path) {
    let context = [
        "光纤/显示完整/弯曲半径符合要求×2，标签/可以识别×3",
        "接地线/显示完整/符合要求×1",
        "线缆/显示完整/绑扎整齐×4",
        "机柜/显示完整×1，走线架/显示完整/符合要求×1",
    ];
    let mut tickets = Vec::new();
    for i in 0..8 {
        let mut per_image = vec![
            "BBU设备/显示完整/这个BBU设备按要求配备了挡风板×1，挡风板/显示完整/安装方向正确×1，螺丝/显示完整/符合要求×3".to_string(),
        ];
        if i % 2 == 1 {
            per_image.push(context[i / 2].to_string());
        }
        tickets.push(TicketSpec {
            group_id: format!("QC-TOY-P{i}"),
            label: "pass",
            per_image,
        });
    }
    for (i, defect) in TOY_DEFECTS.iter().enumerate() {
        let mut per_image = vec![format!(
            "BBU设备/显示完整/这个BBU设备按要求配备了挡风板×1，挡风板/显示完整×1，螺丝/显示完整/符合要求×2，备注: {defect}"
        )];
        if i % 2 == 0 {
            per_image.insert(0, context[i / 2].to_string());
        }
        tickets.push(TicketSpec {
            group_id: format!("QC-TOY-F{i}"),
            label: "fail",
            per_image,
        });
    }
    write_stage_a(dir, &tickets);
    write_toy_guidance(dir);
}

/// Key of the synthetic fail ticket `i`.
pub fn toy_fail_key(i: usize) -> String {
    format!("QC-TOY-F{i}::fail")
}

/// Copy the demo mission's Stage-A file and guidance into `dir`.
pub fn copy_demo_mission(dir: &Path) {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/demo");
    for f in ["stage_a.jsonl", "guidance.json"] {
        std::fs::copy(demo.join(f), dir.join(f)).unwrap_or_else(|e| panic!("copy {f}: {e}"));
    }
}

/// `over` merged into `base`: objects key by key, anything else replaced.
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o,
    }
}

/// The base config (the demo's knobs: 2 temperatures × 2 samples, agreement 0.67) with
/// absolute paths into `dir`, so tests never depend on the working directory, and short lease
/// timings. Steps are 8 tickets (`per_rank_rollout_batch_size` 1 × 8 reference ranks).
pub fn base_config(dir: &Path) -> Value {
    json!({
        "seed": 17,
        "stage_a_paths": [dir.join("stage_a.jsonl")],
        "model": {"model_name_or_path": "scripted-engine"},
        "guidance": {"path": dir.join("guidance.json"), "retention": 5, "reset_on_rerun": true},
        "output": {"root": dir.join("runs"), "run_name": "it"},
        "sampler": {
            "samples_per_decode": 2,
            "grid": [
                {"temperature": 0.3, "top_p": 0.9, "max_new_tokens": 48, "repetition_penalty": 1.05},
                {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 48, "repetition_penalty": 1.05},
            ],
        },
        "manual_review": {"min_verdict_agreement": 0.67},
        "runner": {"epochs": 1, "per_rank_rollout_batch_size": 1, "logging_steps": 8,
                   "lease_ttl_s": 10, "heartbeat_interval_s": 1},
        "reflection": {
            "batch_size": 4, "max_operations": 4, "temperature": 0.3, "top_p": 0.9,
            "repetition_penalty": 1.05, "max_new_tokens": 512,
            "max_reflection_length": 16384, "token_budget": 16384,
            "retry_budget_per_group_per_epoch": 2, "max_calls_per_epoch": null,
        },
        "selection": {"policy": "top_label", "tie_break": "temperature"},
    })
}

/// Writes [`base_config`] with `overrides` merged in as `dir/config.yaml`.
pub fn write_config(dir: &Path, overrides: Value) -> PathBuf {
    let mut config = base_config(dir);
    merge(&mut config, overrides);
    // JSON is YAML: the config loader reads it as a flow-style document.
    let config_path = dir.join("config.yaml");
    std::fs::write(&config_path, serde_json::to_string_pretty(&config).unwrap())
        .expect("write config");
    config_path
}
