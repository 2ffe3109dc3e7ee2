//! Names and help texts of stageb's Prometheus metrics, in one place.
//!
//! The libraries record through the `metrics` facade (a no-op until a binary installs a
//! recorder), so library code and tests pay nothing when no endpoint is served. Names follow
//! Prometheus conventions: a `stageb_` prefix, the unit in the name (`_seconds`, `_bytes`,
//! `_tokens`), `_total` on counters. Labels are small closed sets (job kind, outcome, pass,
//! violation code, epoch): never a ticket id, a worker name or any text from the inputs, so
//! cardinality stays bounded whatever the run.

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

// Rank 0: the lease table.
pub const LEASES_ISSUED: &str = "stageb_leases_issued_total";
pub const LEASES_EXPIRED: &str = "stageb_leases_expired_total";
pub const SUBMITS_FENCED: &str = "stageb_submits_fenced_total";
pub const JOBS_COMPLETED: &str = "stageb_jobs_completed_total";
pub const QUEUE_DEPTH: &str = "stageb_queue_depth_jobs";
pub const JOBS_IN_FLIGHT: &str = "stageb_jobs_in_flight";
pub const LIVE_WORKERS: &str = "stageb_live_workers";
/// Share of live worker time (since rank 0 started) in which a worker held no lease.
pub const WORKERS_IDLE_RATIO: &str = "stageb_workers_idle_ratio";
pub const LEASE_WAIT: &str = "stageb_lease_wait_seconds";
pub const JOB_LATENCY: &str = "stageb_job_latency_seconds";

// Rank 0: the run.
pub const TICKETS_DECIDED: &str = "stageb_tickets_decided_total";
pub const CANDIDATES: &str = "stageb_candidates_total";
pub const CANDIDATES_MALFORMED: &str = "stageb_candidates_malformed_total";
pub const REFLECTION_CALLS: &str = "stageb_reflection_calls_total";
pub const REFLECTION_OPS: &str = "stageb_reflection_ops_total";
pub const GUIDANCE_STEP: &str = "stageb_guidance_step";
pub const EPOCH: &str = "stageb_epoch";
pub const EPOCH_ACCURACY: &str = "stageb_epoch_accuracy_ratio";
pub const PHASE: &str = "stageb_phase";
pub const ROLLOUT_STEP: &str = "stageb_rollout_step";
pub const REFLECTION_CYCLE: &str = "stageb_reflection_cycle";

// Workers.
pub const WORKER_JOBS: &str = "stageb_worker_jobs_total";
pub const WORKER_PREFILL_TOKENS: &str = "stageb_worker_prefill_tokens_total";
pub const WORKER_DECODE_TOKENS: &str = "stageb_worker_decode_tokens_total";
pub const WORKER_DECODE_RATE: &str = "stageb_worker_decode_tokens_per_second";
pub const WORKER_PREFILL_RATE: &str = "stageb_worker_prefill_tokens_per_second";
pub const WORKER_KV_CACHE: &str = "stageb_worker_kv_cache_bytes";
pub const WORKER_JOB_DURATION: &str = "stageb_worker_job_duration_seconds";
pub const WORKER_PREFIX_LOOKUPS: &str = "stageb_worker_prefix_cache_lookups_total";
pub const WORKER_PREFIX_HITS: &str = "stageb_worker_prefix_cache_hits_total";
pub const WORKER_PREFILL_SAVED: &str = "stageb_worker_prefill_tokens_saved_total";
pub const WORKER_PREFIX_CACHE: &str = "stageb_worker_prefix_cache_bytes";
pub const WORKER_JOBS_IN_HAND: &str = "stageb_worker_jobs_in_hand";
pub const WORKER_STEP_ROWS: &str = "stageb_worker_step_rows";
pub const WORKER_STEP_JOBS: &str = "stageb_worker_step_jobs";
pub const WORKER_KV_BLOCKS: &str = "stageb_worker_kv_blocks";

/// Bucket bounds for rows (and jobs) per decode step of a continuous batch.
pub const STEP_ROW_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Bucket bounds (seconds) for the latency histograms: a lease wait is milliseconds when work
/// is queued, a real job seconds to minutes.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0,
];

/// Register every metric's help text and unit with the installed recorder.
pub fn describe_all() {
    describe_rank0();
    describe_worker();
}

