//! Speed of the rollout workload (ignored by default; run with `--ignored --nocapture`).
//!
//! The workload of `performance-baseline.md`: a ChatML prompt of about 600 tokens, 8 candidates
//! × 48 new tokens at temperature 0.7 / top-p 0.9 sharing the prompt. Prints prefill tokens/s,
//! decode time and the ticket time; asserts only that the work was done.

use crate::common;
use common::model_path;

use std::time::Instant;

use stageb_shared::domain::ChatMessage;
use stageb_worker::engine::{DecodeRequest, Engine, EngineOptions, ModelEngine, RolloutRequest};

#[test]
#[ignore]
fn bench_ticket_601_tokens_8x48() {
    let path = model_path();
    let threads = std::env::var("STAGEB_THREADS")
        .ok()
        .and_then(|s| s.parse().ok());
    let t = Instant::now();
    let mut engine = ModelEngine::load(
        &path,
        &EngineOptions {
            threads,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    eprintln!(
        "load: {:.2}s fingerprint {}",
        t.elapsed().as_secs_f64(),
        stageb_worker::engine::Engine::fingerprint(&engine).id()
    );
    let mut user = String::new();
    let mut i = 0;
    while engine.encode(&user).unwrap().len() < 520 {
        i += 1;
        user.push_str(&format!(
            "Ticket {i}: 挡风板安装检查, photo {i} shows the panel with 4 clips; 螺丝齐全, no gap at 2024-03-0{}.\n",
            i % 10
        ));
    }
    let messages = vec![
        ChatMessage::system(
            "G0: 挡风板必须安装到位. S1: Verdict: 通过 or 不通过, then one Reason line.",
        ),
        ChatMessage::user(user),
    ];
    let req = RolloutRequest {
        messages,
        decodes: vec![DecodeRequest {
            decode_index: 0,
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.0,
            max_new_tokens: 48,
            seeds: (0..8).collect(),
        }],
        constrained: std::env::var("STAGEB_BENCH_CONSTRAINED").is_ok(),
    };
    for run in 0..2 {
        let t = Instant::now();
        let out = engine.rollout(&req).unwrap();
        let wall = t.elapsed().as_secs_f64();
        let generated: u32 = out.candidates.iter().map(|c| c.completion_tokens).sum();
        eprintln!(
            "run {run}: prompt {} tok, prefill {:.2}s ({:.1} tok/s), decode {:.2}s ({generated} tokens, {:.1} agg tok/s), ticket {:.2}s",
            out.prompt_tokens,
            out.prefill_us as f64 / 1e6,
            out.prompt_tokens as f64 / (out.prefill_us as f64 / 1e6),
            out.decode_us as f64 / 1e6,
            generated as f64 / (out.decode_us as f64 / 1e6),
            wall
        );
        assert_eq!(out.candidates.len(), 8);
    }
}
