//! The run's identity and totals: the parts of `manifest.json` and `summary.json` the report
//! shows, read leniently (every field optional) so a manifest written at run start, before
//! `finished_at` and the fingerprint are known, or a run that never wrote its summary, still
//! has a header.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use stageb_coordinator::artifacts::files;

use super::load::{FileStatus, read_json};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Manifest {
    pub stageb_version: Option<String>,
    pub mission: Option<String>,
    pub mode: Option<String>,
    pub config_path: Option<String>,
    pub config_sha256: Option<String>,
    pub tickets: Option<u64>,
    pub model: ManifestModel,
    pub schedule: Schedule,
    pub runtime: ManifestRuntime,
    /// The resolved config; read with [`Manifest::config_f64`] for the few knobs shown.
    pub config: Value,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ManifestModel {
    pub path: Option<String>,
    /// `weights-sha256|candle-<ver>|<dtype>|<device kind>`.
    pub fingerprint: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Schedule {
    pub step_size: Option<u64>,
    pub epochs: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ManifestRuntime {
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
    pub resumed: Option<bool>,
    pub replayed_answers: Option<u64>,
    pub live_workers: Option<u64>,
}

impl Manifest {
    /// A number of the resolved config by JSON pointer (`/manual_review/min_verdict_agreement`).
    pub fn config_f64(&self, pointer: &str) -> Option<f64> {
        self.config.pointer(pointer).and_then(Value::as_f64)
    }

    /// Candidates sampled per ticket: grid entries × samples per entry.
    pub fn candidates_per_ticket(&self) -> Option<u64> {
        let grid = self.config.pointer("/sampler/grid")?.as_array()?.len() as u64;
        let samples = self.config_f64("/sampler/samples_per_decode")? as u64;
        Some(grid * samples)
    }

    /// The fingerprint with its weights digest cut to 12 hex digits: what a person compares.
    pub fn fingerprint_short(&self) -> Option<String> {
        let full = self.model.fingerprint.as_deref()?;
        let mut parts = full.split('|');
        let weights = parts.next().unwrap_or("");
        let short: String = weights.chars().take(12).collect();
        let rest: Vec<&str> = parts.collect();
        Some(if rest.is_empty() {
            short
        } else {
            format!("{short}…|{}", rest.join("|"))
        })
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Summary {
    pub tickets: Option<u64>,
    pub epochs: Option<u32>,
    pub candidates: Option<u64>,
    pub malformed_candidates: Option<u64>,
    pub hard_failures: Option<u64>,
    pub need_review: Option<u64>,
    pub reflection_cycles: Option<u64>,
    pub guidance_step: Option<u64>,
    pub guidance_hash: Option<String>,
    pub warnings: Vec<String>,
    /// The `epoch_end` metrics rows; kept loose so one odd row does not lose the summary.
    pub epoch_accuracy: Vec<Value>,
    pub runtime: SummaryRuntime,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SummaryRuntime {
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
    pub elapsed_seconds: Option<f64>,
    /// Scheduler counters (`leases_issued`, `leases_expired`, …), shown as given.
    pub scheduler: BTreeMap<String, Value>,
}

/// The header's inputs.
#[derive(Debug, Clone, Default)]
pub struct Identity {
    pub manifest: Option<Manifest>,
    pub summary: Option<Summary>,
    pub files: Vec<FileStatus>,
}

impl Identity {
    /// The run's epochs as scheduled (manifest), else as summarized.
    pub fn epochs(&self) -> Option<u32> {
        self.manifest
            .as_ref()
            .and_then(|m| m.schedule.epochs)
            .or_else(|| self.summary.as_ref().and_then(|s| s.epochs))
    }
}

pub fn collect(dir: &Path) -> Identity {
    let (manifest, manifest_status) = read_json::<Manifest>(dir, files::MANIFEST);
    let (summary, summary_status) = read_json::<Summary>(dir, files::SUMMARY);
    Identity {
        manifest,
        summary,
        files: vec![manifest_status, summary_status],
    }
}
