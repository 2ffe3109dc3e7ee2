//! What the loop writes besides its ticket rows: the four JSONL writers it appends to,
//! `manifest.json` (at start, once the limits are known, at the end) and the run summary
//! (`summary.json`). Their types: [`crate::artifacts::documents`].

use std::io;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use stageb_shared::SCHEMA_VERSION;
use stageb_shared::digest;

use stageb_shared::limits::EffectiveLimits;

use super::AheadStats;
use super::{REFERENCE_RANKS, RunError, RunInputs, RunLoop, files, io_err, step_size};
use crate::artifacts::documents::{
    Batching, CANDIDATE_SEED_RULE, Manifest, ManifestGuidance, ManifestModel, ManifestRuntime,
    ManifestSchedule, ManifestSeeds, PrefixReuse, RunSummary, SummaryRuntime, WorkerTime,
};
use crate::artifacts::{JsonlWriter, write_json_atomic};
use crate::cluster::scheduler::Scheduler;
use crate::cluster::server::ModelPinHandle;

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

/// What `manifest.json` says, the same before and after the loop is built.
pub(super) struct ManifestFacts<'a> {
    pub(super) dir: &'a Path,
    pub(super) inputs: &'a RunInputs,
    pub(super) model: &'a ModelPinHandle,
    pub(super) limits: Option<&'a EffectiveLimits>,
    pub(super) guidance_reused: bool,
    pub(super) initial_guidance_hash: &'a str,
    pub(super) scheduler: &'a Scheduler,
    pub(super) resuming: bool,
}

/// Writes `manifest.json`: `finished_at` is `None` until the run completes.
pub(super) fn write_manifest(
    facts: &ManifestFacts<'_>,
    started_at: &str,
    finished_at: Option<&str>,
) -> Result<(), RunError> {
    let path = facts.dir.join(files::MANIFEST);
    let manifest =
        manifest(facts, started_at, finished_at).map_err(|e| io_err(&path)(io::Error::other(e)))?;
    write_json_atomic(&path, &manifest).map_err(io_err(&path))
}

fn manifest(
    facts: &ManifestFacts<'_>,
    started_at: &str,
    finished_at: Option<&str>,
) -> serde_json::Result<Manifest> {
    let (inputs, cfg) = (facts.inputs, &facts.inputs.config);
    let model = facts
        .model
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    Ok(Manifest {
        schema_version: SCHEMA_VERSION,
        stageb_version: env!("CARGO_PKG_VERSION").to_string(),
        mission: inputs.ingested.mission.clone(),
        mode: inputs.mode.clone(),
        config_path: inputs.config_path.clone(),
        config_sha256: inputs.config_sha256.clone(),
        // As a JSON value, as the manifest always held it: an `f32` knob reads as its
        // `f64` widening (`0.30000001192092896`). Its paths as the file wrote them, so the
        // same config run from two checkouts records the same.
        config: serde_json::to_value(cfg.with_paths_of(&inputs.config_as_written))?,
        config_notices: values(&inputs.notices)?,
        input_digests: values(&inputs.ingested.input_digests)?,
        tickets_digest: digest::digest_of(&inputs.ingested.tickets),
        tickets: inputs.ingested.tickets.len(),
        model: ManifestModel {
            path: cfg.model.model_name_or_path.clone(),
            fingerprint: model.fingerprint,
        },
        effective_limits: facts.limits.cloned(),
        seeds: ManifestSeeds {
            run_seed: cfg.seed,
            candidate_seed: CANDIDATE_SEED_RULE.to_string(),
        },
        schedule: ManifestSchedule {
            step_size: step_size(cfg),
            reference_ranks: REFERENCE_RANKS,
            epochs: cfg.runner.epochs,
        },
        guidance: ManifestGuidance {
            source: inputs.config_as_written.guidance.path.clone(),
            reused_from_previous_run: facts.guidance_reused,
            initial_hash: facts.initial_guidance_hash.to_string(),
        },
        runtime: ManifestRuntime {
            started_at: started_at.to_string(),
            finished_at: finished_at.map(str::to_string),
            live_workers: facts.scheduler.live_workers(),
            resumed: facts.resuming,
            replayed_answers: facts.scheduler.stats().replayed,
            model_pinned_by: model.pinned_by.to_string(),
            numerics_pinned_by: model.numerics_pinned_by.to_string(),
            tuning: inputs.tuning,
        },
    })
}

impl RunLoop {
    /// Writes `manifest.json`: `finished_at` is `None` until the run completes.
    pub(super) fn write_manifest(
        &self,
        started_at: &str,
        finished_at: Option<&str>,
    ) -> Result<(), RunError> {
        let facts = ManifestFacts {
            dir: &self.dir,
            inputs: &self.inputs,
            model: &self.model,
            limits: self.limits.as_ref(),
            guidance_reused: self.reflector.guidance_reused(),
            initial_guidance_hash: &self.initial_guidance_hash,
            scheduler: &self.dispatch.scheduler,
            resuming: self.resuming,
        };
        write_manifest(&facts, started_at, finished_at)
    }

    /// Writes `summary.json` for a run of `epochs` epochs that started at `started`.
    pub(super) fn write_summary(
        &self,
        epochs: u32,
        started: Instant,
        started_at: String,
        finished_at: String,
    ) -> Result<RunSummary, RunError> {
        let path = self.dir.join(files::SUMMARY);
        let scheduler = self.dispatch.scheduler.stats();
        let runtime = SummaryRuntime {
            started_at,
            finished_at,
            elapsed_seconds: started.elapsed().as_secs_f64(),
            batching: Batching::from_stats(&scheduler),
            workers: WorkerTime::from_stats(&scheduler),
            pipeline: AheadStats {
                reflection: self.reflector.calls_ahead().clone(),
                ..self.ahead_stats.clone()
            },
            scheduler,
            prefix_cache: PrefixReuse {
                reflection: self.reflector.prefix_reuse().clone(),
                ..self.prefix_reuse.clone()
            },
            gate: self.reflector.gate_cost().clone(),
        };
        let runtime =
            serde_json::to_value(runtime).map_err(|e| io_err(&path)(io::Error::other(e)))?;
        let summary = RunSummary {
            schema_version: SCHEMA_VERSION,
            mission: self.inputs.ingested.mission.clone(),
            run_dir: self.dir.clone(),
            tickets: self.inputs.ingested.tickets.len(),
            epochs,
            candidates: self.candidates_seen,
            malformed_candidates: self.malformed,
            hard_failures: self.hard_failures,
            epoch_accuracy: self.epoch_rows.clone(),
            guidance_step: self.guidance.step(),
            guidance_hash: self.guidance.head_hash().to_string(),
            need_review: self.reflector.need_review_count(),
            reflection_cycles: self.reflector.cycles(),
            warnings: self.reflector.run_warnings().to_vec(),
            runtime,
        };
        write_json_atomic(&path, &summary).map_err(io_err(&path))?;
        Ok(summary)
    }
}

/// Each item as a JSON value.
fn values<T: Serialize>(items: &[T]) -> serde_json::Result<Vec<serde_json::Value>> {
    items.iter().map(serde_json::to_value).collect()
}
