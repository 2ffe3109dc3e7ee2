//! The scripted [`Engine`] (test double): rollouts follow the guidance rules of
//! [`super::rules`] literally, generations are answered by the scripted reflector of
//! [`super::reflector`]. Deterministic in (prompt, seed) and the script's shared state.
//!
//! Rollouts add per-seed noise: a sample decoded at temperature ≥ [`NOISY_TEMPERATURE`] flips
//! its verdict when its seed's hash is a multiple of [`NOISE_ONE_IN`], so tickets get
//! contradictions (and sometimes fail-first ties) while cold samples always follow the rules.
//!
//! The [`Script`] is shared by every engine of one run: the [`Behaviour`] switches a spec
//! flipped, the scripted reflector's state and the log of generate calls.

use std::sync::{Arc, Mutex, MutexGuard};

use stageb_shared::seed::splitmix64;
use stageb_worker::engine::{
    CandidateOutput, Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest,
    ModelFingerprint, RolloutOutput, RolloutRequest,
};

use super::behaviour::Behaviour;
use super::reflector::{Pass, Reflector};
use super::rules::{firing_rule, rule_line};

/// A hot sample flips its verdict when `splitmix64(seed)` is a multiple of this.
pub const NOISE_ONE_IN: u64 = 4;
/// Samples decoded at or above this temperature are noisy; colder ones follow the rules.
pub const NOISY_TEMPERATURE: f32 = 0.5;

/// One generate request the engine saw, with its answer.
#[derive(Debug, Clone)]
pub struct LoggedCall {
    pub pass: Pass,
    pub seed: u64,
    pub system: String,
    pub user: String,
    pub output: String,
}

/// What the engines of a run share behind the script's lock.
#[derive(Debug, Default)]
struct State {
    reflector: Reflector,
    log: Vec<LoggedCall>,
}

/// Shared by every engine of one run: behaviour, the scripted reflector and the generate log.
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
    /// The same for generations (system prompt, then user prompt), which the real engine keeps
    /// in a store of their own.
    last_generate_prompt: String,
}

/// Characters `prompt` shares with `last` from the start, at most all but its last one (the
/// real engine always prefills the last prompt token); `last` becomes `prompt`.
fn reused_prefix(last: &mut String, prompt: &str) -> u32 {
    let n = prompt.chars().count();
    let shared = prompt
        .chars()
        .zip(last.chars())
        .take_while(|(a, b)| a == b)
        .count();
    *last = prompt.to_string();
    shared.min(n.saturating_sub(1)) as u32
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
            last_generate_prompt: String::new(),
        }
    }

    /// The same engine presenting `fingerprint` (a spec about model pinning).
    pub fn with_fingerprint(mut self, fingerprint: ModelFingerprint) -> Self {
        self.fingerprint = fingerprint;
        self
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
        let prefix_tokens = reused_prefix(&mut self.last_prompt, user);
        Ok(RolloutOutput {
            candidates,
            prompt_tokens: prompt_tokens as u32,
            prefix_tokens,
            prefill_us: 0,
            decode_us: 0,
            batch: Default::default(),
        })
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        let system = message(&request.messages, "system").to_string();
        let user = message(&request.messages, "user").to_string();
        let pass = Pass::of_schema(request.json_schema.as_ref());
        let mut state = self.script.state();
        let output = state.reflector.answer(pass, &user, &self.script.behaviour);
        state.log.push(LoggedCall {
            pass,
            seed: request.seed,
            system: system.clone(),
            user: user.clone(),
            output: output.clone(),
        });
        let prompt = format!("{system}{user}");
        let prefix_tokens = reused_prefix(&mut self.last_generate_prompt, &prompt);
        Ok(GenerateOutput {
            prompt_tokens: prompt.chars().count() as u32,
            prefix_tokens,
            completion_tokens: output.chars().count() as u32,
            text: output,
            finish: FinishReason::Stop,
            latency_us: 0,
            batch: Default::default(),
        })
    }
}
