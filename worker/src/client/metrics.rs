//! The worker's Prometheus metrics for each job that ends (see [`stageb_shared::observe`]):
//! outcome, duration, tokens and rates, KV cache and prefix-store sizes.

use std::time::Duration;

use stageb_shared::observe;
use stageb_shared::pb;

/// One prefix-store lookup of a `kind` job (`rollout`, `generate`) that reused `prefix_tokens`.
fn record_prefix_reuse(kind: &'static str, prefix_tokens: u32) {
    metrics::counter!(observe::WORKER_PREFIX_LOOKUPS, "kind" => kind).increment(1);
    if prefix_tokens > 0 {
        metrics::counter!(observe::WORKER_PREFIX_HITS, "kind" => kind).increment(1);
    }
    metrics::counter!(observe::WORKER_PREFILL_SAVED, "kind" => kind)
        .increment(u64::from(prefix_tokens));
}

/// The worker's Prometheus metrics for one job (see [`stageb_shared::observe`]).
/// `prefix_bytes`: what the engine's prefix store holds, `None` when it has none.
pub(super) fn record_job_metrics(
    result: &pb::submit_request::Result,
    took: Duration,
    kv_bytes: u64,
    prefix_bytes: Option<u64>,
    in_hand: usize,
) {
    use pb::submit_request::Result as R;
    metrics::gauge!(observe::WORKER_JOBS_IN_HAND).set(in_hand as f64);
    let (kind, outcome) = match result {
        R::Rollout(_) => ("rollout", "ok"),
        R::Generate(_) => ("generate", "ok"),
        R::Error(e) if e.code == "CANCELLED" => ("any", "cancelled"),
        R::Error(_) => ("any", "error"),
    };
    metrics::counter!(observe::WORKER_JOBS, "kind" => kind, "outcome" => outcome).increment(1);
    metrics::histogram!(observe::WORKER_JOB_DURATION, "kind" => kind).record(took.as_secs_f64());
    let rate = |tokens: u64, us: u64| (us > 0).then(|| tokens as f64 * 1e6 / us as f64);
    match result {
        R::Rollout(r) => {
            let decoded: u64 = r
                .candidates
                .iter()
                .map(|c| c.completion_tokens as u64)
                .sum();
            // Reused prefix tokens were not prefilled: neither counted nor in the rate.
            let prefilled = u64::from(r.prompt_tokens.saturating_sub(r.prefix_tokens));
            metrics::counter!(observe::WORKER_PREFILL_TOKENS).increment(prefilled);
            metrics::counter!(observe::WORKER_DECODE_TOKENS).increment(decoded);
            if prefix_bytes.is_some() {
                record_prefix_reuse(kind, r.prefix_tokens);
            }
            if let Some(v) = rate(prefilled, r.prefill_us) {
                metrics::gauge!(observe::WORKER_PREFILL_RATE).set(v);
            }
            if let Some(v) = rate(decoded, r.decode_us) {
                metrics::gauge!(observe::WORKER_DECODE_RATE).set(v);
            }
        }
        R::Generate(g) => {
            let prefilled = u64::from(g.prompt_tokens.saturating_sub(g.prefix_tokens));
            metrics::counter!(observe::WORKER_PREFILL_TOKENS).increment(prefilled);
            metrics::counter!(observe::WORKER_DECODE_TOKENS).increment(g.completion_tokens as u64);
            if prefix_bytes.is_some() {
                record_prefix_reuse(kind, g.prefix_tokens);
            }
        }
        R::Error(_) => {}
    }
    if kv_bytes > 0 {
        metrics::gauge!(observe::WORKER_KV_CACHE).set(kv_bytes as f64);
    }
    if let Some(b) = prefix_bytes {
        metrics::gauge!(observe::WORKER_PREFIX_CACHE).set(b as f64);
    }
}
