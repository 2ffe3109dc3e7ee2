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
    // Fast-forward alone (draft tokens have their own spec below).
    engine.set_draft(false);
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

/// Draft tokens (prompt lookup, fed after each row's token and checked by its own draws) must
/// be an optimization only: the same tokens as one token a step (no drafts, no forced-token
/// fast-forward), for a JSON answer that copies from its prompt (taken drafts, forced runs
/// between them), a constrained rollout of one row and a free rollout of two rows; and a
/// copying answer takes some of its drafts, so it needs fewer forward calls than with
/// fast-forward alone.
#[test]
fn draft_tokens_give_the_same_outputs_as_one_token_a_step() {
    let path = model_path();
    let mut engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let ids = "QC-7-0746160::pass, QC-7-1637324::pass, QC-7-6501958::fail, QC-7-7229598::fail";
    let copy = GenerateRequest {
        messages: ticket(&format!(
            "Tickets: {ids}. List every ticket id above, exactly as written, as JSON."
        )),
        json_schema: Some(serde_json::json!({
            "type": "object",
            "properties": {
                "ids": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
                "note": {"type": "string"}
            },
            "required": ["ids", "note"],
            "additionalProperties": false
        })),
        seed: 5,
        temperature: 0.3,
        top_p: 0.9,
        repetition_penalty: 1.05,
        max_new_tokens: 96,
    };
    // Drafts go to steps of few rows: one row (4 drafts a step), two rows (1 each).
    let mut contract = request(
        "Ticket E: 挡风板已安装, 螺丝齐全, 光纤/反明×1, 光纤/反明×1.",
        24,
    );
    contract.constrained = true;
    contract.decodes.truncate(1);
    contract.decodes[0].seeds = vec![11];
    let mut free = request(
        "Repeat: 光纤/反明×1, 光纤/反明×1, 光纤/反明×1, 光纤/反明×1",
        30,
    );
    free.decodes.remove(0);
    free.decodes[0].seeds = vec![21, 22];
    let run = |engine: &mut ModelEngine| {
        let before = engine.step_split();
        let json = engine.generate(&copy).unwrap();
        let split = engine.step_split().since(&before);
        let rollouts = (
            engine.rollout(&contract).unwrap(),
            engine.rollout(&free).unwrap(),
        );
        (json, rollouts, split, engine.step_split().since(&before))
    };
    let (json, (contract_out, free_out), json_split, all) = run(&mut engine);
    engine.set_draft(false);
    let (_, _, json_split_ff, _) = run(&mut engine);
    engine.set_fast_forward(false);
    let (json_off, (contract_off, free_off), _, all_off) = run(&mut engine);
    assert_eq!(all_off.drafts_fed, 0, "off");
    eprintln!("json: {:?}", json.text);
    eprintln!(
        "rows: {:?} / {:?}",
        contract_out.candidates, free_out.candidates
    );
    eprintln!(
        "drafts (json): {} fed, {} taken, {} steps; all: {} fed, {} taken",
        json_split.drafts_fed,
        json_split.drafts_taken,
        json_split.decode_steps,
        all.drafts_fed,
        all.drafts_taken
    );
    assert_eq!(json.text, json_off.text, "JSON generate");
    assert_eq!(json.completion_tokens, json_off.completion_tokens);
    assert_eq!(json.finish, json_off.finish);
    assert_eq!(
        contract_out.candidates, contract_off.candidates,
        "contract rollout"
    );
    assert_eq!(free_out.candidates, free_off.candidates, "two free rows");
    assert!(
        all.drafts_fed > json_split.drafts_fed,
        "the rollouts' rows were fed drafts too"
    );
    assert!(json_split.drafts_taken > 8, "drafts taken: {json_split:?}");
    // A taken draft saves the call that would have sampled it (unless the constraint forced
    // it, which fast-forward feeds with the token before it anyway).
    assert!(
        json_split.decode_steps + 8 <= json_split_ff.decode_steps,
        "fewer forward calls: {} with drafts, {} with fast-forward alone",
        json_split.decode_steps,
        json_split_ff.decode_steps
    );
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

/// A row's positions that were fed as drafts and not taken are forgotten: what the row is fed
/// next is computed exactly as if they had never been, and the blocks they alone used go back
/// to the pool.
#[test]
fn a_rewound_row_computes_as_if_its_forgotten_positions_were_never_fed() {
    use stageb_worker::engine::cpu::model::{Slot, Workspace};
    let engine = ModelEngine::load(&model_path(), &EngineOptions::default()).expect("load model");
    let model = engine.cpu_model().expect("GGUF on CPU loads the fast path");
    let prompt = engine.encode("Ticket F: 挡风板已安装, 螺丝齐全.").unwrap();
    let answer = engine
        .encode("Verdict: 通过\nReason: 挡风板已安装")
        .unwrap();
    let mut ws = Workspace::default();
    let row = |cache: &mut _, tokens: &[u32], ws: &mut Workspace| {
        let slots = vec![Slot::Row(0); tokens.len()];
        let at: Vec<usize> = (0..tokens.len()).collect();
        model.forward_at(tokens, &slots, cache, &at, ws).unwrap()
    };
    let with_prompt = |ws: &mut Workspace| {
        let mut cache = model.new_cache(prompt.len());
        let slots = vec![Slot::Shared; prompt.len()];
        model
            .forward(&prompt, &slots, &mut cache, prompt.len() - 1, ws)
            .unwrap();
        cache.add_rows(1, 64);
        cache
    };
    let mut straight = with_prompt(&mut ws);
    let want = row(&mut straight, &answer, &mut ws);
    // The same answer fed with wrong guesses in between, each rewound: 3 guesses after the
    // first token (past a block boundary of the row's own positions), 1 after the fourth.
    let mut guessed = with_prompt(&mut ws);
    let wrong: Vec<u32> = (0..40).map(|i| 1000 + i).collect();
    let mut got = row(
        &mut guessed,
        &[&answer[..1], &wrong[..35]].concat(),
        &mut ws,
    );
    got.truncate(model.config.vocab_size);
    let (blocks, used) = (guessed.blocks(), model.kv_pool().stats().used);
    guessed.rewind_row(0, 35).unwrap();
    assert_eq!(
        guessed.blocks(),
        blocks - 1,
        "the row's second block is dropped"
    );
    assert_eq!(
        model.kv_pool().stats().used,
        used - 1,
        "and back in the pool"
    );
    let mut next = row(
        &mut guessed,
        &[&answer[1..4], &wrong[..1]].concat(),
        &mut ws,
    );
    next.truncate(3 * model.config.vocab_size);
    got.extend(next);
    guessed.rewind_row(0, 1).unwrap();
    got.extend(row(&mut guessed, &answer[4..], &mut ws));
    assert_eq!(got.len(), want.len());
    assert!(
        want.iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "a rewound row's logits differ from the straight row's"
    );
    assert!(
        guessed.rewind_row(0, answer.len() + 1).is_err(),
        "past its start"
    );
    assert!(guessed.rewind_row(1, 1).is_err(), "no such row");
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
