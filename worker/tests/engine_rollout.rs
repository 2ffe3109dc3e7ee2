//! Rollout determinism and batching on the real demo model (SmolLM2-135M-Instruct Q4_1).

use crate::common;
use common::model_path;

use stageb_shared::domain::ChatMessage;
use stageb_worker::engine::{
    DecodeRequest, Engine, EngineOptions, FinishReason, GenerateRequest, ModelEngine,
    RolloutRequest,
};

fn ticket(summary: &str) -> Vec<ChatMessage> {
    vec![
        ChatMessage::system(
            "You check windshield installation. Answer in two lines: Verdict: 通过 or 不通过, then Reason.",
        ),
        ChatMessage::user(summary),
    ]
}

fn request(summary: &str, max_new: u32) -> RolloutRequest {
    RolloutRequest {
        messages: ticket(summary),
        decodes: vec![
            DecodeRequest {
                decode_index: 0,
                temperature: 0.7,
                top_p: 0.9,
                repetition_penalty: 1.05,
                max_new_tokens: max_new,
                seeds: vec![11, 12, 13],
            },
            DecodeRequest {
                decode_index: 1,
                temperature: 0.0,
                top_p: 1.0,
                repetition_penalty: 1.0,
                max_new_tokens: max_new,
                seeds: vec![21],
            },
        ],
        constrained: false,
    }
}

#[test]
fn rollout_is_deterministic_and_independent_of_other_tickets() {
    let path = model_path();
    let mut engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let a = request(
        "挡风板: 已安装, 螺丝齐全. Photo 2 shows the panel in place.",
        20,
    );
    let b = request("Ticket B: panel missing, 缺少挡风板.", 20);
    let first = engine.rollout(&a).unwrap();
    assert_eq!(first.candidates.len(), 4);
    assert_eq!(
        first
            .candidates
            .iter()
            .map(|c| (c.decode_index, c.sample_index, c.seed))
            .collect::<Vec<_>>(),
        vec![(0, 0, 11), (0, 1, 12), (0, 2, 13), (1, 0, 21)]
    );
    for c in &first.candidates {
        assert!(
            c.completion_tokens >= 1 && c.completion_tokens <= 20,
            "{c:?}"
        );
        assert!(
            !c.text.contains("<|im_end|>"),
            "special tokens never appear in text: {c:?}"
        );
        if c.finish == FinishReason::Length {
            assert_eq!(c.completion_tokens, 20);
        }
        eprintln!(
            "{}/{} {:?} {:?}",
            c.decode_index, c.sample_index, c.finish, c.text
        );
    }
    // Different seeds at temperature 0.7 give different candidates (the draw is per seed).
    let texts: std::collections::BTreeSet<_> = first.candidates[..3]
        .iter()
        .map(|c| c.text.clone())
        .collect();
    assert!(
        texts.len() >= 2,
        "sampled candidates should differ: {texts:?}"
    );
    let again = engine.rollout(&a).unwrap();
    assert_eq!(first.candidates, again.candidates, "same request twice");
    let other = engine.rollout(&b).unwrap();
    assert_ne!(other.candidates, first.candidates);
    let after = engine.rollout(&a).unwrap();
    assert_eq!(
        first.candidates, after.candidates,
        "after another ticket on the same engine"
    );
    // A fresh engine (new process state) agrees too.
    let mut fresh = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    assert_eq!(
        fresh.rollout(&a).unwrap().candidates,
        first.candidates,
        "fresh engine"
    );
}

#[test]
fn lockstep_rows_match_and_greedy_is_seed_independent() {
    let path = model_path();
    let mut engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let mut req = request("Ticket C: 挡风板安装正确, all four clips engaged.", 16);
    req.decodes = vec![DecodeRequest {
        decode_index: 0,
        temperature: 0.0,
        top_p: 1.0,
        repetition_penalty: 1.0,
        max_new_tokens: 16,
        seeds: vec![1, 2, 3, 4, 5],
    }];
    let out = engine.rollout(&req).unwrap();
    // Every row of the expanded cache holds the same prompt state: greedy rows must agree.
    for c in &out.candidates {
        assert_eq!(
            c.text, out.candidates[0].text,
            "row {} diverged",
            c.sample_index
        );
    }
    // The same greedy continuation through generate (one row).
    let g = engine
        .generate(&GenerateRequest {
            messages: req.messages.clone(),
            json_schema: None,
            seed: 99,
            temperature: 0.0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            max_new_tokens: 16,
        })
        .unwrap();
    assert_eq!(g.prompt_tokens, out.prompt_tokens);
    eprintln!(
        "batch row: {:?}\nsingle:    {:?}",
        out.candidates[0].text, g.text
    );
    assert_eq!(g.text, out.candidates[0].text, "b=1 vs b=5 greedy");
}

