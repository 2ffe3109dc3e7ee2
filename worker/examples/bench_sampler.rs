//! Sampling cost per row and step on real logits: the exact sampler over the full vocabulary
//! against the same sampler behind its max-logit prefilter (`docs/PERFORMANCE.md`).
//!
//! Logits are the demo model's (SmolLM2-135M, 49,152 tokens) after a rollout prompt and after
//! partial answers to it, so their shape is the decode's. Every draw of both paths is compared
//! (they must be the same token), then each path is timed over the same rows and draws (the
//! fastest of 3 rounds), and the share of draws the prefilter leaves to the exhaustive path.
//!
//! `--synthetic SIGMA` replaces the model's logits by rows of 151,936 (Qwen3's vocabulary)
//! normal logits of that spread, as a random-weight checkpoint gives (the GPU check's qwen3-8b:
//! largest |logit| ~5): nearly every token is then near the maximum, the prefilter cannot decide
//! and each draw weighs the whole vocabulary.
//!
//! ```text
//! cargo run -p stageb-worker --example bench_sampler -- [--model M] [--draws 2000] [--synthetic 1.2]
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use stageb_shared::domain::ChatMessage;
use stageb_shared::seed::uniform_at;
use stageb_worker::constraint::AllowedTokens;
use stageb_worker::engine::sampler::prefilter;
use stageb_worker::engine::sampler::{self, SamplingParams, Scratch, SeenTokens};
use stageb_worker::engine::{CandleEngine, EngineOptions};

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1).cloned())
    };
    let draws: u64 = arg("--draws").map_or(2000, |v| v.parse().expect("--draws N"));
    let synthetic: Option<f64> = arg("--synthetic").map(|v| v.parse().expect("--synthetic SIGMA"));
    let (rows, seen) = match synthetic {
        Some(sigma) => synthetic_rows(sigma),
        None => {
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
            let model = arg("--model").map(PathBuf::from).unwrap_or_else(|| {
                stageb_worker::engine::candle_engine::default_model_path(&root)
                    .expect("no model: scripts/fetch-model.sh")
            });
            model_rows(&model)
        }
    };
    bench(&rows, &seen, draws);
}

/// Five rows of `vocab` normal logits (Box-Muller over the seeded uniform stream), and the
/// first 2,000 ids as the prompt's tokens.
fn synthetic_rows(sigma: f64) -> (Vec<Vec<f32>>, SeenTokens) {
    let vocab = 151_936usize;
    let rows = (0..5u64)
        .map(|r| {
            (0..vocab as u64)
                .map(|i| {
                    let (u1, u2) = (
                        uniform_at(r * 1_000_000 + i, 11),
                        uniform_at(r * 1_000_000 + i, 12),
                    );
                    let z = (-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                    (sigma * z) as f32
                })
                .collect()
        })
        .collect();
    let mut seen = SeenTokens::new(vocab);
    for t in 0..2000 {
        seen.insert(t);
    }
    (rows, seen)
}

/// The demo model's logits after a rollout prompt and partial answers, and the prompt's tokens.
fn model_rows(model: &Path) -> (Vec<Vec<f32>>, SeenTokens) {
    let mut engine = CandleEngine::load(model, &EngineOptions::default()).expect("load");
    let prompt = engine
        .render_prompt(&[
            ChatMessage::system("你是通信机房质检助手。根据图片摘要判断这一组是否通过质检任务。输出两行：Verdict: 通过 或 Verdict: 不通过；Reason: 一句话。"),
            ChatMessage::user("任务: 挡风板安装检查\n[G0]. 检查挡风板是否安装\n图片摘要:\n1. 挡风板/显示完整, 卡扣4/4\n请给出结论。"),
        ])
        .unwrap();
    let mut rows = Vec::new();
    for answer in [
        "",
        "Verdict:",
        "Verdict: 通过\nReason:",
        "Verdict: 通过\nReason: 挡风板",
        "Verdict: 不通过\nReason: The panel is",
    ] {
        let ids = engine.encode(&format!("{prompt}{answer}")).unwrap();
        rows.push(engine.prompt_logits(&ids).unwrap());
    }
    let vocab = rows[0].len();
    let mut seen = SeenTokens::new(vocab);
    for t in engine.encode(&prompt).unwrap() {
        seen.insert(t);
    }
    (rows, seen)
}

fn bench(rows: &[Vec<f32>], seen: &SeenTokens, draws: u64) {
    let vocab = rows[0].len();
    println!("rows {} × vocab {vocab}", rows.len());
    for t in [0.3f32, 0.7, 1.0] {
        for (i, r) in rows.iter().enumerate() {
            let max = r.iter().copied().fold(f32::MIN, f32::max);
            let within = |d: f32| r.iter().filter(|&&l| (max - l) / t < d).count();
            println!(
                "T={t} row {i}: tokens within 10/20/30/40 (scaled) of the max: {}/{}/{}/{}",
                within(10.0),
                within(20.0),
                within(30.0),
                within(40.0)
            );
        }
    }
    // A constrained row inside the reason: most tokens allowed, not all.
    let mut mask = AllowedTokens::none(vocab);
    for id in (0..vocab as u32).filter(|i| i % 7 != 3) {
        mask.allow(id);
    }
    let mut s = Scratch::default();
    for (t, p, rp, masked) in [
        (0.3f32, 0.9f32, 1.05f32, false),
        (0.7, 0.9, 1.05, false),
        (0.7, 0.9, 1.05, true),
        (0.7, 1.0, 1.0, false),
        (1.0, 0.95, 1.0, false),
    ] {
        let allowed = masked.then_some(&mask);
        let params = SamplingParams {
            temperature: t,
            top_p: p,
            repetition_penalty: rp,
        };
        let seen = (rp != 1.0).then_some(seen);
        for r in rows {
            for k in 0..200 {
                let u = uniform_at(k, 3);
                let a = sampler::sample(r, &params, seen, allowed, u, &mut s);
                let b = sampler::sample_exhaustive(r, &params, seen, allowed, u, &mut s);
                assert_eq!(a, b, "T={t} p={p} u={u}");
            }
        }
        // The fastest of 3 rounds: the machine is shared, the minimum is the least disturbed.
        let time = |f: &mut dyn FnMut(&[f32], f64) -> Option<u32>| {
            let mut best = f64::INFINITY;
            let mut sink = 0u64;
            for _ in 0..3 {
                let start = Instant::now();
                for k in 0..draws {
                    let r = &rows[k as usize % rows.len()];
                    sink += u64::from(f(r, uniform_at(k, 1)).unwrap_or(0));
                }
                best = best.min(start.elapsed().as_nanos() as f64 / draws as f64);
            }
            (best, sink)
        };
        let mut fallbacks = 0u64;
        for k in 0..draws {
            let r = &rows[k as usize % rows.len()];
            let u = uniform_at(k, 1);
            fallbacks +=
                u64::from(prefilter::sample(r, &params, seen, allowed, u, &mut s).is_none());
        }
        let (full, x) =
            time(&mut |r, u| sampler::sample_exhaustive(r, &params, seen, allowed, u, &mut s));
        let (fast, y) = time(&mut |r, u| sampler::sample(r, &params, seen, allowed, u, &mut s));
        assert_eq!(x, y);
        println!(
            "BENCH T={t} top_p={p} rep={rp} masked={masked}: exhaustive {full:.0} ns/sample, prefiltered \
             {fast:.0} ns/sample ({:.1}x), exhaustive fallbacks {:.1}%",
            full / fast,
            100.0 * fallbacks as f64 / draws as f64
        );
    }
}
