//! One reflection model call: a JSON-mode generation leased to a worker, retried with a new
//! seed while its output does not parse, each attempt logged in the row as a [`CallRecord`].
//! [`Calls`] holds what every call of a run is built with (seed, sampling, progress) and what
//! they cost; the reflector's calls queued ahead are planned here too, as a call that waits
//! re-plans them when an answer they depend on arrives.

use std::collections::BTreeSet;

use serde_json::Value;
use stageb_shared::config::ReflectionConfig;
use stageb_shared::domain::{ChatMessage, TicketKey};
use stageb_shared::observe;
use stageb_shared::reflection_schema::{self, ReflectionParseError};
use stageb_shared::seed::derived_seed;

use super::calls_ahead::CallsAhead;
use super::cycle::split_stop_gradient;
use super::record::Learnable;
use super::row::{CallError, CallPass, CallRecord, CallRuntime, ReflectionRow};
use super::{GradientRecord, JSON_RETRIES, ReflectionError, Reflector};
use crate::artifacts::documents::CallPrefixReuse;
use crate::cluster::dispatch::Dispatch;
use crate::cluster::scheduler::{Completion, JobOutput, JobPayload, REPLAY_WORKER};
use crate::guidance::GuidanceRepo;
use crate::progress::{Phase, ProgressHandle, ReflectPass};

/// What every reflection call of a run is built with, and what the calls cost: the run seed
/// (each call's seed derives from it), the sampling settings, where calls are shown, the
/// prefill the workers' caches saved, and the calls queued ahead.
pub(super) struct Calls {
    run_seed: u64,
    temperature: f32,
    top_p: f32,
    repetition_penalty: f32,
    /// The fitted `reflection.max_new_tokens`.
    max_new_tokens: u32,
    /// Where each call's cycle and pass are shown, when set.
    progress: Option<ProgressHandle>,
    /// Prefill the workers' prefix caches saved on this attempt's calls (runtime only: a
    /// resumed attempt counts its own).
    pub(super) prefix_reuse: CallPrefixReuse,
    /// Calls queued ahead of their cycle (runtime only: a resumed attempt queues its own).
    pub(super) ahead: CallsAhead,
}

impl Calls {
    /// The calls of a run under the fitted `config`, queued ahead for `pipeline_cycles` cycles.
    pub(super) fn new(
        config: &ReflectionConfig,
        run_seed: u64,
        pipeline_cycles: usize,
        progress: Option<ProgressHandle>,
    ) -> Self {
        Calls {
            run_seed,
            temperature: config.temperature,
            top_p: config.top_p,
            repetition_penalty: config.repetition_penalty,
            max_new_tokens: config.max_new_tokens,
            progress,
            prefix_reuse: CallPrefixReuse::default(),
            ahead: CallsAhead::new(pipeline_cycles),
        }
    }

    /// The seed of attempt `attempt` of `pass` in `cycle`.
    pub(super) fn seed(&self, epoch: u32, cycle: u64, pass: CallPass, attempt: u32) -> u64 {
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
    pub(super) fn payload(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
        seed: u64,
    ) -> JobPayload {
        JobPayload::Generate {
            messages: messages.to_vec(),
            json_schema: Some(schema.to_string()),
            seed,
            temperature: self.temperature,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            max_new_tokens: self.max_new_tokens,
        }
    }

    /// Where each call's cycle and pass are shown, when set.
    pub(super) fn progress(&self) -> Option<&ProgressHandle> {
        self.progress.as_ref()
    }

    /// The progress state names the call's cycle and pass, and counts the call for the ETA.
    fn show(&self, cycle: u64, pass: CallPass) {
        let pass = match pass {
            CallPass::Decision => ReflectPass::Decision,
            CallPass::Ops => ReflectPass::Ops,
            CallPass::OpsRevision => ReflectPass::Revision,
        };
        if let Some(progress) = &self.progress {
            let mut p = progress.lock().unwrap_or_else(|e| e.into_inner());
            p.enter(Phase::Reflecting { cycle, pass });
            p.call_made();
        }
    }
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
        dispatch: &mut Dispatch,
        parse: impl Fn(&str) -> Result<T, ReflectionParseError>,
    ) -> Result<Option<T>, ReflectionError> {
        for attempt in 0..=JSON_RETRIES {
            if !self.budget.calls_left() {
                return Ok(None);
            }
            self.budget.charge_call();
            self.calls.show(row.reflection_cycle, pass);
            let seed = self
                .calls
                .seed(row.epoch, row.reflection_cycle, pass, attempt);
            let payload = self.calls.payload(&messages, schema, seed);
            let completion = self.generate(payload, guidance, dispatch).await?;
            let (record, outcome) = judge(pass, attempt, seed, completion, &parse);
            self.calls.prefix_reuse.count(&record);
            row.calls.push(record);
            match outcome {
                Attempt::Parsed(v) => return Ok(Some(v)),
                Attempt::Retry => {}
                Attempt::GiveUp => return Ok(None),
            }
        }
        Ok(None)
    }

