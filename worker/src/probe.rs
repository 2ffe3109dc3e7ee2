//! Diagnostics behind the hidden `stageb probe` command: the measurements a GPU check compares
//! with another engine (transformers, `scripts/gpu/gpu_check/`), run through the real
//! [`ModelEngine`] on token ids, so both sides see exactly the same input.
//!
//! - [`ticket_prompts`]: prompts of exact token lengths, cut from built-in ticket-like text
//!   (mixed Chinese and English, different for every ticket), tokenized with the model's own
//!   tokenizer ([`load_tokenizer`], no weights loaded).
//! - [`logits`]: the next-token logits after one prompt (the rollout prefill) and its greedy
//!   continuation through the engine's decode path (temperature 0: the highest logit, ties to
//!   the lowest id, as `torch.argmax`; stop tokens do not stop it).
//! - [`rollout`]: the rollout workload, ticket after ticket as a worker runs them: every ticket
//!   prefilled once, its candidates decoded together to a fixed length (stop tokens ignored,
//!   unconstrained), timed per ticket, repeated, with an optional time budget; each pass with
//!   its decode steps split into sampling, forward issued, forward done, readback and prefill
//!   ([`StepSplitMs`]) and the device operations a decode step issued, and the engine's
//!   switches in force.
//!
//! Nothing here is used by a run.

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file;
use serde::Serialize;
use tokenizers::Tokenizer;

use crate::engine::gguf::model_err;
use crate::engine::step_split::StepSplit;
use crate::engine::{DecodeRequest, Engine, EngineError, ModelEngine, tokenizer};

/// The tokenizer of a model (a GGUF file or a safetensors directory), without its weights.
pub fn load_tokenizer(model: &Path) -> Result<Tokenizer, EngineError> {
    if model.is_dir() {
        return tokenizer::from_file(&model.join("tokenizer.json"));
    }
    let mut file = std::fs::File::open(model).map_err(|e| model_err(model, e))?;
    let ct = gguf_file::Content::read(&mut file)
        .map_err(|e| model_err(model, format!("not a readable GGUF file: {e}")))?;
    tokenizer::from_gguf(&ct, model)
}

/// Line `n` of the built-in ticket text (deterministic, varied by `n`).
fn ticket_line(n: usize) -> String {
    format!(
        "Ticket {n}: 挡风板安装检查, photo {} shows the panel with {} clips; 螺丝齐全, gap {}.{} mm at 2024-03-{:02}. Summary: 卡扣{}, label {}.\n",
        n % 7 + 1,
        3 + n % 2,
        n % 4,
        n % 10,
        n % 28 + 1,
        if n.is_multiple_of(3) {
            "未卡紧"
        } else {
            "全部卡紧"
        },
        if n.is_multiple_of(5) { "fail" } else { "pass" },
    )
}

/// `tickets` prompts of token ids; prompt `i` holds exactly `tokens - (i * 37) % (jitter + 1)`
/// ids (so `jitter` 0 makes them all `tokens` long), encoded line by line from the built-in
/// text starting at line `1000 * i` (no two prompts share a prefix), without special tokens.
pub fn ticket_prompts(
    tok: &Tokenizer,
    tickets: usize,
    tokens: usize,
    jitter: usize,
) -> Result<Vec<Vec<u32>>, EngineError> {
    if tokens == 0 || jitter >= tokens {
        return Err(EngineError::InvalidRequest(format!(
            "prompt length {tokens} with jitter {jitter}: need 0 <= jitter < length"
        )));
    }
    let mut prompts = Vec::with_capacity(tickets);
    for i in 0..tickets {
        let want = tokens - (i * 37) % (jitter + 1);
        let mut ids: Vec<u32> = Vec::with_capacity(want + 64);
        let mut line = 1000 * i;
        while ids.len() < want {
            let enc = tok
                .encode(ticket_line(line), false)
                .map_err(|e| EngineError::InvalidRequest(format!("tokenize: {e}")))?;
            if enc.get_ids().is_empty() {
                return Err(EngineError::Model(
                    "the tokenizer encodes text to nothing".into(),
                ));
            }
            ids.extend_from_slice(enc.get_ids());
            line += 1;
        }
        ids.truncate(want);
        prompts.push(ids);
    }
    Ok(prompts)
}

