//! Pre-change snapshots: their directory, deterministic names and retention.
//!
//! Names are `guidance-v{seq:04}-step{step:04}-{hash12}.json` so reruns produce the same
//! names, and pruning orders by the parsed version number, not the name. Taking a snapshot
//! (read the live file, write it atomically, prune) is a step of the repository's commit.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Directory of the pre-change snapshots inside the run directory.
pub const SNAPSHOTS_DIR: &str = "snapshots";

/// `{run_dir}/snapshots`.
pub fn snapshots_dir(run_dir: &Path) -> PathBuf {
    run_dir.join(SNAPSHOTS_DIR)
}

/// Deterministic snapshot name of the version `seq` (step, first 12 hex of its content hash).
pub fn snapshot_name(seq: u64, step: u64, content_hash: &str) -> String {
    let hex = content_hash.strip_prefix("sha256:").unwrap_or(content_hash);
    let short: String = hex.chars().take(12).collect();
    format!("guidance-v{seq:04}-step{step:04}-{short}.json")
}

fn parse_snapshot_seq(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("guidance-v")?.strip_suffix(".json")?;
    let (seq, rest) = rest.split_once("-step")?;
    let (step, hash) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(step) || hash.len() != 12 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    if !digits(seq) {
        return None;
    }
    seq.parse().ok()
}

/// Keep the `retention` newest snapshots (by version number, not by name, so `v10000` sorts
/// after `v9999`). Files that are not snapshots are left alone.
pub(super) fn prune_snapshots(dir: &Path, retention: usize) -> io::Result<()> {
    let mut snaps: Vec<(u64, PathBuf)> = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if let Some(seq) = entry.file_name().to_str().and_then(parse_snapshot_seq) {
            snaps.push((seq, entry.path()));
        }
    }
    snaps.sort();
    let excess = snaps.len().saturating_sub(retention);
    for (_, path) in snaps.into_iter().take(excess) {
        fs::remove_file(path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guidance::test_support::*;
    use crate::guidance::{GUIDANCE_FILE, verify_chain};

    #[test]
    fn snapshot_holds_the_pre_update_file_under_a_deterministic_name() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        let run = tmp.path().join("run");
        let before = fs::read(run.join(GUIDANCE_FILE)).unwrap();
        let hash_before = r.content_hash();
        r.apply(&[add("若螺丝松动则不通过", &["QC-1::fail"])], "rid")
            .unwrap();
        let names = snapshot_names(&run);
        assert_eq!(names, vec![snapshot_name(0, 1, &hash_before)]);
        assert!(names[0].starts_with("guidance-v0000-step0001-"));
        assert_eq!(
            fs::read(snapshots_dir(&run).join(&names[0])).unwrap(),
            before
        );
        assert!(no_tmp_files(&run) && no_tmp_files(&snapshots_dir(&run)));
    }

    #[test]
    fn snapshots_are_pruned_to_retention_keeping_the_newest() {
        let tmp = tempfile::tempdir().unwrap();
        let mut r = repo(tmp.path());
        for i in 0..5 {
            r.apply(
                &[add(&format!("规则{i}"), &["QC-1::fail"])],
                &format!("rid{i}"),
            )
            .unwrap();
        }
        let names = snapshot_names(&tmp.path().join("run"));
        assert_eq!(names.len(), 3);
        assert!(
            names[0].starts_with("guidance-v0002-") && names[2].starts_with("guidance-v0004-"),
            "{names:?}"
        );
        assert_eq!(r.step(), 6);
        let report = verify_chain(&tmp.path().join("run")).unwrap();
        assert_eq!(report.versions, 6);
        assert_eq!(report.step, 6);
    }
}
