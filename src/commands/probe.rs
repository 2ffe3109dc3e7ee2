//! `stageb probe` (hidden): the GPU check's measurements ([`stageb_worker::probe`]) on token
//! ids read from a file, each written as one JSON object: what was asked, the engine's
//! fingerprint and load time, and the probe's figures. `scripts/gpu/gpu_check/` compares them with
//! transformers (docs/GPU-TEST.md).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use stageb::{exit, roles};
use stageb_worker::engine::{Engine, ModelEngine};
use stageb_worker::probe::{self, RolloutSpec};

use crate::cli::{
    ModelArgs, Probe, ProbeArgs, ProbeIdsArgs, ProbeLogitsArgs, ProbeRolloutArgs, VERSION,
};

pub(crate) fn run(args: ProbeArgs) -> Result<u8> {
    match args.probe {
        Probe::Ids(a) => ids(a),
        Probe::Logits(a) => logits(a),
        Probe::Rollout(a) => rollout(a),
    }
}

fn ids(args: ProbeIdsArgs) -> Result<u8> {
    let tok = probe::load_tokenizer(&args.model)?;
    let prompts = probe::ticket_prompts(&tok, args.tickets, args.tokens, args.jitter)?;
    write_json(&args.out, &json!(prompts))?;
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let (min, max) = (lens.iter().min(), lens.iter().max());
    println!(
        "probe ids: {} prompt(s) of {}..{} tokens -> {}",
        prompts.len(),
        min.unwrap_or(&0),
        max.unwrap_or(&0),
        args.out.display()
    );
    Ok(exit::OK)
}

fn logits(args: ProbeLogitsArgs) -> Result<u8> {
    let prompts = read_ids(&args.ids)?;
    let Some(ids) = prompts.get(args.prompt) else {
        bail!(
            "{}: no prompt {} (it holds {})",
            args.ids.display(),
            args.prompt,
            prompts.len()
        );
    };
    let (mut engine, mut out) = load(&args.model, &args.model_args, "logits")?;
    let p = probe::logits(&mut engine, ids, args.steps)?;
    println!(
        "probe logits: {} prompt tokens, {} logits, greedy {:?} ({:.2} s prefill, {:.2} s greedy) -> {}",
        p.prompt_tokens,
        p.logits.len(),
        &p.greedy[..p.greedy.len().min(8)],
        p.prefill_s,
        p.greedy_s,
        args.out.display()
    );
    merge(&mut out, serde_json::to_value(p)?);
    write_json(&args.out, &out)?;
    Ok(exit::OK)
}

fn rollout(args: ProbeRolloutArgs) -> Result<u8> {
    let mut prompts = read_ids(&args.ids)?;
    if let Some(n) = args.tickets {
        prompts.truncate(n);
    }
    let budget = args.budget_s.map(Duration::from_secs_f64);
    let spec = RolloutSpec {
        candidates: args.candidates,
        new_tokens: args.new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        reps: args.reps,
        budget,
        warmup_tokens: args.warmup_tokens,
        jobs: args.jobs as usize,
        // The worker's `--kv-cache-mib` (in the model arguments): unset, the device's default.
        kv_cache_bytes: args
            .model_args
            .kv_cache_mib
            .map(|m| m.saturating_mul(1 << 20)),
    };
    let (mut engine, mut out) = load(&args.model, &args.model_args, "rollout")?;
    let p = probe::rollout(&mut engine, &prompts, &spec)?;
    let best = p.best.map(|i| &p.passes[i]);
    println!(
        "probe rollout: {} ticket(s) x {} x {} new tokens, {} in flight, {} pass(es){}: best {:.2} tickets/min, {:.1} rows/step, decode {:.1} tok/s, prefill {:.0} tok/s -> {}",
        p.tickets,
        p.candidates,
        p.new_tokens,
        p.jobs,
        p.passes.len(),
        if p.budget_exhausted {
            " (cut by the budget)"
        } else {
            ""
        },
        best.map_or(0.0, |b| b.tickets_per_min),
        best.map_or(0.0, |b| b.mean_rows_per_step),
        best.map_or(0.0, |b| b.decode_tok_s),
        best.map_or(0.0, |b| b.prefill_tok_s),
        args.out.display()
    );
    merge(&mut out, serde_json::to_value(p)?);
    write_json(&args.out, &out)?;
    Ok(exit::OK)
}

/// Loads the model as a worker would (no prefix store: every prompt is prefilled) and the
/// output's header.
fn load(model: &Path, args: &ModelArgs, probe: &str) -> Result<(ModelEngine, Value)> {
    let mut options = args.engine_options()?;
    options.prefix_cache_bytes = 0;
    let t = Instant::now();
    let engine = roles::load_model(model, &options)?;
    let load_s = t.elapsed().as_secs_f64();
    let header = json!({
        "probe": probe,
        "stageb": VERSION,
        "model": model,
        "device": args.device,
        "numerics": format!("{:?}", args.numerics).to_lowercase(),
        "fingerprint": engine.fingerprint(),
        "max_context": engine.max_context(),
        "load_s": load_s,
    });
    Ok((engine, header))
}

fn merge(into: &mut Value, from: Value) {
    if let (Value::Object(a), Value::Object(b)) = (into, from) {
        a.extend(b);
    }
}

/// Token ids from `path`: one array of ids, or an array of such arrays.
fn read_ids(path: &Path) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let prompts: Vec<Vec<u32>> = match &value {
        Value::Array(a) if a.iter().all(Value::is_number) => vec![serde_json::from_value(value)?],
        _ => serde_json::from_value(value)
            .with_context(|| format!("{}: expected token ids", path.display()))?,
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        bail!("{}: an empty prompt", path.display());
    }
    Ok(prompts)
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}