/// What [`logits`] measured.
#[derive(Debug, Clone, Serialize)]
pub struct LogitsProbe {
    pub prompt_tokens: usize,
    /// Next-token logits after the prompt (f32, the whole vocabulary).
    pub logits: Vec<f32>,
    /// The greedy continuation (its first token is the argmax of `logits`).
    pub greedy: Vec<u32>,
    /// Seconds of the prefill that gave `logits` (the first call also compiles kernels).
    pub prefill_s: f64,
    /// Seconds of the greedy rollout (prefill again, then `greedy.len()` decode steps).
    pub greedy_s: f64,
}

/// Next-token logits after `ids` and `steps` greedy tokens (0: none).
pub fn logits(
    engine: &mut ModelEngine,
    ids: &[u32],
    steps: u32,
) -> Result<LogitsProbe, EngineError> {
    let t = Instant::now();
    let logits = engine.prompt_logits(ids)?;
    let prefill_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let greedy = if steps == 0 {
        Vec::new()
    } else {
        engine.set_ignore_eos(true);
        let decode = DecodeRequest {
            decode_index: 0,
            temperature: 0.0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            max_new_tokens: steps,
            seeds: vec![0],
        };
        let (_, mut tokens) = engine.rollout_ids(ids, &[decode], false)?;
        tokens.pop().unwrap_or_default()
    };
    Ok(LogitsProbe {
        prompt_tokens: ids.len(),
        logits,
        greedy,
        prefill_s,
        greedy_s: t.elapsed().as_secs_f64(),
    })
}

/// How [`rollout`] samples and how long it may take.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutSpec {
    /// Candidates per ticket (rows decoded together).
    pub candidates: u32,
    /// New tokens per candidate, exactly (stop tokens are ignored).
    pub new_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    /// Timed passes over all tickets (after one untimed warm-up ticket).
    pub reps: u32,
    /// No ticket starts after this much time in the timed passes; the pass it cuts is marked
    /// incomplete and its figures cover the tickets it finished.
    pub budget: Option<Duration>,
    /// New tokens of the warm-up ticket (CUDA compiles its kernels on their first use).
    pub warmup_tokens: u32,
    /// Tickets in flight at once: 1 runs them one after another (`Engine::rollout`); more
    /// runs them in one continuous batch (`admit`/`step`), as a worker with `--max-jobs`.
    pub jobs: usize,
    /// The KV-cache budget the tickets in flight share (`--kv-cache-mib`); `None` is the
    /// device's default, as a worker given none ([`Engine::use_kv_budget`]). (Until
    /// 2026-11-29 the probe left the engine at the CPU's 2 GiB, so on a GPU only about three
    /// 2,000-token tickets of 8 x 256 tokens fitted in flight whatever `jobs` said.)
    pub kv_cache_bytes: Option<u64>,
}

/// One ticket of a pass.
#[derive(Debug, Clone, Serialize)]
pub struct TicketTiming {
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Of `decode_s`: sampling the rows' tokens, and the forward calls.
    pub sample_s: f64,
    pub forward_s: f64,
    pub wall_s: f64,
}

