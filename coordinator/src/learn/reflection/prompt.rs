//! What the reflection model reads: the case texts and prompt header, the built-in system
//! prompts, the token estimate and the packing of whole cases under the prompt budget, the
//! messages of both passes, and the JSON schemas tailored to one batch. Text and schema only;
//! the cycle decides what goes in a call. [`Prompts`] holds what every prompt of a run is built
//! from (mission, system prompts, the fitted prompt budget).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde_json::{Value, json};
use stageb_shared::config::ReflectionConfig;
use stageb_shared::domain::{ChatMessage, TicketKey, Verdict};
use stageb_shared::reflection_schema;
use stageb_shared::text;

use super::{GradientRecord, ReflectionError};
use crate::guidance::GuidanceRepo;
use crate::learn::op_check::RejectedOp;
use crate::learn::rejected_memory::RejectedMemory;

/// Characters of a rejected op (and of its reason detail) shown in the revision round.
pub(super) const REJECTED_OP_CHARS: usize = 400;

/// Tokens added to a prompt's byte count for the chat template.
pub(super) const TEMPLATE_TOKENS: usize = 64;

/// A guaranteed upper bound on a text's token count: byte-level tokenizers never produce a
/// token of zero bytes, so tokens ≤ bytes. Packing by it can drop a case that would have fit,
/// but never sends a prompt that does not (prompts are never truncated).
pub fn estimate_tokens(text: &str) -> usize {
    text.len() + TEMPLATE_TOKENS
}

/// The user message's head: mission, guidance step and rules, then what changes from cycle to
/// cycle (its number and the batch's size). Everything the calls of a run share comes before
/// anything one call alone has, so a worker's prefix cache reuses it: a call's JSON retries,
/// the ops pass's revision round (which appends the rejected ops after the cases) and the next
/// cycle's call of the same pass under unchanged guidance all start with the same tokens.
pub(super) fn header_text(mission: &str, guidance: &GuidanceRepo, cycle: u64, n: usize) -> String {
    let mut s = format!("任务: {mission}\n指导步骤: {}\n", guidance.step());
    s.push_str("当前规则:\n");
    for (k, t) in guidance.render_for_prompt() {
        s.push_str(&format!("[{k}]. {}\n", text::normalize(&t)));
    }
    s.push_str(&format!("反思周期: {cycle}\n批次: {n} 组\n"));
    s
}

fn verdict_word(v: Option<Verdict>) -> &'static str {
    match v {
        Some(Verdict::Pass) => "通过",
        Some(Verdict::Fail) => "不通过",
        None => "格式错误",
    }
}

pub(super) fn case_text(n: usize, r: &GradientRecord, with_label: bool) -> String {
    let mut s = format!("\n第{n}组 (ticket_key={}):\n", r.ticket_key);
    if with_label {
        s.push_str(&format!(
            "  参考答案 gt_label: {}\n",
            verdict_word(Some(r.gt))
        ));
    }
    s.push_str(&format!(
        "  最终结论: {}；投票一致度: {}\n",
        verdict_word(r.final_verdict),
        r.vote_strength
            .map(|v| format!("{v:.2}"))
            .unwrap_or_else(|| "-".into())
    ));
    s.push_str("  摘要:\n");
    for (i, (_, summary)) in r.summaries.iter().enumerate() {
        s.push_str(&format!(
            "    {}. {}\n",
            i + 1,
            stageb_shared::text::sanitize_summary(summary)
        ));
    }
    s.push_str("  候选:\n");
    for c in &r.candidates {
        let mark = match c.verdict {
            Some(v) if v == r.gt => "✓",
            Some(_) => "✗",
            None => "?",
        };
        s.push_str(&format!(
            "    {}: {} | {} | {mark}\n",
            c.candidate_index,
            verdict_word(c.verdict),
            text::normalize(&c.reason)
        ));
    }
    s
}

/// `第N组` → ticket key, as [`case_text`] numbers the cases of a prompt (a model may name a
/// case either way).
pub(super) fn shorthand(cases: &[GradientRecord]) -> BTreeMap<String, TicketKey> {
    cases
        .iter()
        .enumerate()
        .map(|(i, r)| (format!("第{}组", i + 1), r.ticket_key.clone()))
        .collect()
}

/// Cap on a free-text analysis field for a call of `max_new_tokens`: the analyses are logged,
/// never used, so they must not eat the budget the structured part needs (a JSON output cut at
/// `max_new_tokens` does not parse and costs a retry).
fn analysis_cap(max_new_tokens: u32) -> usize {
    (max_new_tokens as usize / 6).clamp(16, reflection_schema::ANALYSIS_MAX_CHARS)
}

