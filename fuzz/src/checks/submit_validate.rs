//! A worker's submission as rank 0 decodes it from the wire (`pb::SubmitRequest`, prost) and
//! checks it (`wire` caps, `result_check::validate_output`) before the scheduler accepts it.
//!
//! The conversion below is the edge's own, field for field (`cluster::server` keeps it
//! private): a decoded message becomes a `JobOutput` or a job error. Invariants: decoding
//! never panics; a job error is accepted only with a well-formed code and its message is cut
//! to the cap; a result that validates against a job has exactly one candidate per requested
//! (decode, sample), each with its own seed, a known finish reason, bounded counters and text.

use prost::Message;
use stageb_coordinator::cluster::scheduler::result_check::{
    FINISH_REASONS, MAX_REPORTED_TOKENS, MAX_REPORTED_US, validate_output,
};
use stageb_coordinator::cluster::scheduler::{CandidateText, DecodeJob, JobOutput, JobPayload};
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
    let output = match request.result {
        None => return,
        Some(pb::submit_request::Result::Error(e)) => {
            if wire::is_error_code(&e.code) {
                assert!(!e.code.is_empty() && e.code.len() <= wire::MAX_ERROR_CODE_BYTES);
                assert!(
                    e.code
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
                );
            }
            let kept: String = e
                .message
                .chars()
                .take(wire::MAX_ERROR_MESSAGE_CHARS)
                .collect();
            assert!(kept.chars().count() <= wire::MAX_ERROR_MESSAGE_CHARS);
            return;
        }
        Some(pb::submit_request::Result::Rollout(r)) => JobOutput::Rollout {
            candidates: r
                .candidates
                .into_iter()
                .map(|c| CandidateText {
                    decode_index: c.decode_index,
                    sample_index: c.sample_index,
                    seed: c.seed,
                    text: c.text,
                    completion_tokens: c.completion_tokens,
                    finish_reason: c.finish_reason,
                })
                .collect(),
            prompt_tokens: r.prompt_tokens,
            prefix_tokens: r.prefix_tokens,
            prefill_us: r.prefill_us,
            decode_us: r.decode_us,
        },
        Some(pb::submit_request::Result::Generate(g)) => JobOutput::Generate {
            text: g.text,
            prompt_tokens: g.prompt_tokens,
            prefix_tokens: g.prefix_tokens,
            completion_tokens: g.completion_tokens,
            finish_reason: g.finish_reason,
            latency_us: g.latency_us,
        },
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
