//! `stageb generate`: one prompt through an engine, the way a rollout job runs it (the same
//! seeds, the same two-line contract constraint), with every candidate read back against the
//! contract. Not to be confused with [`Engine::generate`], the free generation reflection uses.
//!
//! [`run_prompt`] drives the engine; [`CandidateRow`] is the `--json` line of one candidate
//! (its fields, in order, are the documented output), and the text lines are
//! [`CandidateRow::text_block`] and [`PromptRun::timing_line`].

use serde::Serialize;
use stageb_shared::contract;
use stageb_shared::domain::{ChatMessage, Verdict};
use stageb_shared::seed::candidate_seed;

use crate::engine::{DecodeRequest, Engine, EngineError, ModelFingerprint, RolloutRequest};

/// One prompt and how to sample it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptSpec {
    /// The system message, if any (before the user message).
    pub system: Option<String>,
    pub user: String,
    pub candidates: u32,
    /// Each candidate's seed derives from it like a rollout's (epoch 0, ticket `generate`).
    pub seed: u64,
    pub temperature: f32,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub max_new_tokens: u32,
    /// Constrain every candidate to the two-line contract.
    pub constrained: bool,
}

impl PromptSpec {
    /// The rollout request an engine runs for this prompt: one decode group of
    /// [`PromptSpec::candidates`] seeds.
    pub fn rollout_request(&self) -> RolloutRequest {
        let mut messages: Vec<ChatMessage> = self
            .system
            .iter()
            .cloned()
            .map(ChatMessage::system)
            .collect();
        messages.push(ChatMessage::user(self.user.clone()));
        let seeds = (0..self.candidates)
            .map(|s| candidate_seed(self.seed, 0, "generate", 0, s))
            .collect();
        RolloutRequest {
            messages,
            decodes: vec![DecodeRequest {
                decode_index: 0,
                temperature: self.temperature,
                top_p: self.top_p,
                repetition_penalty: self.repetition_penalty,
                max_new_tokens: self.max_new_tokens,
                seeds,
            }],
            constrained: self.constrained,
        }
    }
}

/// One candidate as `stageb generate --json` prints it (one object per line).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateRow {
    pub sample_index: u32,
    pub seed: u64,
    pub text: String,
    /// The text obeys the two-line contract.
    pub format_ok: bool,
    pub verdict: Option<Verdict>,
    pub reason: Option<String>,
    /// The contract's violation code when it does not.
    pub violation: Option<&'static str>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub finish_reason: &'static str,
    pub model_fingerprint: ModelFingerprint,
}

impl CandidateRow {
    /// The candidate in text form: a header line, then the text as generated.
    pub fn text_block(&self) -> String {
        let status = match self.violation {
            None => "ok".to_string(),
            Some(code) => format!("MALFORMED {code}"),
        };
        format!(
            "--- candidate {} (seed {}, {} tokens, {status})\n{}",
            self.sample_index, self.seed, self.completion_tokens, self.text
        )
    }
}

/// What one prompt gave.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRun {
    /// In request order.
    pub rows: Vec<CandidateRow>,
    pub prompt_tokens: u32,
    pub prefill_us: u64,
    pub decode_us: u64,
    pub fingerprint: ModelFingerprint,
}

impl PromptRun {
    /// The closing line of the text form: prompt size, timings, model.
    pub fn timing_line(&self) -> String {
        format!(
            "prompt {} tokens, prefill {:.2}s, decode {:.2}s, model {}",
            self.prompt_tokens,
            self.prefill_us as f64 / 1e6,
            self.decode_us as f64 / 1e6,
            self.fingerprint.id()
        )
    }
}

