//! One reflection model call: a JSON-mode generation leased to a worker, retried with a new
//! seed while its output does not parse, each attempt logged in the row as a [`CallRecord`].

use serde_json::Value;
use stageb_shared::domain::ChatMessage;
use stageb_shared::observe;
use stageb_shared::reflection_schema::ReflectionParseError;
use stageb_shared::seed::derived_seed;

use super::row::{CallError, CallPass, CallRecord, CallRuntime, ReflectionRow};
use super::{JSON_RETRIES, ReflectionError, Reflector};
use crate::artifacts::documents::CallPrefixReuse;
use crate::cluster::completions::{Completions, await_any};
use crate::cluster::scheduler::{Completion, JobOutput, JobPayload, REPLAY_WORKER, Scheduler};
use crate::guidance::GuidanceRepo;
use crate::progress::{Phase, ReflectPass};

/// Where reflection calls go: the scheduler that leases them to workers, and the channel their
/// answers come back on.
pub(super) struct Dispatch<'a> {
    pub(super) scheduler: &'a Scheduler,
    pub(super) completions: &'a mut Completions,
}

/// Counting is done here, where the records are made; the totals are a part of
/// `summary.json` ([`crate::artifacts::documents`]).
impl CallPrefixReuse {
    /// Counts one attempt's record when a worker (not the journal) produced its generation.
    pub(super) fn count(&mut self, record: &CallRecord) {
        let r = &record.runtime;
        let Some(prefix) = r.prefix_tokens else {
            return;
        };
        if r.worker_id.as_deref() == Some(REPLAY_WORKER) {
            return;
        }
        self.calls += 1;
        self.calls_with_hit += u64::from(prefix > 0);
        self.prompt_tokens += u64::from(record.prompt_tokens);
        self.prefill_tokens_saved += u64::from(prefix.min(record.prompt_tokens));
        self.hit_rate = self.calls_with_hit as f64 / self.calls as f64;
    }
}

/// What one attempt came to.
enum Attempt<T> {
    Parsed(T),
    /// Unusable, but another seed may do better.
    Retry,
    /// A deterministic failure (an over-long prompt): a new seed would not help.
    GiveUp,
}

impl Reflector {
    /// Run one JSON-mode generation through the lease mechanism, retrying with a new seed when
    /// the output does not parse; every attempt is logged in `row.calls`. `None` when every
    /// attempt failed or the epoch's call budget ran out.
    pub(super) async fn call_json<T>(
        &mut self,
        row: &mut ReflectionRow,
        pass: CallPass,
        (messages, schema): (Vec<ChatMessage>, &Value),
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch<'_>,
        parse: impl Fn(&str) -> Result<T, ReflectionParseError>,
    ) -> Result<Option<T>, ReflectionError> {
        for attempt in 0..=JSON_RETRIES {
            if !self.calls_left() {
                return Ok(None);
            }
            self.state.calls_epoch.charge();
            self.show_call(row.reflection_cycle, pass);
            let seed = self.call_seed(row.epoch, row.reflection_cycle, pass, attempt);
            let payload = self.call_payload(&messages, schema, seed);
            let completion = self.generate(payload, guidance, dispatch).await?;
            let (record, outcome) = judge(pass, attempt, seed, completion, &parse);
            self.prefix_reuse.count(&record);
            row.calls.push(record);
            match outcome {
                Attempt::Parsed(v) => return Ok(Some(v)),
                Attempt::Retry => {}
                Attempt::GiveUp => return Ok(None),
            }
        }
        Ok(None)
    }

    /// The seed of attempt `attempt` of `pass` in `cycle`.
    pub(super) fn call_seed(&self, epoch: u32, cycle: u64, pass: CallPass, attempt: u32) -> u64 {
        derived_seed(
            self.run_seed,
            "reflection-call",
            &[
                &epoch.to_le_bytes(),
                &cycle.to_le_bytes(),
                pass.as_str().as_bytes(),
                &attempt.to_le_bytes(),
            ],
        )
    }

    /// The job of one call: everything its answer depends on.
    pub(super) fn call_payload(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
        seed: u64,
    ) -> JobPayload {
        JobPayload::Generate {
            messages: messages.to_vec(),
            json_schema: Some(schema.to_string()),
            seed,
            temperature: self.config.temperature,
            top_p: self.config.top_p,
            repetition_penalty: self.config.repetition_penalty,
            max_new_tokens: self.config.max_new_tokens,
        }
    }

