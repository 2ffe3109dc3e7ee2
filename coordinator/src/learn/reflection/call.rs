//! One reflection model call: a JSON-mode generation leased to a worker, retried with a new
//! seed while its output does not parse, each attempt logged as a [`CallRecord`].

use serde::Serialize;
use serde_json::{Value, json};
use stageb_shared::domain::ChatMessage;
use stageb_shared::observe;
use stageb_shared::reflection_schema;
use stageb_shared::seed::derived_seed;
use tokio::sync::mpsc;

use super::{JSON_RETRIES, ReflectionError, Reflector};
use crate::cluster::completions::await_completions;
use crate::cluster::scheduler::{Completion, JobOutput, JobPayload, Scheduler};

/// Token usage and latency of one model call, for `reflection.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub(super) struct CallRecord {
    pub(super) pass: &'static str,
    pub(super) attempt: u32,
    pub(super) seed: u64,
    pub(super) ok: bool,
    pub(super) parse_error: Option<Value>,
    pub(super) raw_output: String,
    pub(super) prompt_tokens: u32,
    pub(super) completion_tokens: u32,
    pub(super) finish_reason: String,
    pub(super) runtime: Value,
}

impl Reflector {
    /// Run one JSON-mode generation through the lease mechanism, retrying with a new seed when
    /// the output does not parse. `None` when every attempt failed or the budget ran out.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn call_json<T>(
        &mut self,
        epoch: u32,
        cycle: u64,
        pass: &'static str,
        messages: Vec<ChatMessage>,
        schema: &Value,
        scheduler: &Scheduler,
        completions: &mut mpsc::UnboundedReceiver<Completion>,
        calls: &mut Vec<CallRecord>,
        parse: impl Fn(&str) -> Result<T, reflection_schema::ReflectionParseError>,
    ) -> Result<Option<T>, ReflectionError> {
        for attempt in 0..=JSON_RETRIES {
            if !self.calls_left() {
                return Ok(None);
            }
            self.state.calls_epoch += 1;
            let seed = derived_seed(
                self.run_seed,
                "reflection-call",
                &[
                    &epoch.to_le_bytes(),
                    &cycle.to_le_bytes(),
                    pass.as_bytes(),
                    &attempt.to_le_bytes(),
                ],
            );
            let job = scheduler.enqueue(JobPayload::Generate {
                messages: messages.clone(),
                json_schema: Some(schema.to_string()),
                seed,
                temperature: self.config.temperature,
                top_p: self.config.top_p,
                repetition_penalty: self.config.repetition_penalty,
                max_new_tokens: self.config.max_new_tokens,
            });
            let mut done =
                await_completions(scheduler, completions, &[job], self.worker_grace).await?;
            let completion = done.remove(&job).expect("awaited");
            let runtime = match &completion.provenance {
                Some(p) => {
                    json!({"worker_id": p.worker_id, "lease_id": p.lease_id, "attempt": p.attempt})
                }
                None => json!({}),
            };
            match completion.result {
                Ok(JobOutput::Generate {
                    text,
                    prompt_tokens,
                    completion_tokens,
                    finish_reason,
                    latency_us,
                }) => {
                    let parsed = parse(&text);
                    let outcome = if parsed.is_ok() {
                        "parsed"
                    } else {
                        "unparseable"
                    };
                    ::metrics::counter!(observe::REFLECTION_CALLS, "pass" => pass, "outcome" => outcome)
                        .increment(1);
                    let mut runtime = runtime;
                    runtime["latency_us"] = json!(latency_us);
                    calls.push(CallRecord {
                        pass,
                        attempt,
                        seed,
                        ok: parsed.is_ok(),
                        parse_error: parsed
                            .as_ref()
                            .err()
                            .map(|e| serde_json::to_value(e).unwrap_or(json!(e.to_string()))),
                        raw_output: text,
                        prompt_tokens,
                        completion_tokens,
                        finish_reason,
                        runtime,
                    });
                    if let Ok(v) = parsed {
                        return Ok(Some(v));
                    }
                }
                Ok(JobOutput::Rollout { .. }) => {
                    calls.push(failed_call(
                        pass,
                        attempt,
                        seed,
                        "WRONG_RESULT_KIND",
                        "a generation returned a rollout",
                        runtime,
                    ));
                }
                Err(f) => {
                    ::metrics::counter!(observe::REFLECTION_CALLS, "pass" => pass, "outcome" => "failed")
                        .increment(1);
                    calls.push(failed_call(
                        pass, attempt, seed, &f.code, &f.message, runtime,
                    ));
                    // Deterministic failures (an over-long prompt) do not improve with a new seed.
                    if f.code == "PROMPT_TOO_LONG" || f.code == "INVALID_REQUEST" {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(None)
    }
}

fn failed_call(
    pass: &'static str,
    attempt: u32,
    seed: u64,
    code: &str,
    message: &str,
    runtime: Value,
) -> CallRecord {
    CallRecord {
        pass,
        attempt,
        seed,
        ok: false,
        parse_error: Some(json!({"code": code, "message": message})),
        raw_output: String::new(),
        prompt_tokens: 0,
        completion_tokens: 0,
        finish_reason: String::new(),
        runtime,
    }
}