fn cap_string(schema: &mut Value, pointer: &str, cap: usize) {
    if let Some(s) = schema.pointer_mut(pointer)
        && let Some(n) = s.get("maxLength").and_then(Value::as_u64)
    {
        s["maxLength"] = json!((n as usize).min(cap));
    }
}

/// Restrict `no_evidence_group_ids` to the batch's keys: constrain what can be constrained,
/// validate everything anyway.
pub fn tailor_decision_schema(batch: &BTreeSet<TicketKey>, max_new_tokens: u32) -> Value {
    let mut schema = reflection_schema::decision_json_schema();
    cap_string(
        &mut schema,
        "/properties/decision_analysis",
        analysis_cap(max_new_tokens),
    );
    let keys: Vec<&str> = batch.iter().map(TicketKey::as_str).collect();
    if let Some(arr) = schema.pointer_mut("/properties/no_evidence_group_ids") {
        arr["items"] = json!({"enum": keys});
        arr["maxItems"] = json!(keys.len());
    }
    schema
}

/// Restrict op evidence to `L` and op keys to existing `G` keys; with `predictions`, offer
/// each op an optional `expected_flips` within `L` as well.
pub fn tailor_ops_schema(
    max_operations: usize,
    learnable: &BTreeSet<TicketKey>,
    guidance: &GuidanceRepo,
    max_new_tokens: u32,
    predictions: bool,
) -> Value {
    let mut schema = reflection_schema::ops_json_schema(max_operations);
    if predictions {
        reflection_schema::offer_expected_flips(&mut schema);
    }
    cap_string(
        &mut schema,
        "/properties/evidence_analysis",
        analysis_cap(max_new_tokens),
    );
    let keys: Vec<&str> = learnable.iter().map(TicketKey::as_str).collect();
    let g_keys: Vec<String> = guidance
        .render_for_prompt()
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with('G'))
        .collect();
    if let Some(branches) = schema
        .pointer_mut("/properties/operations/items/anyOf")
        .and_then(Value::as_array_mut)
    {
        let removable: Vec<String> = g_keys
            .iter()
            .filter(|k| k.as_str() != "G0")
            .cloned()
            .collect();
        if removable.is_empty() {
            // Nothing can be deleted or merged away: drop those branches rather than offer an
            // empty enum.
            branches.retain(|b| {
                !matches!(
                    b.pointer("/properties/op/const").and_then(Value::as_str),
                    Some("delete" | "merge")
                )
            });
        }
        for b in branches {
            if let Some(ev) = b.pointer_mut("/properties/evidence") {
                ev["items"] = json!({"enum": keys});
                ev["maxItems"] = json!(keys.len().max(1));
            }
            if let Some(flips) = b.pointer_mut("/properties/expected_flips") {
                flips["items"] = json!({"enum": keys});
                flips["maxItems"] = json!(keys.len());
            }
            // G0 may be updated or merged into, never deleted or merged away: the schema does
            // not offer what validation would reject anyway.
            let is_delete =
                b.pointer("/properties/op/const").and_then(Value::as_str) == Some("delete");
            if let Some(k) = b.pointer_mut("/properties/key") {
                *k = json!({"enum": if is_delete { &removable } else { &g_keys }});
            }
            if let Some(m) = b.pointer_mut("/properties/merged_from") {
                m["items"] = json!({"enum": removable});
            }
        }
    }
    for field in [
        "learnable_group_ids",
        "covered_group_ids",
        "uncovered_group_ids",
    ] {
        if let Some(arr) = schema.pointer_mut(&format!("/properties/coverage/properties/{field}")) {
            arr["items"] = json!({"enum": keys});
            arr["maxItems"] = json!(keys.len());
        }
    }
    schema
}

pub(super) const DECISION_SYSTEM: &str = "你是质检规则学习中的 stop-gradient 判定助手。\n\
每个案例给出了人工标注的参考答案 gt_label、模型的候选结论和图片摘要。\n\
对每个案例，尝试找出一条可泛化、可验证的判定方向，使以后类似摘要得出与 gt_label 一致的结论。\n\
只有在认真尝试多个方向后，仍然完全找不到可学习依据的案例，才把它的 ticket_key 放入 no_evidence_group_ids；只要有任何可学习方向，就不要放入。\n\
不得把原因归为标注错误。\n\
只输出一个 JSON 对象：{\"no_evidence_group_ids\": [ticket_key...], \"decision_analysis\": \"简要说明尝试过的方向\"}，不要输出其他字段或文字。";

