//! Continuous batching on the real demo model (SmolLM2-135M-Instruct Q4_1): a job's output
//! does not depend on what else shares its steps. The same rollouts and generations run one
//! at a time, all together, in another arrival order, and joining a batch mid-decode give the
//! same candidates and texts, bit for bit; a cancelled job leaves the others untouched. A
//! proptest draws arrival schedules (order and join step of each job) at random and checks the
//! same property (`PROPTEST_CASES` sets how many; 6 by default, each a few seconds). The
//! candle backend (the path CUDA runs, here on the CPU with the model dequantized to f32) is
//! held to the same: its decode tile keeps every projection's shape fixed whatever shares a
//! step.

use crate::common;
use common::model_path;

use proptest::prelude::*;
use stageb_shared::domain::ChatMessage;
use stageb_worker::engine::BackendKind;
use stageb_worker::engine::step_split::StepSplit;
use stageb_worker::engine::{
    BatchShare, CancelFlag, DecodeRequest, Engine, EngineError, EngineOptions, EngineSwitches,
    GenerateRequest, Job, JobOutput, ModelEngine, Numerics, RolloutRequest, WeightFormat,
};

const SYSTEM: &str =
    "You check windshield installation. Answer in two lines: Verdict: 通过 or 不通过, then Reason.";

fn rollout(summary: &str, constrained: bool, seeds: Vec<u64>) -> Job {
    Job::Rollout(RolloutRequest {
        messages: vec![ChatMessage::system(SYSTEM), ChatMessage::user(summary)],
        decodes: vec![
            DecodeRequest {
                decode_index: 0,
                temperature: 0.7,
                top_p: 0.9,
                repetition_penalty: 1.05,
                max_new_tokens: 24,
                seeds,
            },
            DecodeRequest {
                decode_index: 1,
                temperature: 0.0,
                top_p: 1.0,
                repetition_penalty: 1.0,
                max_new_tokens: 20,
                seeds: vec![7],
            },
        ],
        constrained,
    })
}

fn generate(prompt: &str, schema: bool, seed: u64) -> Job {
    Job::Generate(GenerateRequest {
        messages: vec![ChatMessage::system(SYSTEM), ChatMessage::user(prompt)],
        json_schema: schema.then(|| {
            serde_json::json!({
                "type": "object",
                "properties": {"verdict": {"type": "string", "enum": ["pass", "fail"]}},
                "required": ["verdict"]
            })
        }),
        seed,
        temperature: 0.8,
        top_p: 0.95,
        repetition_penalty: 1.0,
        max_new_tokens: 28,
    })
}

fn jobs() -> Vec<Job> {
    vec![
        rollout(
            "挡风板: 已安装, 螺丝齐全. Photo 2 shows the panel in place.",
            true,
            vec![1, 2, 3],
        ),
        rollout("Ticket B: panel missing, 缺少挡风板.", false, vec![4, 5]),
        generate("Summarize: two photos, the panel is installed.", true, 99),
        rollout(
            &"图片1: 挡风板安装到位。".repeat(40),
            true,
            vec![8, 9, 10, 11],
        ),
        generate("Write one sentence about bolts.", false, 5),
    ]
}

/// An output without its timing, prefix-reuse and batching fields (runtime facts, not results).
fn result_of(out: JobOutput) -> JobOutput {
    match out {
        JobOutput::Rollout(mut r) => {
            (r.prefill_us, r.decode_us, r.prefix_tokens) = (0, 0, 0);
            r.batch = Default::default();
            JobOutput::Rollout(r)
        }
        JobOutput::Generate(mut g) => {
            (g.latency_us, g.prefix_tokens) = (0, 0);
            g.batch = Default::default();
            JobOutput::Generate(g)
        }
    }
}

fn batch_of(out: &JobOutput) -> BatchShare {
    match out {
        JobOutput::Rollout(r) => r.batch,
        JobOutput::Generate(g) => g.batch,
    }
}

fn alone(engine: &mut ModelEngine, job: &Job) -> JobOutput {
    result_of(match job {
        Job::Rollout(r) => JobOutput::Rollout(engine.rollout(r).expect("rollout")),
        Job::Generate(g) => JobOutput::Generate(engine.generate(g).expect("generate")),
    })
}

