//! The rollout workload of `docs/PERFORMANCE.md`, timed through the real engine.
//!
//! One ticket = a ChatML prompt of about `--prompt-tokens` tokens (built with the engine's own
//! tokenizer), prefilled once, then 8 candidates × 48 new tokens decoded together at
//! temperature 0.7 / top-p 0.9 on `--threads` threads. Two variants:
//! - `fixed`: unconstrained, stop tokens ignored, so every candidate decodes exactly 48 tokens
//!   (what `llama-batched-bench` measures);
//! - `constrained`: the two-line verdict contract (rows stop when the contract is complete).
//!
//! Each variant runs once to warm up, then `--runs` times; prints every run and one JSON line
//! per variant (`BENCH {...}`) with medians, for `scripts/bench/bench-engine.sh`.
//!
//! ```text
//! cargo run --release -p stageb-worker --example bench_engine -- [--model M] [--threads 2]
//!     [--runs 3] [--prompt-tokens 600] [--candidates 8] [--new-tokens 48] [--variant fixed|constrained|both]
//!     [--numerics int8|f32] [--kernels auto|avx512vnni|avx512bw|avx2|scalar]
//!     [--prefix-cache-mib 0]   (off by default: the ticket's prefill is part of the workload)
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use stageb_shared::domain::ChatMessage;
use stageb_worker::engine::{
    DecodeRequest, Engine, EngineOptions, KernelChoice, ModelEngine, Numerics, RolloutRequest,
};

struct Args {
    model: Option<PathBuf>,
    threads: usize,
    runs: usize,
    prompt_tokens: usize,
    candidates: u64,
    new_tokens: u32,
    variant: String,
    numerics: Numerics,
    kernels: KernelChoice,
    prefix_cache_mib: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        model: None,
        threads: 2,
        runs: 3,
        prompt_tokens: 600,
        candidates: 8,
        new_tokens: 48,
        variant: "both".into(),
        numerics: Numerics::default(),
        kernels: KernelChoice::Auto,
        prefix_cache_mib: 0,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--model" => a.model = Some(PathBuf::from(v)),
            "--threads" => a.threads = v.parse().expect("--threads N"),
            "--runs" => a.runs = v.parse().expect("--runs N"),
            "--prompt-tokens" => a.prompt_tokens = v.parse().expect("--prompt-tokens N"),
            "--candidates" => a.candidates = v.parse().expect("--candidates N"),
            "--new-tokens" => a.new_tokens = v.parse().expect("--new-tokens N"),
            "--variant" => a.variant = v,
            "--prefix-cache-mib" => a.prefix_cache_mib = v.parse().expect("--prefix-cache-mib N"),
            "--numerics" => a.numerics = v.parse().expect("--numerics int8|f32"),
            "--kernels" => {
                a.kernels = v
                    .parse()
                    .expect("--kernels auto|avx512vnni|avx512bw|avx2|scalar")
            }
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    a
}

