//! The run directory as one attempt holds it: its lock (a second process on the same
//! directory is refused before it truncates anything) and its job journal (continued when
//! resuming, fresh otherwise). What the start does with the directory is decided before, by
//! [`crate::run::start::plan`].

use std::path::Path;

use stageb_shared::error::ErrorCode;

use crate::cluster::scheduler::journal::{JOURNAL_FILE, Journal};
use crate::run::RunError;
use crate::run::start::{StartError, StartPlan, refuse};

impl StartPlan {
    /// Opens the journal this run appends to: continued when resuming, fresh otherwise.
    pub fn open_journal(&self) -> Result<Journal, RunError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| RunError::Io {
            path: self.dir.clone(),
            source,
        })?;
        // A fresh start makes the run's sealing key (artifacts::seal) before anything is
        // written; a resume keeps the key the run started with.
        if !self.resuming {
            crate::artifacts::seal::create_key(&self.dir).map_err(|source| RunError::Io {
                path: self.dir.clone(),
                source,
            })?;
        }
        let path = self.dir.join(JOURNAL_FILE);
        let journal = if self.resuming {
            Journal::append_to(&path)
        } else {
            Journal::create(&path)
        };
        journal.map_err(|source| RunError::Io { path, source })
    }
}

/// The lock file every rank 0 holds in its run directory while it runs.
pub const LOCK_FILE: &str = ".stageb.lock";

/// Held for as long as a run writes to its directory: a second `stageb run`, `coordinator` or
/// `launch` started on the same directory (say, a requeued job while the first still runs, or
/// the same command typed twice) is refused before it truncates anything. An OS file lock, so
/// it is released when the process dies, however it dies.
#[derive(Debug)]
pub struct RunDirLock {
    _file: std::fs::File,
}

/// Take the run directory's lock (creating the directory), or refuse with `E_RUN_LOCKED`.
pub fn lock_run_dir(dir: &Path) -> Result<RunDirLock, StartError> {
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
