//! The repository: the run's guidance in memory, mirrored by `{run_dir}/guidance.json`.
//!
//! [`GuidanceRepo`] owns the persistence protocol around the pure transitions of
//! [`super::apply`]: seed from the global file, resume, apply a reflection or a cleanup as a new
//! version (snapshot first, then one atomic write, only then update memory), and record
//! feedback counters (atomic write, no version). On any error nothing changes, on disk or in
//! memory.

use super::apply::{apply_ops, check_invariants, remove_keys};
use super::edits::{AppliedOp, GuidanceOp, OpEffect, SkippedOp};
use super::error::{GuidanceError, io_err};
use super::fs::atomic_write;
use super::model::{MissionGuidance, RuleKey, confidence};
use super::parse::{invalid, load_mission_section};
use super::snapshot::{prune_snapshots, snapshot_name, snapshots_dir};
use super::time::utc_now_iso;
use super::version::{
    SectionFile, VersionBody, VersionEntry, VersionKind, guidance_path, parse_run_value,
    read_run_file,
};
use serde_json::Value;
use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// A clock returning an ISO-8601 UTC timestamp (injectable so tests are byte-reproducible).
pub type Clock = fn() -> String;

/// Options of a [`GuidanceRepo`].
#[derive(Debug, Clone, Copy)]
pub struct RepoOptions {
    /// Snapshots kept (`guidance.retention`, ≥ 1).
    pub retention: usize,
    pub clock: Clock,
}

impl Default for RepoOptions {
    fn default() -> Self {
        RepoOptions {
            retention: 5,
            clock: utc_now_iso,
        }
    }
}

/// The result of a persisted [`GuidanceRepo::apply`].
#[derive(Debug, Clone, PartialEq)]
pub struct ApplyOutcome {
    pub reflection_id: String,
    pub step_before: u64,
    pub step_after: u64,
    pub content_hash: String,
    pub version_hash: String,
    pub applied: Vec<AppliedOp>,
    pub skipped: Vec<SkippedOp>,
    /// Keys that did not exist before.
    pub new_keys: Vec<RuleKey>,
    /// Keys created, updated or merged into (for hit/miss attribution).
    pub touched_keys: Vec<RuleKey>,
}

/// The result of [`GuidanceRepo::record_feedback`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeedbackOutcome {
    pub updated: Vec<RuleKey>,
    /// Keys without metadata (seed rules never reflected on) or no longer present.
    pub ignored: Vec<RuleKey>,
}

/// Test-only fault injection for the persistence path.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailPoint {
    Snapshot,
    BeforeRename,
}

/// The run's guidance: in-memory state mirrored by `{run_dir}/guidance.json`.
#[derive(Debug)]
pub struct GuidanceRepo {
    run_dir: PathBuf,
    options: RepoOptions,
    current: MissionGuidance,
    versions: Vec<VersionEntry>,
    #[cfg(test)]
    fail_at: Option<FailPoint>,
}

impl GuidanceRepo {
    /// Seed the run guidance from the global file's `mission` section and write it to
    /// `{run_dir}/guidance.json` (replacing any earlier run guidance there: a fresh run starts
    /// from the global file; use [`GuidanceRepo::open`] to continue one).
    pub fn create(
        global: &Path,
        mission: &str,
        run_dir: &Path,
        options: RepoOptions,
    ) -> Result<Self, GuidanceError> {
        if options.retention == 0 {
            return Err(GuidanceError::InvalidRetention);
        }
        let seed = load_mission_section(global, mission)?;
        let now = (options.clock)();
        let body = VersionBody {
            seq: 0,
            step: seed.step,
            kind: VersionKind::Seed,
            parent_hash: None,
            content_hash: seed.content_hash(),
            reflection_id: None,
            ops: Vec::new(),
            applied: Vec::new(),
            skipped: Vec::new(),
            removed: Vec::new(),
            seed: Some(seed.hashed_content()),
        };
        fs::create_dir_all(run_dir).map_err(io_err(run_dir))?;
        let repo = GuidanceRepo {
            run_dir: run_dir.to_path_buf(),
            options,
            versions: vec![VersionEntry::new(body, &now)],
            current: seed,
            #[cfg(test)]
            fail_at: None,
        };
        let bytes = repo.render_file(&repo.current, &repo.versions);
        repo.write_live(&bytes)?;
        Ok(repo)
    }

