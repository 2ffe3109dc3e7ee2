//! Shared fixtures of the reflection-loop integration tests: a scripted [`Engine`] (test double)
//! that follows guidance rules literally and reflects with a deterministic rule proposer, a tiny
//! synthetic mission, and [`run_mission`], which runs a whole mission through the real cluster
//! runtime (real gRPC on loopback, real scheduler and leases, real artifacts).
//!
//! # The rule language
//! Rules are natural-language Chinese that the ops validator accepts (no object chains, no `/`,
//! no `×`, no third-state words, ≤160 characters). The scripted reflector writes two forms and
//! the scripted engine reads exactly these two (any other rule, such as the seed `G1`, is ignored):
//! - presence: `若摘要出现“A”或“B”则判不通过；否则按其他规则判定` fails a ticket when any
//!   summary contains any quoted phrase;
//! - absence: `若所有摘要均未出现“A”则判不通过；否则按其他规则判定` fails a ticket when no
//!   summary contains the phrase.
//!
//! A ticket that no rule fails passes. Rollouts add per-seed noise: a sample decoded at
//! temperature ≥ 0.5 flips its verdict when its seed's hash is a multiple of [`NOISE_ONE_IN`],
//! so tickets get contradictions (and sometimes fail-first ties) while cold samples always
//! follow the rules.
//!
//! # The scripted reflector
//! It parses the reflection prompt (rules, `第N组 (ticket_key=…)` cases, `参考答案 gt_label`,
//! `最终结论`, summaries) and reasons the way the prompts ask a model to:
//! - phrases are the attribute and remark parts of Stage-A summaries (object names dropped);
//!   "positive" confirmations (`安装方向正确`, `显示完整`, …) never explain a fail;
//! - it remembers every labelled case it has seen (a memory shared by all engines of a run,
//!   deterministic because rank 0 runs reflection calls one at a time);
//! - a fail-labelled case decided `通过` is explained by the defect-looking phrase that explains
//!   the most such cases and that no pass-labelled case ever contained; failing that, by the
//!   absence of a confirmation that ≥90% of pass-labelled cases contain;
//! - a pass-labelled case decided `不通过` by a learned rule gets that rule narrowed or deleted,
//!   unless the rule is trusted (it fails more than twice as many fail-labelled as
//!   pass-labelled cases remembered): then the label, not the rule, looks wrong;
//! - decision pass: a wrongly decided case with none of these directions is no-evidence;
//! - ops pass: the explaining rule is added (or an existing presence rule extended), and every
//!   other learnable case is cited as further evidence of that change, so closure `L == E`
//!   holds whenever the cycle changes something (a restated rule is no change).
//!
//! [`Behaviour`] switches on the scripted misbehaviours individual tests need.

#![allow(dead_code)] // each test file uses its own subset

pub mod compare;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{Value, json};
use stageb::cluster::{self, CoordinatorSettings};
use stageb_coordinator::run::RunSummary;
use stageb_shared::auth::AuthToken;
use stageb_worker::engine::{
    CandidateOutput, Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest,
    ModelFingerprint, RolloutOutput, RolloutRequest,
};

/// A hot sample flips its verdict when `mix(seed)` is a multiple of this.
pub const NOISE_ONE_IN: u64 = 4;
/// Samples decoded at or above this temperature are noisy; colder ones follow the rules.
pub const NOISY_TEMPERATURE: f32 = 0.5;
/// Mission of every fixture here (the demo's).
pub const MISSION: &str = "挡风板安装检查";

// ---------------------------------------------------------------------------------------------
// The rule language

/// A learned rule the scripted engine understands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// Fail when any summary contains any of the phrases.
    Present(Vec<String>),
    /// Fail when no summary contains the phrase.
    Absent(String),
}

impl Rule {
    /// Parse a guidance text; `None` for anything outside the language.
    pub fn parse(text: &str) -> Option<Rule> {
        if !text.contains("则判不通过") {
            return None;
        }
        let quoted = quoted_phrases(text);
        if quoted.is_empty() {
            return None;
        }
        if text.contains("均未出现") {
            Some(Rule::Absent(quoted[0].clone()))
        } else if text.contains("出现") {
            Some(Rule::Present(quoted))
        } else {
            None
        }
    }

    /// The rule as guidance text.
    pub fn render(&self) -> String {
        match self {
            Rule::Present(phrases) => {
                let list: Vec<String> = phrases.iter().map(|p| format!("“{p}”")).collect();
                format!(
                    "若摘要出现{}则判不通过；否则按其他规则判定",
                    list.join("或")
                )
            }
            Rule::Absent(p) => {
                format!("若所有摘要均未出现“{p}”则判不通过；否则按其他规则判定")
            }
        }
    }

    /// Does the rule fail a ticket with these summaries?
    pub fn fires(&self, summaries: &[String]) -> bool {
        match self {
            Rule::Present(phrases) => phrases
                .iter()
                .any(|p| summaries.iter().any(|s| s.contains(p.as_str()))),
            Rule::Absent(p) => !summaries.iter().any(|s| s.contains(p.as_str())),
        }
    }
}

fn quoted_phrases(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find('“') {
        let after = &rest[start + '“'.len_utf8()..];
        let Some(end) = after.find('”') else { break };
        let phrase = after[..end].trim();
        if !phrase.is_empty() {
            out.push(phrase.to_string());
        }
        rest = &after[end + '”'.len_utf8()..];
    }
    out
}

