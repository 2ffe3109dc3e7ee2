//! Constrained rollouts end cleanly within a small `max_new_tokens` (real demo model): the
//! engine spends the last few tokens of a row finishing it (EOS as soon as the contract allows
//! it), so no candidate is cut inside a multi-byte character (`Reason: 判定通�`) and every one
//! parses. Too small a budget for a complete verdict is refused up front.

use crate::common;
use common::model_path;

use stageb_shared::contract;
use stageb_shared::domain::ChatMessage;
use stageb_worker::engine::{DecodeRequest, Engine, EngineOptions, ModelEngine, RolloutRequest};

fn request(summary: &str, max_new: u32, seed0: u64) -> RolloutRequest {
    RolloutRequest {
        messages: vec![
            ChatMessage::system(
                "判断挡风板安装. Output: Verdict: 通过 or 不通过\nReason: 用中文写一行理由.",
            ),
            ChatMessage::user(format!("Ticket: {summary} 请用中文说明判定理由.")),
        ],
        decodes: vec![DecodeRequest {
            decode_index: 0,
            temperature: 0.9,
            top_p: 0.95,
            repetition_penalty: 1.05,
            max_new_tokens: max_new,
            seeds: (seed0..seed0 + 8).collect(),
        }],
        constrained: true,
    }
}

#[test]
fn small_budgets_never_cut_a_character_and_always_parse() {
    let path = model_path();
    let mut engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let summaries = [
        "挡风板已安装, 4个卡扣到位.",
        "未见挡风板, 判定通过吗?",
        "卡扣缺失 2 个, 螺丝松动.",
    ];
    let mut total = 0;
    for (i, s) in summaries.iter().enumerate() {
        for max_new in [20u32, 21, 22, 24] {
            let out = engine
                .rollout(&request(s, max_new, 100 * i as u64 + max_new as u64))
                .unwrap();
            for c in &out.candidates {
                total += 1;
                assert!(
                    c.completion_tokens <= max_new,
                    "{} tokens > {max_new}",
                    c.completion_tokens
                );
                assert!(
                    !c.text.contains('\u{FFFD}'),
                    "cut mid-character: {:?}",
                    c.text
                );
                if let Err(e) = contract::parse(&c.text) {
                    panic!("max_new {max_new} does not parse: {e:?}\n{:?}", c.text);
                }
            }
            if max_new == 20 {
                eprintln!("{max_new}: {:?}", out.candidates[0].text);
            }
        }
    }
    assert_eq!(total, 3 * 4 * 8);
}

#[test]
fn constrained_budget_below_minimum_is_invalid() {
    let path = model_path();
    let mut engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let err = engine.rollout(&request("x", 19, 0)).unwrap_err();
    assert_eq!(err.code(), "INVALID_REQUEST", "{err}");
}
