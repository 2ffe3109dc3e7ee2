//! Specs of the run loop's pure helpers (run directory names, step sizes, payloads).

use super::*;
use crate::cluster::scheduler::JobPayload;
use stageb_shared::domain::{SourceLocation, Verdict};

const CONFIG: &str = "seed: 17\nstage_a_paths: [a.jsonl]\nmodel: {model_name_or_path: m.gguf}\n\
guidance: {path: g.json, retention: 2}\noutput: {root: runs, run_name: t}\n\
sampler: {samples_per_decode: 2, grid: [{temperature: 0.5, top_p: 0.9, max_new_tokens: 32}]}\n\
reflection: {batch_size: 4}\nselection: {policy: top_label, tie_break: temperature}\nrunner: {epochs: 1}\n";

fn ticket(label: Verdict) -> Ticket {
    Ticket {
        group_id: "QC-1".into(),
        mission: "挡风板安装检查".into(),
        label,
        per_image: vec![("image_1".into(), "挡风板/显示完整/安装方向正确×1".into())],
        images: vec![],
        label_source: "human".into(),
        label_timestamp: None,
        source: SourceLocation {
            file: "a.jsonl".into(),
            line: 1,
        },
    }
}

#[test]
fn the_label_never_reaches_the_rollout_prompt() {
    // The job builder receives the whole ticket, label included: both tickets of a
    // resubmitted group must get byte-identical prompts (only their seeds differ, because
    // the ticket key is part of the seed).
    let cfg = stageb_shared::config::parse_config(CONFIG, "test.yaml")
        .unwrap()
        .config;
    let guidance = vec![("G0".to_string(), "检查挡风板".to_string())];
    let messages = |label| match rollout_payload(&cfg, 1, &ticket(label), &guidance) {
        JobPayload::Rollout { messages, .. } => messages,
        other => panic!("unexpected payload {other:?}"),
    };
    let (pass, fail) = (messages(Verdict::Pass), messages(Verdict::Fail));
    assert_eq!(pass, fail);
    let all: String = pass.iter().map(|m| m.content.as_str()).collect();
    assert!(!all.contains("::pass") && !all.contains("::fail") && !all.contains("gt_label"));
}

#[test]
fn step_size_does_not_depend_on_the_number_of_workers() {
    let cfg = stageb_shared::config::parse_config(CONFIG, "test.yaml")
        .unwrap()
        .config;
    assert_eq!(
        step_size(&cfg),
        (cfg.runner.per_rank_rollout_batch_size * REFERENCE_RANKS) as usize
    );
}

#[test]
fn run_dir_refuses_names_that_escape_the_root() {
    let mut cfg = stageb_shared::config::parse_config(CONFIG, "test.yaml")
        .unwrap()
        .config;
    assert!(run_dir(&cfg, "../etc").is_err());
    assert!(run_dir(&cfg, "a/b").is_err());
    cfg.output.run_name = "..".into();
    assert!(run_dir(&cfg, "挡风板安装检查").is_err());
}