/// `[K]. text` lines → `(K, text)`.
fn rule_line(line: &str) -> Option<(String, String)> {
    let rest = line.trim().strip_prefix('[')?;
    let (key, text) = rest.split_once("]. ")?;
    Some((key.to_string(), text.to_string()))
}

/// The first learned rule (in prompt order) that fails a ticket with these summaries.
fn firing_rule<'a>(rules: &'a [(String, String)], summaries: &[String]) -> Option<&'a str> {
    rules
        .iter()
        .filter(|(k, _)| k.starts_with('G'))
        .find(|(_, t)| Rule::parse(t).is_some_and(|r| r.fires(summaries)))
        .map(|(k, _)| k.as_str())
}

// ---------------------------------------------------------------------------------------------
// Phrases of a Stage-A summary

const POSITIVE_WORDS: &[&str] = &[
    "正确",
    "完整",
    "符合要求",
    "按要求",
    "可以识别",
    "整齐",
    "到位",
    "牢固",
];
const NEGATION_MARKS: &[&str] = &["未", "不", "无", "没", "错"];
const DEFECT_MARKS: &[&str] = &[
    "未", "不", "无", "没", "错", "反", "松", "缺", "损", "晃", "翘", "裂", "脱", "模糊",
];

/// A confirmation such as `安装方向正确`: never an explanation of a fail.
fn is_positive(phrase: &str) -> bool {
    POSITIVE_WORDS.iter().any(|w| phrase.contains(w))
        && !NEGATION_MARKS.iter().any(|w| phrase.contains(w))
}

fn looks_like_defect(phrase: &str) -> bool {
    DEFECT_MARKS.iter().any(|w| phrase.contains(w))
}

/// Attribute and remark phrases of one summary: clauses split on `，`, counts (`×N`) and the
/// object name (first chain element) dropped, `备注:` remarks kept whole.
pub fn phrases_of(summary: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for clause in summary.split(['，', ',', '；', ';']) {
        let clause = clause.trim();
        if let Some(remark) = clause
            .strip_prefix("备注:")
            .or_else(|| clause.strip_prefix("备注："))
        {
            out.insert(remark.trim().to_string());
            continue;
        }
        let chain = clause.split('×').next().unwrap_or("");
        let parts: Vec<&str> = chain.split('/').map(str::trim).collect();
        let attrs = if parts.len() > 1 {
            &parts[1..]
        } else {
            &parts[..]
        };
        out.extend(attrs.iter().map(|p| p.to_string()));
    }
    out.retain(|p| p.chars().count() >= 2);
    out
}

fn phrases_of_all(summaries: &[String]) -> BTreeSet<String> {
    summaries.iter().flat_map(|s| phrases_of(s)).collect()
}

// ---------------------------------------------------------------------------------------------
// Script: behaviour switches, the shared memory and the call log

/// Scripted misbehaviours for individual tests (all off by default).
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    /// Declared no-evidence by every decision pass that sees them.
    pub always_stop: BTreeSet<String>,
    /// Declared no-evidence the first time a decision pass sees them only.
    pub stop_first_sighting: BTreeSet<String>,
    /// Never cited as evidence by any ops pass.
    pub never_cover: BTreeSet<String>,
    /// This many first decision calls answer with text that is not JSON.
    pub invalid_json_decisions: usize,
    /// No rollout noise at all.
    pub quiet: bool,
    /// Only the scripted stops above; wrongly decided cases without a direction are not
    /// declared no-evidence.
    pub no_natural_stops: bool,
    /// The first ops call also proposes an absence rule worded with a third-state word
    /// (`否则待定`, rejected by validation); the revision call re-sends every op, as its prompt
    /// asks, with that one corrected.
    pub third_state_op_then_revise: bool,
}

/// Which reflection pass a generate request was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Decision,
    Ops,
    /// Neither schema (unexpected).
    Other,
}

/// One generate request the engine saw, with its answer.
#[derive(Debug, Clone)]
pub struct LoggedCall {
    pub pass: Pass,
    pub seed: u64,
    pub system: String,
    pub user: String,
    pub output: String,
}

/// Every labelled case the reflector has seen, in any call: what it knows about the mission.
#[derive(Debug, Default)]
struct Memory {
    cases: BTreeMap<String, Case>,
}

#[derive(Debug, Default)]
struct State {
    memory: Memory,
    sightings: BTreeMap<String, u32>,
    decision_calls: usize,
    ops_calls: usize,
    log: Vec<LoggedCall>,
}

/// Shared by every engine of one run: behaviour, the reflector's memory and the generate log.
#[derive(Debug, Default)]
pub struct Script {
    pub behaviour: Behaviour,
    state: Mutex<State>,
}

