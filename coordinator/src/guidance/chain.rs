//! Verification of a run's version hash chain.
//!
//! [`verify_chain`] trusts nothing in the file: it recomputes every `version_hash`, checks the
//! parent links, and replays every version from the seed with the same pure transitions the
//! repository used ([`super::apply`]), so any edit to content, ops, outcomes or steps is found.

use super::apply::{apply_ops, remove_keys};
use super::model::{MissionGuidance, RuleKey};
use super::parse::{invalid, read_json};
use super::version::{
    SectionFile, VersionBody, VersionEntry, VersionKind, guidance_path, read_run_file,
};
use stageb_shared::digest::digest_of;
use stageb_shared::error::InputError;
use std::path::Path;

/// The verified state of a run's guidance chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainReport {
    pub mission: String,
    pub versions: usize,
    pub step: u64,
    pub head_hash: String,
    pub content_hash: String,
}

/// A broken or unreadable guidance chain.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("guidance chain broken at version {seq}: {reason}")]
    Broken { seq: u64, reason: String },
}

/// Verify `{run_dir}/guidance.json`: the version list starts with a seed, each entry links to
/// its parent, every `version_hash` recomputes, replaying every version from the seed gives
/// its recorded `content_hash` (and the recorded applied/skipped outcome), steps advance by
/// one per reflection and not on cleanup, `S*` never changes, `G0` always exists, and the live
/// content and step equal the head.
pub fn verify_chain(run_dir: &Path) -> Result<ChainReport, ChainError> {
    let path = guidance_path(run_dir);
    let mission = run_file_mission(&path)?;
    let (live, file) = read_run_file(&path, &mission)?;

    let first = file
        .versions
        .first()
        .ok_or_else(|| broken(0, "no versions".into()))?;
    let seed_content = match (&first.body.kind, &first.body.seed, &first.body.parent_hash) {
        (VersionKind::Seed, Some(seed), None) => seed,
        _ => {
            return Err(broken(
                0,
                "first version must be a seed with its content and no parent".into(),
            ));
        }
    };
    let mut state = MissionGuidance::from_hashed(&mission, first.body.step, seed_content);
    let seed_scaffold: Vec<(RuleKey, String)> = state
        .experiences
        .iter()
        .filter(|(k, _)| k.is_scaffold())
        .map(|(k, v)| (*k, v.clone()))
        .collect();
    let mut prev: Option<&VersionEntry> = None;
    for (i, entry) in file.versions.iter().enumerate() {
        let seq = i as u64;
        let body = &entry.body;
        if body.seq != seq {
            return Err(broken(seq, format!("seq is {}", body.seq)));
        }
        if digest_of(body) != entry.version_hash {
            return Err(broken(seq, "version_hash does not match its body".into()));
        }
        if let Some(p) = prev {
            if body.parent_hash.as_deref() != Some(p.version_hash.as_str()) {
                return Err(broken(
                    seq,
                    "parent_hash does not link to the previous version".into(),
                ));
            }
            state = replay(&state, body, seq)?;
        }
        if state.content_hash() != body.content_hash {
            return Err(broken(
                seq,
                "content_hash does not match the replayed content".into(),
            ));
        }
        let scaffold: Vec<(RuleKey, String)> = state
            .experiences
            .iter()
            .filter(|(k, _)| k.is_scaffold())
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        if scaffold != seed_scaffold {
            return Err(broken(seq, "S* rules differ from the seed".into()));
        }
        if !state.experiences.contains_key(&RuleKey::G0) {
            return Err(broken(seq, "G0 missing".into()));
        }
        prev = Some(entry);
    }
    let head = prev.ok_or_else(|| broken(0, "no versions".into()))?;
    check_head(&live, &file, head)?;
    Ok(ChainReport {
        mission,
        versions: file.versions.len(),
        step: live.step,
        head_hash: head.version_hash.clone(),
        content_hash: head.body.content_hash.clone(),
    })
}

fn broken(seq: u64, reason: String) -> ChainError {
    ChainError::Broken { seq, reason }
}