    /// Lease one generation (or take the same job queued ahead) and wait for its answer. While
    /// it waits, each decision answer of a call queued ahead that arrives re-plans the calls
    /// ahead, so that its cycle's ops call is queued at once.
    async fn generate(
        &mut self,
        payload: JobPayload,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<Completion, ReflectionError> {
        let job = match self.calls.ahead.take(&payload) {
            Some(job) => {
                dispatch.scheduler.promote(&[job]);
                job
            }
            None => dispatch.scheduler.enqueue(payload),
        };
        // Kept if it arrives while the calls ahead are re-planned (which collects what came).
        dispatch.completions.expect([job]);
        loop {
            let mut watch = self.calls.ahead.decisions_in_flight(dispatch);
            watch.insert(job);
            let done = dispatch.await_any(&watch, &mut |_| {}).await?;
            if done.job == job {
                return Ok(done);
            }
            dispatch.completions.put_back(done);
            self.plan_calls_ahead(guidance, dispatch);
        }
    }

    /// Queue ahead the calls the next cycles will most likely make (see `calls_ahead`);
    /// calls queued for cycles now past, or for upcoming cycles under another guess, are
    /// withdrawn. The current cycle's own calls are left as they are.
    pub(super) fn plan_calls_ahead(&mut self, guidance: &GuidanceRepo, dispatch: &mut Dispatch) {
        if self.calls.ahead.depth() == 0 {
            return;
        }
        dispatch.completions.collect_ready();
        let current = self.cycles;
        let mut wanted: BTreeSet<String> = BTreeSet::new();
        // Only the cycles the budget lets call are guessed (once it is spent, a boundary's
        // remaining cycles route their cases without a call: nothing to guess).
        let depth = (0..self.calls.ahead.depth())
            .take_while(|&j| self.budget.covers_cycle_ahead(j))
            .count();
        let drain = self.calls.ahead.draining();
        let pack = |batch| self.prompts.pack(batch, guidance);
        let upcoming = self.queue.upcoming(drain, depth, pack);
        for (j, kept) in upcoming.into_iter().enumerate() {
            let cycle = current + 1 + j as u64;
            self.queue_likely_calls(cycle, kept, guidance, dispatch, &mut wanted);
        }
        self.calls.ahead.withdraw_where(dispatch, |digest, cycle| {
            cycle < current || (cycle > current && !wanted.contains(digest))
        });
    }

    /// Queue the decision call `cycle` would make on its packed cases `kept`, and its ops call
    /// when the decision's answer (queued ahead before) is in and leaves cases to learn from;
    /// their digests go into `wanted`.
    fn queue_likely_calls(
        &mut self,
        cycle: u64,
        kept: Vec<GradientRecord>,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch,
        wanted: &mut BTreeSet<String>,
    ) {
        let kept_keys: BTreeSet<TicketKey> = kept.iter().map(|r| r.ticket_key.clone()).collect();
        let (messages, schema) = self.prompts.decision(&kept, &kept_keys, guidance, cycle);
        let seed = self.calls.seed(self.epoch, cycle, CallPass::Decision, 0);
        let decision = self.calls.payload(&messages, &schema, seed);
        let (digest, job) = self
            .calls
            .ahead
            .want(cycle, CallPass::Decision, decision, dispatch);
        wanted.insert(digest);
        let answer = dispatch
            .completions
            .peek(job)
            .and_then(|c| match &c.result {
                Ok(JobOutput::Generate { text, .. }) => {
                    reflection_schema::parse_decision(text).ok()
                }
                _ => None,
            });
        let Some(decision) = answer else {
            return;
        };
        let learnable = split_stop_gradient(kept, &kept_keys, &decision).learnable;
        if learnable.records.is_empty() {
            return;
        }
        let ops = self.first_ops_payload(&learnable, guidance, cycle);
        let ahead = &mut self.calls.ahead;
        wanted.insert(ahead.want(cycle, CallPass::Ops, ops, dispatch).0);
    }

    /// The job of `cycle`'s ops pass on `learnable` (its first attempt), built as the cycle's
    /// ops rounds build it: for a call queued ahead.
    fn first_ops_payload(
        &self,
        learnable: &Learnable,
        guidance: &GuidanceRepo,
        cycle: u64,
    ) -> JobPayload {
        let inputs = self.ops_inputs(learnable, guidance);
        let messages = inputs.messages(&self.prompts, cycle, None);
        let seed = self.calls.seed(self.epoch, cycle, CallPass::Ops, 0);
        self.calls.payload(&messages, &inputs.schema, seed)
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
