//! The epoch loop on rank 0: schedule each step's rollouts, turn results into decisions in a
//! fixed order, write every artifact, and hand gradient candidates to reflection at step
//! boundaries.
//!
//! # Determinism
//! Each epoch's ticket order is a seeded shuffle; steps are fixed-size slices of it
//! ([`step_size`]: defined by ticket count, never by how many workers exist). All rollouts of a
//! step use the guidance version current when the step starts. Workers finish in any order,
//! but results are processed and written in step order, and every candidate's seed is derived
//! from `(run seed, epoch, ticket key, decode index, sample index)`. Rows therefore come out
//! byte-identical with 1 or N workers; only the `runtime` object (which worker, which lease,
//! how long) differs, and it is the one thing determinism checks drop.
//!
//! # Files
//! - `mod.rs` (here): the loop's state ([`RunLoop`]), its inputs and errors.
//! - `epochs.rs`: the loop itself: [`RunLoop::prepare`] opens the run ([`PreparedRun`]),
//!   [`PreparedRun::run`] waits for the model's context, builds the loop, then epochs → steps.
//! - `step.rs`: one step: its rollouts awaited, its tickets decided, its reflection round.
//! - `boundary.rs`: the epoch boundary: drained reflection, the epoch row, the ablation.
//! - `ticket.rs`: one ticket decided and its rows written (selection, trajectories, failures).
//! - `outputs.rs`: the JSONL writers, `manifest.json` and `summary.json`.
//! - `steps_ahead.rs`: the next steps' rollouts, queued ahead while a step's reflection runs.
//! - [`rollout_prompt`]: a ticket's rollout job (prompt and seeds).
//! - [`checkpoint`] and `resume.rs`: the step checkpoint, and opening a run from its start or
//!   from a checkpoint; [`start`]: fresh, `--overwrite` or `--resume`; [`dir`]: the run
//!   directory an attempt holds ([`dir::RunDir`]: its lock and job journal).
//!
//! The row types themselves are [`crate::artifacts::rows`] and [`crate::artifacts::documents`].

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use stageb_shared::config::{ConfigNotice, RunConfig};
use stageb_shared::domain::Ticket;
use stageb_shared::ingest::Ingested;
use stageb_shared::limits::EffectiveLimits;

use crate::cluster::completions::WaitError;
use crate::cluster::dispatch::Dispatch;
use crate::decide::accuracy;
use crate::decide::split::Splits;
use crate::guidance::{GuidanceError, GuidanceRepo};
use crate::learn::reflection::{ReflectionError, ReflectionOpening, Reflector};
use crate::run::checkpoint::{Checkpoint, CheckpointPolicy};

mod boundary;
pub mod checkpoint;
pub mod dir;
mod epochs;
mod outputs;
mod resume;
pub mod rollout_prompt;
pub mod start;
mod step;
pub mod steps_ahead;
mod ticket;
use crate::artifacts::documents::PrefixReuse;
pub use crate::artifacts::documents::RunSummary;
use outputs::Writers;
pub use rollout_prompt::rollout_payload;
use steps_ahead::AheadStats;

/// Ranks of the reference deployment (one 8-GPU node). A step is
/// `per_rank_rollout_batch_size × REFERENCE_RANKS` tickets whatever the actual number of
/// workers, so a run's decisions never depend on how many workers served it.
pub const REFERENCE_RANKS: u32 = 8;

/// Tickets per step for a config.
pub fn step_size(config: &RunConfig) -> usize {
    (config.runner.per_rank_rollout_batch_size.max(1) * REFERENCE_RANKS) as usize
}

