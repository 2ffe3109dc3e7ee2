//! The scripted [`Engine`] (test double): rollouts follow the guidance rules of
//! [`super::rules`] literally, generations are answered by the scripted reflector of
//! [`super::reflector`]. Deterministic in (prompt, seed) and the script's shared state.
//!
//! Rollouts add per-seed noise: a sample decoded at temperature ≥ [`NOISY_TEMPERATURE`] flips
//! its verdict when its seed's hash is a multiple of [`NOISE_ONE_IN`], so tickets get
//! contradictions (and sometimes fail-first ties) while cold samples always follow the rules.
//!
//! [`Behaviour`] switches on the scripted misbehaviours individual tests need; the [`Script`]
//! is shared by every engine of one run.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Value, json};
use stageb_shared::seed::splitmix64;
use stageb_worker::engine::{
    CandidateOutput, Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest,
    ModelFingerprint, RolloutOutput, RolloutRequest,
};

use super::missions::TOY_CONFIRMATION;
use super::reflector::{Memory, ReflectionPrompt, decide, propose};
use super::rules::{Rule, firing_rule, rule_line};

/// A hot sample flips its verdict when `splitmix64(seed)` is a multiple of this.
pub const NOISE_ONE_IN: u64 = 4;
/// Samples decoded at or above this temperature are noisy; colder ones follow the rules.
pub const NOISY_TEMPERATURE: f32 = 0.5;

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

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) memory: Memory,
    pub(super) sightings: BTreeMap<String, u32>,
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
                    && splitmix64(seed).is_multiple_of(NOISE_ONE_IN);
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
