//! Prompt-prefix KV reuse on the real demo model (SmolLM2-135M-Instruct Q4_1, CPU fast path):
//! a prefill that starts from a stored prefix gives the same bits as one from position 0.
//!
//! Three tickets share a long system prompt (longer than one prefill chunk, so the reused
//! prefix ends past a chunk boundary) and differ in their user message: a short one (fewer
//! than 16 tokens left to prefill, the matmul's small-batch path), and a long one (more than
//! 512 tokens left, crossing the next chunk boundary). One engine serves every case, with the
//! store off for the references and on for the rest. Generations (reflection calls) do the
//! same from a store of their own.

use crate::common;
use common::model_path;

use stageb_shared::domain::ChatMessage;
use stageb_worker::engine::{
    DEFAULT_PREFIX_CACHE_BYTES, DecodeRequest, Engine, EngineOptions, GenerateRequest, ModelEngine,
    RolloutRequest,
};

/// A system prompt of ~540 tokens: mission, rules and format, as rank 0 sends them.
fn system() -> String {
    let mut s = String::from("你是通信机房质检助手。根据图片摘要判断这一组是否通过质检任务。\n");
    for i in 0..15 {
        s.push_str(&format!(
            "[G{i}]. Rule {i}: the windshield panel must be installed, clips 4/4, gap under {i} mm.\n"
        ));
    }
    s.push_str("输出两行：Verdict: 通过 或 Verdict: 不通过；Reason: 一句话。");
    s
}

fn messages(user: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::system(system()), ChatMessage::user(user)]
}

fn long_user() -> String {
    (1..=16)
        .map(|i| format!("{i}. 挡风板/显示完整, clips {i}/4 present, gap {i}mm.\n"))
        .collect()
}

fn rollout(user: &str) -> RolloutRequest {
    RolloutRequest {
        messages: messages(user),
        decodes: vec![
            DecodeRequest {
                decode_index: 0,
                temperature: 0.7,
                top_p: 0.9,
                repetition_penalty: 1.05,
                max_new_tokens: 12,
                seeds: vec![5, 6],
            },
            DecodeRequest {
                decode_index: 1,
                temperature: 0.0,
                top_p: 1.0,
                repetition_penalty: 1.0,
                max_new_tokens: 12,
                seeds: vec![7],
            },
        ],
        constrained: false,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_prefix_from_the_store_changes_no_bit_of_logits_or_candidates() {
    let mut engine = ModelEngine::load(&model_path(), &EngineOptions::default()).unwrap();
    let users = [
        "1. 挡风板已安装, 4个卡扣到位.\n请给出结论。".to_string(),
        "无".to_string(),
        long_user(),
    ];
    let prompts: Vec<Vec<u32>> = users
        .iter()
        .map(|u| {
            let text = engine.render_prompt(&messages(u)).unwrap();
            engine.encode(&text).unwrap()
        })
        .collect();

    engine.set_prefix_cache_bytes(0);
    assert_eq!(engine.prefix_cache_bytes(), None, "off");
    let reference_logits: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| bits(&engine.prompt_logits(p).unwrap()))
        .collect();
    // Rollouts of the short and the long tail (the first prompt only fills the store).
    let reference_rollouts: Vec<_> = users[1..]
        .iter()
        .map(|u| engine.rollout(&rollout(u)).unwrap())
        .collect();
    assert!(reference_rollouts.iter().all(|r| r.prefix_tokens == 0));

    // Logits: the first prompt fills the store, the others start from its prefix.
    engine.set_prefix_cache_bytes(DEFAULT_PREFIX_CACHE_BYTES);
    let mut reused = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (logits, n) = engine.prompt_logits_reusing(p).unwrap();
        assert_eq!(bits(&logits), reference_logits[i], "prompt {i} logits");
        reused.push(n);
    }
    let (short_tail, long_tail) = (prompts[1].len() - reused[1], prompts[2].len() - reused[2]);
    assert_eq!(reused[0], 0, "an empty store");
    assert!(reused[1] > 512, "the prefix ends past a chunk: {reused:?}");
    assert!(short_tail < 16, "small-batch tail: {short_tail}");
    assert!(long_tail > 512, "a tail over a chunk: {long_tail}");
    // The same prompt again: everything but its last token comes from the store.
    let (logits, n) = engine.prompt_logits_reusing(&prompts[2]).unwrap();
    assert_eq!(
        (n, bits(&logits)),
        (prompts[2].len() - 1, reference_logits[2].clone())
    );

    // Rollouts through the warm store: the same candidates, bit for bit in their tokens.
    for (i, u) in users[1..].iter().enumerate() {
        let out = engine.rollout(&rollout(u)).unwrap();
        assert!(out.prefix_tokens > 512, "rollout {i} reused its head");
        assert_eq!(
            out.candidates, reference_rollouts[i].candidates,
            "rollout {i}"
        );
        assert_eq!(out.prompt_tokens, reference_rollouts[i].prompt_tokens);
    }
    let held = engine.prefix_cache_bytes().unwrap();
    assert!(
        held > 0 && held <= DEFAULT_PREFIX_CACHE_BYTES as u64,
        "{held}"
    );
}

