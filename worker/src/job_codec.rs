//! Jobs and results between the wire and the engine: a leased [`pb::job::Kind`] becomes a
//! [`Job`] (refused with a coded error when it cannot be run: too many candidates, a schema
//! that is not JSON), and a job's end becomes the [`pb::submit_request::Result`] rank 0 reads.

use stageb_shared::domain::ChatMessage;
use stageb_shared::pb;
use stageb_shared::wire::MAX_CANDIDATES_PER_JOB;

use crate::engine::{DecodeRequest, EngineError, GenerateRequest, Job, JobOutput, RolloutRequest};

fn messages(ms: Vec<pb::ChatMessage>) -> Vec<ChatMessage> {
    ms.into_iter()
        .map(|m| ChatMessage {
            role: m.role,
            content: m.content,
        })
        .collect()
}

/// The engine's job for a leased one, or why it cannot run (checked before the engine
/// allocates anything for it).
pub fn job_from_pb(kind: pb::job::Kind) -> Result<Job, EngineError> {
    match kind {
        pb::job::Kind::Rollout(job) => {
            let asked: usize = job.decodes.iter().map(|d| d.seeds.len()).sum();
            if asked > MAX_CANDIDATES_PER_JOB {
                // Refused before the engine allocates a row per candidate: a huge count would
                // abort the worker.
                return Err(EngineError::InvalidRequest(format!(
                    "a rollout job asks for {asked} candidates; a worker decodes at most {MAX_CANDIDATES_PER_JOB} per job"
                )));
            }
            Ok(Job::Rollout(RolloutRequest {
                messages: messages(job.messages),
                decodes: job.decodes.into_iter().map(DecodeRequest::from).collect(),
                constrained: job.constrained,
            }))
        }
        pb::job::Kind::Generate(job) => {
            let json_schema = if job.json_schema.is_empty() {
                None
            } else {
                Some(serde_json::from_str(&job.json_schema).map_err(|e| {
                    EngineError::InvalidRequest(format!("json_schema is not JSON: {e}"))
                })?)
            };
            Ok(Job::Generate(GenerateRequest {
                messages: messages(job.messages),
                json_schema,
                seed: job.seed,
                temperature: job.temperature,
                top_p: job.top_p,
                repetition_penalty: job.repetition_penalty,
                max_new_tokens: job.max_new_tokens,
            }))
        }
    }
}

/// What is submitted for a job's end.
pub fn result_to_pb(result: Result<JobOutput, EngineError>) -> pb::submit_request::Result {
    match result {
        Ok(JobOutput::Rollout(out)) => pb::submit_request::Result::Rollout(pb::RolloutResult {
            candidates: out
                .candidates
                .into_iter()
                .map(|c| pb::Candidate {
                    decode_index: c.decode_index,
                    sample_index: c.sample_index,
                    seed: c.seed,
                    text: c.text,
                    completion_tokens: c.completion_tokens,
                    finish_reason: c.finish.as_str().to_string(),
                })
                .collect(),
            prompt_tokens: out.prompt_tokens,
            prefix_tokens: out.prefix_tokens,
            prefill_us: out.prefill_us,
            decode_us: out.decode_us,
            batch_steps: out.batch.steps,
            batch_rows: out.batch.rows,
        }),
        Ok(JobOutput::Generate(out)) => pb::submit_request::Result::Generate(pb::GenerateResult {
            text: out.text,
            prompt_tokens: out.prompt_tokens,
            prefix_tokens: out.prefix_tokens,
            completion_tokens: out.completion_tokens,
            finish_reason: out.finish.as_str().to_string(),
            latency_us: out.latency_us,
            batch_steps: out.batch.steps,
            batch_rows: out.batch.rows,
        }),
        Err(e) => pb::submit_request::Result::Error(pb::JobError {
            code: e.code().into(),
            message: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a coordinator sending 100k seeds in one decode made the worker abort
    /// on allocation. The job is refused with a coded error before the engine sees it.
    #[test]
    fn regression_a_job_with_100k_seeds_is_refused_before_the_engine() {
        let job = pb::RolloutJob {
            messages: vec![],
            decodes: vec![pb::DecodeSpec {
                seeds: (0..100_000).collect(),
                ..Default::default()
            }],
            constrained: true,
        };
        let err = job_from_pb(pb::job::Kind::Rollout(job)).unwrap_err();
        match result_to_pb(Err(err)) {
            pb::submit_request::Result::Error(e) => {
                assert_eq!(e.code, "INVALID_REQUEST");
                assert!(e.message.contains("100000 candidates"), "{}", e.message);
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_schema_that_is_not_json_is_refused() {
        let job = pb::GenerateJob {
            json_schema: "{not json".into(),
            ..Default::default()
        };
        let err = job_from_pb(pb::job::Kind::Generate(job)).unwrap_err();
        assert_eq!(err.code(), "INVALID_REQUEST");
        assert!(err.to_string().contains("json_schema is not JSON"));
    }
}
