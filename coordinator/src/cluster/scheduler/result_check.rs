//! What rank 0 accepts from a worker as the answer to a job: the shape it must have (one
//! candidate per requested decode and sample, with the seed it was given), the sizes of its
//! texts, and bounds on every counter and label, checked before anything adds them up or
//! writes them. The lease table ([`crate::cluster::scheduler`]) calls it before accepting a result.

use std::collections::HashSet;

use super::job::{JobOutput, JobPayload};

/// Largest token count a worker may report (far beyond any model's context): counters from
/// the network are checked before rank 0 does arithmetic with them.
pub const MAX_REPORTED_TOKENS: u32 = 1 << 24;
/// Largest duration a worker may report, in microseconds (one week).
pub const MAX_REPORTED_US: u64 = 7 * 24 * 3600 * 1_000_000;
/// The finish reasons an engine reports (`worker::engine::FinishReason`).
pub const FINISH_REASONS: &[&str] = &["stop", "length"];

/// Rank 0 trusts nothing a worker says about identity or shape: a rollout must return exactly
/// one candidate per requested (decode, sample) with the seed it was given.
pub fn validate_output(
    payload: &JobPayload,
    output: &JobOutput,
    max_text_bytes: usize,
) -> Result<(), String> {
    check_counters(output)?;
    match (payload, output) {
        (JobPayload::Rollout { decodes, .. }, JobOutput::Rollout { candidates, .. }) => {
            let expected: usize = decodes.iter().map(|d| d.seeds.len()).sum();
            if candidates.len() != expected {
                return Err(format!(
                    "expected {expected} candidates, got {}",
                    candidates.len()
                ));
            }
            let mut seen = HashSet::new();
            for c in candidates {
                let decode = decodes
                    .iter()
                    .find(|d| d.decode_index == c.decode_index)
                    .ok_or_else(|| format!("unknown decode index {}", c.decode_index))?;
                let seed = decode
                    .seeds
                    .get(c.sample_index as usize)
                    .ok_or_else(|| format!("unknown sample index {}", c.sample_index))?;
                if *seed != c.seed {
                    return Err(format!(
                        "candidate ({}, {}) has the wrong seed",
                        c.decode_index, c.sample_index
                    ));
                }
                if !seen.insert((c.decode_index, c.sample_index)) {
                    return Err(format!(
                        "candidate ({}, {}) returned twice",
                        c.decode_index, c.sample_index
                    ));
                }
                if c.text.len() > max_text_bytes {
                    return Err(format!(
                        "candidate text of {} bytes exceeds {max_text_bytes}",
                        c.text.len()
                    ));
                }
            }
            Ok(())
        }
        (JobPayload::Generate { .. }, JobOutput::Generate { text, .. }) => {
            if text.len() > max_text_bytes * 4 {
                return Err(format!(
                    "generated text of {} bytes is too long",
                    text.len()
                ));
            }
            Ok(())
        }
        _ => Err("result kind does not match the job kind".into()),
    }
}

/// Counters and labels a worker reports are bounded before anything adds them up or writes
/// them: token counts to [`MAX_REPORTED_TOKENS`], durations to [`MAX_REPORTED_US`], finish
/// reasons to [`FINISH_REASONS`].
fn check_counters(output: &JobOutput) -> Result<(), String> {
    let tokens = |name: &str, n: u32| {
        if n > MAX_REPORTED_TOKENS {
            Err(format!("{name} {n} exceeds {MAX_REPORTED_TOKENS}"))
        } else {
            Ok(())
        }
    };
    let micros = |name: &str, us: u64| {
        if us > MAX_REPORTED_US {
            Err(format!("{name} {us} exceeds {MAX_REPORTED_US}"))
        } else {
            Ok(())
        }
    };
    let finish = |reason: &str| {
        if FINISH_REASONS.contains(&reason) {
            Ok(())
        } else {
            Err(format!(
                "unknown finish_reason (expected one of {FINISH_REASONS:?})"
            ))
        }
    };
    match output {
        JobOutput::Rollout {
            candidates,
            prompt_tokens,
            prefix_tokens,
            prefill_us,
            decode_us,
        } => {
            tokens("prompt_tokens", *prompt_tokens)?;
            reused_prefix(*prefix_tokens, *prompt_tokens)?;
            micros("prefill_us", *prefill_us)?;
            micros("decode_us", *decode_us)?;
            for c in candidates {
                tokens("completion_tokens", c.completion_tokens)?;
                finish(&c.finish_reason)?;
            }
        }
        JobOutput::Generate {
            prompt_tokens,
            prefix_tokens,
            completion_tokens,
            finish_reason,
            latency_us,
            ..
        } => {
            tokens("prompt_tokens", *prompt_tokens)?;
            reused_prefix(*prefix_tokens, *prompt_tokens)?;
            tokens("completion_tokens", *completion_tokens)?;
            micros("latency_us", *latency_us)?;
            finish(finish_reason)?;
        }
    }
    Ok(())
}

/// A reused prefix always leaves the last prompt token to prefill (its logits start the
/// decode), so `prefix_tokens` is below `prompt_tokens` unless it is 0.
fn reused_prefix(prefix_tokens: u32, prompt_tokens: u32) -> Result<(), String> {
    if prefix_tokens > 0 && prefix_tokens >= prompt_tokens {
        return Err(format!(
            "prefix_tokens {prefix_tokens} is not below prompt_tokens {prompt_tokens}"
        ));
    }
    Ok(())
}