pub(super) const OPS_SYSTEM: &str = "你是质检规则编辑助手。根据案例修改检查规则，使以后的判定与参考答案 gt_label 一致。\n\
S* 是只读的结构不变量，不得修改或删除；G0 是检查清单，可以更新但不得删除；G1 及以后可以增加、更新、删除、合并。\n\
每个操作必须给出非空 evidence，只能使用本批案例的 ticket_key；尽量让本批每个案例都出现在某个操作的 evidence 中。\n\
规则用自然语言写成“若…则…；否则…”，不得照抄摘要里的对象链（如“挡风板/显示完整”），不得出现 ×、image_、备注: 等摘要标记，不得出现需复核、待定、证据不足等第三态用语。\n\
优先更新或合并已有规则，新增规则最多一条。\n\
只输出一个 JSON 对象：{\"has_evidence\": true, \"evidence_analysis\": \"...\", \"operations\": [...]}。";

/// The two system prompts of a run: the config's files (`reflection.decision_prompt_path`,
/// `reflection.ops_prompt_path`) or the built-in ones.
#[derive(Debug, Clone)]
pub struct SystemPrompts {
    decision: String,
    ops: String,
}

impl SystemPrompts {
    /// Reads the config's prompt files (an unreadable or empty one is refused).
    pub fn read(config: &ReflectionConfig) -> Result<Self, ReflectionError> {
        Ok(SystemPrompts {
            decision: read_prompt(&config.decision_prompt_path, DECISION_SYSTEM)?,
            ops: read_prompt(&config.ops_prompt_path, OPS_SYSTEM)?,
        })
    }
}

fn read_prompt(path: &Option<PathBuf>, builtin: &str) -> Result<String, ReflectionError> {
    let Some(path) = path else {
        return Ok(builtin.to_string());
    };
    let text = std::fs::read_to_string(path).map_err(|source| ReflectionError::PromptFile {
        path: path.clone(),
        source,
    })?;
    if text.trim().is_empty() {
        return Err(ReflectionError::EmptyPrompt { path: path.clone() });
    }
    Ok(text)
}

/// What every reflection prompt of a run is built from. Set once, from the config fitted to
/// the model's context.
pub(super) struct Prompts {
    mission: String,
    system: SystemPrompts,
    /// The fitted `min(token_budget, max_reflection_length)`, so that
    /// `prompt + max_new_tokens ≤ context`.
    budget: usize,
    /// The fitted `reflection.max_new_tokens` (the schemas cap the analyses by it).
    max_new_tokens: u32,
    /// `reflection.gate.enabled`: the ops pass may claim `expected_flips`.
    gate_enabled: bool,
}

impl Prompts {
    pub(super) fn new(mission: &str, system: SystemPrompts, config: &ReflectionConfig) -> Self {
        Prompts {
            mission: mission.to_string(),
            system,
            budget: config.token_budget.min(config.max_reflection_length) as usize,
            max_new_tokens: config.max_new_tokens,
            gate_enabled: config.gate.enabled,
        }
    }

