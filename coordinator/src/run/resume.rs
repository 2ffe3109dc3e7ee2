//! How the run loop opens its directory (from the start, or where a step checkpoint left it)
//! and what it saves at a step boundary. The checkpoint format, when one is written and why
//! every crash point is safe: [`crate::run::checkpoint`].

use std::path::Path;

use stageb_shared::digest;

use super::{RunError, RunInputs, RunLoop, Writers, io_err};
use crate::artifacts::{JsonlWriter, seal};
use crate::decide::accuracy::Accumulator;
use crate::guidance::{GuidanceRepo, RepoOptions};
use crate::learn::reflection::ReflectionOpening;
use crate::run::checkpoint::{self, Checkpoint, LoopCounters, Position, RunIdentity};

/// What a run writes to, opened fresh or from a checkpoint.
pub(super) struct Opened {
    pub(super) guidance: GuidanceRepo,
    pub(super) writers: Writers,
    pub(super) reflection: ReflectionOpening,
    pub(super) guidance_reused: bool,
    pub(super) initial_guidance_hash: String,
}

/// Where an epoch starts: at its first step, or where a checkpoint left it (with the
/// epoch's metrics window so far).
pub(super) struct EpochStart {
    pub(super) epoch: u32,
    pub(super) steps_done: u64,
    pub(super) epoch_step: u64,
    pub(super) window: Option<Accumulator>,
}

impl Default for EpochStart {
    fn default() -> Self {
        EpochStart {
            epoch: 1,
            steps_done: 0,
            epoch_step: 0,
            window: None,
        }
    }
}

/// Opens a run from its start: fresh artifacts and journal-less state; the guidance seeded from
/// the global file, or continued from a previous run when `guidance.reset_on_rerun` is false.
/// A checkpoint left by an earlier run (or an unusable one) is removed: it describes other
/// artifacts than the ones this start writes.
pub(super) fn open_fresh(
    dir: &Path,
    inputs: &RunInputs,
    resuming: bool,
    options: RepoOptions,
) -> Result<Opened, RunError> {
    checkpoint::remove(dir).map_err(io_err(dir))?;
    let mission = inputs.ingested.mission.as_str();
    let reuse = !resuming
        && !inputs.config.guidance.reset_on_rerun
        && dir.join(crate::guidance::GUIDANCE_FILE).exists();
    if !reuse {
        // A reseeded run starts a new chain: the previous run's snapshots would otherwise
        // share names with this run's and be pruned in their place.
        let snapshots = dir.join(crate::guidance::SNAPSHOTS_DIR);
        if snapshots.exists() {
            std::fs::remove_dir_all(&snapshots).map_err(io_err(&snapshots))?;
        }
    }
    let guidance = if reuse {
        tracing::info!(
            "reusing the guidance left by the previous run (guidance.reset_on_rerun is false)"
        );
        GuidanceRepo::open(dir, mission, options)?
    } else {
        GuidanceRepo::create(&inputs.config.guidance.path, mission, dir, options)?
    };
    let initial_guidance_hash = guidance.head_hash().to_string();
    Ok(Opened {
        guidance,
        writers: Writers::open(dir, JsonlWriter::create)?,
        reflection: ReflectionOpening::open(dir, &inputs.config.reflection, None)?,
        guidance_reused: reuse,
        initial_guidance_hash,
    })
}

/// Which run a checkpoint must belong to.
pub(super) fn run_identity(inputs: &RunInputs) -> RunIdentity {
    RunIdentity {
        config_sha256: inputs.config_sha256.clone(),
        tickets_digest: digest::digest_of(&inputs.ingested.tickets),
    }
}