/// One pass over the tickets.
#[derive(Debug, Clone, Serialize)]
pub struct PassReport {
    pub tickets_done: usize,
    /// Every ticket ran (the budget did not cut this pass).
    pub complete: bool,
    pub wall_s: f64,
    pub tickets_per_min: f64,
    /// Prompt tokens per second of prefill time.
    pub prefill_tok_s: f64,
    /// Generated tokens per second of decode time (all rows of a ticket together).
    pub decode_tok_s: f64,
    /// Generated tokens per second of wall time.
    pub generated_tok_s: f64,
    /// Decode time per lockstep step: a ticket of `n` new tokens runs `n - 1` forward passes
    /// after its prefill (the first token comes from the prefill's logits).
    pub decode_step_ms: f64,
    /// Of a step: sampling every row's token (on the host), and the forward call.
    pub sample_step_ms: f64,
    pub forward_step_ms: f64,
    /// Rows per forward step, as the tickets' outputs report their steps (the candidates
    /// with one ticket in flight).
    pub mean_rows_per_step: f64,
    /// The pass's decode steps split by phase, as the engine timed them.
    pub step_split_ms: StepSplitMs,
    /// Device operations issued per decode step (forward and readback; the candle backend),
    /// `None` where the backend issues none (the CPU fast path).
    pub host_ops_per_step: Option<f64>,
    pub tickets: Vec<TicketTiming>,
}

/// Mean milliseconds of a decode step in each phase ([`StepSplit`]): sampling the rows' tokens
/// on the host, issuing the forward call, waiting for the device to finish it (CUDA; nothing
/// on the CPU), reading the logits back into the rows' reach, and (per step that ran one) a
/// prefill chunk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepSplitMs {
    pub sampling: f64,
    pub forward_issued: f64,
    pub forward_done: f64,
    pub readback: f64,
    pub prefill: f64,
}

impl StepSplitMs {
    /// The means of `split` (a pass's difference of the engine's totals).
    pub fn of(split: &StepSplit) -> StepSplitMs {
        let per = |d: Duration, n: u64| match n {
            0 => 0.0,
            n => d.as_secs_f64() * 1e3 / n as f64,
        };
        let steps = split.decode_steps;
        StepSplitMs {
            sampling: per(split.sampling, steps),
            forward_issued: per(split.forward_issued, steps),
            forward_done: per(split.forward_done, steps),
            readback: per(split.readback, steps),
            prefill: per(split.prefill, split.prefill_steps),
        }
    }
}

/// What [`rollout`] measured.
#[derive(Debug, Clone, Serialize)]
pub struct RolloutProbe {
    pub tickets: usize,
    /// Tickets in flight at once ([`RolloutSpec::jobs`]).
    pub jobs: usize,
    pub candidates: u32,
    pub new_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub warmup_s: f64,
    pub passes: Vec<PassReport>,
    /// Index in `passes` of the best pass (most tickets per minute, complete passes first).
    pub best: Option<usize>,
    /// The KV-cache budget the tickets in flight shared ([`RolloutSpec::kv_cache_bytes`]).
    pub kv_budget_bytes: u64,
    /// KV-cache bytes a ticket held at its peak, as the engine counts them (keys and values
    /// of every layer in the cache's dtype: the prompt once, then each row's own).
    pub kv_cache_bytes: u64,
    /// Bytes of the most KV blocks held at once (every job in flight and the prefix store;
    /// the CPU path's pool, 0 on the candle backend).
    pub kv_peak_bytes: u64,
    /// The time budget stopped a pass early.
    pub budget_exhausted: bool,
    /// The first candidate's text of the last ticket run (at most 200 characters).
    pub sample_text: String,
    /// The engine's switches in force, canonical (`STAGEB_ENGINE_SWITCHES`).
    pub switches: String,
}