/// Run `spec` on `engine` and check every candidate against the contract.
pub fn run_prompt(engine: &mut impl Engine, spec: &PromptSpec) -> Result<PromptRun, EngineError> {
    let out = engine.rollout(&spec.rollout_request())?;
    let fingerprint = engine.fingerprint().clone();
    let rows = out
        .candidates
        .into_iter()
        .map(|c| {
            let parsed = contract::parse(&c.text);
            CandidateRow {
                sample_index: c.sample_index,
                seed: c.seed,
                format_ok: parsed.is_ok(),
                verdict: parsed.as_ref().ok().map(|p| p.verdict),
                reason: parsed.as_ref().ok().map(|p| p.reason.clone()),
                violation: parsed.as_ref().err().map(|v| v.code.code()),
                text: c.text,
                prompt_tokens: out.prompt_tokens,
                completion_tokens: c.completion_tokens,
                finish_reason: c.finish.as_str(),
                model_fingerprint: fingerprint.clone(),
            }
        })
        .collect();
    Ok(PromptRun {
        rows,
        prompt_tokens: out.prompt_tokens,
        prefill_us: out.prefill_us,
        decode_us: out.decode_us,
        fingerprint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{
        CandidateOutput, FinishReason, GenerateOutput, GenerateRequest, RolloutOutput,
    };
    use serde_json::Value;

    /// Answers a rollout with the texts it holds, one per seed, and keeps the request.
    struct Scripted {
        texts: Vec<&'static str>,
        fingerprint: ModelFingerprint,
        asked: Option<RolloutRequest>,
    }

    impl Engine for Scripted {
        fn fingerprint(&self) -> &ModelFingerprint {
            &self.fingerprint
        }
        fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
            self.asked = Some(request.clone());
            let seeds = &request.decodes[0].seeds;
            let candidates = self.texts.iter().zip(seeds).enumerate();
            Ok(RolloutOutput {
                candidates: candidates
                    .map(|(i, (text, &seed))| CandidateOutput {
                        decode_index: 0,
                        sample_index: i as u32,
                        seed,
                        text: text.to_string(),
                        completion_tokens: 7,
                        finish: FinishReason::Stop,
                    })
                    .collect(),
                prompt_tokens: 30,
                prefix_tokens: 0,
                prefill_us: 1_500_000,
                decode_us: 250_000,
                batch: Default::default(),
            })
        }
        fn generate(&mut self, _: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
            unreachable!("generate runs rollouts only")
        }
    }

    fn spec() -> PromptSpec {
        PromptSpec {
            system: Some("你是质检员".into()),
            user: "挡风板安装牢固".into(),
            candidates: 2,
            seed: 5,
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.0,
            max_new_tokens: 48,
            constrained: true,
        }
    }

    fn engine() -> Scripted {
        Scripted {
            texts: vec!["Verdict: 通过\nReason: 安装牢固", "通过"],
            fingerprint: ModelFingerprint {
                weights_sha256: "ab12".into(),
                candle_version: "0.11.1".into(),
                dtype: "q4_1".into(),
                device: "cpu".into(),
                architecture: "llama".into(),
            },
            asked: None,
        }
    }

    #[test]
    fn the_prompt_runs_as_one_rollout_with_the_system_message_first_and_derived_seeds() {
        let mut engine = engine();
        run_prompt(&mut engine, &spec()).unwrap();
        let asked = engine.asked.unwrap();
        assert_eq!(asked, spec().rollout_request());
        let contents: Vec<_> = asked.messages.iter().map(|m| m.content.as_str()).collect();
        assert_eq!(contents, ["你是质检员", "挡风板安装牢固"]);
        let seeds = &asked.decodes[0].seeds;
        assert_eq!(seeds[1], candidate_seed(5, 0, "generate", 0, 1));
        assert!(asked.constrained);
    }

    #[test]
    fn every_candidate_is_read_back_against_the_contract() {
        let run = run_prompt(&mut engine(), &spec()).unwrap();
        let [good, bad] = &run.rows[..] else {
            panic!("two rows: {:?}", run.rows)
        };
        assert_eq!(
            (good.format_ok, good.verdict, good.reason.as_deref()),
            (true, Some(Verdict::Pass), Some("安装牢固"))
        );
        assert_eq!((bad.format_ok, bad.verdict), (false, None));
        assert!(bad.violation.is_some());
        assert!(good.text_block().starts_with("--- candidate 0 (seed "));
        assert!(
            good.text_block()
                .ends_with(", 7 tokens, ok)\nVerdict: 通过\nReason: 安装牢固")
        );
        let malformed = format!("tokens, MALFORMED {})\n通过", bad.violation.unwrap());
        assert!(
            bad.text_block().ends_with(&malformed),
            "{}",
            bad.text_block()
        );
        assert_eq!(
            run.timing_line(),
            "prompt 30 tokens, prefill 1.50s, decode 0.25s, model ab12|candle-0.11.1|q4_1|cpu"
        );
    }

    /// The `--json` line: these keys in this order (scripts read them).
    #[test]
    fn a_json_row_has_the_documented_keys_in_order() {
        let run = run_prompt(&mut engine(), &spec()).unwrap();
        let row = serde_json::to_value(&run.rows[1]).unwrap();
        let keys: Vec<_> = row.as_object().unwrap().keys().cloned().collect();
        assert_eq!(
            keys,
            [
                "sample_index",
                "seed",
                "text",
                "format_ok",
                "verdict",
                "reason",
                "violation",
                "prompt_tokens",
                "completion_tokens",
                "finish_reason",
                "model_fingerprint"
            ]
        );
        assert_eq!(
            (&row["verdict"], &row["reason"]),
            (&Value::Null, &Value::Null)
        );
        assert_eq!(row["model_fingerprint"]["architecture"], "llama");
    }
}