/// System rules plus ticket summaries (mixed Chinese/English) until the rendered prompt has
/// at least `target` tokens.
fn build_messages(engine: &ModelEngine, target: usize) -> (Vec<ChatMessage>, usize) {
    let system = "G0: 挡风板必须安装到位, 4个卡扣全部卡紧. G1: 螺丝齐全, 缝隙小于 3mm. \
                  S1: Answer in two lines: `Verdict: 通过` or `Verdict: 不通过`, then `Reason: ` and one line.";
    let mut user = String::new();
    let mut i = 0;
    loop {
        let messages = vec![ChatMessage::system(system), ChatMessage::user(user.clone())];
        let n = engine
            .encode(&engine.render_prompt(&messages).unwrap())
            .unwrap()
            .len();
        if n >= target {
            return (messages, n);
        }
        i += 1;
        user.push_str(&format!(
            "Ticket {i}: 挡风板安装检查, photo {i} shows the panel with {} clips; 螺丝齐全, gap {}mm at 2024-03-0{}.\n",
            3 + i % 2,
            i % 4,
            i % 10
        ));
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = parse_args();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let model = args
        .model
        .clone()
        .or_else(|| stageb_worker::engine::default_model_path(&root))
        .expect("no model: pass --model or run scripts/fetch-model.sh");
    stageb_worker::engine::cpu::isa::choose(args.kernels);
    let t = Instant::now();
    let mut engine = ModelEngine::load(
        &model,
        &EngineOptions {
            threads: Some(args.threads),
            numerics: args.numerics,
            // Off by default: every run of the ticket would otherwise find its own prompt in
            // the store and skip the prefill llama-batched-bench pays for.
            prefix_cache_bytes: args.prefix_cache_mib << 20,
            ..EngineOptions::default()
        },
    )
    .expect("load model");
    println!(
        "model {} loaded in {:.2}s; fingerprint dtype {}; kernels f32 {:?}, int8 {}; threads {}",
        model.display(),
        t.elapsed().as_secs_f64(),
        engine.fingerprint().dtype,
        stageb_worker::engine::cpu::kernels::F32Copy::in_use(),
        stageb_worker::engine::cpu::isa::int8_isa().name(),
        args.threads
    );
    let (messages, prompt_tokens) = build_messages(&engine, args.prompt_tokens);
    println!("prompt: {prompt_tokens} tokens");
    let variants: Vec<&str> = match args.variant.as_str() {
        "both" => vec!["fixed", "constrained"],
        v => vec![if v == "fixed" { "fixed" } else { "constrained" }],
    };
    for variant in variants {
        let constrained = variant == "constrained";
        engine.set_ignore_eos(!constrained);
        let req = RolloutRequest {
            messages: messages.clone(),
            decodes: vec![DecodeRequest {
                decode_index: 0,
                temperature: 0.7,
                top_p: 0.9,
                repetition_penalty: 1.0,
                max_new_tokens: args.new_tokens,
                seeds: (0..args.candidates).collect(),
            }],
            constrained,
        };
        engine.rollout(&req).expect("warm-up rollout");
        let (mut ticket, mut prefill, mut decode, mut pp, mut tg) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut generated = 0;
        for run in 0..args.runs {
            let t = Instant::now();
            let out = engine.rollout(&req).expect("rollout");
            let wall = t.elapsed().as_secs_f64();
            generated = out
                .candidates
                .iter()
                .map(|c| c.completion_tokens)
                .sum::<u32>();
            let (p, d) = (out.prefill_us as f64 / 1e6, out.decode_us as f64 / 1e6);
            println!(
                "{variant} run {run}: prefill {p:.3}s ({:.1} tok/s), decode {d:.3}s ({generated} tokens, {:.1} agg tok/s), ticket {wall:.3}s",
                prompt_tokens as f64 / p,
                generated as f64 / d
            );
            if run == 0 {
                println!("  e.g. {:?}", out.candidates[0].text);
            }
            ticket.push(wall);
            prefill.push(p);
            decode.push(d);
            pp.push(prompt_tokens as f64 / p);
            tg.push(generated as f64 / d);
        }
        let (tmin, tmax) = (
            ticket.iter().cloned().fold(f64::INFINITY, f64::min),
            ticket.iter().cloned().fold(0.0, f64::max),
        );
        println!(
            "BENCH {}",
            serde_json::json!({
                "variant": variant,
                "prompt_tokens": prompt_tokens,
                "candidates": args.candidates,
                "new_tokens": args.new_tokens,
                "generated_last_run": generated,
                "runs": args.runs,
                "ticket_s": median(&mut ticket),
                "ticket_min_s": tmin,
                "ticket_max_s": tmax,
                "prefill_s": median(&mut prefill),
                "decode_s": median(&mut decode),
                "prefill_tok_s": median(&mut pp),
                "decode_agg_tok_s": median(&mut tg),
            })
        );
    }
}