/// [`describe_all`]'s rank-0 half: the lease table, then the run.
fn describe_rank0() {
    describe_counter!(LEASES_ISSUED, "Leases handed to workers.");
    describe_counter!(
        LEASES_EXPIRED,
        "Leases that ended without an answer (their jobs re-queued), by cause: expired, lifetime, register, no_progress."
    );
    describe_counter!(
        SUBMITS_FENCED,
        "Results refused because their lease was no longer valid."
    );
    describe_counter!(
        JOBS_COMPLETED,
        "Jobs completed, by kind (rollout, generate) and outcome (ok, error)."
    );
    describe_gauge!(QUEUE_DEPTH, "Jobs queued and not leased.");
    describe_gauge!(JOBS_IN_FLIGHT, "Jobs leased and not yet answered.");
    describe_gauge!(LIVE_WORKERS, "Worker sessions seen within two lease TTLs.");
    describe_gauge!(
        WORKERS_IDLE_RATIO,
        "Share of live worker time since rank 0 started in which a worker held no lease."
    );
    describe_histogram!(
        LEASE_WAIT,
        Unit::Seconds,
        "Time a Lease call waited before it got jobs."
    );
    describe_histogram!(
        JOB_LATENCY,
        Unit::Seconds,
        "Time from a lease to its accepted result, by job kind."
    );
    describe_counter!(
        TICKETS_DECIDED,
        "Tickets decided (one per ticket and epoch)."
    );
    describe_counter!(CANDIDATES, "Candidate verdicts received from rollouts.");
    describe_counter!(
        CANDIDATES_MALFORMED,
        "Candidates that broke the two-line contract, by violation code."
    );
    describe_counter!(
        REFLECTION_CALLS,
        "Reflection model calls, by pass (decision, ops) and outcome."
    );
    describe_counter!(
        REFLECTION_OPS,
        "Guidance operations proposed by the ops pass, by outcome (applied, rejected)."
    );
    describe_gauge!(GUIDANCE_STEP, "The guidance step in force.");
    describe_gauge!(EPOCH, "The epoch being run.");
    describe_gauge!(
        EPOCH_ACCURACY,
        "Accuracy of a finished epoch, need-review counted wrong (review=included) or left out (review=excluded)."
    );
    describe_gauge!(
        PHASE,
        "What rank 0 is doing: 1 for the current phase (starting, rollouts, decision, ops, revision, writing, draining, done), 0 for the others."
    );
    describe_gauge!(
        ROLLOUT_STEP,
        "The step of the epoch whose rollouts ran last (1-based)."
    );
    describe_gauge!(
        REFLECTION_CYCLE,
        "The reflection cycle whose call ran last (the run's cycle counter)."
    );
}

/// [`describe_all`]'s worker half.
fn describe_worker() {
    describe_counter!(
        WORKER_JOBS,
        "Jobs a worker ran, by kind and outcome (ok, error, cancelled)."
    );
    describe_counter!(
        WORKER_PREFILL_TOKENS,
        "Prompt tokens prefilled (those reused from the prefix cache not counted)."
    );
    describe_counter!(WORKER_DECODE_TOKENS, "Tokens generated.");
    describe_gauge!(
        WORKER_DECODE_RATE,
        "Generated tokens per second of the last rollout's decode."
    );
    describe_gauge!(
        WORKER_PREFILL_RATE,
        "Prompt tokens per second of the last job's prefill."
    );
    describe_gauge!(
        WORKER_KV_CACHE,
        Unit::Bytes,
        "Bytes of the KV cache the last job held at its peak."
    );
    describe_counter!(
        WORKER_PREFIX_LOOKUPS,
        "Jobs that looked their prompt up in the worker's prefix cache, by kind (rollout, generate)."
    );
    describe_counter!(
        WORKER_PREFIX_HITS,
        "Jobs whose prefill started from a reused prompt prefix, by kind (rollout, generate)."
    );
    describe_counter!(
        WORKER_PREFILL_SAVED,
        "Prompt tokens whose KV was reused from the prefix cache instead of prefilled, by kind."
    );
    describe_gauge!(
        WORKER_PREFIX_CACHE,
        Unit::Bytes,
        "Bytes of prompt KV the worker's prefix caches (rollouts' and generations') hold."
    );
    describe_gauge!(
        WORKER_JOBS_IN_HAND,
        "Jobs the worker holds (leased, not yet submitted), running in one batch."
    );
    describe_histogram!(
        WORKER_STEP_ROWS,
        "Rows (candidate tokens and prefill chunks) per forward call of the worker's batch."
    );
    describe_histogram!(
        WORKER_STEP_JOBS,
        "Jobs sharing a forward call of the worker's batch."
    );
    describe_gauge!(
        WORKER_KV_BLOCKS,
        "KV blocks of the worker's pool, by state: used (by jobs and the prefix caches), free (left by the budget)."
    );
    describe_histogram!(
        WORKER_JOB_DURATION,
        Unit::Seconds,
        "Time a worker spent running a job, by kind."
    );
}
