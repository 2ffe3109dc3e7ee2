//! Sampling cost per row, before and after the radix path, on flat and peaked logits.
//!
//! Four routes to the same token are timed over the same rows and draws (the fastest of 3
//! rounds, in ns of this thread's CPU time per row: the machine is shared, and wall time
//! counts other processes' turns), after checking on every timed draw that they agree:
//! - `exhaustive`: the sampler of record (`sampler::sample_exhaustive`, doubling partial
//!   selection over the whole vocabulary);
//! - `before`: the previous `sampler::sample`, the max-logit prefilter with no limit on the
//!   tokens it weighs, falling back to the exhaustive sampler;
//! - `after`: today's `sampler::sample`, the prefilter while few tokens are near the maximum,
//!   else the radix path;
//! - `radix`: the radix path alone (`sampler::radix::sample`).
//!
//! Rows (5 per scenario):
//! - `qwen-flat`: 151,936 logits (Qwen3's vocabulary) within 1e-3 of each other, as a
//!   random-weight checkpoint gives at its flattest;
//! - `qwen-normal`: 151,936 normal logits of spread 1.2 (the GPU check's random-weight
//!   qwen3-8b: largest |logit| ~5);
//! - `qwen-peaked`: a trained model's spread: a normal(0, 2) bulk and 8 tokens 10-20 above it;
//! - `smol-flat`, `smol-peaked`: the same on 49,152 tokens (SmolLM2's vocabulary);
//! - `smollm2`: the demo model's own logits after a rollout prompt and partial answers to it
//!   (skipped when the model is absent).
//!
//! Settings: temperature 0.7, top-p 0.9 (the GPU check's); `--all` adds repetition penalty
//! 1.05 over 2,000 seen tokens, a mask allowing 6 tokens in 7, and top-p 1.
//!
//! ```text
//! cargo run -p stageb-worker --example bench_sampler -- [--draws 200] [--model M] [--all]
//!     [--only SCENARIO] [--routes exhaustive,before,after,radix]
//! ```

use std::path::{Path, PathBuf};

use stageb_shared::domain::ChatMessage;
use stageb_shared::seed::uniform_at;
use stageb_worker::constraint::AllowedTokens;
use stageb_worker::engine::sampler::{self, SamplingParams, Scratch, SeenTokens, prefilter, radix};
use stageb_worker::engine::{EngineOptions, ModelEngine};

const QWEN: usize = 151_936;
const SMOL: usize = 49_152;

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1).cloned())
    };
    let draws: u64 = arg("--draws").map_or(200, |v| v.parse().expect("--draws N"));
    let all = argv.iter().any(|a| a == "--all");
    let only = arg("--only");
    let routes = arg("--routes").unwrap_or_else(|| "exhaustive,before,after,radix".into());
    let mut scenarios: Vec<(&str, Box<MakeRows>)> = vec![
        ("qwen-flat", Box::new(|| Some(rows(QWEN, flat)))),
        (
            "qwen-normal",
            Box::new(|| Some(rows(QWEN, |i, r| 1.2 * normal(i, r)))),
        ),
        ("qwen-peaked", Box::new(|| Some(rows(QWEN, peaked)))),
        ("smol-flat", Box::new(|| Some(rows(SMOL, flat)))),
        ("smol-peaked", Box::new(|| Some(rows(SMOL, peaked)))),
    ];
    let model = arg("--model").map(PathBuf::from).or_else(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        stageb_worker::engine::default_model_path(&root)
    });
    scenarios.push((
        "smollm2",
        Box::new(move || model.as_deref().filter(|m| m.exists()).map(model_rows)),
    ));
    println!("ns per row, fastest of 3 rounds of {draws} draws; rows of one scenario cycle");
    for (name, make) in scenarios {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let Some(rows) = make() else {
            println!("{name}: skipped (no model: scripts/fetch-model.sh)");
            continue;
        };
        bench(name, &rows, draws, all, &routes);
    }
}