pub use crate::artifacts::files;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot write artifacts under {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(transparent)]
    Guidance(#[from] GuidanceError),
    /// Bad input met while opening the run (e.g. an artifact that fails its seal on resume).
    #[error(transparent)]
    Input(#[from] stageb_shared::error::InputError),
    #[error("the mission name `{0}` cannot be used as a directory name")]
    BadMission(String),
    #[error("no worker has been alive for {0:?}; giving up")]
    NoWorkers(Duration),
    #[error("the scheduler stopped delivering results")]
    SchedulerClosed,
    #[error(transparent)]
    Reflection(ReflectionError),
}

impl From<WaitError> for RunError {
    fn from(e: WaitError) -> Self {
        match e {
            WaitError::NoWorkers(grace) => RunError::NoWorkers(grace),
            WaitError::SchedulerClosed => RunError::SchedulerClosed,
        }
    }
}

/// Reflection's failures as the run reports them: a guidance or wait failure is the same
/// whichever part of the loop met it (bad guidance input stays an input error, exit 2).
impl From<ReflectionError> for RunError {
    fn from(e: ReflectionError) -> Self {
        match e {
            ReflectionError::Guidance(g) => RunError::Guidance(g),
            ReflectionError::Wait(w) => w.into(),
            other => RunError::Reflection(other),
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> RunError + '_ {
    move |source| RunError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `{output.root}/{run_name}/{mission}/`, refusing names that would escape the root.
pub fn run_dir(config: &RunConfig, mission: &str) -> Result<PathBuf, RunError> {
    let bad = |s: &str| {
        s.is_empty()
            || s == "."
            || s == ".."
            || s.contains('/')
            || s.contains('\\')
            || s.contains('\0')
    };
    if bad(mission) {
        return Err(RunError::BadMission(mission.to_string()));
    }
    if bad(&config.output.run_name) {
        return Err(RunError::BadMission(config.output.run_name.clone()));
    }
    Ok(config
        .output
        .root
        .join(&config.output.run_name)
        .join(mission))
}

/// Everything the loop needs, prepared by the caller.
pub struct RunInputs {
    /// With paths resolved.
    pub config: RunConfig,
    /// The same config with its paths as the file wrote them: what the manifest records (with
    /// `config`'s values otherwise), so the same config run from two checkouts records the
    /// same.
    pub config_as_written: RunConfig,
    /// As given, relative to the working directory when it lies inside it.
    pub config_path: PathBuf,
    pub config_sha256: String,
    pub notices: Vec<ConfigNotice>,
    pub ingested: Ingested,
    /// Shown in the manifest (`embedded` or `cluster`).
    pub mode: String,
    /// The device-tuned settings in force (`--max-jobs`, `runner.pipeline_*`) and where each
    /// came from, once rank 0 decided them at start (the manifest's `runtime.tuning`).
    pub tuning: Option<stageb_shared::config::Tuning>,
}

pub use crate::progress::{ProgressHandle, ProgressSnapshot};

fn now_iso() -> String {
    crate::guidance::utc_now_iso()
}

/// The guidance a step's rollouts run under: its step, its `G0` (for the vote's overrides) and,
/// with the gate on, the digest of its rendering (under which gate outcomes are kept).
struct StepGuidance {
    step: u64,
    g0: String,
    digest: Option<String>,
}

/// An epoch under way: which one, its tickets and config, its metrics window so far, when it
/// started, and how many of its tickets were decided.
struct EpochRun<'a> {
    epoch: u32,
    tickets: &'a [Ticket],
    cfg: &'a RunConfig,
    window: accuracy::Accumulator,
    started: Instant,
    epoch_step: u64,
}

/// A run whose directory is open ([`RunLoop::prepare`]); [`PreparedRun::run`] waits for
/// the model's context, then builds the loop and runs it.
pub struct PreparedRun {
    inputs: RunInputs,
    dir: PathBuf,
    dispatch: Dispatch,
    model: crate::cluster::server::ModelPinHandle,
    progress: ProgressHandle,
    guidance: GuidanceRepo,
    writers: Writers,
    /// What reflection opened with the run (prompts, logs, a checkpoint's state).
    reflection: ReflectionOpening,
    guidance_reused: bool,
    initial_guidance_hash: String,
    /// Continuing an earlier attempt (shown in the manifest's `runtime`).
    resuming: bool,
    /// The token limits the run plans with, once its context is known.
    limits: Option<EffectiveLimits>,
    /// Where a resumed run continues.
    resume_from: Option<Checkpoint>,
    /// The held-out splits, when `reflection.gate` is on.
    splits: Option<Splits>,
}

/// The rank-0 run loop, built once the run's context is known.
pub struct RunLoop {
    inputs: RunInputs,
    dir: PathBuf,
    /// Where jobs go and answers come back, with the run's worker grace.
    dispatch: Dispatch,
    model: crate::cluster::server::ModelPinHandle,
    progress: ProgressHandle,
    guidance: GuidanceRepo,
    reflector: Reflector,
    writers: Writers,
    /// Continuing an earlier attempt (shown in the manifest's `runtime`).
    resuming: bool,
    /// Tickets decided so far, across epochs (the original's `global_step`).
    global_step: u64,
    /// Schedule steps started so far, across epochs (guidance is fixed within one).
    schedule_step: u64,
    initial_guidance_hash: String,
    candidates_seen: u64,
    malformed: u64,
    hard_failures: u64,
    /// Prompt prefill the workers' prefix caches saved (`runtime.prefix_cache`).
    prefix_reuse: PrefixReuse,
    /// The next steps' rollouts (up to `runner.pipeline_steps`, in order), queued ahead while
    /// this step's reflection runs.
    steps_ahead: std::collections::VecDeque<steps_ahead::StepAhead>,
    /// What was queued ahead and what became of it (`runtime.pipeline`).
    ahead_stats: AheadStats,
    /// The token limits the run plans with, once its context is known.
    limits: Option<EffectiveLimits>,
    /// Epoch rows of the finished epochs (the summary's `epoch_accuracy`).
    epoch_rows: Vec<serde_json::Value>,
    checkpoints: CheckpointPolicy,
    /// The held-out splits, when `reflection.gate` is on.
    splits: Option<Splits>,
}

#[cfg(test)]
mod tests;
