//! The step checkpoint (`checkpoint.json`): where a resumed run starts, so that resuming costs
//! what is left of the run, not everything it ever did.
//!
//! Without it, `--resume` starts over from epoch 1 and replays every journaled answer
//! ([`crate::cluster::scheduler::journal`]): the journal grows with all work ever done, and so does the time to
//! the first new lease. At every step boundary that the journal has outgrown (see
//! [`CheckpointPolicy`]) and at every epoch's end, rank 0 instead records the loop's state
//! there: the position (epoch, steps done), the counters, the epoch's metrics window, the
//! reflector's buffers and budgets, the bytes of `guidance.json`, and the length of every
//! JSONL artifact. A step boundary is a barrier: every job of the step and every reflection
//! call after it has been answered, decided and written, so no journal row is needed by
//! anything after it, and the journal starts over empty.
//!
//! # Crash safety
//! The order at a boundary is: sync every artifact, write `checkpoint.json` atomically (temp
//! file, fsync, rename, directory fsync), then truncate `jobs.jsonl`. A crash
//! - before the rename leaves the previous checkpoint (or none) and the journal rows written
//!   since it: the resume continues from there, as before this module existed;
//! - between the rename and the truncation leaves the new checkpoint and journal rows it no
//!   longer needs: they are cache entries no job asks for;
//! - after the truncation, or anywhere in the next step, leaves the checkpoint and the rows
//!   journaled since: rows appended to the artifacts after it are cut back to the recorded
//!   lengths and rewritten by the resumed run.
//!
//! A leftover temp file is never read. A checkpoint that is unreadable, of another version or
//! run, or that names artifacts longer than the files are (they were replaced) is ignored with
//! a warning: the run then starts over from epoch 1 and recomputes what the journal no longer
//! holds, which costs time, never a different result. Determinism is the journal's argument
//! again: everything restored here is a function of the inputs and the answers, so the rows
//! written after a resume equal an uninterrupted run's.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::artifacts::{files, write_atomic};
use crate::decide::accuracy::Accumulator;
use crate::learn::reflection::ReflectorState;

/// File name of the checkpoint inside the run directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";

/// Version of the checkpoint format: another version is ignored (full replay instead).
const CHECKPOINT_VERSION: u32 = 1;

/// Every append-only artifact a checkpoint records the length of.
pub const JSONL_ARTIFACTS: [&str; 6] = [
    files::TRAJECTORIES,
    files::SELECTIONS,
    files::METRICS,
    files::FAILURE_MALFORMED,
    files::NEED_REVIEW_QUEUE,
    files::REFLECTION,
];

/// Which run a checkpoint belongs to (what `--resume` already checks in the manifest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub config_sha256: String,
    pub tickets_digest: String,
}

/// Where the run continues: `steps_done` steps of `epoch` are decided (0 at an epoch's start;
/// `epoch` is `epochs + 1` once every epoch is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    pub epoch: u32,
    pub steps_done: u64,
    pub epoch_step: u64,
}

/// The run loop's own counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LoopCounters {
    pub global_step: u64,
    pub schedule_step: u64,
    pub candidates_seen: u64,
    pub malformed: u64,
    pub hard_failures: u64,
    /// The epoch rows of the finished epochs (for the summary).
    pub epoch_rows: Vec<Value>,
}

/// The state of a run at a step boundary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Checkpoint {
    pub checkpoint_version: u32,
    pub run: RunIdentity,
    pub position: Position,
    pub counters: LoopCounters,
    /// The epoch's metrics window (`None` at an epoch's start).
    pub window: Option<Accumulator>,
    pub reflector: ReflectorState,
    /// `guidance.json` as it was at the boundary (a later reflection may have replaced it).
    pub guidance_file: String,
    /// The guidance the run started from (the manifest names it).
    pub initial_guidance_hash: String,
    /// Bytes of each JSONL artifact at the boundary, all durable.
    pub artifact_bytes: BTreeMap<String, u64>,
}

