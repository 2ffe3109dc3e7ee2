//! The run directory as one attempt holds it ([`RunDir`]): its lock (a second process on the
//! same directory is refused before it truncates anything) and its job journal (continued when
//! resuming, fresh otherwise). What the start does with the directory (fresh, `--overwrite`,
//! `--resume` and the checks a resume makes) is decided before, by [`crate::run::start::plan`],
//! which writes nothing: rank 0 pins the run's model between the two, and a refused model must
//! leave no directory behind.

use std::path::{Path, PathBuf};

use stageb_shared::error::ErrorCode;

use crate::cluster::scheduler::journal::{JOURNAL_FILE, Journal, ReplayCache};
use crate::run::RunError;
use crate::run::start::{StartError, StartPlan, refuse};

/// A run directory held by one attempt: where it is, whether an earlier attempt is continued,
/// and the lock held for as long as the run writes there.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    resuming: bool,
    _lock: RunDirLock,
}

/// The job journal a run directory opens with: the file this attempt appends every answer
/// to, and the earlier attempt's answers when it resumes.
pub struct RunJournal {
    pub journal: Journal,
    pub replay: ReplayCache,
}

impl RunDir {
    /// Takes the directory `plan` decided on: its lock first (`E_RUN_LOCKED` while another
    /// process holds it), then its job journal, continued when resuming, fresh otherwise.
    pub fn open(plan: StartPlan) -> Result<(RunDir, RunJournal), StartError> {
        let lock = lock_run_dir(&plan.dir)?;
        let journal = open_journal(&plan.dir, plan.resuming)?;
        let dir = RunDir {
            path: plan.dir,
            resuming: plan.resuming,
            _lock: lock,
        };
        let replay = plan.replay;
        Ok((dir, RunJournal { journal, replay }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether an earlier attempt at this run is continued.
    pub fn resuming(&self) -> bool {
        self.resuming
    }

    /// After bad input met once the directory was opened (before the run wrote anything): a
    /// fresh start's journal is removed if nothing was written to it, with the lock file, and
    /// the directory if that leaves it empty. A resumed run's directory is left as it is.
    pub fn discard_unused(&self) {
        if self.resuming {
            return;
        }
        let journal = self.path.join(JOURNAL_FILE);
        if std::fs::metadata(&journal).is_ok_and(|m| m.len() == 0) {
            let _ = std::fs::remove_file(&journal);
            let _ = std::fs::remove_file(self.path.join(LOCK_FILE));
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Opens the journal the run in `dir` appends to: continued when `resuming`, fresh otherwise.
fn open_journal(dir: &Path, resuming: bool) -> Result<Journal, RunError> {
    let io = |source| RunError::Io {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    // A fresh start makes the run's sealing key (artifacts::seal) before anything is
    // written; a resume keeps the key the run started with.
    if !resuming {
        crate::artifacts::seal::create_key(dir).map_err(io)?;
    }
    let path = dir.join(JOURNAL_FILE);
    let journal = if resuming {
        Journal::append_to(&path)
    } else {
        Journal::create(&path)
    };
    journal.map_err(|source| RunError::Io { path, source })
}

/// The lock file every rank 0 holds in its run directory while it runs.
pub const LOCK_FILE: &str = ".stageb.lock";

/// Held for as long as a run writes to its directory: a second `stageb run`, `coordinator` or
/// `launch` started on the same directory (say, a requeued job while the first still runs, or
/// the same command typed twice) is refused before it truncates anything. An OS file lock, so
/// it is released when the process dies, however it dies.
#[derive(Debug)]
struct RunDirLock {
    _file: std::fs::File,
}

/// Take the run directory's lock (creating the directory), or refuse with `E_RUN_LOCKED`.
fn lock_run_dir(dir: &Path) -> Result<RunDirLock, StartError> {
    let io = |source| {
        StartError::Run(RunError::Io {
            path: dir.to_path_buf(),
            source,
        })
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            return Err(refuse(
                ErrorCode::RunLocked,
                &path,
                format!(
                    "another stageb process ({}) is running in {}; wait for it or stop it first",
                    holder.trim(),
                    dir.display()
                ),
            ));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
    }
    // Who holds it, for the refusal above (diagnostics only; the lock is the OS's).
    use std::io::Write;
    let _ = file.set_len(0);
    let _ = writeln!(file, "pid {}", std::process::id());
    Ok(RunDirLock { _file: file })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_process_on_the_same_run_directory_is_refused_until_the_first_ends() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("runs/demo/m");
        let first = lock_run_dir(&dir).unwrap();
        match lock_run_dir(&dir) {
            Err(StartError::Input(e)) => {
                assert_eq!(e.code, ErrorCode::RunLocked);
                assert!(e.to_string().contains("pid"), "{e}");
            }
            other => panic!("second lock taken: {other:?}"),
        }
        drop(first);
        lock_run_dir(&dir).expect("free again once the first run ends");
    }
}
