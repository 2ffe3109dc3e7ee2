//! The run's identity and totals: `manifest.json` and `summary.json`, read as rank 0's
//! document types (`artifacts::documents`) and leniently (a missing key reads as its default),
//! so a manifest written at run start, before `finished_at` and the fingerprint are known, or a
//! run that never wrote its summary, still has a header. The views the page needs of them
//! (a config knob, the short fingerprint, candidates per ticket) are the functions below.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use stageb_coordinator::artifacts::documents::{Manifest, RunSummary};
use stageb_coordinator::artifacts::files;

use super::load::{FileStatus, read_json};

/// A number of the resolved config by JSON pointer (`/manual_review/min_verdict_agreement`).
pub fn config_f64(m: &Manifest, pointer: &str) -> Option<f64> {
    m.config.pointer(pointer).and_then(Value::as_f64)
}

/// Candidates sampled per ticket: grid entries × samples per entry.
pub fn candidates_per_ticket(m: &Manifest) -> Option<u64> {
    let grid = m.config.pointer("/sampler/grid")?.as_array()?.len() as u64;
    let samples = config_f64(m, "/sampler/samples_per_decode")? as u64;
    Some(grid * samples)
}

/// The summary's scheduler counters (`leases_issued`, `leases_expired`, …) by name.
pub fn scheduler_counters(s: &RunSummary) -> BTreeMap<String, Value> {
    match serde_json::to_value(s.runtime_facts().scheduler) {
        Ok(Value::Object(counters)) => counters.into_iter().collect(),
        _ => BTreeMap::new(),
    }
}

/// The fingerprint with its weights digest cut to 12 hex digits: what a person compares.
pub fn fingerprint_short(m: &Manifest) -> Option<String> {
    let full = m.model.fingerprint.as_deref()?;
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

/// The header's inputs.
#[derive(Debug, Clone, Default)]
pub struct Identity {
    pub manifest: Option<Manifest>,
    pub summary: Option<RunSummary>,
    pub files: Vec<FileStatus>,
}

impl Identity {
    /// The run's epochs as scheduled (manifest), else as summarized.
    pub fn epochs(&self) -> Option<u32> {
        self.manifest
            .as_ref()
            .map(|m| m.schedule.epochs)
            .or_else(|| self.summary.as_ref().map(|s| s.epochs))
    }
}

pub fn collect(dir: &Path) -> Identity {
    let (manifest, manifest_status) = read_json::<Manifest>(dir, files::MANIFEST);
    let (summary, summary_status) = read_json::<RunSummary>(dir, files::SUMMARY);
    Identity {
        manifest,
        summary,
        files: vec![manifest_status, summary_status],
    }
}