impl Checkpoint {
    /// A checkpoint of the run in `dir` now: reads the artifact lengths and the guidance file
    /// (the caller has synced them).
    #[allow(clippy::too_many_arguments)]
    pub fn capture(
        dir: &Path,
        run: RunIdentity,
        position: Position,
        counters: LoopCounters,
        window: Option<Accumulator>,
        reflector: ReflectorState,
        initial_guidance_hash: String,
    ) -> io::Result<Checkpoint> {
        let mut artifact_bytes = BTreeMap::new();
        for name in JSONL_ARTIFACTS {
            artifact_bytes.insert(name.to_string(), std::fs::metadata(dir.join(name))?.len());
        }
        let guidance_file = std::fs::read_to_string(dir.join(crate::guidance::GUIDANCE_FILE))?;
        Ok(Checkpoint {
            checkpoint_version: CHECKPOINT_VERSION,
            run,
            position,
            counters,
            window,
            reflector,
            guidance_file,
            initial_guidance_hash,
            artifact_bytes,
        })
    }

    /// Writes `checkpoint.json` atomically (compact JSON: it can hold a whole epoch's window).
    pub fn save(&self, dir: &Path) -> io::Result<u64> {
        let mut bytes = serde_json::to_vec(self).map_err(io::Error::other)?;
        bytes.push(b'\n');
        write_atomic(&dir.join(CHECKPOINT_FILE), &bytes)?;
        Ok(bytes.len() as u64)
    }

    /// The checkpoint of `run` in `dir`, if there is a usable one (see the module header for
    /// what is ignored, and why that is safe).
    pub fn load(dir: &Path, run: &RunIdentity) -> Option<Checkpoint> {
        remove_leftover_temp_files(dir);
        let path = dir.join(CHECKPOINT_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => return ignored(&path, &format!("unreadable: {e}")),
        };
        let checkpoint: Checkpoint = match serde_json::from_str(&text) {
            Ok(c) => c,
            Err(e) => return ignored(&path, &format!("not a checkpoint: {e}")),
        };
        if checkpoint.checkpoint_version != CHECKPOINT_VERSION {
            return ignored(&path, "another checkpoint version");
        }
        if checkpoint.run != *run {
            return ignored(&path, "written by another run");
        }
        // Only the run's own JSONL artifacts: `restore_files` cuts every file named here, so a
        // name outside them (`../x`, an absolute path, `manifest.json`) must never be accepted.
        if let Some(name) = (checkpoint.artifact_bytes.keys())
            .find(|name| !JSONL_ARTIFACTS.contains(&name.as_str()))
        {
            return ignored(
                &path,
                &format!("it names {name:?}, which is not a JSONL artifact of the run"),
            );
        }
        for (name, want) in &checkpoint.artifact_bytes {
            let have = std::fs::metadata(dir.join(name)).map_or(0, |m| m.len());
            if have < *want {
                return ignored(
                    &path,
                    &format!("{name} holds {have} bytes, fewer than the {want} it names"),
                );
            }
        }
        Some(checkpoint)
    }

    /// Puts the artifacts back as they were at the boundary: every JSONL file cut to its
    /// recorded length (what the crashed attempt wrote after it is rewritten), and
    /// `guidance.json` restored when a later reflection had replaced it.
    pub fn restore_files(&self, dir: &Path) -> io::Result<()> {
        for (name, len) in &self.artifact_bytes {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join(name))?;
            if f.metadata()?.len() != *len {
                // Sealed first: a crash right after the cut must not leave the seal of the
                // longer file (regression: the soak's resumed rank 0, killed before the next
                // sync of metrics.jsonl, left a seal no resume could pass).
                crate::artifacts::seal::seal_prefix(&dir.join(name), *len)?;
                f.set_len(*len)?;
                f.sync_all()?;
            }
        }
        let guidance = dir.join(crate::guidance::GUIDANCE_FILE);
        if std::fs::read_to_string(&guidance).ok().as_deref() != Some(self.guidance_file.as_str()) {
            write_atomic(&guidance, self.guidance_file.as_bytes())?;
        }
        Ok(())
    }
}