/// Runs `jobs` in one batch: job `i` joins after `joins[i]` steps. Outputs in job order.
/// Checks that at some step every job was in the batch at once when all join at step 0, and
/// that steps were shared when two or more do.
fn batched(engine: &mut ModelEngine, jobs: &[Job], joins: &[usize]) -> Vec<JobOutput> {
    let mut out: Vec<Option<JobOutput>> = vec![None; jobs.len()];
    let (mut step, mut most, mut shared_steps) = (0, 0, false);
    while out.iter().any(Option::is_none) {
        for (i, job) in jobs.iter().enumerate() {
            if joins[i] == step {
                engine
                    .admit(i as u64, job, CancelFlag::default())
                    .expect("admit");
            }
        }
        most = most.max(engine.jobs_in_batch());
        for (key, res) in engine.step() {
            let res = res.expect("job");
            let share = batch_of(&res);
            assert!(
                share.steps > 0 && share.rows >= u64::from(share.steps),
                "{share:?}"
            );
            shared_steps |= share.rows > u64::from(share.steps);
            out[key as usize] = Some(result_of(res));
        }
        step += 1;
        assert!(step < 10_000, "the batch never drained");
    }
    if joins.iter().all(|&j| j == 0) {
        assert_eq!(most, jobs.len(), "all jobs shared the batch");
    }
    if joins.iter().filter(|&&j| j == 0).count() > 1 {
        assert!(
            shared_steps,
            "the outputs report steps shared with other rows"
        );
    }
    out.into_iter().map(Option::unwrap).collect()
}

fn engine() -> ModelEngine {
    let e = ModelEngine::load(&model_path(), &EngineOptions::default()).expect("load model");
    assert!(e.batches(), "the CPU fast path batches jobs");
    e
}

#[test]
fn jobs_give_the_same_outputs_alone_together_reordered_and_joining_mid_decode() {
    let jobs = jobs();
    let mut eng = engine();
    let reference: Vec<JobOutput> = jobs.iter().map(|j| alone(&mut eng, j)).collect();
    // Every rollout ends with candidates, every generation with text: the test compares work.
    for r in &reference {
        match r {
            JobOutput::Rollout(r) => assert!(r.candidates.iter().all(|c| c.completion_tokens > 0)),
            JobOutput::Generate(g) => assert!(g.completion_tokens > 0),
        }
    }
    // A fresh engine: no prefix kept from the reference runs.
    let mut eng = engine();
    let together = batched(&mut eng, &jobs, &[0; 5]);
    assert_eq!(together, reference, "all jobs admitted at once");
    let staggered = batched(&mut eng, &jobs, &[0, 3, 1, 9, 5]);
    assert_eq!(staggered, reference, "jobs joining mid-decode");
    let mut reversed: Vec<Job> = jobs.clone();
    reversed.reverse();
    let mut got = batched(&mut eng, &reversed, &[0, 0, 2, 2, 4]);
    got.reverse();
    assert_eq!(got, reference, "arrival order reversed");
}

#[test]
fn jobs_joining_together_share_the_prompt_head_the_first_one_prefilled() {
    let jobs: Vec<Job> = short_jobs().into_iter().take(2).collect();
    let mut eng = engine();
    eng.set_prefix_cache_bytes(0);
    let reference: Vec<JobOutput> = jobs.iter().map(|j| alone(&mut eng, j)).collect();
    let mut eng = engine();
    for (i, job) in jobs.iter().enumerate() {
        eng.admit(i as u64, job, CancelFlag::default())
            .expect("admit");
    }
    let mut out: Vec<Option<JobOutput>> = vec![None; jobs.len()];
    while out.iter().any(Option::is_none) {
        for (key, res) in eng.step() {
            out[key as usize] = Some(res.expect("job"));
        }
    }
    let prefix = |o: &JobOutput| match o {
        JobOutput::Rollout(r) => r.prefix_tokens,
        JobOutput::Generate(g) => g.prefix_tokens,
    };
    let out: Vec<JobOutput> = out.into_iter().map(Option::unwrap).collect();
    assert_eq!(prefix(&out[0]), 0, "the first job found an empty store");
    assert!(
        prefix(&out[1]) > 10,
        "the second job, admitted with the first, starts after its system prompt: {}",
        prefix(&out[1])
    );
    let got: Vec<JobOutput> = out.into_iter().map(result_of).collect();
    assert_eq!(got, reference, "sharing changes no bit");
}