/// Runs the rollout workload over `prompts` ([`RolloutSpec`]): one untimed warm-up ticket,
/// then `reps` timed passes over every prompt, one ticket at a time.
pub fn rollout(
    engine: &mut ModelEngine,
    prompts: &[Vec<u32>],
    spec: &RolloutSpec,
) -> Result<RolloutProbe, EngineError> {
    let Some(first) = prompts.first() else {
        return Err(EngineError::InvalidRequest("no prompt to run".into()));
    };
    if spec.candidates == 0 || spec.new_tokens == 0 {
        return Err(EngineError::InvalidRequest(
            "candidates and new tokens must be at least 1".into(),
        ));
    }
    engine.set_ignore_eos(true);
    let kv_budget = Engine::use_kv_budget(engine, spec.kv_cache_bytes);
    // Candidate `c` of ticket `i` draws with seed `1000 * i + c`; the warm-up with its own.
    let decode = |seed_base: u64, max_new: u32| DecodeRequest {
        decode_index: 0,
        temperature: spec.temperature,
        top_p: spec.top_p,
        repetition_penalty: 1.0,
        max_new_tokens: max_new,
        seeds: (0..u64::from(spec.candidates))
            .map(|c| seed_base + c)
            .collect(),
    };
    let t = Instant::now();
    let warmup = spec.warmup_tokens.clamp(1, spec.new_tokens);
    engine.rollout_ids(first, &[decode(u64::MAX / 2, warmup)], false)?;
    let warmup_s = t.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut passes = Vec::new();
    let mut budget_exhausted = false;
    let mut sample_text = String::new();
    for _ in 0..spec.reps {
        let pass_start = Instant::now();
        let out_of_time = || spec.budget.is_some_and(|b| started.elapsed() >= b);
        let split_before = engine.step_split();
        let (tickets, cut, steps) = match spec.jobs {
            0 | 1 => run_sequential(engine, prompts, &decode, spec.new_tokens, &out_of_time)?,
            k => run_batched(engine, prompts, &decode, (spec.new_tokens, k), &out_of_time)?,
        };
        budget_exhausted |= cut;
        if let Some((_, text)) = tickets.last() {
            sample_text = text.clone();
        }
        if tickets.is_empty() {
            break;
        }
        let complete = tickets.len() == prompts.len();
        let wall_s = pass_start.elapsed().as_secs_f64();
        let mut pass = batched_pass_report(tickets, (complete, wall_s, steps), spec);
        let split = engine.step_split().since(&split_before);
        pass.step_split_ms = StepSplitMs::of(&split);
        pass.host_ops_per_step = split.host_ops_per_step();
        passes.push(pass);
        if !complete {
            break;
        }
    }
    let best = best_pass(&passes);
    Ok(RolloutProbe {
        tickets: prompts.len(),
        candidates: spec.candidates,
        new_tokens: spec.new_tokens,
        temperature: spec.temperature,
        top_p: spec.top_p,
        warmup_s,
        passes,
        best,
        jobs: spec.jobs.max(1),
        kv_budget_bytes: kv_budget,
        kv_cache_bytes: Engine::last_kv_cache_bytes(engine),
        kv_peak_bytes: Engine::kv_blocks(engine).map_or(0, |p| (p.peak * p.block_bytes) as u64),
        budget_exhausted,
        sample_text,
        switches: engine.switches().to_string(),
    })
}

/// A ticket's timing with the forward steps it took part in and the rows they computed (0, 0
/// when it ran alone), and its first candidate's text.
type Ran = ((TicketTiming, u64, u64), String);

/// One pass, ticket after ticket; stops early when `out_of_time` (then `true`). No batch
/// steps are counted (0).
fn run_sequential(
    engine: &mut ModelEngine,
    prompts: &[Vec<u32>],
    decode: &dyn Fn(u64, u32) -> DecodeRequest,
    new_tokens: u32,
    out_of_time: &dyn Fn() -> bool,
) -> Result<(Vec<Ran>, bool, u64), EngineError> {
    let mut ran = Vec::new();
    for (i, ids) in prompts.iter().enumerate() {
        if out_of_time() {
            return Ok((ran, true, 0));
        }
        let t = Instant::now();
        let (out, _) = engine.rollout_ids(ids, &[decode(i as u64 * 1000, new_tokens)], false)?;
        let wall_s = t.elapsed().as_secs_f64();
        let (sample_us, forward_us) = engine.decode_split_last_job();
        let mut timing = timing_of(&out, wall_s);
        (timing.sample_s, timing.forward_s) = (sample_us as f64 / 1e6, forward_us as f64 / 1e6);
        ran.push(((timing, 0, 0), first_text(&out)));
    }
    Ok((ran, false, 0))
}