/// Temp files of atomic writes that a crash interrupted (`.checkpoint.json.tmp-<pid>`,
/// `.manifest.json.tmp-<pid>`, a seal's under `integrity/`): never read, and removed so that
/// they neither pile up over many crashes nor sit among the artifacts (regression: the soak
/// found a killed rank 0's `.manifest.json.tmp-<pid>` beside the resumed run's artifacts).
/// The run directory's lock guarantees no other process is writing one.
fn remove_leftover_temp_files(dir: &Path) {
    for d in [
        dir.to_path_buf(),
        dir.join(crate::artifacts::seal::INTEGRITY_DIR),
    ] {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') && name.contains(".tmp-") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

fn ignored(path: &Path, why: &str) -> Option<Checkpoint> {
    tracing::warn!(path = %path.display(), why, "checkpoint ignored: the run starts over from epoch 1 (answers still journaled are replayed, the rest recomputed)");
    None
}

/// Removes the checkpoint of an earlier run (a fresh start or `--overwrite`).
pub fn remove(dir: &Path) -> io::Result<()> {
    match std::fs::remove_file(dir.join(CHECKPOINT_FILE)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// When a step boundary is worth a checkpoint: once the journal written since the last one
/// outweighs that checkpoint. Writing a checkpoint then costs at most about as many bytes as
/// the journal it lets go, so checkpoints never dominate a run (a checkpoint holds the
/// epoch's window, which grows with the epoch), and the journal on disk stays below about
/// one checkpoint plus one step. Epoch ends always checkpoint.
#[derive(Debug, Clone, Copy, Default)]
pub struct CheckpointPolicy {
    last_bytes: u64,
}

impl CheckpointPolicy {
    pub fn due(&self, journal_bytes: u64) -> bool {
        journal_bytes > 0 && journal_bytes >= self.last_bytes
    }

    pub fn saved(&mut self, checkpoint_bytes: u64) {
        self.last_bytes = checkpoint_bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_is_due_once_the_journal_outweighs_the_last_one() {
        let mut p = CheckpointPolicy::default();
        assert!(!p.due(0), "nothing journaled: nothing to let go");
        assert!(p.due(1));
        p.saved(1000);
        assert!(!p.due(999));
        assert!(p.due(1000));
    }

    /// The invariant of the `checkpoint_load` fuzz target: a checkpoint naming a file outside
    /// the run's JSONL artifacts (`../x`, an absolute path, `manifest.json`) was accepted, and
    /// in a run without a seal key `restore_files` would then cut that file to the length the
    /// checkpoint names.
    #[test]
    fn a_checkpoint_naming_a_file_outside_the_run_is_ignored() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("run");
        std::fs::create_dir(&dir).unwrap();
        let victim = root.path().join("victim.txt");
        std::fs::write(&victim, "keep me").unwrap();
        let run = RunIdentity {
            config_sha256: "c".into(),
            tickets_digest: "t".into(),
        };
        for name in ["../victim.txt", victim.to_str().unwrap(), "manifest.json"] {
            let checkpoint = Checkpoint {
                checkpoint_version: CHECKPOINT_VERSION,
                run: run.clone(),
                position: Position {
                    epoch: 1,
                    steps_done: 0,
                    epoch_step: 0,
                },
                counters: LoopCounters::default(),
                window: None,
                reflector: ReflectorState::default(),
                guidance_file: String::new(),
                initial_guidance_hash: String::new(),
                artifact_bytes: BTreeMap::from([(name.to_string(), 0)]),
            };
            checkpoint.save(&dir).unwrap();
            assert!(Checkpoint::load(&dir, &run).is_none(), "{name} accepted");
        }
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
    }

    #[test]
    fn removing_a_missing_checkpoint_is_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        remove(dir.path()).unwrap();
    }
}