/// Paged KV: a job takes blocks from the pool as its cache fills and gives
/// every one back when it ends; with the prefix store on, the second of two jobs admitted
/// together reads the head the first one prefilled from the same blocks (the pool's peak is
/// lower), and the store keeps the prompts' blocks after the jobs end. The outputs are the
/// same bits either way.
#[test]
fn a_batch_takes_kv_blocks_as_it_fills_shares_a_stored_head_and_gives_every_block_back() {
    let jobs: Vec<Job> = short_jobs().into_iter().take(2).collect();
    let run = |store_bytes: usize| {
        let mut eng = engine();
        eng.set_prefix_cache_bytes(store_bytes);
        eng.set_kv_budget(64 << 20);
        let out = batched(&mut eng, &jobs, &[0, 0]);
        (out, eng.kv_blocks().expect("the CPU path keeps a pool"))
    };
    let (plain, off) = run(0);
    assert_eq!(off.used, 0, "every block is back in the pool: {off:?}");
    assert_eq!(off.capacity, (64 << 20) / off.block_bytes, "{off:?}");
    assert!(off.peak > 2, "{off:?}");
    let (shared, on) = run(256 << 20);
    assert_eq!(shared, plain, "sharing blocks changes no bit");
    assert!(on.used > 0, "the store keeps the prompts' blocks: {on:?}");
    assert!(
        on.peak < off.peak,
        "the second job reads the stored head's blocks: peak {} with the store, {} without",
        on.peak,
        off.peak
    );
}

/// A full pool makes a new job wait: with a KV budget too small for two
/// jobs' worst cases, the second job's prefill starts only once the first has ended (one job
/// always runs, whatever its size), so the jobs never share a step and the pool's peak is one
/// job's; nothing fails, nothing is evicted, and the outputs are the bits they are with room
/// for both.
#[test]
fn a_job_that_does_not_fit_the_kv_budget_waits_for_the_others_to_end() {
    let jobs: Vec<Job> = short_jobs().into_iter().take(2).collect();
    let run = |budget: u64| {
        let mut eng = engine();
        eng.set_prefix_cache_bytes(0);
        eng.set_kv_budget(budget);
        let mut out: Vec<Option<JobOutput>> = vec![None; jobs.len()];
        let mut overlapped = false;
        for (i, job) in jobs.iter().enumerate() {
            eng.admit(i as u64, job, CancelFlag::default())
                .expect("admit");
        }
        while out.iter().any(Option::is_none) {
            for (key, res) in eng.step() {
                out[key as usize] = Some(res.expect("job"));
            }
            overlapped |= eng.last_step_size().1 > 1;
        }
        let out: Vec<JobOutput> = out.into_iter().map(Option::unwrap).map(result_of).collect();
        (out, eng.kv_blocks().unwrap().peak, overlapped)
    };
    let (roomy, peak_roomy, overlapped) = run(64 << 20);
    assert!(overlapped, "with room, the jobs share steps");
    let block = engine().kv_blocks().unwrap().block_bytes as u64;
    let (tight, peak_tight, overlapped) = run(block);
    assert!(!overlapped, "the second job waited for the first to end");
    assert_eq!(tight, roomy, "waiting changes no bit");
    assert!(peak_tight < peak_roomy, "{peak_tight} vs {peak_roomy}");
}

/// The candle backend (the path CUDA runs) on the same model, dequantized to f32 or kept in
/// its GGUF blocks: jobs there share a step through one lockstep cache each.
fn candle_engine(format: WeightFormat) -> ModelEngine {
    let opts = EngineOptions {
        weight_format: format,
        numerics: Numerics::F32,
        ..EngineOptions::default()
    };
    let e = ModelEngine::load(&model_path(), &opts).expect("load model");
    assert!(
        e.backend().kind() == BackendKind::Candle,
        "an explicit weight format loads the candle backend"
    );
    assert!(e.batches(), "the candle backend batches jobs");
    e
}