/// One pass with up to `jobs` tickets in one continuous batch; a ticket joins as another
/// ends. Per-ticket prefill and decode times overlap (only the wall time is the pass's); also
/// returns the batch's steps.
fn run_batched(
    engine: &mut ModelEngine,
    prompts: &[Vec<u32>],
    decode: &dyn Fn(u64, u32) -> DecodeRequest,
    (new_tokens, jobs): (u32, usize),
    out_of_time: &dyn Fn() -> bool,
) -> Result<(Vec<Ran>, bool, u64), EngineError> {
    let (mut ran, mut next, mut cut, mut steps) = (Vec::new(), 0, false, 0);
    let mut started: Vec<Option<Instant>> = vec![None; prompts.len()];
    loop {
        while next < prompts.len() && engine.jobs_in_batch() < jobs && !cut {
            cut = out_of_time();
            if !cut {
                let d = decode(next as u64 * 1000, new_tokens);
                engine.admit_ids(next as u64, &prompts[next], &[d], false)?;
                started[next] = Some(Instant::now());
                next += 1;
            }
        }
        if engine.jobs_in_batch() == 0 {
            return Ok((ran, cut, steps));
        }
        steps += 1;
        for (key, res) in engine.step_batch() {
            let crate::engine::JobOutput::Rollout(out) = res? else {
                return Err(EngineError::Model(
                    "a probe job ended as a generation".into(),
                ));
            };
            let wall_s = started[key as usize].map_or(0.0, |t| t.elapsed().as_secs_f64());
            let b = out.batch;
            ran.push((
                (timing_of(&out, wall_s), u64::from(b.steps), b.rows),
                first_text(&out),
            ));
        }
    }
}

fn timing_of(out: &crate::engine::RolloutOutput, wall_s: f64) -> TicketTiming {
    TicketTiming {
        prompt_tokens: out.prompt_tokens,
        generated_tokens: out.candidates.iter().map(|c| c.completion_tokens).sum(),
        prefill_s: out.prefill_us as f64 / 1e6,
        decode_s: out.decode_us as f64 / 1e6,
        sample_s: 0.0,
        forward_s: 0.0,
        wall_s,
    }
}

fn first_text(out: &crate::engine::RolloutOutput) -> String {
    out.candidates
        .first()
        .map(|c| c.text.chars().take(200).collect())
        .unwrap_or_default()
}

/// [`pass_report`] with the rows per step the tickets' outputs report (the candidates when
/// they ran alone). With `batch_steps` (tickets in one batch) a step's time and the decode
/// rate are the wall time's, since the tickets' own times overlap.
fn batched_pass_report(
    ran: Vec<Ran>,
    (complete, wall_s, batch_steps): (bool, f64, u64),
    spec: &RolloutSpec,
) -> PassReport {
    let (steps, rows) = ran
        .iter()
        .fold((0, 0), |(s, r), ((_, ts, tr), _)| (s + ts, r + tr));
    let tickets = ran.into_iter().map(|((t, ..), _)| t).collect();
    let mut pass = pass_report(tickets, complete, wall_s, spec.new_tokens);
    pass.mean_rows_per_step = match steps {
        0 => f64::from(spec.candidates),
        _ => rows as f64 / steps as f64,
    };
    if batch_steps > 0 {
        pass.decode_step_ms = wall_s * 1e3 / batch_steps as f64;
        pass.decode_tok_s = pass.generated_tok_s;
    }
    pass
}