#[test]
fn bad_requests_are_rejected() {
    let path = model_path();
    let opts = EngineOptions {
        max_context: Some(64),
        ..EngineOptions::default()
    };
    let mut engine = ModelEngine::load(&path, &opts).expect("load model");
    let long = request(&"word ".repeat(200), 8);
    let err = engine.rollout(&long).unwrap_err();
    assert_eq!(err.code(), "PROMPT_TOO_LONG", "{err}");
    let mut bad = request("x", 8);
    bad.decodes[0].top_p = 0.0;
    assert_eq!(engine.rollout(&bad).unwrap_err().code(), "INVALID_REQUEST");
}

/// Forced-token fast-forward (the constraint allows exactly one token: the contract's
/// `Verdict: ` / `\nReason: ` scaffolding, JSON keys) feeds a forced run in one multi-token
/// forward. It must be an optimization only: the same candidates, token for token, as sampling
/// every forced token step by step.
#[test]
fn forced_runs_fed_at_once_give_the_same_outputs_as_step_by_step() {
    let path = model_path();
    let mut engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let mut contract = request(
        "Ticket D: 挡风板缺失, 2 clips broken. Photo 1 shows a gap.",
        40,
    );
    contract.constrained = true;
    let json = GenerateRequest {
        messages: ticket("Summarize as JSON: verdict and a short reason."),
        json_schema: Some(serde_json::json!({
            "type": "object",
            "properties": {
                "verdict": {"type": "string", "enum": ["pass", "fail"]},
                "reason": {"type": "string", "maxLength": 40}
            },
            "required": ["verdict", "reason"],
            "additionalProperties": false
        })),
        seed: 7,
        temperature: 0.7,
        top_p: 0.9,
        repetition_penalty: 1.05,
        max_new_tokens: 48,
    };
    let fast = engine.rollout(&contract).unwrap();
    let forced_contract = engine.forced_tokens_last_job();
    let fast_json = engine.generate(&json).unwrap();
    let forced_json = engine.forced_tokens_last_job();
    engine.set_fast_forward(false);
    let slow = engine.rollout(&contract).unwrap();
    assert_eq!(engine.forced_tokens_last_job(), 0, "fast-forward off");
    let slow_json = engine.generate(&json).unwrap();
    for c in &fast.candidates {
        eprintln!("{:?} {:?}", c.finish, c.text);
    }
    eprintln!("json: {:?}", fast_json.text);
    eprintln!("forced tokens: contract {forced_contract}, json {forced_json}");
    assert!(
        forced_contract >= 4 * fast.candidates.len() as u64,
        "the contract's scaffolding is forced in every row: {forced_contract}"
    );
    assert!(forced_json > 0, "JSON keys are forced");
    assert_eq!(fast.candidates, slow.candidates, "contract rollout");
    assert_eq!(fast_json.text, slow_json.text, "JSON generate");
    assert_eq!(fast_json.completion_tokens, slow_json.completion_tokens);
    assert_eq!(fast_json.finish, slow_json.finish);
}

/// On the CPU path a position's logits depend only on the tokens up to it: not on where a
/// forward call starts (prefill chunks, a cached prefix) nor on which positions share a block
/// of prefill attention. The prefix cache and the blocked attention rely on it.
#[test]
fn a_position_gives_the_same_logits_however_the_prompt_is_split() {
    use stageb_worker::engine::cpu::model::{Slot, Workspace};
    let path = model_path();
    let engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let Some(model) = engine.cpu_model() else {
        panic!("GGUF on CPU loads the fast path");
    };
    let tokens = engine
        .encode("Ticket E: 挡风板已安装, 4 clips engaged, no gap; photo 3 shows the label.")
        .unwrap();
    let n = tokens.len();
    assert!(n > 20, "{n} tokens");
    let mut ws = Workspace::default();
    let logits_after = |splits: &[usize], ws: &mut Workspace| {
        let mut cache = model.new_cache(n);
        let mut start = 0;
        let mut last = Vec::new();
        for &end in splits.iter().chain(std::iter::once(&n)) {
            let chunk = &tokens[start..end];
            let slots = vec![Slot::Shared; chunk.len()];
            last = model
                .forward(chunk, &slots, &mut cache, chunk.len() - 1, ws)
                .unwrap();
            start = end;
        }
        last
    };
    let whole = logits_after(&[], &mut ws);
    for splits in [vec![n - 1], vec![5], vec![3, 7, 18], vec![n - 2]] {
        let split = logits_after(&splits, &mut ws);
        assert!(
            whole
                .iter()
                .zip(&split)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "splits {splits:?} changed the last position's logits"
        );
    }
}