/// The one mission a run file holds (a step of [`verify_chain`], which is given only the run
/// directory, so the mission comes from the file).
fn run_file_mission(path: &Path) -> Result<String, ChainError> {
    let value = read_json(path)?;
    let mission = match value.as_object() {
        Some(top) if top.len() == 1 => top.keys().next().cloned().unwrap_or_default(),
        _ => return Err(invalid(path, "run guidance must hold exactly one mission").into()),
    };
    Ok(mission)
}

/// Replay the version `body` (seq `seq`, not the seed) on its parent's `state` and check its
/// step (a step of [`verify_chain`]).
fn replay(
    state: &MissionGuidance,
    body: &VersionBody,
    seq: u64,
) -> Result<MissionGuidance, ChainError> {
    let next = match body.kind {
        VersionKind::Seed => {
            return Err(broken(seq, "a seed after the first version".into()));
        }
        VersionKind::Reflection => {
            let rid = body.reflection_id.as_deref().unwrap_or("");
            let replay = apply_ops(state, &body.ops, rid, "")
                .map_err(|e| broken(seq, format!("replay failed: {e}")))?;
            if replay.applied != body.applied || replay.skipped != body.skipped {
                return Err(broken(
                    seq,
                    "replayed op outcome differs from the recorded one".into(),
                ));
            }
            replay.guidance
        }
        VersionKind::Cleanup => {
            for k in &body.removed {
                if k.is_scaffold() || k.is_g0() || !state.experiences.contains_key(k) {
                    return Err(broken(
                        seq,
                        format!("cleanup removed {k}, which it may not"),
                    ));
                }
            }
            remove_keys(state, &body.removed, "")
        }
    };
    if body.step != next.step {
        return Err(broken(
            seq,
            format!("step {} but replay gives {}", body.step, next.step),
        ));
    }
    Ok(next)
}

/// The live content, step and `version_hash` must be the head version's (a step of
/// [`verify_chain`]).
fn check_head(
    live: &MissionGuidance,
    file: &SectionFile,
    head: &VersionEntry,
) -> Result<(), ChainError> {
    let last = head.body.seq;
    if live.content_hash() != head.body.content_hash || file.content_hash != head.body.content_hash
    {
        return Err(broken(
            last,
            "live content does not match the head version".into(),
        ));
    }
    if live.step != head.body.step {
        return Err(broken(
            last,
            format!("live step {} but head step {}", live.step, head.body.step),
        ));
    }
    if file.version_hash != head.version_hash {
        return Err(broken(last, "live version_hash is not the head's".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guidance::GUIDANCE_FILE;
    use crate::guidance::test_support::*;
    use serde_json::{Value, json};
    use std::fs;

    #[test]
    fn chain_verification_detects_tampering() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        r.apply(&[add("若螺丝松动则不通过", &["QC-1::fail"])], "rid")
            .unwrap();
        r.apply(&[delete(RuleKey::G1)], "rid2").unwrap();
        let run = tmp.path().join("run");
        let report = verify_chain(&run).unwrap();
        assert_eq!((report.versions, report.step), (3, 3));
        assert_eq!(report.head_hash, r.head_hash());

        let path = run.join(GUIDANCE_FILE);
        let original: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        let tamper = |f: &dyn Fn(&mut Value)| {
            let mut v = original.clone();
            f(&mut v[MISSION]);
            fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
            verify_chain(&run)
        };
        assert!(
            tamper(&|s| s["experiences"]["G2"] = json!("偷改")).is_err(),
            "live edit"
        );
        assert!(
            tamper(&|s| s["experiences"]["S1"] = json!("偷改")).is_err(),
            "scaffold edit"
        );
        assert!(
            tamper(&|s| s["versions"][1]["ops"][0]["text"] = json!("别的")).is_err(),
            "op edit"
        );
        assert!(
            tamper(&|s| s["versions"][2]["parent_hash"] = json!("sha256:00")).is_err(),
            "relink"
        );
        assert!(tamper(&|s| s["step"] = json!(9)).is_err(), "step edit");
        // Timing fields are outside the hashes.
        assert!(tamper(&|s| s["versions"][1]["created_at"] = json!("2030-01-01T00:00:00")).is_ok());
    }
}