fn pass_report(
    tickets: Vec<TicketTiming>,
    complete: bool,
    wall_s: f64,
    new_tokens: u32,
) -> PassReport {
    let sum = |f: fn(&TicketTiming) -> f64| tickets.iter().map(f).sum::<f64>();
    let prompt = sum(|t| f64::from(t.prompt_tokens));
    let generated = sum(|t| f64::from(t.generated_tokens));
    let (prefill, decode) = (sum(|t| t.prefill_s), sum(|t| t.decode_s));
    let per = |n: f64, d: f64| if d > 0.0 { n / d } else { 0.0 };
    let steps = tickets.len() as f64 * f64::from(new_tokens.saturating_sub(1).max(1));
    PassReport {
        tickets_done: tickets.len(),
        complete,
        wall_s,
        tickets_per_min: per(tickets.len() as f64 * 60.0, wall_s),
        prefill_tok_s: per(prompt, prefill),
        decode_tok_s: per(generated, decode),
        generated_tok_s: per(generated, wall_s),
        decode_step_ms: per(decode * 1e3, steps),
        sample_step_ms: per(sum(|t| t.sample_s) * 1e3, steps),
        forward_step_ms: per(sum(|t| t.forward_s) * 1e3, steps),
        mean_rows_per_step: 0.0,
        step_split_ms: StepSplitMs::default(),
        host_ops_per_step: None,
        tickets,
    }
}

/// The pass with the most tickets per minute, complete passes first.
fn best_pass(passes: &[PassReport]) -> Option<usize> {
    let pick = |complete: bool| {
        passes
            .iter()
            .enumerate()
            .filter(|(_, p)| p.complete == complete)
            .max_by(|a, b| a.1.tickets_per_min.total_cmp(&b.1.tickets_per_min))
            .map(|(i, _)| i)
    };
    pick(true).or_else(|| pick(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(done: usize, complete: bool, rate: f64) -> PassReport {
        PassReport {
            tickets_done: done,
            complete,
            wall_s: 1.0,
            tickets_per_min: rate,
            prefill_tok_s: 0.0,
            decode_tok_s: 0.0,
            generated_tok_s: 0.0,
            decode_step_ms: 0.0,
            sample_step_ms: 0.0,
            forward_step_ms: 0.0,
            mean_rows_per_step: 0.0,
            step_split_ms: StepSplitMs::default(),
            host_ops_per_step: None,
            tickets: Vec::new(),
        }
    }

    #[test]
    fn best_pass_prefers_complete_passes() {
        let passes = [
            pass(4, true, 10.0),
            pass(4, true, 12.0),
            pass(1, false, 30.0),
        ];
        assert_eq!(best_pass(&passes), Some(1));
        assert_eq!(best_pass(&passes[2..]), Some(0));
        assert_eq!(best_pass(&[]), None);
    }

    #[test]
    fn pass_report_rates() {
        let t = TicketTiming {
            prompt_tokens: 100,
            generated_tokens: 40,
            prefill_s: 0.5,
            decode_s: 1.5,
            sample_s: 0.5,
            forward_s: 1.0,
            wall_s: 2.0,
        };
        let p = pass_report(vec![t.clone(), t], true, 4.0, 5);
        assert_eq!(p.tickets_per_min, 30.0);
        assert_eq!(p.prefill_tok_s, 200.0);
        assert!((p.decode_tok_s - 80.0 / 3.0).abs() < 1e-9);
        assert_eq!(p.generated_tok_s, 20.0);
        // 2 tickets x 4 forward passes in 3 s of decode.
        assert_eq!(p.decode_step_ms, 375.0);
        assert_eq!((p.sample_step_ms, p.forward_step_ms), (125.0, 250.0));
    }

    #[test]
    fn the_step_split_is_a_mean_per_decode_step_and_prefill_per_chunk() {
        let split = StepSplit {
            decode_steps: 4,
            prefill_steps: 2,
            sampling: Duration::from_millis(8),
            forward_issued: Duration::from_millis(20),
            forward_done: Duration::from_millis(4),
            readback: Duration::from_millis(2),
            prefill: Duration::from_millis(30),
            host_ops: Some(4000),
            ..StepSplit::default()
        };
        let ms = StepSplitMs::of(&split);
        assert_eq!(
            (ms.sampling, ms.forward_issued, ms.forward_done, ms.readback),
            (2.0, 5.0, 1.0, 0.5)
        );
        assert_eq!(ms.prefill, 15.0);
        assert_eq!(split.host_ops_per_step(), Some(1000.0));
        assert_eq!(
            StepSplitMs::of(&StepSplit::default()),
            StepSplitMs::default()
        );
    }
}