    /// The progress state names the call's cycle and pass.
    fn show_call(&self, cycle: u64, pass: CallPass) {
        let pass = match pass {
            CallPass::Decision => ReflectPass::Decision,
            CallPass::Ops => ReflectPass::Ops,
            CallPass::OpsRevision => ReflectPass::Revision,
        };
        if let Some(progress) = &self.progress {
            crate::progress::enter(progress, Phase::Reflecting { cycle, pass });
        }
    }

    /// Lease one generation (or take the same job queued ahead) and wait for its answer. While
    /// it waits, each decision answer of a call queued ahead that arrives re-plans the calls
    /// ahead, so that its cycle's ops call is queued at once.
    async fn generate(
        &mut self,
        payload: JobPayload,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch<'_>,
    ) -> Result<Completion, ReflectionError> {
        let job = match self.calls_ahead.take(&payload) {
            Some(job) => {
                dispatch.scheduler.promote(&[job]);
                job
            }
            None => dispatch.scheduler.enqueue(payload),
        };
        // Kept if it arrives while the calls ahead are re-planned (which collects what came).
        dispatch.completions.expect([job]);
        loop {
            let mut watch = self.calls_ahead.decisions_in_flight(dispatch);
            watch.insert(job);
            let done = await_any(
                dispatch.scheduler,
                dispatch.completions,
                &watch,
                self.worker_grace,
                &mut |_| {},
            )
            .await?;
            if done.job == job {
                return Ok(done);
            }
            dispatch.completions.put_back(done);
            self.plan_calls_ahead(guidance, dispatch);
        }
    }
}

/// The log entry of one attempt, and what it came to.
fn judge<T>(
    pass: CallPass,
    attempt: u32,
    seed: u64,
    completion: Completion,
    parse: &impl Fn(&str) -> Result<T, ReflectionParseError>,
) -> (CallRecord, Attempt<T>) {
    let runtime = match &completion.provenance {
        Some(p) => CallRuntime {
            worker_id: Some(p.worker_id.clone()),
            lease_id: Some(p.lease_id),
            attempt: Some(p.attempt),
            latency_us: None,
            prefix_tokens: None,
        },
        None => CallRuntime::default(),
    };
    let empty = CallRecord::empty(pass, attempt, seed, runtime);
    match completion.result {
        Ok(JobOutput::Generate {
            text,
            prompt_tokens,
            prefix_tokens,
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
            count_call(pass, outcome);
            let record = CallRecord {
                ok: parsed.is_ok(),
                parse_error: parsed.as_ref().err().map(|e| CallError::Unparseable {
                    code: e.code.code().to_string(),
                    detail: e.detail.clone(),
                }),
                raw_output: text,
                prompt_tokens,
                completion_tokens,
                finish_reason,
                runtime: CallRuntime {
                    latency_us: Some(latency_us),
                    prefix_tokens: Some(prefix_tokens),
                    ..empty.runtime
                },
                ..empty
            };
            match parsed {
                Ok(v) => (record, Attempt::Parsed(v)),
                Err(_) => (record, Attempt::Retry),
            }
        }
        Ok(JobOutput::Rollout { .. }) => {
            let record = empty.failed("WRONG_RESULT_KIND", "a generation returned a rollout");
            (record, Attempt::Retry)
        }
        Err(f) => {
            count_call(pass, "failed");
            // Deterministic failures (an over-long prompt) do not improve with a new seed.
            let give_up = f.code == "PROMPT_TOO_LONG" || f.code == "INVALID_REQUEST";
            let record = empty.failed(&f.code, &f.message);
            (
                record,
                if give_up {
                    Attempt::GiveUp
                } else {
                    Attempt::Retry
                },
            )
        }
    }
}

fn count_call(pass: CallPass, outcome: &'static str) {
    ::metrics::counter!(observe::REFLECTION_CALLS, "pass" => pass.as_str(), "outcome" => outcome)
        .increment(1);
}

impl CallRecord {
    /// An attempt that produced nothing: no output, no tokens.
    fn empty(pass: CallPass, attempt: u32, seed: u64, runtime: CallRuntime) -> Self {
        CallRecord {
            pass,
            attempt,
            seed,
            ok: false,
            parse_error: None,
            raw_output: String::new(),
            prompt_tokens: 0,
            completion_tokens: 0,
            finish_reason: String::new(),
            runtime,
        }
    }

    /// This attempt, failed without an output: the job failed, or its result was not a
    /// generation.
    fn failed(self, code: &str, message: &str) -> Self {
        CallRecord {
            parse_error: Some(CallError::Failed {
                code: code.to_string(),
                message: message.to_string(),
            }),
            ..self
        }
    }
}