    /// Open an existing run guidance (resume). Its content hash and chain head must match.
    pub fn open(
        run_dir: &Path,
        mission: &str,
        options: RepoOptions,
    ) -> Result<Self, GuidanceError> {
        if options.retention == 0 {
            return Err(GuidanceError::InvalidRetention);
        }
        let path = guidance_path(run_dir);
        let (current, file) = read_run_file(&path, mission)?;
        check_head(&current, &file, &path)?;
        Ok(GuidanceRepo {
            run_dir: run_dir.to_path_buf(),
            options,
            current,
            versions: file.versions,
            #[cfg(test)]
            fail_at: None,
        })
    }

    /// Checks `text`, a run's `guidance.json` content kept elsewhere (a step checkpoint's
    /// copy), exactly as [`GuidanceRepo::open`] checks the file, without writing anything:
    /// a resume validates it before it restores the file, so a refused copy never lands.
    pub fn check_run_text(text: &str, mission: &str, path: &Path) -> Result<(), GuidanceError> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| invalid(path, format!("not valid JSON: {e}")))?;
        let (current, file) = parse_run_value(&value, mission, path)?;
        check_head(&current, &file, path)
    }

    pub fn current(&self) -> &MissionGuidance {
        &self.current
    }

    pub fn step(&self) -> u64 {
        self.current.step
    }

    pub fn versions(&self) -> &[VersionEntry] {
        &self.versions
    }

    /// `version_hash` of the newest version.
    pub fn head_hash(&self) -> &str {
        self.versions.last().map_or("", |v| v.version_hash.as_str())
    }

    pub fn content_hash(&self) -> String {
        self.current.content_hash()
    }

    pub fn render_for_prompt(&self) -> Vec<(String, String)> {
        self.current.render_for_prompt()
    }

    pub fn path(&self) -> PathBuf {
        guidance_path(&self.run_dir)
    }

    /// Apply validated ops as one reflection: a new version (`step + 1`), snapshotted and
    /// written atomically. On error nothing changes, on disk or in memory.
    pub fn apply(
        &mut self,
        ops: &[GuidanceOp],
        reflection_id: &str,
    ) -> Result<ApplyOutcome, GuidanceError> {
        let now = (self.options.clock)();
        let result = apply_ops(&self.current, ops, reflection_id, &now)?;
        let body = VersionBody {
            seq: self.versions.len() as u64,
            step: result.guidance.step,
            kind: VersionKind::Reflection,
            parent_hash: Some(self.head_hash().to_string()),
            content_hash: result.guidance.content_hash(),
            reflection_id: Some(reflection_id.to_string()),
            ops: ops.to_vec(),
            applied: result.applied.clone(),
            skipped: result.skipped.clone(),
            removed: Vec::new(),
            seed: None,
        };
        let entry = VersionEntry::new(body, &now);
        let outcome = ApplyOutcome {
            reflection_id: reflection_id.to_string(),
            step_before: self.current.step,
            step_after: result.guidance.step,
            content_hash: entry.body.content_hash.clone(),
            version_hash: entry.version_hash.clone(),
            new_keys: result
                .guidance
                .experiences
                .keys()
                .filter(|k| !self.current.experiences.contains_key(k))
                .copied()
                .collect(),
            touched_keys: {
                let set: BTreeSet<RuleKey> = result
                    .applied
                    .iter()
                    .filter(|a| a.effect != OpEffect::Deleted)
                    .map(|a| a.key)
                    .collect();
                set.into_iter().collect()
            },
            applied: result.applied,
            skipped: result.skipped,
        };
        self.commit_version(result.guidance, entry)?;
        Ok(outcome)
    }

    /// Add one hit per key in `hits` and one miss per key in `misses` (keys with metadata only;
    /// seed rules without metadata are reported in `ignored`, as the original). No step, no
    /// version, no snapshot; written atomically.
    pub fn record_feedback(
        &mut self,
        hits: &[RuleKey],
        misses: &[RuleKey],
    ) -> Result<FeedbackOutcome, GuidanceError> {
        let mut next = self.current.clone();
        let mut outcome = FeedbackOutcome::default();
        let marks = hits
            .iter()
            .map(|k| (*k, true))
            .chain(misses.iter().map(|k| (*k, false)));
        for (key, hit) in marks {
            match next.metadata.get_mut(&key) {
                Some(meta) => {
                    if hit {
                        meta.hit_count += 1;
                    } else {
                        meta.miss_count += 1;
                    }
                    meta.confidence = confidence(meta.hit_count, meta.miss_count);
                    if !outcome.updated.contains(&key) {
                        outcome.updated.push(key);
                    }
                }
                None => {
                    if !outcome.ignored.contains(&key) {
                        outcome.ignored.push(key);
                    }
                }
            }
        }
        if outcome.updated.is_empty() {
            return Ok(outcome);
        }
        let bytes = self.render_file(&next, &self.versions);
        self.write_live(&bytes)?;
        self.current = next;
        Ok(outcome)
    }

    /// Add settled predictions to the rules they were made for: `(key, hits, misses)` per
    /// settled op, in order. Keys without metadata (a rule deleted since, or a seed rule) are
    /// skipped. Like feedback: no step, no version, no snapshot; written atomically. Returns
    /// the keys updated.
    pub fn record_claims(
        &mut self,
        settled: &[(RuleKey, u64, u64)],
    ) -> Result<Vec<RuleKey>, GuidanceError> {
        let mut next = self.current.clone();
        let mut updated = Vec::new();
        for (key, hits, misses) in settled {
            if let Some(meta) = next.metadata.get_mut(key) {
                meta.claims_hit += hits;
                meta.claims_missed += misses;
                if !updated.contains(key) {
                    updated.push(*key);
                }
            }
        }
        if updated.is_empty() {
            return Ok(updated);
        }
        let bytes = self.render_file(&next, &self.versions);
        self.write_live(&bytes)?;
        self.current = next;
        Ok(updated)
    }

    /// Remove learned rules with `confidence < threshold && miss_count >= min_miss`, or whose
    /// checked predictions failed as often (`RuleMetadata::claims_failing` with the same two
    /// numbers); never `G0` or `S*`, never emptying the guidance. A cleanup version keeps the
    /// step; the current file is snapshotted first. Returns the removed keys (empty: nothing written).
    pub fn cleanup_low_confidence(
        &mut self,
        threshold: f64,
        min_miss: u64,
    ) -> Result<Vec<RuleKey>, GuidanceError> {
        let removed: Vec<RuleKey> = self
            .current
            .metadata
            .iter()
            .filter(|(k, m)| {
                !k.is_scaffold()
                    && !k.is_g0()
                    && ((m.confidence < threshold && m.miss_count >= min_miss)
                        || m.claims_failing(threshold, min_miss))
            })
            .map(|(k, _)| *k)
            .filter(|k| self.current.experiences.contains_key(k))
            .collect();
        if removed.is_empty() || removed.len() >= self.current.experiences.len() {
            return Ok(Vec::new());
        }
        let now = (self.options.clock)();
        let next = remove_keys(&self.current, &removed, &now);
        check_invariants(&self.current, &next)?;
        let body = VersionBody {
            seq: self.versions.len() as u64,
            step: next.step,
            kind: VersionKind::Cleanup,
            parent_hash: Some(self.head_hash().to_string()),
            content_hash: next.content_hash(),
            reflection_id: None,
            ops: Vec::new(),
            applied: Vec::new(),
            skipped: Vec::new(),
            removed: removed.clone(),
            seed: None,
        };
        let entry = VersionEntry::new(body, &now);
        self.commit_version(next, entry)?;
        Ok(removed)
    }

    /// Snapshot, prune, write; only then update memory.
    fn commit_version(
        &mut self,
        next: MissionGuidance,
        entry: VersionEntry,
    ) -> Result<(), GuidanceError> {
        self.snapshot_current()?;
        let mut versions = self.versions.clone();
        versions.push(entry);
        let bytes = self.render_file(&next, &versions);
        self.write_live(&bytes)?;
        self.current = next;
        self.versions = versions;
        Ok(())
    }

    fn snapshot_current(&self) -> Result<(), GuidanceError> {
        let dir = snapshots_dir(&self.run_dir);
        let head = self.versions.last().map(|v| &v.body);
        let name = snapshot_name(
            head.map_or(0, |b| b.seq),
            self.current.step,
            head.map_or("", |b| b.content_hash.as_str()),
        );
        let target = dir.join(&name);
        let snap_err = |source: io::Error| GuidanceError::Snapshot {
            path: target.clone(),
            source,
        };
        #[cfg(test)]
        if self.fail_at == Some(FailPoint::Snapshot) {
            return Err(snap_err(io::Error::other("injected snapshot failure")));
        }
        let bytes = fs::read(self.path()).map_err(snap_err)?;
        fs::create_dir_all(&dir).map_err(snap_err)?;
        atomic_write(&target, &bytes, false).map_err(snap_err)?;
        prune_snapshots(&dir, self.options.retention).map_err(snap_err)?;
        Ok(())
    }

    fn render_file(&self, g: &MissionGuidance, versions: &[VersionEntry]) -> Vec<u8> {
        let section = SectionFile {
            step: g.step,
            updated_at: g.updated_at.clone(),
            experiences: g.experiences.clone(),
            metadata: g.metadata.clone(),
            content_hash: g.content_hash(),
            version_hash: versions
                .last()
                .map_or(String::new(), |v| v.version_hash.clone()),
            versions: versions.to_vec(),
        };
        let mut file = serde_json::Map::new();
        file.insert(
            g.mission.clone(),
            serde_json::to_value(section).unwrap_or(Value::Null),
        );
        let mut bytes = serde_json::to_vec_pretty(&Value::Object(file)).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }

    fn write_live(&self, bytes: &[u8]) -> Result<(), GuidanceError> {
        let path = self.path();
        #[cfg(test)]
        let fail = self.fail_at == Some(FailPoint::BeforeRename);
        #[cfg(not(test))]
        let fail = false;
        atomic_write(&path, bytes, fail).map_err(io_err(&path))
    }
}