/// A standard normal number for token `i` of row `r` (Box-Muller over the seeded stream).
fn normal(i: u64, r: u64) -> f64 {
    let (u1, u2) = (
        uniform_at(r * 1_000_000 + i, 11),
        uniform_at(r * 1_000_000 + i, 12),
    );
    (-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Within 1e-3 of each other: every token near the maximum.
fn flat(i: u64, r: u64) -> f64 {
    0.25 + 1e-3 * uniform_at(r * 1_000_000 + i, 13)
}

/// A normal(0, 2) bulk and 8 tokens 10-20 above it.
fn peaked(i: u64, r: u64) -> f64 {
    let bulk = 2.0 * normal(i, r);
    if i % 9973 == 17 && i < 9973 * 8 {
        bulk + 10.0 + 10.0 * uniform_at(r * 1_000_000 + i, 14)
    } else {
        bulk
    }
}

fn rows(vocab: usize, f: impl Fn(u64, u64) -> f64) -> Vec<Vec<f32>> {
    (0..5u64)
        .map(|r| (0..vocab as u64).map(|i| f(i, r) as f32).collect())
        .collect()
}

/// The demo model's logits after a rollout prompt and partial answers.
fn model_rows(model: &Path) -> Vec<Vec<f32>> {
    let mut engine = ModelEngine::load(model, &EngineOptions::default()).expect("load");
    let prompt = engine
        .render_prompt(&[
            ChatMessage::system("你是通信机房质检助手。根据图片摘要判断这一组是否通过质检任务。输出两行：Verdict: 通过 或 Verdict: 不通过；Reason: 一句话。"),
            ChatMessage::user("任务: 挡风板安装检查\n[G0]. 检查挡风板是否安装\n图片摘要:\n1. 挡风板/显示完整, 卡扣4/4\n请给出结论。"),
        ])
        .unwrap();
    [
        "",
        "Verdict:",
        "Verdict: 通过\nReason:",
        "Verdict: 通过\nReason: 挡风板",
        "Verdict: 不通过\nReason: The panel is",
    ]
    .iter()
    .map(|answer| {
        let ids = engine.encode(&format!("{prompt}{answer}")).unwrap();
        engine.prompt_logits(&ids).unwrap()
    })
    .collect()
}

/// Builds a scenario's rows, or `None` when it cannot (no model).
type MakeRows = dyn Fn() -> Option<Vec<Vec<f32>>>;

type Route<'a> = dyn FnMut(&[f32], f64, &mut Scratch) -> Option<u32> + 'a;

/// This thread's CPU time, in ns.
fn cpu_ns() -> u128 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime");
    t.tv_sec as u128 * 1_000_000_000 + t.tv_nsec as u128
}

fn bench(name: &str, rows: &[Vec<f32>], draws: u64, all: bool, only_routes: &str) {
    let vocab = rows[0].len();
    let mut seen = SeenTokens::new(vocab);
    for t in 0..2000 {
        seen.insert(t);
    }
    let mut mask = AllowedTokens::none(vocab);
    for id in (0..vocab as u32).filter(|i| i % 7 != 3) {
        mask.allow(id);
    }
    let mut settings = vec![(0.7f32, 0.9f32, 1.0f32, false)];
    if all {
        settings.extend([
            (0.7, 0.9, 1.05, false),
            (0.7, 0.9, 1.05, true),
            (1.0, 1.0, 1.0, false),
        ]);
    }
    for (t, p, rp, masked) in settings {
        let params = SamplingParams {
            temperature: t,
            top_p: p,
            repetition_penalty: rp,
        };
        let seen = (rp != 1.0).then_some(&seen);
        let allowed = masked.then_some(&mask);
        let mut routes: Vec<(&str, Box<Route>)> = vec![
            (
                "exhaustive",
                Box::new(|r, u, s| sampler::sample_exhaustive(r, &params, seen, allowed, u, s)),
            ),
            (
                "before",
                Box::new(|r, u, s| {
                    prefilter::sample(r, &params, seen, allowed, u, s)
                        .or_else(|| sampler::sample_exhaustive(r, &params, seen, allowed, u, s))
                }),
            ),
            (
                "after",
                Box::new(|r, u, s| sampler::sample(r, &params, seen, allowed, u, s)),
            ),
            (
                "radix",
                Box::new(|r, u, s| radix::sample(r, &params, seen, allowed, u, s)),
            ),
        ];
        let mut s = Scratch::default();
        let row = |k: u64| &rows[k as usize % rows.len()];
        // Every route draws the same token on every timed draw.
        let want: Vec<Option<u32>> = (0..draws)
            .map(|k| {
                sampler::sample_exhaustive(row(k), &params, seen, allowed, uniform_at(k, 1), &mut s)
            })
            .collect();
        let mut line = format!("{name} vocab={vocab} T={t} top_p={p} rep={rp} masked={masked}:");
        for (route, f) in routes.iter_mut() {
            if !only_routes.split(',').any(|r| r == *route) {
                continue;
            }
            for k in 0..draws {
                assert_eq!(
                    f(row(k), uniform_at(k, 1), &mut s),
                    want[k as usize],
                    "{route} draw {k}"
                );
            }
            // The fastest of 3 rounds: the machine is shared, the minimum is the least disturbed.
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let start = cpu_ns();
                for k in 0..draws {
                    std::hint::black_box(f(row(k), uniform_at(k, 1), &mut s));
                }
                best = best.min((cpu_ns() - start) as f64 / draws as f64);
            }
            line += &format!(" {route} {best:.0}");
        }
        let decided = (0..draws)
            .filter(|&k| {
                prefilter::sample(row(k), &params, seen, allowed, uniform_at(k, 1), &mut s)
                    .is_some()
            })
            .count();
        println!(
            "BENCH {line} ns/row; prefilter decides {:.0}%",
            100.0 * decided as f64 / draws as f64
        );
    }
}