#[test]
fn candle_backend_jobs_give_the_same_outputs_alone_and_joining_a_batch_in_any_order() {
    let jobs = short_jobs();
    let mut eng = candle_engine(WeightFormat::Dequantized);
    let reference: Vec<JobOutput> = jobs.iter().map(|j| alone(&mut eng, j)).collect();
    // Reversed arrival; two jobs start together, the others join mid-decode.
    let mut reversed = jobs.clone();
    reversed.reverse();
    let mut got = batched(&mut eng, &reversed, &[0, 0, 2, 5]);
    got.reverse();
    assert_eq!(got, reference, "reversed, joining mid-decode");
}

#[test]
fn a_cancelled_job_leaves_and_the_others_finish_unchanged() {
    let jobs = jobs();
    let mut eng = engine();
    let reference: Vec<JobOutput> = jobs.iter().map(|j| alone(&mut eng, j)).collect();
    let mut eng = engine();
    let flags: Vec<CancelFlag> = jobs.iter().map(|_| CancelFlag::default()).collect();
    for (i, (job, flag)) in jobs.iter().zip(&flags).enumerate() {
        eng.admit(i as u64, job, flag.clone()).expect("admit");
    }
    let mut results: Vec<Option<Result<JobOutput, EngineError>>> =
        (0..jobs.len()).map(|_| None).collect();
    let mut steps = 0;
    while results.iter().any(Option::is_none) {
        if steps == 4 {
            flags[1].cancel();
        }
        for (key, res) in eng.step() {
            results[key as usize] = Some(res.map(result_of));
        }
        steps += 1;
        assert!(steps < 10_000);
    }
    for (i, res) in results.into_iter().enumerate() {
        match res.unwrap() {
            Err(EngineError::Cancelled) => assert_eq!(i, 1, "only job 1 was cancelled"),
            Ok(out) => assert_eq!(out, reference[i], "job {i}"),
            Err(e) => panic!("job {i}: {e}"),
        }
    }
}

/// The liveness hook: a job's progress grows with the steps it takes, its tokens and ended
/// rows are its output's when it leaves, and a job not in the batch has none.
#[test]
fn a_job_in_the_batch_reports_its_tokens_and_ended_rows_as_it_goes() {
    let mut eng = engine();
    let job = rollout("progress: one clip missing", false, vec![3, 4]);
    assert_eq!(eng.job_progress(7), None, "not admitted");
    eng.admit(7, &job, CancelFlag::default()).expect("admit");
    let first = eng.job_progress(7).expect("in the batch");
    assert_eq!((first.tokens, first.rows, first.rows_finished), (0, 3, 0));
    let mut last = first;
    let out = loop {
        let ended = eng.step();
        if let Some((_, out)) = ended.into_iter().next() {
            break out.expect("job");
        }
        let now = eng.job_progress(7).expect("still in the batch");
        assert!(now.tokens >= last.tokens && now.prompt_done >= last.prompt_done);
        assert!(now.rows_finished >= last.rows_finished && now.rows_finished <= now.rows);
        last = now;
    };
    let JobOutput::Rollout(r) = out else {
        panic!("a rollout");
    };
    let tokens: u64 = r
        .candidates
        .iter()
        .map(|c| u64::from(c.completion_tokens))
        .sum();
    assert!(
        last.tokens > 0 && last.tokens <= tokens,
        "{last:?} of {tokens}"
    );
    assert_eq!(
        last.prompt_done, r.prompt_tokens,
        "its prompt was in its KV"
    );
    assert_eq!(eng.job_progress(7), None, "the job left");
}

#[test]
fn a_job_that_cannot_run_is_refused_at_admission() {
    let mut eng = engine();
    let Job::Rollout(mut r) = rollout("x", true, vec![1]) else {
        unreachable!()
    };
    r.decodes[0].max_new_tokens = 0;
    let err = eng
        .admit(0, &Job::Rollout(r), CancelFlag::default())
        .unwrap_err();
    assert_eq!(err.code(), "INVALID_REQUEST");
    assert!(eng.step().is_empty(), "nothing was admitted");
}