impl Script {
    pub fn new(behaviour: Behaviour) -> Arc<Script> {
        Arc::new(Script {
            behaviour,
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every generate request seen so far, in order.
    pub fn calls(&self) -> Vec<LoggedCall> {
        self.state().log.clone()
    }
}

// ---------------------------------------------------------------------------------------------
// The engine

/// The test double: rollouts follow the rules literally, generations are the scripted
/// reflector. Deterministic in (prompt, seed) and the shared script state.
pub struct ScriptedEngine {
    script: Arc<Script>,
    fingerprint: ModelFingerprint,
    /// The previous rollout's user prompt: its common prefix with the next one is reported as
    /// reused, the way the real engine's prefix cache reports (a runtime field only).
    last_prompt: String,
}

impl ScriptedEngine {
    pub fn new(script: Arc<Script>) -> Self {
        ScriptedEngine {
            script,
            fingerprint: ModelFingerprint {
                weights_sha256: "scripted-engine-v1".into(),
                candle_version: "none".into(),
                dtype: "none".into(),
                device: "cpu".into(),
                architecture: "scripted".into(),
            },
            last_prompt: String::new(),
        }
    }
}

/// splitmix64 finalizer: a well-mixed function of the seed.
fn mix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn message<'a>(messages: &'a [stageb_shared::domain::ChatMessage], role: &str) -> &'a str {
    messages
        .iter()
        .find(|m| m.role == role)
        .map(|m| m.content.as_str())
        .unwrap_or("")
}

/// Rules and summaries of a rollout user prompt (`coordinator/src/prompts.rs` layout).
fn parse_rollout_prompt(user: &str) -> (Vec<(String, String)>, Vec<String>) {
    let mut rules = Vec::new();
    let mut summaries = Vec::new();
    let mut in_summaries = false;
    for line in user.lines() {
        if line.starts_with("图片摘要") {
            in_summaries = true;
            continue;
        }
        if in_summaries {
            if let Some((n, s)) = line.split_once(". ")
                && n.chars().all(|c| c.is_ascii_digit())
            {
                summaries.push(s.to_string());
            }
        } else if let Some(rule) = rule_line(line) {
            rules.push(rule);
        }
    }
    (rules, summaries)
}

impl Engine for ScriptedEngine {
    fn fingerprint(&self) -> &ModelFingerprint {
        &self.fingerprint
    }

