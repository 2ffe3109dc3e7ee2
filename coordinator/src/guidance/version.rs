//! The version records of the hash chain and the run file that stores them.
//!
//! A [`VersionEntry`] is one link of the chain (hashed [`VersionBody`] plus its hash); the run's
//! `guidance.json` holds the live content *and* the whole `versions` list in one mission section
//! ([`SectionFile`]), so content and history are written by one atomic rename and can never
//! disagree after a crash. Both the repository (resume) and chain verification read the run
//! file through [`read_run_file`].

use super::edits::{AppliedOp, GuidanceOp, SkippedOp};
use super::model::{HashedContent, MissionGuidance, RuleKey, RuleMetadata};
use super::parse::{invalid, mission_section, parse_section, read_json};
use serde::{Deserialize, Serialize};
use stageb_shared::digest::digest_of;
use stageb_shared::error::InputError;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// File name of the run guidance inside the run directory.
pub const GUIDANCE_FILE: &str = "guidance.json";

/// Why a version exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VersionKind {
    /// Copied from the global guidance file.
    Seed,
    /// An applied reflection (`step + 1`).
    Reflection,
    /// Lifecycle cleanup of low-confidence rules (step unchanged).
    Cleanup,
}

/// The hashed body of a version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionBody {
    pub seq: u64,
    pub step: u64,
    pub kind: VersionKind,
    pub parent_hash: Option<String>,
    pub content_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reflection_id: Option<String>,
    /// The ops given to apply (reflection).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<GuidanceOp>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied: Vec<AppliedOp>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedOp>,
    /// Keys removed by a cleanup.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<RuleKey>,
    /// The seed content (first version only), so the chain can be replayed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<HashedContent>,
}

/// One entry of the `versions` list: hashed body, its hash, and a timing field outside the hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionEntry {
    #[serde(flatten)]
    pub body: VersionBody,
    pub version_hash: String,
    /// Timing only; excluded from every hash.
    pub created_at: String,
}

impl VersionEntry {
    pub(super) fn new(body: VersionBody, created_at: &str) -> Self {
        VersionEntry {
            version_hash: digest_of(&body),
            body,
            created_at: created_at.to_string(),
        }
    }
}

/// The mission section as written to the run's `guidance.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct SectionFile {
    pub(super) step: u64,
    pub(super) updated_at: String,
    pub(super) experiences: BTreeMap<RuleKey, String>,
    pub(super) metadata: BTreeMap<RuleKey, RuleMetadata>,
    pub(super) content_hash: String,
    pub(super) version_hash: String,
    pub(super) versions: Vec<VersionEntry>,
}

/// `{run_dir}/guidance.json`.
pub fn guidance_path(run_dir: &Path) -> PathBuf {
    run_dir.join(GUIDANCE_FILE)
}

pub(super) fn read_run_file(
    path: &Path,
    mission: &str,
) -> Result<(MissionGuidance, SectionFile), InputError> {
    parse_run_value(&read_json(path)?, mission, path)
}

/// [`read_run_file`] on a file's content already parsed as JSON (`path` names it in errors).
pub(super) fn parse_run_value(
    value: &serde_json::Value,
    mission: &str,
    path: &Path,
) -> Result<(MissionGuidance, SectionFile), InputError> {
    let section = mission_section(value, mission, path)?;
    let current = parse_section(section, mission, path)?;
    let file: SectionFile = serde_json::from_value(section.clone())
        .map_err(|e| invalid(path, format!("run guidance section is malformed: {e}")))?;
    Ok((current, file))
}