/// Short jobs for the schedule proptest: two rollouts (one constrained, at the 20 tokens a
/// constrained verdict needs), two generations.
fn short_jobs() -> Vec<Job> {
    let shorten = |mut job: Job| {
        match &mut job {
            Job::Rollout(r) => r.decodes.iter_mut().for_each(|d| d.max_new_tokens = 20),
            Job::Generate(g) => g.max_new_tokens = 12,
        }
        job
    };
    vec![
        shorten(rollout("挡风板: 已安装.", true, vec![1, 2])),
        shorten(rollout("Ticket B: panel missing.", false, vec![3])),
        shorten(generate("Summarize: the panel is installed.", true, 11)),
        shorten(generate("One sentence about bolts.", false, 12)),
    ]
}

/// A schedule: the order jobs are admitted in, and the step each joins at.
fn schedules() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    let n = short_jobs().len();
    (
        Just((0..n).collect::<Vec<_>>()).prop_shuffle(),
        proptest::collection::vec(0usize..12, n),
    )
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

#[test]
fn any_arrival_schedule_gives_each_job_its_output_alone() {
    let jobs = short_jobs();
    let mut eng = engine();
    let reference: Vec<JobOutput> = jobs.iter().map(|j| alone(&mut eng, j)).collect();
    let eng = std::cell::RefCell::new(engine());
    let config = ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |((order, joins) in schedules())| {
        let arrived: Vec<Job> = order.iter().map(|&i| jobs[i].clone()).collect();
        let got = batched(&mut eng.borrow_mut(), &arrived, &joins);
        for (slot, &i) in order.iter().enumerate() {
            prop_assert_eq!(&got[slot], &reference[i], "job {} joining at step {}", i, joins[slot]);
        }
    });
}

/// The device operations per decode step of `eng` (the candle backend) with `jobs` rollouts of
/// 8 candidates in its batch, over `steps` steps once every job decodes (stop tokens ignored,
/// so no row ends meanwhile); the batch is drained afterwards. Also the steps' split.
fn ops_per_step_at(eng: &mut ModelEngine, jobs: usize, steps: usize) -> (f64, StepSplit) {
    eng.set_ignore_eos(true);
    let decode = DecodeRequest {
        decode_index: 0,
        temperature: 0.7,
        top_p: 0.9,
        repetition_penalty: 1.0,
        max_new_tokens: (jobs + steps + 2) as u32,
        seeds: (0..8).collect(),
    };
    for k in 0..jobs {
        let prompt = eng
            .encode(&format!(
                "Ticket {k}: 挡风板 photo {k} shows {} clips.",
                k + 3
            ))
            .unwrap();
        eng.admit_ids(k as u64, &prompt, std::slice::from_ref(&decode), false)
            .expect("admit");
    }
    // One prompt (a single chunk) prefills per step: after `jobs` steps every job decodes.
    for _ in 0..jobs {
        assert!(eng.step_batch().is_empty(), "no job ends while prefilling");
    }
    let before = eng.step_split();
    for _ in 0..steps {
        assert!(eng.step_batch().is_empty(), "no job ends while measured");
    }
    let split = eng.step_split().since(&before);
    while eng.jobs_in_batch() > 0 {
        for (_, res) in eng.step_batch() {
            res.expect("job");
        }
    }
    assert_eq!(split.decode_steps, steps as u64);
    let per_step = split
        .host_ops_per_step()
        .expect("the candle backend counts");
    (per_step, split)
}

#[test]
fn the_candle_backend_counts_the_device_operations_of_a_decode_step_the_cpu_path_none() {
    let mut eng = candle_engine(WeightFormat::Dequantized);
    let (one, split) = ops_per_step_at(&mut eng, 1, 2);
    assert!(one > 0.0, "{split:?}");
    assert_eq!(split.prefill_steps, 0, "measured after the prefill");
    let (two, _) = ops_per_step_at(&mut eng, 2, 2);
    assert!(
        two >= one,
        "two jobs issue no fewer operations than one: {two} < {one}"
    );

    let mut cpu = engine();
    let before = cpu.step_split();
    alone(&mut cpu, &short_jobs()[1]);
    let split = cpu.step_split().since(&before);
    assert!(
        split.decode_steps > 0 && split.prefill_steps > 0,
        "{split:?}"
    );
    assert_eq!(
        split.host_ops, None,
        "the CPU fast path issues no device operations"
    );
}