    fn prefix_cache_bytes(&self) -> Option<u64> {
        Some(self.last_prompt.len() as u64)
    }

    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        let user = message(&request.messages, "user");
        let (rules, summaries) = parse_rollout_prompt(user);
        if summaries.is_empty() {
            return Err(EngineError::InvalidRequest(
                "no summaries in the prompt".into(),
            ));
        }
        let fired = firing_rule(&rules, &summaries);
        let mut candidates = Vec::new();
        for d in &request.decodes {
            for (s, &seed) in d.seeds.iter().enumerate() {
                let noisy = !self.script.behaviour.quiet
                    && d.temperature >= NOISY_TEMPERATURE
                    && mix(seed).is_multiple_of(NOISE_ONE_IN);
                let fail = fired.is_some() != noisy;
                let text = match (fail, fired, noisy) {
                    (true, Some(k), _) => {
                        format!("Verdict: 不通过\nReason: 摘要触发规则{k}，判不通过")
                    }
                    (true, None, _) => "Verdict: 不通过\nReason: 抽样偏差，判不通过".to_string(),
                    (false, _, true) => "Verdict: 通过\nReason: 抽样偏差，判通过".to_string(),
                    (false, _, false) => {
                        "Verdict: 通过\nReason: 未触发任何不通过规则，判通过".to_string()
                    }
                };
                candidates.push(CandidateOutput {
                    decode_index: d.decode_index,
                    sample_index: s as u32,
                    seed,
                    completion_tokens: text.chars().count() as u32,
                    text,
                    finish: FinishReason::Stop,
                });
            }
        }
        let prompt_tokens = user.chars().count();
        let shared = user
            .chars()
            .zip(self.last_prompt.chars())
            .take_while(|(a, b)| a == b)
            .count();
        self.last_prompt = user.to_string();
        Ok(RolloutOutput {
            candidates,
            prompt_tokens: prompt_tokens as u32,
            prefix_tokens: shared.min(prompt_tokens.saturating_sub(1)) as u32,
            prefill_us: 0,
            decode_us: 0,
        })
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        let system = message(&request.messages, "system").to_string();
        let user = message(&request.messages, "user").to_string();
        let schema = request.json_schema.clone().unwrap_or(Value::Null);
        let pass = if schema
            .pointer("/properties/no_evidence_group_ids")
            .is_some()
        {
            Pass::Decision
        } else if schema.pointer("/properties/operations").is_some() {
            Pass::Ops
        } else {
            Pass::Other
        };
        let prompt = ReflectionPrompt::parse(&user);
        let behaviour = &self.script.behaviour;
        let mut state = self.script.state();
        state.memory.learn(&prompt.cases);
        let output = match pass {
            Pass::Decision => {
                state.decision_calls += 1;
                if state.decision_calls <= behaviour.invalid_json_decisions {
                    "好的，以下是判定结果：no_evidence_group_ids 为空".to_string()
                } else {
                    decide(&prompt, behaviour, &mut state).to_string()
                }
            }
            Pass::Ops => {
                state.ops_calls += 1;
                let mut out = propose(&prompt, behaviour, &state.memory);
                let revision = user.contains("以下操作被拒绝");
                if behaviour.third_state_op_then_revise && (state.ops_calls == 1 || revision) {
                    let evidence: Vec<&str> = prompt
                        .cases
                        .iter()
                        .filter(|c| c.wrong_pass())
                        .map(|c| c.key.as_str())
                        .collect();
                    let mut text = Rule::Absent(TOY_CONFIRMATION.into()).render();
                    if !revision {
                        text = text.replace("按其他规则判定", "待定");
                    }
                    out["operations"].as_array_mut().unwrap().push(json!({
                        "op": "add", "text": text, "evidence": evidence,
                        "rationale": "所有图片都看不到方向确认时要点无法确认",
                    }));
                }
                out.to_string()
            }
            Pass::Other => "{}".to_string(),
        };
        state.log.push(LoggedCall {
            pass,
            seed: request.seed,
            system,
            user: user.clone(),
            output: output.clone(),
        });
        Ok(GenerateOutput {
            prompt_tokens: user.chars().count() as u32,
            completion_tokens: output.chars().count() as u32,
            text: output,
            finish: FinishReason::Stop,
            latency_us: 0,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The scripted reflector

/// One `第N组` case of a reflection prompt.
#[derive(Debug, Clone, Default)]
pub struct Case {
    pub key: String,
    pub gt_fail: bool,
    /// `None` when the prompt says 格式错误.
    pub final_fail: Option<bool>,
    pub summaries: Vec<String>,
}

impl Case {
    fn wrong_pass(&self) -> bool {
        self.gt_fail && self.final_fail == Some(false)
    }

    fn wrong_fail(&self) -> bool {
        !self.gt_fail && self.final_fail == Some(true)
    }
}

/// A parsed reflection user prompt (`coordinator/src/reflection.rs` `header_text`/`case_text`).
#[derive(Debug, Clone, Default)]
pub struct ReflectionPrompt {
    pub rules: Vec<(String, String)>,
    pub cases: Vec<Case>,
}

fn verdict_is_fail(word: &str) -> Option<bool> {
    match word.trim() {
        "不通过" => Some(true),
        "通过" => Some(false),
        _ => None,
    }
}

impl ReflectionPrompt {
    pub fn parse(user: &str) -> Self {
        let mut out = ReflectionPrompt::default();
        let mut in_summaries = false;
        for line in user.lines() {
            let trimmed = line.trim();
            if let Some(rest) = trimmed.split_once("(ticket_key=").map(|(_, r)| r)
                && trimmed.starts_with('第')
            {
                out.cases.push(Case {
                    key: rest
                        .trim_end_matches("):")
                        .trim_end_matches(')')
                        .to_string(),
                    ..Case::default()
                });
                in_summaries = false;
                continue;
            }
            let Some(case) = out.cases.last_mut() else {
                if let Some(rule) = rule_line(line) {
                    out.rules.push(rule);
                }
                continue;
            };
            if let Some(gt) = trimmed.strip_prefix("参考答案 gt_label:") {
                case.gt_fail = verdict_is_fail(gt).unwrap_or(false);
            } else if let Some(fin) = trimmed.strip_prefix("最终结论:") {
                case.final_fail = verdict_is_fail(fin.split('；').next().unwrap_or(""));
            } else if trimmed == "摘要:" {
                in_summaries = true;
            } else if trimmed == "候选:" {
                in_summaries = false;
            } else if in_summaries
                && let Some((n, s)) = trimmed.split_once(". ")
                && n.chars().all(|c| c.is_ascii_digit())
            {
                case.summaries.push(s.to_string());
            }
        }
        out
    }
}

impl Memory {
    fn learn(&mut self, cases: &[Case]) {
        for c in cases {
            self.cases.insert(c.key.clone(), c.clone());
        }
    }

    fn pass_cases(&self) -> impl Iterator<Item = &Case> {
        self.cases.values().filter(|c| !c.gt_fail)
    }

    /// Does any pass-labelled case contain `phrase`?
    fn seen_in_pass(&self, phrase: &str) -> bool {
        self.pass_cases()
            .any(|c| c.summaries.iter().any(|s| s.contains(phrase)))
    }

    /// `(fail-labelled, pass-labelled)` cases the rule fails.
    fn support(&self, rule: &Rule) -> (usize, usize) {
        let fired = self.cases.values().filter(|c| rule.fires(&c.summaries));
        fired.fold(
            (0, 0),
            |(f, p), c| if c.gt_fail { (f + 1, p) } else { (f, p + 1) },
        )
    }

    /// A rule (or phrase) is trusted when it fails at least twice as many fail-labelled as
    /// pass-labelled cases: a pass-labelled case it fails is then more likely mislabelled
    /// than the rule wrong.
    fn trusted(&self, rule: &Rule) -> bool {
        let (fails, passes) = self.support(rule);
        fails > 2 * passes
    }

    /// Confirmations nearly every pass-labelled case carries: `(phrase, cases)`, once a few
    /// pass-labelled cases have been seen.
    fn confirmations(&self) -> Vec<(String, usize)> {
        let n = self.pass_cases().count();
        if n < 3 {
            return Vec::new();
        }
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for c in self.pass_cases() {
            for p in phrases_of_all(&c.summaries) {
                *counts.entry(p).or_default() += 1;
            }
        }
        counts
            .into_iter()
            .filter(|(p, c)| is_positive(p) && *c * 10 >= n * 9)
            .collect()
    }
}

/// Presence phrases that could explain failing `case`: defect-looking or neutral phrases no
/// pass-labelled case contains.
fn presence_candidates(case: &Case, memory: &Memory) -> Vec<String> {
    phrases_of_all(&case.summaries)
        .into_iter()
        .filter(|p| !is_positive(p) && !memory.seen_in_pass(p))
        .collect()
}

/// Absent confirmations that could explain failing `case`.
fn absence_candidates(case: &Case, memory: &Memory) -> Vec<(String, usize)> {
    memory
        .confirmations()
        .into_iter()
        .filter(|(p, _)| !case.summaries.iter().any(|s| s.contains(p.as_str())))
        .collect()
}

/// The parts of `rule` to take back because they fail `case` (pass-labelled) without enough
/// support: phrases of a presence rule, or the whole absence rule. Empty when the rule does
/// not fire on `case` or is trusted.
fn blamed(rule: &Rule, case: &Case, memory: &Memory) -> Vec<String> {
    match rule {
        Rule::Present(ps) => ps
            .iter()
            .filter(|p| case.summaries.iter().any(|s| s.contains(p.as_str())))
            .filter(|p| !memory.trusted(&Rule::Present(vec![(*p).clone()])))
            .cloned()
            .collect(),
        Rule::Absent(p) if rule.fires(&case.summaries) && !memory.trusted(rule) => {
            vec![p.clone()]
        }
        Rule::Absent(_) => Vec::new(),
    }
}

/// Whether a wrongly decided case has any learnable direction.
fn has_direction(case: &Case, rules: &[(String, String)], memory: &Memory) -> bool {
    if case.wrong_pass() {
        !presence_candidates(case, memory).is_empty()
            || !absence_candidates(case, memory).is_empty()
    } else if case.wrong_fail() {
        rules
            .iter()
            .filter(|(k, _)| k.starts_with('G'))
            .filter_map(|(_, t)| Rule::parse(t))
            .any(|r| !blamed(&r, case, memory).is_empty())
    } else {
        true
    }
}

fn decide(prompt: &ReflectionPrompt, behaviour: &Behaviour, state: &mut State) -> Value {
    let mut stop = Vec::new();
    for case in &prompt.cases {
        let seen = state.sightings.entry(case.key.clone()).or_default();
        *seen += 1;
        let scripted = behaviour.always_stop.contains(&case.key)
            || (*seen == 1 && behaviour.stop_first_sighting.contains(&case.key));
        let natural = !behaviour.no_natural_stops
            && (case.wrong_pass() || case.wrong_fail())
            && !has_direction(case, &prompt.rules, &state.memory);
        if scripted || natural {
            stop.push(case.key.clone());
        }
    }
    json!({
        "no_evidence_group_ids": stop,
        "decision_analysis": "逐例尝试了摘要短语出现、确认信息缺失和既有规则收窄三个方向；列出的案例三个方向都找不到可泛化依据。",
    })
}

/// One op under construction.
struct Draft {
    op: &'static str,
    key: Option<String>,
    text: Option<String>,
    rationale: &'static str,
    evidence: Vec<String>,
}

impl Draft {
    fn json(&self) -> Value {
        let mut v = json!({"op": self.op, "rationale": self.rationale, "evidence": self.evidence});
        if let Some(k) = &self.key {
            v["key"] = json!(k);
        }
        if let Some(t) = &self.text {
            v["text"] = json!(t);
        }
        v
    }
}

fn propose(prompt: &ReflectionPrompt, behaviour: &Behaviour, memory: &Memory) -> Value {
    let cases = &prompt.cases;
    let mut rules: BTreeMap<String, Option<Rule>> = prompt
        .rules
        .iter()
        .filter(|(k, _)| k.starts_with('G'))
        .map(|(k, t)| (k.clone(), Rule::parse(t)))
        .collect();
    let mut drafts: Vec<Draft> = Vec::new();
    let mut cited: BTreeSet<String> = BTreeSet::new();

    // 1. A learned rule that fails pass-labelled cases without enough support is narrowed
    //    (its blamed phrases dropped) or deleted.
    let keys: Vec<String> = rules.keys().cloned().collect();
    for key in keys {
        let Some(rule) = rules[&key].clone() else {
            continue;
        };
        let mut drop: BTreeSet<String> = BTreeSet::new();
        let mut evidence: Vec<String> = Vec::new();
        for c in cases.iter().filter(|c| c.wrong_fail()) {
            let blame = blamed(&rule, c, memory);
            if !blame.is_empty() {
                evidence.push(c.key.clone());
                drop.extend(blame);
            }
        }
        if evidence.is_empty() {
            continue;
        }
        let narrowed = match &rule {
            Rule::Present(ps) => {
                let keep: Vec<String> = ps.iter().filter(|p| !drop.contains(*p)).cloned().collect();
                (!keep.is_empty()).then_some(Rule::Present(keep))
            }
            Rule::Absent(_) => None,
        };
        cited.extend(evidence.iter().cloned());
        match narrowed {
            Some(r) => {
                drafts.push(Draft {
                    op: "update",
                    key: Some(key.clone()),
                    text: Some(r.render()),
                    rationale: "原规则使参考答案为通过的案例判不通过，去掉误伤的短语",
                    evidence,
                });
                rules.insert(key, Some(r));
            }
            None => {
                drafts.push(Draft {
                    op: "delete",
                    key: Some(key.clone()),
                    text: None,
                    rationale: "该规则使参考答案为通过的案例判不通过",
                    evidence,
                });
                rules.insert(key, None);
            }
        }
    }

    // 2. Fail-labelled cases decided 通过 that no rule fails yet: explain them.
    let fires_now = |rules: &BTreeMap<String, Option<Rule>>, c: &Case| {
        rules.values().flatten().any(|r| r.fires(&c.summaries))
    };
    let mut open: Vec<&Case> = cases
        .iter()
        .filter(|c| c.wrong_pass() && !fires_now(&rules, c))
        .collect();
    let mut phrases: Vec<String> = Vec::new();
    let mut phrase_evidence: Vec<String> = Vec::new();
    loop {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for c in &open {
            for p in presence_candidates(c, memory) {
                *counts.entry(p).or_default() += 1;
            }
        }
        // Defect-looking first, then the most cases explained, then the shortest phrase.
        let best = counts.into_iter().max_by(|(pa, na), (pb, nb)| {
            looks_like_defect(pa)
                .cmp(&looks_like_defect(pb))
                .then(na.cmp(nb))
                .then(pb.chars().count().cmp(&pa.chars().count()))
                .then(pb.cmp(pa))
        });
        let Some((phrase, _)) = best else { break };
        let mut longer = phrases.clone();
        longer.push(phrase.clone());
        if Rule::Present(longer).render().chars().count() > 150 {
            break; // the rest waits for the next cycle (retried as uncovered)
        }
        let (hit, rest): (Vec<&Case>, Vec<&Case>) = open
            .into_iter()
            .partition(|c| c.summaries.iter().any(|s| s.contains(phrase.as_str())));
        phrase_evidence.extend(hit.iter().map(|c| c.key.clone()));
        phrases.push(phrase);
        open = rest;
    }
    if !phrases.is_empty() {
        // Prefer extending an existing presence rule over adding one.
        let existing = rules.iter().find_map(|(k, r)| match r {
            Some(Rule::Present(ps)) => {
                let mut all = ps.clone();
                all.extend(phrases.iter().cloned());
                let r = Rule::Present(all);
                (r.render().chars().count() <= 150).then(|| (k.clone(), r))
            }
            _ => None,
        });
        cited.extend(phrase_evidence.iter().cloned());
        match existing {
            Some((key, r)) => {
                if let Some(d) = drafts
                    .iter_mut()
                    .find(|d| d.key.as_deref() == Some(key.as_str()))
                {
                    d.op = "update";
                    d.text = Some(r.render());
                    d.evidence.extend(phrase_evidence);
                } else {
                    drafts.push(Draft {
                        op: "update",
                        key: Some(key.clone()),
                        text: Some(r.render()),
                        rationale: "补充新的缺陷短语，覆盖同类不通过案例",
                        evidence: phrase_evidence,
                    });
                }
                rules.insert(key, Some(r));
            }
            None => {
                let r = Rule::Present(phrases);
                drafts.push(Draft {
                    op: "add",
                    key: None,
                    text: Some(r.render()),
                    rationale: "新增缺陷短语规则，现有规则未检查这些现象",
                    evidence: phrase_evidence,
                });
                rules.insert("new-present".into(), Some(r));
            }
        }
    }
    // Still open: the absence of a confirmation every pass case has.
    let mut counts: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for c in &open {
        for (p, support) in absence_candidates(c, memory) {
            let e = counts.entry(p).or_insert((0, support));
            e.0 += 1;
        }
    }
    let best = counts.into_iter().max_by(|(pa, (na, sa)), (pb, (nb, sb))| {
        na.cmp(nb)
            .then(sa.cmp(sb))
            .then(pa.chars().count().cmp(&pb.chars().count()))
            .then(pb.cmp(pa))
    });
    if let Some((phrase, _)) = best {
        let evidence: Vec<String> = open
            .iter()
            .filter(|c| !c.summaries.iter().any(|s| s.contains(phrase.as_str())))
            .map(|c| c.key.clone())
            .collect();
        cited.extend(evidence.iter().cloned());
        drafts.push(Draft {
            op: "add",
            key: None,
            text: Some(Rule::Absent(phrase).render()),
            rationale: "所有图片都看不到该确认信息时要点无法确认，现有规则未覆盖",
            evidence,
        });
    }

    // 3. Every other learnable case was considered for this cycle's change: cited as its
    //    evidence. Without a change they stay uncovered (a restated rule changes nothing and
    //    covers nothing).
    let rest: Vec<String> = cases
        .iter()
        .map(|c| c.key.clone())
        .filter(|k| !cited.contains(k))
        .collect();
    if let Some(first) = drafts.first_mut() {
        first.evidence.extend(rest);
    }

    for d in &mut drafts {
        d.evidence.retain(|k| !behaviour.never_cover.contains(k));
    }
    drafts.retain(|d| !d.evidence.is_empty());
    let operations: Vec<Value> = drafts.iter().map(Draft::json).collect();
    json!({
        "has_evidence": !operations.is_empty(),
        "evidence_analysis": "按摘要短语与参考答案的对应关系提出规则，其余案例与检查清单一致。",
        "operations": operations,
    })
}

// ---------------------------------------------------------------------------------------------
// Missions and runs

/// A ticket of a synthetic mission.
pub struct TicketSpec {
    pub group_id: String,
    pub label: &'static str,
    pub per_image: Vec<String>,
}

/// Write `stage_a.jsonl` for `tickets` into `dir`.
pub fn write_stage_a(dir: &Path, tickets: &[TicketSpec]) {
    let mut text = String::new();
    for t in tickets {
        let per_image: serde_json::Map<String, Value> = t
            .per_image
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("image_{}", i + 1), json!(s)))
            .collect();
        let images: Vec<String> = (0..t.per_image.len())
            .map(|i| format!("{}_{i}.jpeg", t.group_id))
            .collect();
        let row = json!({"group_id": t.group_id, "mission": MISSION, "label": t.label,
                         "images": images, "per_image": per_image});
        text.push_str(&row.to_string());
        text.push('\n');
    }
    std::fs::write(dir.join("stage_a.jsonl"), text).expect("write stage_a.jsonl");
}

/// Seed guidance of the synthetic mission: the demo's `S1` and `G0`, no learned rule, so the
/// scripted engine starts by passing everything.
pub fn write_toy_guidance(dir: &Path) {
    let g = json!({MISSION: {
        "step": 1,
        "updated_at": "2026-01-01T00:00:00+00:00",
        "experiences": {
            "S1": "结论只能基于摘要中与挡风板相关的证据；光纤、尾纤、线缆、标签等其他对象的问题与挡风板无关，不影响判定。",
            "G0": "检查BBU设备是否按要求配备挡风板；挡风板安装方向是否正确；挡风板是否安装牢固。",
        },
        "metadata": {},
    }});
    std::fs::write(
        dir.join("guidance.json"),
        serde_json::to_string_pretty(&g).unwrap(),
    )
    .expect("write guidance.json");
}

/// The confirmation every synthetic pass ticket carries and no fail ticket does.
pub const TOY_CONFIRMATION: &str = "安装方向正确";

/// Defects of the synthetic fail tickets: none contains a fail-first trigger word, so only
/// learned rules can fail them, and no two share a phrase, so each needs its own evidence.
pub const TOY_DEFECTS: &[&str] = &[
    "挡风板装反了",
    "挡风板有晃动",
    "挡风板一侧螺丝未拧紧",
    "挡风板边缘翘起",
    "挡风板表面有裂纹",
    "挡风板卡扣脱落",
    "挡风板与机框之间不贴合",
    "挡风板没有固定",
];

/// The synthetic mission: 8 pass tickets with a fully confirmed panel and 8 fail tickets
/// (`QC-TOY-F{i}::fail`, defect `TOY_DEFECTS[i]` in a remark only). The engine passes every
/// ticket until rules are learned, so every fail ticket is a gradient candidate in epoch 1.
pub fn write_toy_mission(dir: &Path) {
    let context = [
        "光纤/显示完整/弯曲半径符合要求×2，标签/可以识别×3",
        "接地线/显示完整/符合要求×1",
        "线缆/显示完整/绑扎整齐×4",
        "机柜/显示完整×1，走线架/显示完整/符合要求×1",
    ];
    let mut tickets = Vec::new();
    for i in 0..8 {
        let mut per_image = vec![
            "BBU设备/显示完整/这个BBU设备按要求配备了挡风板×1，挡风板/显示完整/安装方向正确×1，螺丝/显示完整/符合要求×3".to_string(),
        ];
        if i % 2 == 1 {
            per_image.push(context[i / 2].to_string());
        }
        tickets.push(TicketSpec {
            group_id: format!("QC-TOY-P{i}"),
            label: "pass",
            per_image,
        });
    }
    for (i, defect) in TOY_DEFECTS.iter().enumerate() {
        let mut per_image = vec![format!(
            "BBU设备/显示完整/这个BBU设备按要求配备了挡风板×1，挡风板/显示完整×1，螺丝/显示完整/符合要求×2，备注: {defect}"
        )];
        if i % 2 == 0 {
            per_image.insert(0, context[i / 2].to_string());
        }
        tickets.push(TicketSpec {
            group_id: format!("QC-TOY-F{i}"),
            label: "fail",
            per_image,
        });
    }
    write_stage_a(dir, &tickets);
    write_toy_guidance(dir);
}

/// Key of the synthetic fail ticket `i`.
pub fn toy_fail_key(i: usize) -> String {
    format!("QC-TOY-F{i}::fail")
}

/// Copy the demo mission's Stage-A file and guidance into `dir`.
pub fn copy_demo_mission(dir: &Path) {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/demo");
    for f in ["stage_a.jsonl", "guidance.json"] {
        std::fs::copy(demo.join(f), dir.join(f)).unwrap_or_else(|e| panic!("copy {f}: {e}"));
    }
}

/// `over` merged into `base`: objects key by key, anything else replaced.
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o,
    }
}

