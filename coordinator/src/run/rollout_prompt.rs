//! The prompts rank 0 sends to workers: our own wording, built only from the mission, the
//! guidance of the current step and the ticket's sanitized summaries; and the rollout job
//! that carries one ([`rollout_payload`]: the prompt, one seed per candidate).
//!
//! The human label never reaches a rollout prompt: [`rollout_messages`] does not take the
//! label at all, so it cannot leak it (a test checks that both labels of a resubmitted group
//! give byte-identical prompts). Summaries are sanitized first: traditional→simplified, spaces
//! normalized, and Stage-A's own third-state markers (`需复核`) removed so the model is never
//! shown the words it must not write (the original showed them, and the model copied them).

use stageb_shared::config::RunConfig;
use stageb_shared::domain::{ChatMessage, Ticket};
use stageb_shared::seed::candidate_seed;
use stageb_shared::text::{self, sanitize_summary};

use crate::cluster::scheduler::{DecodeJob, JobPayload};

/// Guidance as the prompt shows it: `(key, text)` pairs, scaffold `S*` first, then `G*`, each
/// in numeric key order (G2 before G10).
pub type GuidanceLines = [(String, String)];

fn is_scaffold(key: &str) -> bool {
    key.starts_with('S')
}

/// Short on purpose: every token of the system prompt is prefilled for every ticket, and small
/// models copy placeholder text, so the format is described rather than templated.
const ROLLOUT_SYSTEM: &str = "你是通信机房质检助手。根据图片摘要判断这一组是否通过质检任务。\n\
结构不变量（S*）优先级最高，G0 是检查清单，G1 及以后是补充规则；与任务无关的问题不影响判定；找不到通过依据时判不通过。\n\
输出两行：第一行 Verdict: 通过 或 Verdict: 不通过；第二行以 Reason: 开头，用一句话写出判断依据。";

/// The `[system, user]` messages of one ticket's rollout.
pub fn rollout_messages(
    mission: &str,
    guidance: &GuidanceLines,
    per_image: &[(String, String)],
) -> Vec<ChatMessage> {
    let mut user = String::new();
    user.push_str(&format!("任务: {mission}\n"));
    let scaffold: Vec<_> = guidance.iter().filter(|(k, _)| is_scaffold(k)).collect();
    if !scaffold.is_empty() {
        user.push_str("结构不变量（S*）:\n");
        for (k, t) in scaffold {
            user.push_str(&format!("[{k}]. {}\n", text::normalize(t)));
        }
    }
    user.push_str("检查规则（G0+）:\n");
    for (k, t) in guidance.iter().filter(|(k, _)| !is_scaffold(k)) {
        user.push_str(&format!("[{k}]. {}\n", text::normalize(t)));
    }
    user.push_str(&format!("图片数量: {}\n图片摘要:\n", per_image.len()));
    for (i, (_, summary)) in per_image.iter().enumerate() {
        user.push_str(&format!("{}. {}\n", i + 1, sanitize_summary(summary)));
    }
    user.push_str("请给出结论。");
    vec![ChatMessage::system(ROLLOUT_SYSTEM), ChatMessage::user(user)]
}

/// The rollout job of one ticket: prompt from the step's guidance, one seed per candidate.
pub fn rollout_payload(
    cfg: &RunConfig,
    epoch: u32,
    ticket: &Ticket,
    guidance: &[(String, String)],
) -> JobPayload {
    let key = ticket.key();
    let decodes = cfg
        .sampler
        .decode_specs()
        .iter()
        .enumerate()
        .map(|(d, spec)| DecodeJob {
            decode_index: d as u32,
            temperature: spec.temperature,
            top_p: spec.top_p,
            repetition_penalty: spec.repetition_penalty,
            max_new_tokens: spec.max_new_tokens,
            seeds: (0..cfg.sampler.samples_per_decode)
                .map(|s| candidate_seed(cfg.seed, epoch, key.as_str(), d as u32, s))
                .collect(),
        })
        .collect();
    JobPayload::Rollout {
        messages: rollout_messages(&ticket.mission, guidance, &ticket.per_image),
        decodes,
        constrained: cfg.sampler.constrained,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guidance() -> Vec<(String, String)> {
        vec![
            ("S1".into(), "只依据与挡风板相关的证据".into()),
            ("G0".into(), "检查挡风板是否安装".into()),
            ("G2".into(), "规则二".into()),
            ("G10".into(), "规则十".into()),
        ]
    }

    #[test]
    fn keys_are_listed_in_the_order_given_scaffold_first() {
        let msgs = rollout_messages(
            "挡风板安装检查",
            &guidance(),
            &[("image_1".into(), "挡风板/显示完整".into())],
        );
        let user = &msgs[1].content;
        let pos = |k: &str| user.find(k).unwrap();
        assert!(
            pos("[S1]") < pos("[G0]") && pos("[G0]") < pos("[G2]") && pos("[G2]") < pos("[G10]")
        );
        assert_eq!(msgs[0].role, "system");
    }
}