/// The figure the step-count goal reads: device operations per decode step of the candle
/// backend (f32, on the CPU) at 1, 8 and 16 jobs of 8 candidates, with the switches of
/// `STAGEB_ENGINE_SWITCHES` (e.g. `paged=on,fused=on`), at the CPU's decode tile (8 rows, so
/// 8 GEMMs per projection at 64 rows) and at CUDA's (64). Slow (16 jobs are 128 rows a step):
/// run it by hand with `--ignored --nocapture`.
#[test]
#[ignore]
fn host_operations_per_decode_step_at_1_8_and_16_jobs() {
    for (tile, jobs) in [
        (None, 1),
        (None, 8),
        (None, 16),
        (Some(64), 1),
        (Some(64), 8),
    ] {
        let mut eng = candle_engine(WeightFormat::Dequantized);
        if let Some(rows) = tile {
            eng.set_decode_tile(rows);
        }
        let (per_step, split) = ops_per_step_at(&mut eng, jobs, 3);
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / split.decode_steps as f64;
        eprintln!(
            "candle f32 cpu [{}], tile {}, {jobs} job(s) x 8 rows: {per_step:.0} host ops/decode \
             step; per step sampling {:.1} ms, forward issued {:.1} ms, done {:.1} ms, readback \
             {:.1} ms",
            eng.switches(),
            tile.map_or("8 (cpu)".to_string(), |t| t.to_string()),
            ms(split.sampling),
            ms(split.forward_issued),
            ms(split.forward_done),
            ms(split.readback),
        );
    }
}

/// The candle backend with its logits read back once a step (the fed rows gathered on the
/// device, one copy to a buffer the engine keeps) or job by job (the path before it): the
/// same candidates and texts, alone and batched, in f32 and in bf16 (whose logits reach the
/// host in bf16 and are widened there). A job alone read back once a step is the one-job case
/// of the batched gather, which every other spec here runs (once a step is the default): CI
/// checks it against the per-job path in the long suite only.
#[test]
fn logits_read_once_a_step_or_per_job_give_the_same_outputs_in_f32_and_bf16() {
    let load = |numerics: Numerics, switches: &str| {
        let opts = EngineOptions {
            weight_format: WeightFormat::Dequantized,
            numerics,
            switches: Some(EngineSwitches::parse(switches).unwrap()),
            ..EngineOptions::default()
        };
        let e = ModelEngine::load(&model_path(), &opts).expect("load model");
        assert!(e.backend().kind() == BackendKind::Candle);
        assert_eq!(
            e.switches().to_string().contains("per-job"),
            switches.contains("per-job")
        );
        e
    };
    let all = short_jobs();
    // bf16 on the two generations: short prompts keep candle's slow CPU bf16 matmuls cheap;
    // the rollout's eight rows are gathered in the f32 case.
    for (numerics, jobs) in [(Numerics::F32, &all[..]), (Numerics::Bf16, &all[2..4])] {
        let mut per_job = load(numerics, "readback=per-job");
        let reference: Vec<JobOutput> = jobs.iter().map(|j| alone(&mut per_job, j)).collect();
        let mut once = load(numerics, "readback=once");
        if crate::common::full_depth() {
            let alone_once: Vec<JobOutput> = jobs.iter().map(|j| alone(&mut once, j)).collect();
            assert_eq!(alone_once, reference, "{numerics:?} alone");
        }
        let joins: Vec<usize> = (0..jobs.len()).map(|i| [0, 0, 2, 5][i]).collect();
        assert_eq!(
            batched(&mut once, jobs, &joins),
            reference,
            "{numerics:?} batched, once"
        );
        let per_job_batched = batched(&mut per_job, jobs, &joins);
        assert_eq!(per_job_batched, reference, "{numerics:?} batched, per job");
    }
}