/// The base config (the demo's knobs: 2 temperatures × 2 samples, agreement 0.67) with
/// absolute paths into `dir`, so tests never depend on the working directory, and short lease
/// timings. Steps are 8 tickets (`per_rank_rollout_batch_size` 1 × 8 reference ranks).
pub fn base_config(dir: &Path) -> Value {
    json!({
        "seed": 17,
        "stage_a_paths": [dir.join("stage_a.jsonl")],
        "model": {"model_name_or_path": "scripted-engine"},
        "guidance": {"path": dir.join("guidance.json"), "retention": 5, "reset_on_rerun": true},
        "output": {"root": dir.join("runs"), "run_name": "it"},
        "sampler": {
            "samples_per_decode": 2,
            "grid": [
                {"temperature": 0.3, "top_p": 0.9, "max_new_tokens": 48, "repetition_penalty": 1.05},
                {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 48, "repetition_penalty": 1.05},
            ],
        },
        "manual_review": {"min_verdict_agreement": 0.67},
        "runner": {"epochs": 1, "per_rank_rollout_batch_size": 1, "logging_steps": 8,
                   "lease_ttl_s": 10, "heartbeat_interval_s": 1},
        "reflection": {
            "batch_size": 4, "max_operations": 4, "temperature": 0.3, "top_p": 0.9,
            "repetition_penalty": 1.05, "max_new_tokens": 512,
            "max_reflection_length": 16384, "token_budget": 16384,
            "retry_budget_per_group_per_epoch": 2, "max_calls_per_epoch": null,
        },
        "selection": {"policy": "top_label", "tie_break": "temperature"},
    })
}

