//! The prompts rank 0 sends to workers: our own wording, built only from the mission, the
//! guidance of the current step and the ticket's sanitized summaries.
//!
//! The human label never reaches a rollout prompt: [`rollout_messages`] does not take the
//! label at all, so it cannot leak it (a test checks that both labels of a resubmitted group
//! give byte-identical prompts). Summaries are sanitized first: traditional→simplified, spaces
//! normalized, and Stage-A's own third-state markers (`需复核`) removed so the model is never
//! shown the words it must not write (python-original §10 item 12).

use stageb_shared::domain::ChatMessage;
use stageb_shared::text;

/// Guidance as the prompt shows it: `(key, text)` pairs, scaffold `S*` first, then `G*`, each
/// in numeric key order (G2 before G10).
pub type GuidanceLines = [(String, String)];

/// Stage-A markers of undecided state, removed from summaries (longest first so a longer
/// phrase is never half-removed).
const SUMMARY_THIRD_STATE_MARKERS: &[&str] = &["需人工复核", "需要复核", "待复核", "需复核"];

/// Sanitize one Stage-A summary for a rollout prompt.
pub fn sanitize_summary(summary: &str) -> String {
    let mut s = text::normalize(summary);
    for sep in ["需复核,备注:", "需复核，备注:", "需复核,备注：", "需复核，备注："] {
        s = s.replace(sep, "备注:");
    }
    for marker in SUMMARY_THIRD_STATE_MARKERS {
        s = s.replace(marker, "");
    }
    text::normalize_spaces(&s)
}

fn is_scaffold(key: &str) -> bool {
    key.starts_with('S')
}

const ROLLOUT_SYSTEM: &str = "你是通信机房质检助手，始终用简体中文回答。\n\
根据一组图片的文字摘要，判断这一组是否通过本次质检任务。\n\
规则优先级：结构不变量（S*）最高；G0 是检查清单；G1 及以后的规则补充如何判定。与本任务检查清单无关的问题不影响判定。\n\
若摘要中无法找到支持通过的依据，判不通过。\n\
只输出两行，不要多余内容：\n\
Verdict: 通过 或 Verdict: 不通过\n\
Reason: 一行理由，说明依据\n\
结论只能是通过或不通过，不得使用其他结论。";

/// The `[system, user]` messages of one ticket's rollout.
pub fn rollout_messages(mission: &str, guidance: &GuidanceLines, per_image: &[(String, String)]) -> Vec<ChatMessage> {
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
    user.push_str("请按两行格式给出结论。");
    vec![ChatMessage::system(ROLLOUT_SYSTEM), ChatMessage::user(user)]
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
    fn third_state_markers_never_reach_the_prompt() {
        let s = sanitize_summary("挡风板/显示完整,需复核,备注: 角度不清×1，需複核");
        assert!(!s.contains("复核") && !s.contains("複核"), "{s}");
        assert!(s.contains("备注:"), "{s}");
    }

    #[test]
    fn keys_are_listed_in_the_order_given_scaffold_first() {
        let msgs = rollout_messages("挡风板安装检查", &guidance(), &[("image_1".into(), "挡风板/显示完整".into())]);
        let user = &msgs[1].content;
        let pos = |k: &str| user.find(k).unwrap();
        assert!(pos("[S1]") < pos("[G0]") && pos("[G0]") < pos("[G2]") && pos("[G2]") < pos("[G10]"));
        assert_eq!(msgs[0].role, "system");
    }
}
