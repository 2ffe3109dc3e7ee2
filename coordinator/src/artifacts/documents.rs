//! The run's two whole-file documents, one type each: `manifest.json` ([`Manifest`]: what the
//! run is, written at its start and rewritten as it learns its model and ends) and
//! `summary.json` ([`RunSummary`]: what it produced, written when it completes). Rank 0 writes
//! them (`crate::run`); `stageb report`, `stageb audit` and `--resume` read them back.
//!
//! As for the rows ([`crate::artifacts::rows`]): keys come out in field order, which is part
//! of the format; a reader takes a missing key as its default. The parts a reader must not lose
//! the whole document over stay JSON values: the resolved config (read with
//! [`Manifest::run_config`]), the config notices and input digests, the summary's epoch rows;
//! so does the summary's `runtime`, which callers index.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use stageb_shared::config::{RunConfig, Tuning};
use stageb_shared::limits::EffectiveLimits;

use crate::cluster::scheduler::SchedulerStats;

/// How a candidate's seed is derived, as the manifest states it.
pub const CANDIDATE_SEED_RULE: &str =
    "sha256(stageb/candidate-seed/v1, run seed, epoch, ticket key, decode index, sample index)";

/// `manifest.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Manifest {
    pub schema_version: u32,
    pub stageb_version: String,
    pub mission: String,
    /// How the processes were started: `embedded` or `cluster`.
    pub mode: String,
    pub config_path: PathBuf,
    pub config_sha256: String,
    /// The resolved config, kept as written (the `effective_limits` are what ran).
    pub config: serde_json::Value,
    pub config_notices: Vec<serde_json::Value>,
    pub input_digests: Vec<serde_json::Value>,
    pub tickets_digest: String,
    pub tickets: usize,
    pub model: ManifestModel,
    /// The lengths every call was planned with; `null` until the model's context is known.
    pub effective_limits: Option<EffectiveLimits>,
    pub seeds: ManifestSeeds,
    pub schedule: ManifestSchedule,
    pub guidance: ManifestGuidance,
    pub runtime: ManifestRuntime,
}

