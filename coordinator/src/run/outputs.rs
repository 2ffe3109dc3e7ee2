//! What the loop writes besides its ticket rows: the four JSONL writers it appends to,
//! `manifest.json` (at start, once the limits are known, at the end) and the run summary
//! (`summary.json`).

use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::json;
use stageb_shared::SCHEMA_VERSION;
use stageb_shared::digest;

use super::{REFERENCE_RANKS, RunError, RunLoop, files, io_err, step_size};
use crate::artifacts::{JsonlWriter, write_json_atomic};

/// What a run produced, also written as `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub schema_version: u32,
    pub mission: String,
    pub run_dir: PathBuf,
    pub tickets: usize,
    pub epochs: u32,
    pub candidates: u64,
    pub malformed_candidates: u64,
    pub hard_failures: u64,
    pub epoch_accuracy: Vec<serde_json::Value>,
    pub guidance_step: u64,
    pub guidance_hash: String,
    pub need_review: usize,
    pub reflection_cycles: u64,
    /// Run-level warnings a user must not miss (e.g. an epoch in which no decision pass
    /// parsed: the guidance could not learn anything then).
    pub warnings: Vec<String>,
    pub runtime: serde_json::Value,
}

pub(super) struct Writers {
    pub(super) trajectories: JsonlWriter,
    pub(super) selections: JsonlWriter,
    pub(super) metrics: JsonlWriter,
    pub(super) failures: JsonlWriter,
}

impl Writers {
    /// Opens the four files with `open`: fresh ([`JsonlWriter::create`]) or appended to after
    /// a checkpoint ([`JsonlWriter::open_resume`]).
    pub(super) fn open(
        dir: &Path,
        open: fn(&Path) -> io::Result<JsonlWriter>,
    ) -> Result<Self, RunError> {
        let open = |name: &str| {
            let p = dir.join(name);
            open(&p).map_err(|source| RunError::Io { path: p, source })
        };
        Ok(Writers {
            trajectories: open(files::TRAJECTORIES)?,
            selections: open(files::SELECTIONS)?,
            metrics: open(files::METRICS)?,
            failures: open(files::FAILURE_MALFORMED)?,
        })
    }

    pub(super) fn sync(&mut self) -> io::Result<()> {
        self.trajectories.sync()?;
        self.selections.sync()?;
        self.metrics.sync()?;
        self.failures.sync()
    }
}

impl RunLoop {
    pub(super) fn write_manifest(
        &self,
        started_at: &str,
        finished_at: Option<&str>,
    ) -> Result<(), RunError> {
        let cfg = &self.inputs.config;
        let model = self.model.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let manifest = json!({
            "schema_version": SCHEMA_VERSION,
            "stageb_version": env!("CARGO_PKG_VERSION"),
            "mission": self.inputs.ingested.mission,
            "mode": self.inputs.mode,
            "config_path": self.inputs.config_path,
            "config_sha256": self.inputs.config_sha256,
            "config": cfg,
            "config_notices": self.inputs.notices,
            "input_digests": self.inputs.ingested.input_digests,
            "tickets_digest": digest::digest_of(&self.inputs.ingested.tickets),
            "tickets": self.inputs.ingested.tickets.len(),
            "model": {"path": cfg.model.model_name_or_path, "fingerprint": model.fingerprint},
            // The lengths every call was planned with (the config above is kept as written).
            "effective_limits": self.limits,
            "seeds": {"run_seed": cfg.seed, "candidate_seed": "sha256(stageb/candidate-seed/v1, run seed, epoch, ticket key, decode index, sample index)"},
            "schedule": {"step_size": step_size(cfg), "reference_ranks": REFERENCE_RANKS, "epochs": cfg.runner.epochs},
            "guidance": {
                "source": cfg.guidance.path,
                "reused_from_previous_run": self.reflector.guidance_reused(),
                "initial_hash": self.initial_guidance_hash,
            },
            // Timing-dependent (workers come and go), hence under `runtime`.
            "runtime": {"started_at": started_at, "finished_at": finished_at, "live_workers": self.scheduler.live_workers(),
                        "resumed": self.resuming, "replayed_answers": self.scheduler.stats().replayed,
                        // Who pinned the model differs between an attempt and its resume.
                        "model_pinned_by": model.pinned_by},
        });
        let path = self.dir.join(files::MANIFEST);
        write_json_atomic(&path, &manifest).map_err(io_err(&path))
    }
}
