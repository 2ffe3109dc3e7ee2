//! Constrained decoding end to end on the real demo model: rollouts with the two-line contract
//! must parse 100%, reflection calls in JSON mode must parse into the reflection types.
//! Unconstrained rollouts print their malformed rate (not asserted: a 135M model rarely follows
//! the format on its own, which is why constraints exist).
//!
//! Prompts are short and
//! `max_new_tokens` small to keep CI time reasonable on 2 cores.

use crate::common;
use common::{depth, model_path};

use stageb_shared::contract;
use stageb_shared::domain::ChatMessage;
use stageb_shared::reflection_schema;
use stageb_worker::engine::{
    DecodeRequest, Engine, EngineOptions, GenerateRequest, ModelEngine, RolloutRequest,
};

const SUMMARIES: [&str; 25] = [
    "挡风板已安装, 4个卡扣到位.",
    "Panel present, one clip loose.",
    "未见挡风板.",
    "挡风板安装正确 OK.",
    "Photo blurry, panel edge visible.",
    "挡风板有裂纹.",
    "Screws: 4/4, gap 2mm.",
    "挡风板位置偏移 5mm.",
    "Label missing on panel.",
    "安装完成, 无异常.",
    "Panel upside down.",
    "卡扣缺失 2 个.",
    "All fasteners present, 通过检查.",
    "挡风板颜色不符.",
    "Panel installed, tape residue.",
    "图片显示挡风板完整.",
    "Gap exceeds 3mm at left edge.",
    "挡风板与车身贴合良好.",
    "Wrong part number A-113.",
    "安装角度正确, 螺丝齐全.",
    "Panel scratched, functional.",
    "挡风板未固定.",
    "Clip 3 broken.",
    "检查合格.",
    "Protective film not removed.",
];

fn rollout_request(summary: &str, i: usize, constrained: bool) -> RolloutRequest {
    RolloutRequest {
        messages: vec![
            ChatMessage::system(
                "判断挡风板安装. Output: Verdict: 通过 or 不通过\\nReason: one line.",
            ),
            ChatMessage::user(format!("Ticket {i}: {summary}")),
        ],
        decodes: vec![DecodeRequest {
            decode_index: 0,
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.05,
            max_new_tokens: 48,
            seeds: (0..8).map(|s| 1000 * i as u64 + s).collect(),
        }],
        constrained,
    }
}

#[test]
fn constrained_rollouts_always_parse() {
    let path = model_path();
    let mut engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let (mut total, mut ok_constrained, mut ok_free, mut total_free) = (0, 0, 0, 0);
    let tickets = depth(8, SUMMARIES.len());
    for (i, s) in SUMMARIES.iter().take(tickets).enumerate() {
        let out = engine.rollout(&rollout_request(s, i, true)).unwrap();
        assert_eq!(out.candidates.len(), 8);
        for c in &out.candidates {
            total += 1;
            match contract::parse(&c.text) {
                Ok(_) => ok_constrained += 1,
                Err(e) => panic!(
                    "ticket {i} candidate {} does not parse: {e:?}\n{:?}",
                    c.sample_index, c.text
                ),
            }
        }
        if i == 0 {
            eprintln!("example: {:?}", out.candidates[0].text);
        }
        // The same prompts unconstrained, on a third of them (time), for the malformed rate.
        if i % 3 == 0 {
            let free = engine.rollout(&rollout_request(s, i, false)).unwrap();
            for c in &free.candidates {
                total_free += 1;
                ok_free += usize::from(contract::parse(&c.text).is_ok());
            }
        }
    }
    eprintln!("constrained: {ok_constrained}/{total} parse");
    eprintln!(
        "unconstrained: {}/{total_free} malformed ({:.0}%)",
        total_free - ok_free,
        100.0 * (total_free - ok_free) as f64 / total_free.max(1) as f64
    );
    assert_eq!(ok_constrained, total);
    assert_eq!(total, 8 * tickets);
}

/// The reflection schemas as rank 0 sends them for a batch of `keys` with rules `G0`/`G1`.
fn tailored(ops: bool, keys: &[String]) -> serde_json::Value {
    let mut schema = if ops {
        reflection_schema::ops_json_schema(2)
    } else {
        reflection_schema::decision_json_schema()
    };
    let analysis = if ops {
        "/properties/evidence_analysis"
    } else {
        "/properties/decision_analysis"
    };
    schema.pointer_mut(analysis).unwrap()["maxLength"] = serde_json::json!(60);
    if let Some(ids) = schema.pointer_mut("/properties/no_evidence_group_ids") {
        ids["items"] = serde_json::json!({"enum": keys});
        ids["maxItems"] = serde_json::json!(keys.len());
    }
    if let Some(branches) = schema
        .pointer_mut("/properties/operations/items/anyOf")
        .and_then(|v| v.as_array_mut())
    {
        for b in branches {
            if let Some(ev) = b.pointer_mut("/properties/evidence") {
                ev["items"] = serde_json::json!({"enum": keys});
                ev["maxItems"] = serde_json::json!(keys.len());
            }
            if let Some(k) = b.pointer_mut("/properties/key") {
                *k = serde_json::json!({"enum": ["G0", "G1"]});
            }
            if let Some(m) = b.pointer_mut("/properties/merged_from") {
                m["items"] = serde_json::json!({"enum": ["G0", "G1"]});
            }
        }
    }
    if let Some(cov) = schema.pointer_mut("/properties/coverage") {
        // Advisory only; rank 0 drops it from what the model may write in tight budgets.
        for f in [
            "learnable_group_ids",
            "covered_group_ids",
            "uncovered_group_ids",
        ] {
            if let Some(a) = cov.pointer_mut(&format!("/properties/{f}")) {
                a["items"] = serde_json::json!({"enum": keys});
                a["maxItems"] = serde_json::json!(keys.len());
            }
        }
    }
    schema
}

#[test]
fn json_mode_reflection_outputs_parse() {
    let path = model_path();
    let mut engine = ModelEngine::load(&path, &EngineOptions::default()).expect("load model");
    let mut parsed = 0;
    let calls = depth(6, 20) as u64;
    for i in 0..calls {
        let ops = i % 2 == 1;
        // Tailored the way rank 0 tailors them (coordinator `reflection::tailor_*_schema`): ids
        // restricted to the batch's ticket keys and existing rule keys, the logged-only analysis
        // fields short. Bounded schemas are what makes a completed output possible within the
        // token budget; an untailored schema lets a small model repeat array items until it is
        // cut off.
        let keys = [format!("QC-{i}::fail"), format!("QC-{}::pass", i + 1)];
        let schema = tailored(ops, &keys);
        let req = GenerateRequest {
            messages: vec![
                ChatMessage::system("You revise QC guidance. Reply with JSON only."),
                ChatMessage::user(format!(
                    "Batch {i}: tickets QC-{i}::fail (label fail, model said 通过), QC-{}::pass. Guidance G0: 挡风板必须安装.",
                    i + 1
                )),
            ],
            json_schema: Some(schema),
            seed: 500 + i,
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.05,
            max_new_tokens: 768,
        };
        let out = engine.generate(&req).unwrap();
        let r = if ops {
            reflection_schema::parse_ops(&out.text).map(|_| ())
        } else {
            reflection_schema::parse_decision(&out.text).map(|_| ())
        };
        match r {
            Ok(()) => parsed += 1,
            Err(e) => panic!(
                "call {i} ({:?}, {} tokens) does not parse: {e:?}\n{}",
                out.finish, out.completion_tokens, out.text
            ),
        }
    }
    assert_eq!(parsed, calls);
}