/// The sampling prefilter draws the exhaustive sampler's token on the model's
/// own logits (after a rollout prompt and after partial answers), for the grid's settings and
/// others, with the repetition penalty over the prompt and with a constraint-like mask.
#[test]
fn the_sampling_prefilter_draws_what_the_exhaustive_sampler_draws_on_real_logits() {
    use stageb_shared::seed::uniform_at;
    use stageb_worker::constraint::AllowedTokens;
    use stageb_worker::engine::sampler::{self, SamplingParams, Scratch, SeenTokens};

    let mut engine = ModelEngine::load(&model_path(), &EngineOptions::default()).unwrap();
    let prompt = engine
        .render_prompt(&ticket("挡风板: 已安装, 螺丝齐全."))
        .unwrap();
    let mut rows = Vec::new();
    for answer in [
        "",
        "Verdict:",
        "Verdict: 通过\nReason:",
        "Verdict: 不通过\nReason: 挡风板",
    ] {
        let ids = engine.encode(&format!("{prompt}{answer}")).unwrap();
        rows.push(engine.prompt_logits(&ids).unwrap());
    }
    let vocab = rows[0].len();
    let mut seen = SeenTokens::new(vocab);
    for t in engine.encode(&prompt).unwrap() {
        seen.insert(t);
    }
    // A reason-like mask: most tokens, not all.
    let mut mask = AllowedTokens::none(vocab);
    for id in (0..vocab as u32).filter(|i| i % 7 != 3) {
        mask.allow(id);
    }
    let mut s = Scratch::default();
    let (mut draws, mut distinct) = (0, std::collections::BTreeSet::new());
    for (t, p, rp) in [
        (0.3, 0.9, 1.05),
        (0.7, 0.9, 1.05),
        (0.7, 1.0, 1.0),
        (1.2, 0.95, 1.3),
    ] {
        let params = SamplingParams {
            temperature: t,
            top_p: p,
            repetition_penalty: rp,
        };
        for logits in &rows {
            for allowed in [None, Some(&mask)] {
                for k in 0..60 {
                    let u = uniform_at(k, 9);
                    let want = sampler::sample_exhaustive(
                        logits,
                        &params,
                        Some(&seen),
                        allowed,
                        u,
                        &mut s,
                    );
                    let got = sampler::sample(logits, &params, Some(&seen), allowed, u, &mut s);
                    assert_eq!(got, want, "T={t} top_p={p} rep={rp} u={u}");
                    draws += 1;
                    distinct.insert(want);
                }
            }
        }
    }
    assert!(
        distinct.len() > 20,
        "{draws} draws, {} tokens",
        distinct.len()
    );
}

/// Rows are sampled in parallel (`ModelEngine::sample_rows`); a row's token depends only on its
/// own logits, seed and state, so one thread or several give the same candidates, on the CPU
/// fast path and on candle's lockstep path (the one a GPU runs, here in bf16 on the CPU).
#[test]
fn rows_sampled_on_one_thread_or_several_give_the_same_candidates() {
    use stageb_worker::engine::Numerics;
    let path = model_path();
    let run = |numerics: Numerics, threads: usize, req: &RolloutRequest| {
        let options = EngineOptions {
            numerics,
            threads: Some(threads),
            ..EngineOptions::default()
        };
        let mut engine = ModelEngine::load(&path, &options).expect("load model");
        let out = engine.rollout(req).unwrap();
        out.candidates
            .into_iter()
            .map(|c| (c.seed, c.text, c.finish, c.completion_tokens))
            .collect::<Vec<_>>()
    };
    let free = request("Ticket D: 挡风板/显示完整, 卡扣4/4.", 8);
    let mut contract = request("Ticket E: 挡风板缺失, photo 3 blurred.", 40);
    contract.constrained = true;
    for (numerics, req) in [
        (Numerics::Auto, &free),
        (Numerics::Auto, &contract),
        (Numerics::Bf16, &free),
    ] {
        let one = run(numerics, 1, req);
        assert_eq!(one.len(), 4);
        assert_eq!(
            one,
            run(numerics, 2, req),
            "{numerics:?}, constrained {}",
            req.constrained
        );
    }
}