/// The newest version of the chain must be the content and the file's head.
fn check_head(
    current: &MissionGuidance,
    file: &SectionFile,
    path: &Path,
) -> Result<(), GuidanceError> {
    let head = file
        .versions
        .last()
        .ok_or_else(|| invalid(path, "run guidance has no versions"))?;
    if head.body.content_hash != current.content_hash() || head.version_hash != file.version_hash {
        return Err(invalid(
            path,
            "run guidance content does not match its version chain",
        )
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guidance::test_support::*;
    use crate::guidance::{GUIDANCE_FILE, verify_chain};
    use serde_json::json;

    #[test]
    fn load_keeps_step_experiences_and_updated_at_and_copies_into_the_run_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let r = repo(tmp.path());
        let g = r.current();
        assert_eq!(g.step, 1);
        assert_eq!(g.updated_at, "2025-12-16T12:54:39.555188+00:00");
        assert_eq!(g.text(RuleKey::G1), Some("若挡风板缺失则不通过"));
        assert_eq!(g.metadata[&RuleKey::G1].hit_count, 1);
        assert!(tmp.path().join("run/guidance.json").exists());
        let global_before = fs::read(tmp.path().join("initial_guidance.json")).unwrap();
        assert!(!global_before.is_empty());
        verify_chain(&tmp.path().join("run")).unwrap();
    }

    #[test]
    fn reruns_are_byte_identical() {
        let run_once = |dir: &Path| {
            let mut r = repo(dir);
            r.apply(&[add("若螺丝松动则不通过", &["QC-1::fail"])], "rid")
                .unwrap();
            r.record_feedback(&[RuleKey::G1], &[RuleKey::G(2)]).unwrap();
            let run = dir.join("run");
            let mut files = vec![(
                "guidance".to_string(),
                fs::read(run.join(GUIDANCE_FILE)).unwrap(),
            )];
            for n in snapshot_names(&run) {
                files.push((n.clone(), fs::read(snapshots_dir(&run).join(n)).unwrap()));
            }
            files
        };
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        assert_eq!(run_once(a.path()), run_once(b.path()));
    }

    #[test]
    fn regression_temp_open_failure_leaves_live_file_and_no_temp() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let run = tmp.path().join("run");
        let before = fs::read(run.join(GUIDANCE_FILE)).unwrap();
        r.fail_at = Some(FailPoint::BeforeRename);
        let err = r
            .apply(&[add("新规则", &["QC-1::fail"])], "rid")
            .unwrap_err();
        assert!(matches!(err, GuidanceError::Io { .. }), "{err:?}");
        assert_eq!(fs::read(run.join(GUIDANCE_FILE)).unwrap(), before);
        assert!(no_tmp_files(&run));
        assert_eq!(r.step(), 1, "memory unchanged too");
        assert_eq!(r.versions().len(), 1);
        verify_chain(&run).unwrap();
    }

    #[test]
    fn snapshot_failure_is_an_error_and_nothing_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let run = tmp.path().join("run");
        let before = fs::read(run.join(GUIDANCE_FILE)).unwrap();
        r.fail_at = Some(FailPoint::Snapshot);
        let err = r
            .apply(&[add("新规则", &["QC-1::fail"])], "rid")
            .unwrap_err();
        assert!(matches!(err, GuidanceError::Snapshot { .. }), "{err:?}");
        assert_eq!(fs::read(run.join(GUIDANCE_FILE)).unwrap(), before);
        // A real failure: `snapshots` is a file, so the directory cannot be created.
        r.fail_at = None;
        fs::write(snapshots_dir(&run), b"not a dir").unwrap();
        let err = r
            .apply(&[add("新规则", &["QC-1::fail"])], "rid")
            .unwrap_err();
        assert!(matches!(err, GuidanceError::Snapshot { .. }), "{err:?}");
        assert_eq!(fs::read(run.join(GUIDANCE_FILE)).unwrap(), before);
        assert!(no_tmp_files(&run));
    }

    #[test]
    fn feedback_updates_counters_without_step_or_version() {
        let tmp = tempfile::tempdir().unwrap();
        let mut section = base_section();
        section["metadata"]["G1"]["hit_count"] = json!(0);
        section["metadata"]["G1"]["miss_count"] = json!(2);
        let global = write_global(tmp.path(), section);
        let mut r =
            GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), opts()).unwrap();
        let hash = r.content_hash();
        let out = r.record_feedback(&[RuleKey::G1], &[RuleKey::G0]).unwrap();
        assert_eq!(out.updated, vec![RuleKey::G1]);
        assert_eq!(
            out.ignored,
            vec![RuleKey::G0],
            "seed rules without metadata get no stats"
        );
        let m = &r.current().metadata[&RuleKey::G1];
        assert_eq!((m.hit_count, m.miss_count), (1, 2));
        assert!(m.confidence > 0.0 && m.confidence < 1.0);
        assert_eq!(r.step(), 1);
        assert_eq!(r.versions().len(), 1);
        assert_eq!(r.content_hash(), hash);
        let reopened = GuidanceRepo::open(&tmp.path().join("run"), MISSION, opts()).unwrap();
        assert_eq!(reopened.current().metadata[&RuleKey::G1].hit_count, 1);
        assert!(snapshot_names(&tmp.path().join("run")).is_empty());
        verify_chain(&tmp.path().join("run")).unwrap();
    }

    #[test]
    fn lifecycle_cleanup_removes_only_weak_learned_rules() {
        let tmp = tempfile::tempdir().unwrap();
        let mut section = base_section();
        section["experiences"]["G2"] = json!("二");
        section["metadata"]["G1"] =
            json!({"reflection_id": "r", "hit_count": 0, "miss_count": 3, "confidence": 0.0});
        section["metadata"]["G2"] =
            json!({"reflection_id": "r", "hit_count": 0, "miss_count": 2, "confidence": 0.0});
        section["metadata"]["G0"] =
            json!({"reflection_id": "r", "hit_count": 0, "miss_count": 9, "confidence": 0.0});
        let global = write_global(tmp.path(), section);
        let mut r =
            GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), opts()).unwrap();
        let removed = r.cleanup_low_confidence(0.35, 3).unwrap();
        assert_eq!(removed, vec![RuleKey::G1]);
        assert_eq!(r.step(), 1, "cleanup does not bump step");
        assert_eq!(r.versions().len(), 2);
        assert_eq!(
            snapshot_names(&tmp.path().join("run")).len(),
            1,
            "snapshot first"
        );
        assert!(r.current().experiences.contains_key(&RuleKey::G0));
        assert!(r.cleanup_low_confidence(0.35, 3).unwrap().is_empty());
        verify_chain(&tmp.path().join("run")).unwrap();
    }

    #[test]
    fn settled_claims_count_on_their_rule_and_repeated_failures_are_cleaned_up() {
        let tmp = tempfile::tempdir().unwrap();
        let mut section = base_section();
        section["experiences"]["G2"] = json!("二");
        section["metadata"]["G2"] =
            json!({"reflection_id": "r", "hit_count": 5, "miss_count": 0, "confidence": 1.0});
        let global = write_global(tmp.path(), section);
        let mut r =
            GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), opts()).unwrap();
        let before = std::fs::read_to_string(r.path()).unwrap();
        assert!(!before.contains("claims_"), "absent while zero: {before}");
        let hash = r.content_hash();
        let updated = r
            .record_claims(&[
                (RuleKey::G1, 2, 0),
                (RuleKey::G(2), 0, 2),
                (RuleKey::G(7), 1, 1),
            ])
            .unwrap();
        assert_eq!(
            updated,
            vec![RuleKey::G1, RuleKey::G(2)],
            "G7 has no metadata"
        );
        let m = &r.current().metadata[&RuleKey::G(2)];
        assert_eq!((m.claims_hit, m.claims_missed), (0, 2));
        assert_eq!(
            (r.step(), r.versions().len()),
            (1, 1),
            "no step, no version"
        );
        assert_eq!(r.content_hash(), hash, "counters are not content");
        let reopened = GuidanceRepo::open(&tmp.path().join("run"), MISSION, opts()).unwrap();
        assert_eq!(reopened.current().metadata[&RuleKey::G1].claims_hit, 2);
        assert!(
            r.cleanup_low_confidence(0.35, 3).unwrap().is_empty(),
            "two missed claims are not yet repeated failure at min_miss 3"
        );
        r.record_claims(&[(RuleKey::G(2), 0, 1), (RuleKey::G1, 0, 1)])
            .unwrap();
        assert_eq!(
            r.cleanup_low_confidence(0.35, 3).unwrap(),
            vec![RuleKey::G(2)],
            "a confident rule whose claims keep failing goes; G1 (2 of 3 claims right) stays"
        );
        verify_chain(&tmp.path().join("run")).unwrap();
    }

    #[test]
    fn reopening_a_run_rewrites_identical_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        r.apply(&[add("若螺丝松动则不通过", &["QC-1::fail"])], "rid")
            .unwrap();
        r.record_feedback(
            &[RuleKey::G1, RuleKey::G(2)],
            &[RuleKey::G(2), RuleKey::G(2)],
        )
        .unwrap();
        let run = tmp.path().join("run");
        let on_disk = fs::read(run.join(GUIDANCE_FILE)).unwrap();
        let reopened = GuidanceRepo::open(&run, MISSION, opts()).unwrap();
        assert_eq!(
            reopened.render_file(reopened.current(), reopened.versions()),
            on_disk
        );
    }

    #[test]
    fn zero_retention_is_rejected() {
        let tmp = tempfile::tempdir().unwrap();
        let global = write_global(tmp.path(), base_section());
        let o = RepoOptions {
            retention: 0,
            clock: fixed_clock,
        };
        assert!(matches!(
            GuidanceRepo::create(&global, MISSION, &tmp.path().join("run"), o),
            Err(GuidanceError::InvalidRetention)
        ));
    }
}