impl Manifest {
    /// The resolved config, when it reads as one.
    pub fn run_config(&self) -> Option<RunConfig> {
        serde_json::from_value(self.config.clone()).ok()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ManifestModel {
    /// `model.model_name_or_path` of the config.
    pub path: String,
    /// `weights-sha256|candle-<ver>|<dtype>|<device kind>`, once a worker has loaded it.
    pub fingerprint: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ManifestSeeds {
    pub run_seed: u64,
    /// [`CANDIDATE_SEED_RULE`].
    pub candidate_seed: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ManifestSchedule {
    /// Tickets per rollout step.
    pub step_size: usize,
    pub reference_ranks: u32,
    pub epochs: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ManifestGuidance {
    /// The seed guidance file of the config.
    pub source: PathBuf,
    /// A previous run's guidance was continued (`guidance.reset_on_rerun: false`).
    pub reused_from_previous_run: bool,
    pub initial_hash: String,
}

/// Timing-dependent facts (workers come and go), hence under `runtime`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ManifestRuntime {
    pub started_at: String,
    /// `null` until the run completes.
    pub finished_at: Option<String>,
    pub live_workers: usize,
    /// This attempt continues an earlier one (`--resume`).
    pub resumed: bool,
    pub replayed_answers: u64,
    /// Who pinned the model (`config`, `operator`, `resumed_run`, `first_worker`): it differs
    /// between an attempt and its resume.
    pub model_pinned_by: String,
    /// Who decided the numerics (`rank0_worker`, `first_worker`, `resumed_run`).
    pub numerics_pinned_by: String,
    /// The device-tuned settings in force (`--max-jobs`, `runner.pipeline_*`) and where each
    /// came from (config, flag, device default): they change no artifact byte, and may differ
    /// between an attempt and its resume on another device.
    pub tuning: Option<Tuning>,
}

/// What a run produced, also written as `summary.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunSummary {
    pub schema_version: u32,
    pub mission: String,
    pub run_dir: PathBuf,
    pub tickets: usize,
    pub epochs: u32,
    pub candidates: u64,
    pub malformed_candidates: u64,
    pub hard_failures: u64,
    /// The `epoch_end` rows of `metrics.jsonl`; kept as values so one odd row does not lose a
    /// reader the summary.
    pub epoch_accuracy: Vec<serde_json::Value>,
    pub guidance_step: u64,
    pub guidance_hash: String,
    pub need_review: usize,
    pub reflection_cycles: u64,
    /// Run-level warnings a user must not miss (e.g. an epoch in which no decision pass
    /// parsed: the guidance could not learn anything then).
    pub warnings: Vec<String>,
    /// A [`SummaryRuntime`] as JSON, which callers index (`summary.runtime["scheduler"]`);
    /// typed: [`RunSummary::runtime_facts`].
    pub runtime: serde_json::Value,
}

impl RunSummary {
    /// The `runtime` object, typed (a missing key reads as its default).
    pub fn runtime_facts(&self) -> SummaryRuntime {
        SummaryRuntime::deserialize(&self.runtime).unwrap_or_default()
    }
}

/// The run's timing and the cluster's counters: outside every determinism comparison.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SummaryRuntime {
    pub started_at: String,
    pub finished_at: String,
    pub elapsed_seconds: f64,
    pub scheduler: SchedulerStats,
    pub prefix_cache: PrefixReuse,
    pub batching: Batching,
    pub pipeline: AheadStats,
    pub workers: WorkerTime,
    /// What the gate's edit checks cost (`reflection.gate.check_edits`); absent without them.
    #[serde(skip_serializing_if = "GateCost::is_zero")]
    pub gate: GateCost,
}

/// `summary.json` `runtime.prefix_cache`: how much prompt prefill the workers' prefix caches
/// saved, summed over a run's rollouts (the run loop counts them) and its reflection calls
/// (the reflector counts them). Rank 0 keeps a step's rollouts together (one step's jobs are
/// queued at once, in step order, all with the same guidance), so consecutive rollouts on a
/// worker share their system prompt and guidance, and a worker reuses that head's KV. The
/// numbers depend on which worker got which ticket: runtime facts, outside every determinism
/// comparison.
///
/// Totals over the rollouts workers computed in this attempt (answers replayed from the job
/// journal prefilled nothing and are left out).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefixReuse {
    /// Rollout answers counted.
    pub rollouts: u64,
    /// Those whose prefill started from a reused prefix.
    pub rollouts_with_hit: u64,
    /// `rollouts_with_hit / rollouts` (0 without rollouts).
    pub hit_rate: f64,
    /// Prompt tokens of those rollouts.
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV was reused instead of prefilled.
    pub prefill_tokens_saved: u64,
    /// The same for the reflection calls (the generations' own prefix store).
    pub reflection: CallPrefixReuse,
}

impl PrefixReuse {
    /// Counts one rollout answer of `prompt_tokens`, `prefix_tokens` of them reused (checked
    /// below `prompt_tokens` when the answer was accepted).
    pub fn add(&mut self, prompt_tokens: u32, prefix_tokens: u32) {
        self.rollouts += 1;
        self.rollouts_with_hit += u64::from(prefix_tokens > 0);
        self.prompt_tokens += u64::from(prompt_tokens);
        self.prefill_tokens_saved += u64::from(prefix_tokens.min(prompt_tokens));
        self.hit_rate = self.rollouts_with_hit as f64 / self.rollouts as f64;
    }
}

/// How much prompt prefill the workers' generation prefix caches saved on the reflection calls
/// they answered in this attempt (`summary.json` `runtime.prefix_cache.reflection`; answers
/// replayed from the job journal prefilled nothing and are left out). A cycle's calls share
/// their system prompt, guidance and cases (the prompts put them first), so a worker that
/// answered the call before reuses that head. Which worker got which call decides the numbers:
/// runtime facts, outside every determinism comparison.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CallPrefixReuse {
    /// Reflection calls a worker answered with a generation.
    pub calls: u64,
    /// Those whose prefill started from a reused prefix.
    pub calls_with_hit: u64,
    /// `calls_with_hit / calls` (0 without calls).
    pub hit_rate: f64,
    /// Prompt tokens of those calls.
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV was reused instead of prefilled.
    pub prefill_tokens_saved: u64,
}