/// Writes [`base_config`] with `overrides` merged in as `dir/config.yaml`.
pub fn write_config(dir: &Path, overrides: Value) -> PathBuf {
    let mut config = base_config(dir);
    merge(&mut config, overrides);
    // JSON is YAML: the config loader reads it as a flow-style document.
    let config_path = dir.join("config.yaml");
    std::fs::write(&config_path, serde_json::to_string_pretty(&config).unwrap())
        .expect("write config");
    config_path
}

/// Runs `config_path` through the real coordinator and `workers` in-process workers over
/// loopback gRPC with a generated token, starting per `start`, stopping early when
/// `interrupt` resolves.
pub fn try_run<E, F>(
    config_path: &Path,
    workers: usize,
    make_engine: F,
    start: cluster::StartMode,
    interrupt: impl std::future::Future<Output = ()>,
) -> Result<RunSummary, cluster::ClusterError>
where
    E: stageb_worker::engine::Engine + 'static,
    F: Fn(usize) -> E + Send + Sync + 'static,
{
    try_run_watched(config_path, workers, make_engine, start, interrupt, None)
}

/// [`try_run`] publishing the run's progress to `progress` (for tests that watch it).
pub fn try_run_watched<E, F>(
    config_path: &Path,
    workers: usize,
    make_engine: F,
    start: cluster::StartMode,
    interrupt: impl std::future::Future<Output = ()>,
    progress: Option<stageb_coordinator::run::ProgressHandle>,
) -> Result<RunSummary, cluster::ClusterError>
where
    E: stageb_worker::engine::Engine + 'static,
    F: Fn(usize) -> E + Send + Sync + 'static,
{
    let inputs = cluster::prepare_inputs(config_path, "embedded")?;
    let settings = CoordinatorSettings {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: Some(AuthToken::generate()),
        tls: None,
        edge_limits: Default::default(),
        worker_grace: Duration::from_secs(30),
        progress_every: Duration::from_secs(60),
        show_progress: false,
        progress,
        start,
        drain_timeout: Duration::from_secs(10),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(cluster::run_coordinator_until(
        inputs,
        settings,
        move |addr, token| {
            cluster::spawn_local_workers(workers, addr, token, None, move |i| Ok(make_engine(i)))
        },
        interrupt,
    ))
}

/// Run the mission in `dir` (`stage_a.jsonl`, `guidance.json`) with `overrides` merged into
/// [`base_config`] (see [`try_run`]). Returns the summary and the run directory.
pub fn run_mission<F>(
    dir: &Path,
    overrides: Value,
    workers: usize,
    make_engine: F,
) -> (RunSummary, PathBuf)
where
    F: Fn(usize) -> ScriptedEngine + Send + Sync + 'static,
{
    let config_path = write_config(dir, overrides);
    let summary = try_run(
        &config_path,
        workers,
        make_engine,
        cluster::StartMode::Fresh,
        std::future::pending(),
    )
    .expect("the run completes");
    let run_dir = summary.run_dir.clone();
    (summary, run_dir)
}

/// Rows of a JSONL artifact of the run.
pub fn read_jsonl(run_dir: &Path, name: &str) -> Vec<Value> {
    let text =
        std::fs::read_to_string(run_dir.join(name)).unwrap_or_else(|e| panic!("read {name}: {e}"));
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{name}: {e}: {l}")))
        .collect()
}

/// A JSON array of strings as a set.
pub fn str_set(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// `stageb audit` finds nothing wrong with the run directory.
pub fn assert_audit_ok(run_dir: &Path) {
    let report = stageb_inspect::audit::audit(run_dir);
    let lines: Vec<String> = report.violations.iter().map(|v| v.to_string()).collect();
    assert!(
        report.ok(),
        "audit of {} found {} violation(s):\n{}",
        run_dir.display(),
        lines.len(),
        lines.join("\n")
    );
}

/// A minimal rollout job: one decode group with one candidate per seed (scheduler-level tests
/// that need a payload rank 0 accepts answers for).
pub fn rollout_job(seeds: Vec<u64>) -> stageb_coordinator::cluster::scheduler::JobPayload {
    stageb_coordinator::cluster::scheduler::JobPayload::Rollout {
        messages: vec![stageb_shared::domain::ChatMessage::user("x")],
        decodes: vec![stageb_coordinator::cluster::scheduler::DecodeJob {
            decode_index: 0,
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.0,
            max_new_tokens: 8,
            seeds,
        }],
        constrained: true,
    }
}