/// Opens a run where `checkpoint` left it: the artifacts cut back to the boundary, the
/// guidance as it was there (its snapshots are kept: the chain continues), the reflector's
/// state restored. The loop's own state is taken from the checkpoint by [`RunLoop::run`].
pub(super) fn open_at_checkpoint(
    dir: &Path,
    inputs: &RunInputs,
    checkpoint: &Checkpoint,
    options: RepoOptions,
) -> Result<Opened, RunError> {
    let mission = inputs.ingested.mission.as_str();
    // Checked before anything is cut or written: a refused checkpoint copy of the guidance
    // (edited, or of another chain) must never replace the run's file.
    let guidance_file = dir.join(crate::guidance::GUIDANCE_FILE);
    GuidanceRepo::check_run_text(&checkpoint.guidance_file, mission, &guidance_file)?;
    verify_seals(dir, checkpoint)?;
    checkpoint.restore_files(dir).map_err(io_err(dir))?;
    let guidance = GuidanceRepo::open(dir, mission, options)?;
    let state = Some(checkpoint.reflector.clone());
    let reflection = ReflectionOpening::open(dir, &inputs.config.reflection, state)?;
    let p = checkpoint.position;
    tracing::info!(
        epoch = p.epoch,
        steps_done = p.steps_done,
        tickets_decided = checkpoint.counters.global_step,
        "resuming from the step checkpoint"
    );
    Ok(Opened {
        guidance,
        writers: Writers::open(dir, JsonlWriter::open_resume)?,
        reflection,
        guidance_reused: false,
        initial_guidance_hash: checkpoint.initial_guidance_hash.clone(),
    })
}

/// Every artifact the checkpoint keeps must match its seal up to the checkpoint's length
/// (`artifacts::seal`): a file changed after rank 0 wrote it is refused (`E_RESUME_MISMATCH`)
/// before anything is cut or written.
fn verify_seals(dir: &Path, checkpoint: &Checkpoint) -> Result<(), RunError> {
    for (name, &len) in &checkpoint.artifact_bytes {
        let refuse = |why: String| {
            stageb_shared::error::InputError::new(
                stageb_shared::error::ErrorCode::ResumeMismatch,
                dir.join(name).display().to_string(),
                None,
                format!("cannot resume: {why}; pass --overwrite to start over"),
            )
        };
        match seal::verify_file(dir, name) {
            Ok(None) => {}
            Ok(Some(sealed)) if sealed >= len => {}
            Ok(Some(sealed)) => {
                return Err(refuse(format!(
                    "{name} is sealed up to {sealed} bytes, short of the checkpoint's {len}"
                ))
                .into());
            }
            Err(e) => return Err(refuse(e.to_string()).into()),
        }
    }
    Ok(())
}

impl RunLoop {
    /// The loop's counters as a checkpoint stores them.
    fn counters(&self) -> LoopCounters {
        LoopCounters {
            global_step: self.global_step,
            schedule_step: self.schedule_step,
            candidates_seen: self.candidates_seen,
            malformed: self.malformed,
            hard_failures: self.hard_failures,
            epoch_rows: self.epoch_rows.clone(),
        }
    }

    /// Takes the loop's counters back from a checkpoint.
    pub(super) fn restore_counters(&mut self, c: &LoopCounters) {
        self.global_step = c.global_step;
        self.schedule_step = c.schedule_step;
        self.candidates_seen = c.candidates_seen;
        self.malformed = c.malformed;
        self.hard_failures = c.hard_failures;
        self.epoch_rows = c.epoch_rows.clone();
        // The epochs finished before the checkpoint publish their accuracy gauges again, as
        // an uninterrupted run's rank 0 would show them.
        for row in &c.epoch_rows {
            if let Ok(row) =
                serde_json::from_value::<crate::decide::accuracy::MetricsRow>(row.clone())
            {
                super::boundary::record_epoch_accuracy(row.epoch, &row);
            }
        }
        let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        p.done = c.global_step;
        p.candidates = c.candidates_seen;
    }

    /// At a step boundary (every job and reflection call answered and written): a checkpoint
    /// when one is due, or always at an epoch's end (`window` is `None` there), then the
    /// journal starts over. Ordering and crash windows: [`crate::run::checkpoint`].
    pub(super) fn checkpoint_at(
        &mut self,
        position: Position,
        window: Option<&Accumulator>,
    ) -> Result<(), RunError> {
        if window.is_some()
            && !self
                .checkpoints
                .due(self.dispatch.scheduler.journal_bytes())
        {
            return Ok(());
        }
        let dir = self.dir.clone();
        self.writers.sync().map_err(io_err(&dir))?;
        self.reflector.sync_logs().map_err(io_err(&dir))?;
        let checkpoint = Checkpoint::capture(
            &dir,
            run_identity(&self.inputs),
            position,
            self.counters(),
            window.cloned(),
            self.reflector.state(),
            self.initial_guidance_hash.clone(),
        )
        .map_err(io_err(&dir))?;
        let bytes = checkpoint.save(&dir).map_err(io_err(&dir))?;
        self.checkpoints.saved(bytes);
        self.dispatch
            .scheduler
            .restart_journal()
            .map_err(io_err(&dir))
    }
}