    /// The batch in prompt order (priority, then arrival, then key), split into the cases
    /// that fit the prompt budget and those left out whole.
    pub(super) fn pack(
        &self,
        batch: Vec<GradientRecord>,
        guidance: &GuidanceRepo,
    ) -> (Vec<GradientRecord>, Vec<GradientRecord>) {
        let mut ordered = batch;
        ordered.sort_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then(a.order.cmp(&b.order))
                .then(a.ticket_key.cmp(&b.ticket_key))
        });
        self.fit_cases(&ordered, guidance)
    }

    /// Split `ordered` into cases that fit the token budget and cases dropped whole.
    fn fit_cases(
        &self,
        ordered: &[GradientRecord],
        guidance: &GuidanceRepo,
    ) -> (Vec<GradientRecord>, Vec<GradientRecord>) {
        let budget = self.budget;
        // Both passes see the same cases; budget for the longer of the two system prompts.
        let system = self.system.decision.len().max(self.system.ops.len());
        let base = system
            + estimate_tokens("")
            + estimate_tokens(&header_text(&self.mission, guidance, 0, 0));
        let mut used = base;
        let mut kept = Vec::new();
        let mut dropped = Vec::new();
        for (i, r) in ordered.iter().enumerate() {
            let cost = estimate_tokens(&case_text(i + 1, r, true));
            if kept.is_empty() || used + cost <= budget {
                used += cost;
                kept.push(r.clone());
            } else {
                dropped.push(r.clone());
            }
        }
        (kept, dropped)
    }

    /// The decision pass's messages and schema for `cycle` on the kept cases: as the cycle
    /// sends them, and as a call queued ahead builds them.
    pub(super) fn decision(
        &self,
        kept: &[GradientRecord],
        kept_keys: &BTreeSet<TicketKey>,
        guidance: &GuidanceRepo,
        cycle: u64,
    ) -> (Vec<ChatMessage>, Value) {
        let messages = self.decision_messages(kept, guidance, cycle);
        let schema = tailor_decision_schema(kept_keys, self.max_new_tokens);
        (messages, schema)
    }

    /// The ops pass's schema for `learnable` under `guidance`, with at most `max_ops` ops.
    pub(super) fn ops_schema(
        &self,
        max_ops: usize,
        learnable: &BTreeSet<TicketKey>,
        guidance: &GuidanceRepo,
    ) -> Value {
        let gate = self.gate_enabled;
        tailor_ops_schema(max_ops, learnable, guidance, self.max_new_tokens, gate)
    }

    fn decision_messages(
        &self,
        cases: &[GradientRecord],
        guidance: &GuidanceRepo,
        cycle: u64,
    ) -> Vec<ChatMessage> {
        let mut user = header_text(&self.mission, guidance, cycle, cases.len());
        for (i, r) in cases.iter().enumerate() {
            user.push_str(&case_text(i + 1, r, true));
        }
        user.push_str("\n请输出 JSON。");
        vec![
            ChatMessage::system(self.system.decision.clone()),
            ChatMessage::user(user),
        ]
    }

    pub(super) fn ops_messages(
        &self,
        cases: &[GradientRecord],
        guidance: &GuidanceRepo,
        cycle: u64,
        rejected: Option<&[RejectedOp]>,
        remembered: Option<&RejectedMemory>,
    ) -> Vec<ChatMessage> {
        let mut user = header_text(&self.mission, guidance, cycle, cases.len());
        for (i, r) in cases.iter().enumerate() {
            user.push_str(&case_text(i + 1, r, true));
        }
        if let Some(rejected) = rejected.filter(|r| !r.is_empty()) {
            user.push_str(
                "\n以下操作被拒绝。只需给出按原因修正后的这些操作，不要重复已接受的操作：\n",
            );
            // The packed cases fit the prompt budget; the rejected ops (a hostile model can
            // make them long) get what is left, each line capped, the rest left out.
            let budget = self.budget;
            let mut used = self.system.ops.len() + estimate_tokens(&user) + estimate_tokens("");
            for r in rejected {
                let op = serde_json::to_string(&r.proposed).unwrap_or_default();
                let line = format!(
                    "- {} → 拒绝原因: {} ({})\n",
                    text::truncate_chars(&op, REJECTED_OP_CHARS),
                    r.reason.code(),
                    text::truncate_chars(&r.detail, REJECTED_OP_CHARS)
                );
                if used + line.len() > budget {
                    break;
                }
                used += line.len();
                user.push_str(&line);
            }
        }
        if let Some(memory) = remembered.filter(|m| !m.is_empty()) {
            self.push_remembered(&mut user, memory);
        }
        if self.gate_enabled {
            user.push_str(EXPECTED_FLIPS_ASK);
        }
        user.push_str("\n请输出 JSON。");
        vec![
            ChatMessage::system(self.system.ops.clone()),
            ChatMessage::user(user),
        ]
    }
}

/// With `reflection.gate` on, the ops pass may say which of an op's evidence cases it expects
/// to be decided correctly once the op is applied; the next epoch checks the claim.
const EXPECTED_FLIPS_ASK: &str = "\n每个操作可另给 expected_flips：该操作应用后预计会被判对的 evidence 案例（evidence 的子集）；下一轮会逐一核对。\n";

impl Prompts {
    /// The edits rejected in earlier cycles, newest first, within what is left of the prompt
    /// budget (each line capped).
    fn push_remembered(&self, user: &mut String, memory: &RejectedMemory) {
        user.push_str("\n以下修改此前已被拒绝，不要再次提出：\n");
        let budget = self.budget;
        let mut used = self.system.ops.len() + estimate_tokens(user) + estimate_tokens("");
        let mut entries: Vec<_> = memory.entries().collect();
        entries.reverse();
        for e in entries {
            let line = format!(
                "- {} → 拒绝原因: {}\n",
                text::truncate_chars(&e.shown, REJECTED_OP_CHARS),
                e.reason
            );
            if used + line.len() > budget {
                break;
            }
            used += line.len();
            user.push_str(&line);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn token_estimate_is_an_upper_bound_for_byte_level_tokenizers() {
        // 通过 is 4 tokens for SmolLM2 and 6 bytes: the estimate never undercounts.
        assert!(estimate_tokens("通过") >= 4);
        assert_eq!(estimate_tokens(""), TEMPLATE_TOKENS);
    }
}