fn generation(user: &str) -> GenerateRequest {
    GenerateRequest {
        messages: messages(user),
        json_schema: None,
        seed: 11,
        temperature: 0.7,
        top_p: 0.9,
        repetition_penalty: 1.05,
        max_new_tokens: 12,
    }
}

/// Reflection calls (generations) reuse the head they share (system prompt,
/// guidance, cases) from a store of their own, bit for bit, and without evicting the rollouts'.
#[test]
fn generations_reuse_their_shared_head_bit_for_bit_and_leave_the_rollouts_store_alone() {
    let mut engine = ModelEngine::load(&model_path(), &EngineOptions::default()).unwrap();
    // A decision-like call, then a revision-like one: the same head, a longer tail.
    let first = long_user();
    let second = format!("{first}以下操作被拒绝，请修正：- add G3 → not_a_rule\n");
    engine.set_prefix_cache_bytes(0);
    let reference: Vec<_> = [&first, &second]
        .iter()
        .map(|u| engine.generate(&generation(u)).unwrap())
        .collect();
    assert!(reference.iter().all(|g| g.prefix_tokens == 0), "store off");

    engine.set_prefix_cache_bytes(DEFAULT_PREFIX_CACHE_BYTES);
    let warm_rollout = engine.rollout(&rollout("无")).unwrap();
    assert_eq!(warm_rollout.prefix_tokens, 0, "an empty store");
    let out: Vec<_> = [&first, &second]
        .iter()
        .map(|u| engine.generate(&generation(u)).unwrap())
        .collect();
    assert!(
        out[0].prefix_tokens == 0,
        "the generations' store starts empty"
    );
    assert!(
        out[1].prefix_tokens as usize > first.len() / 4,
        "the second call reused the first one's head: {}",
        out[1].prefix_tokens
    );
    for (i, (o, r)) in out.iter().zip(&reference).enumerate() {
        assert_eq!(
            (&o.text, o.completion_tokens, o.prompt_tokens),
            (&r.text, r.completion_tokens, r.prompt_tokens),
            "generation {i}: the same text with the store on and off"
        );
    }
    // The rollouts' store still holds their head: the generations did not go there.
    let next = engine.rollout(&rollout("1. 挡风板已安装.")).unwrap();
    assert!(next.prefix_tokens > 512, "{}", next.prefix_tokens);
}

/// The candle backend (the path CUDA runs; here the demo model dequantized to f32 on the CPU)
/// reuses whole prefill chunks: a chunk's keys and values come from the same shapes in every
/// prompt that holds it, so a prefill that starts after a stored run of whole chunks gives
/// the bits of one from position 0; a partial chunk is computed again. Checked one job at a
/// time and in the running batch, where the second of two jobs admitted together reuses the
/// chunk the first one prefilled.
#[test]
fn the_candle_backend_reuses_whole_prefill_chunks_bit_for_bit() {
    use stageb_worker::engine::{CancelFlag, Job, JobOutput, Numerics, WeightFormat};
    let opts = EngineOptions {
        weight_format: WeightFormat::Dequantized,
        numerics: Numerics::F32,
        ..EngineOptions::default()
    };
    let mut engine = ModelEngine::load(&model_path(), &opts).unwrap();
    let (a, b) = (
        rollout("无"),
        rollout("1. 挡风板已安装, 4个卡扣到位.\n请给出结论。"),
    );
    engine.set_prefix_cache_bytes(0);
    let reference = engine.rollout(&b).unwrap();
    assert_eq!(reference.prefix_tokens, 0, "store off");
    assert!(reference.prompt_tokens > 512 && reference.prompt_tokens < 1024);

    engine.set_prefix_cache_bytes(DEFAULT_PREFIX_CACHE_BYTES);
    assert_eq!(
        engine.rollout(&a).unwrap().prefix_tokens,
        0,
        "an empty store"
    );
    let out = engine.rollout(&b).unwrap();
    assert_eq!(out.prefix_tokens, 512, "one whole chunk of the shared head");
    assert_eq!(out.candidates, reference.candidates, "one job at a time");

    // The running batch, from an empty store: the first job publishes its chunk when its
    // prefill ends, the second starts after it.
    engine.set_prefix_cache_bytes(DEFAULT_PREFIX_CACHE_BYTES);
    for (key, job) in [a, b].into_iter().enumerate() {
        engine
            .admit(key as u64, &Job::Rollout(job), CancelFlag::default())
            .unwrap();
    }
    let mut got = None;
    while got.is_none() {
        for (key, res) in engine.step() {
            if key == 1 {
                got = Some(res.unwrap());
            }
        }
    }
    let Some(JobOutput::Rollout(batched)) = got else {
        panic!("a rollout's output")
    };
    assert_eq!(
        batched.prefix_tokens, 512,
        "the batch reused the first job's chunk"
    );
    assert_eq!(batched.candidates, reference.candidates, "in the batch");
}
