//! A worker's submission as rank 0 decodes it from the wire (`pb::SubmitRequest`, prost) and
//! checks it (`wire` caps, `result_check::validate_output`) before the scheduler accepts it.
//!
//! The conversion is the edge's own (`cluster::server::decode_result`): a decoded message
//! becomes a `JobOutput`, a job error, or a refusal. Invariants: decoding
//! never panics; a job error is accepted only with a well-formed code and its message is cut
//! to the cap; a result that validates against a job has exactly one candidate per requested
//! (decode, sample), each with its own seed, a known finish reason, bounded counters and text.

use prost::Message;
use stageb_coordinator::cluster::scheduler::result_check::{
    FINISH_REASONS, MAX_REPORTED_TOKENS, MAX_REPORTED_US, validate_output,
};
use stageb_coordinator::cluster::scheduler::{DecodeJob, JobOutput, JobPayload};
use stageb_coordinator::cluster::server::decode_result;
use stageb_shared::domain::ChatMessage;
use stageb_shared::pb;
use stageb_shared::wire;
use std::collections::HashSet;

const MAX_TEXT_BYTES: usize = 64;

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let Ok(request) = pb::SubmitRequest::decode(data) else {
        return;
    };
    if wire::check_len("session", &request.session, wire::MAX_SESSION_BYTES).is_err() {
        assert!(request.session.len() > wire::MAX_SESSION_BYTES);
    }
    let error_code = match &request.result {
        Some(pb::submit_request::Result::Error(e)) => Some(e.code.clone()),
        _ => None,
    };
    let output = match decode_result(request.result) {
        Err(_) => {
            // Refused at the edge: no result at all, or a job error without a valid code.
            assert!(error_code.is_none_or(|code| !wire::is_error_code(&code)));
            return;
        }
        Ok(Err(failure)) => {
            assert!(wire::is_error_code(&failure.code));
            assert!(!failure.code.is_empty() && failure.code.len() <= wire::MAX_ERROR_CODE_BYTES);
            assert!(
                failure
                    .code
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            );
            assert!(failure.message.chars().count() <= wire::MAX_ERROR_MESSAGE_CHARS);
            return;
        }
        Ok(Ok(output)) => output,
    };
    for payload in [rollout_job(), generate_job()] {
        let verdict = validate_output(&payload, &output, MAX_TEXT_BYTES);
        if verdict.is_ok() {
            check_accepted(&payload, &output);
        }
    }
}

fn check_accepted(payload: &JobPayload, output: &JobOutput) {
    match (payload, output) {
        (
            JobPayload::Rollout { decodes, .. },
            JobOutput::Rollout {
                candidates,
                prompt_tokens,
                prefix_tokens,
                prefill_us,
                decode_us,
            },
        ) => {
            let expected: HashSet<(u32, u32, u64)> = decodes
                .iter()
                .flat_map(|d| {
                    d.seeds
                        .iter()
                        .enumerate()
                        .map(|(i, s)| (d.decode_index, i as u32, *s))
                })
                .collect();
            let got: HashSet<(u32, u32, u64)> = candidates
                .iter()
                .map(|c| (c.decode_index, c.sample_index, c.seed))
                .collect();
            assert_eq!(candidates.len(), expected.len());
            assert_eq!(got, expected);
            for c in candidates {
                assert!(c.text.len() <= MAX_TEXT_BYTES);
                assert!(FINISH_REASONS.contains(&c.finish_reason.as_str()));
                assert!(c.completion_tokens <= MAX_REPORTED_TOKENS);
            }
            assert!(*prompt_tokens <= MAX_REPORTED_TOKENS && prefix_tokens <= prompt_tokens);
            assert!(*prefill_us <= MAX_REPORTED_US && *decode_us <= MAX_REPORTED_US);
        }
        (
            JobPayload::Generate { .. },
            JobOutput::Generate {
                text,
                prompt_tokens,
                prefix_tokens,
                completion_tokens,
                finish_reason,
                latency_us,
            },
        ) => {
            assert!(text.len() <= MAX_TEXT_BYTES * 4);
            assert!(FINISH_REASONS.contains(&finish_reason.as_str()));
            assert!(*prompt_tokens <= MAX_REPORTED_TOKENS && prefix_tokens <= prompt_tokens);
            assert!(*completion_tokens <= MAX_REPORTED_TOKENS && *latency_us <= MAX_REPORTED_US);
        }
        _ => panic!("a result of another kind than its job was accepted"),
    }
}

fn rollout_job() -> JobPayload {
    let decode = |decode_index, seeds: Vec<u64>| DecodeJob {
        decode_index,
        temperature: 0.7,
        top_p: 0.9,
        repetition_penalty: 1.0,
        max_new_tokens: 32,
        seeds,
    };
    JobPayload::Rollout {
        messages: vec![ChatMessage {
            role: "user".into(),
            content: "ticket".into(),
        }],
        decodes: vec![decode(0, vec![11, 12]), decode(3, vec![13])],
        constrained: true,
    }
}

fn generate_job() -> JobPayload {
    JobPayload::Generate {
        messages: vec![ChatMessage {
            role: "user".into(),
            content: "reflect".into(),
        }],
        json_schema: None,
        seed: 7,
        temperature: 0.0,
        top_p: 1.0,
        repetition_penalty: 1.0,
        max_new_tokens: 64,
    }
}