/// `summary.json` `runtime.pipeline`: steps and rollout jobs queued ahead in this attempt, and
/// what became of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AheadStats {
    pub steps_ahead: u64,
    /// Steps whose guidance had not changed: their jobs were used as queued.
    pub steps_used: u64,
    /// Steps whose guidance changed: their jobs were withdrawn and queued again.
    pub steps_discarded: u64,
    pub jobs_ahead: u64,
    pub jobs_used: u64,
    pub jobs_discarded: u64,
    /// Reflection calls queued ahead of their cycle (`runner.pipeline_cycles`).
    pub reflection: CallsAheadStats,
}

/// Calls queued ahead in this attempt, and what became of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CallsAheadStats {
    /// Calls queued ahead of their cycle.
    pub calls_ahead: u64,
    /// Of those, the calls a cycle used as they were.
    pub calls_used: u64,
    /// Of those, the calls withdrawn unused (a wrong guess, or left over at a boundary).
    pub calls_withdrawn: u64,
}

/// What the gate cost this attempt (`summary.json` `runtime.gate`; a resumed attempt counts
/// its own).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GateCost {
    /// Candidates evaluated.
    pub checks: u64,
    /// Of them, refused.
    pub refused: u64,
    /// Gate rollouts queued.
    pub rollouts: u64,
    /// Gate outcomes reused instead of rolled out.
    pub reused: u64,
}

impl GateCost {
    pub fn is_zero(&self) -> bool {
        *self == GateCost::default()
    }
}

/// How the workers' time was spent, as rank 0 saw it (`summary.json` `runtime.workers`): the
/// share in which a live worker held no lease is the idle fraction the pipelining targets.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerTime {
    /// Live worker time summed over workers.
    pub registered_seconds: f64,
    /// The part of it spent holding at least one lease.
    pub busy_seconds: f64,
    /// `1 - busy / registered` (0 when no worker was seen).
    pub idle_fraction: f64,
}

impl WorkerTime {
    pub fn from_stats(stats: &SchedulerStats) -> Self {
        let (all, busy) = (stats.worker_ms, stats.worker_busy_ms.min(stats.worker_ms));
        WorkerTime {
            registered_seconds: all as f64 / 1000.0,
            busy_seconds: busy as f64 / 1000.0,
            idle_fraction: stats.idle_fraction(),
        }
    }
}

/// How full the workers' forward steps were, as the jobs computed in this attempt saw them
/// (`summary.json` `runtime.batching`; workers that do not batch report nothing).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Batching {
    /// Forward steps summed over jobs (a step shared by three jobs counts three times).
    pub job_steps: u64,
    /// The rows (decoding sequences and prefill chunks) of those steps.
    pub rows: u64,
    /// `rows / job_steps`: the rows a job's step computed on average, its own and other
    /// jobs' (0 when no job reported).
    pub mean_rows_per_step: f64,
}

impl Batching {
    pub fn from_stats(stats: &SchedulerStats) -> Self {
        let (job_steps, rows) = (stats.batch_job_steps, stats.batch_rows);
        Batching {
            job_steps,
            rows,
            mean_rows_per_step: if job_steps == 0 {
                0.0
            } else {
                rows as f64 / job_steps as f64
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_is_rollouts_with_a_hit_over_rollouts() {
        let mut r = PrefixReuse::default();
        assert_eq!(r.hit_rate, 0.0);
        r.add(600, 0); // the first ticket of a worker
        r.add(610, 580);
        r.add(590, 580);
        r.add(620, 400); // guidance changed after token 400
        assert_eq!(
            r,
            PrefixReuse {
                rollouts: 4,
                rollouts_with_hit: 3,
                hit_rate: 0.75,
                prompt_tokens: 2420,
                prefill_tokens_saved: 1560,
                reflection: CallPrefixReuse::default(),
            }
        );
    }
}
