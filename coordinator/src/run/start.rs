//! How a run takes its directory: fresh, replacing an earlier run, or resuming one.
//!
//! A directory with a `manifest.json` belongs to an earlier run. A plain start there would
//! truncate that run's artifacts, so it is refused (`E_RUN_EXISTS`) unless the user asks for
//! `--overwrite` (start over) or `--resume` (continue it, see [`crate::cluster::scheduler::journal`]). `--resume` on
//! a directory without a manifest starts fresh, so a requeued batch job can always pass it.
//!
//! Resuming checks that it continues the *same* run: same config text, same tickets, same
//! artifact schema. It pins the model fingerprint and the context the earlier attempt recorded,
//! so workers with another model are refused and every call is planned as before. A run that continued a previous run's guidance
//! (`guidance.reset_on_rerun: false`) cannot be resumed: its starting guidance was overwritten
//! by the attempt itself.

use std::path::{Path, PathBuf};

use serde_json::Value;
use stageb_shared::digest;
use stageb_shared::error::{ErrorCode, InputError};
use stageb_shared::limits::RunContext;

use crate::cluster::scheduler::journal::{JOURNAL_FILE, Journal, ReplayCache};
use crate::run::{RunError, RunInputs, files, run_dir};
use stageb_shared::SCHEMA_VERSION;

/// What to do with a run directory that may already hold a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartMode {
    /// Start; refuse a directory that holds a run.
    #[default]
    Fresh,
    /// Start over, replacing whatever the directory holds.
    Overwrite,
    /// Continue the run the directory holds (or start, if it holds none).
    Resume,
}

/// The decided start of a run.
pub struct StartPlan {
    pub dir: PathBuf,
    /// Whether an earlier attempt is being continued.
    pub resuming: bool,
    /// Resuming: the model fingerprint the earlier attempt ran with.
    pub pinned_fingerprint: Option<String>,
    /// Resuming: the context the earlier attempt planned with (its `effective_limits`).
    pub pinned_context: Option<RunContext>,
    /// Resuming: the earlier attempt's answers.
    pub replay: ReplayCache,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error(transparent)]
    Run(#[from] RunError),
}

fn refuse(code: ErrorCode, manifest: &Path, message: String) -> StartError {
    StartError::Input(InputError::new(
        code,
        manifest.display().to_string(),
        None,
        message,
    ))
}

/// Decides how the run described by `inputs` starts, per `mode`.
pub fn plan(inputs: &RunInputs, mode: StartMode) -> Result<StartPlan, StartError> {
    let dir = run_dir(&inputs.config, &inputs.ingested.mission)?;
    let manifest_path = dir.join(files::MANIFEST);
    let fresh = |dir: PathBuf| StartPlan {
        dir,
        resuming: false,
        pinned_fingerprint: None,
        pinned_context: None,
        replay: ReplayCache::default(),
    };
    if !manifest_path.exists() {
        if mode == StartMode::Resume {
            tracing::info!(run_dir = %dir.display(), "nothing to resume there: starting the run");
        }
        return Ok(fresh(dir));
    }
    match mode {
        StartMode::Fresh => {
            return Err(refuse(
                ErrorCode::RunExists,
                &manifest_path,
                format!(
                    "{} already holds a run; pass --resume to continue it or --overwrite to replace it",
                    dir.display()
                ),
            ));
        }
        StartMode::Overwrite => {
            tracing::warn!(run_dir = %dir.display(), "--overwrite: replacing the earlier run's artifacts");
            return Ok(fresh(dir));
        }
        StartMode::Resume => {}
    }
    let manifest = read_manifest(&manifest_path)
        .map_err(|e| refuse(ErrorCode::ResumeMismatch, &manifest_path, e))?;
    let mismatch = |what: &str, before: &Value, now: Value| -> Result<(), StartError> {
        if *before == now {
            return Ok(());
        }
        Err(refuse(
            ErrorCode::ResumeMismatch,
            &manifest_path,
            format!(
                "cannot resume: {what} differs from the earlier run ({before} there, {now} now); \
                 restore it, or pass --overwrite to start over"
            ),
        ))
    };
    mismatch(
        "the artifact schema version",
        &manifest["schema_version"],
        Value::from(SCHEMA_VERSION),
    )?;
    mismatch(
        "the config file (sha256)",
        &manifest["config_sha256"],
        Value::from(inputs.config_sha256.clone()),
    )?;
    mismatch(
        "the tickets (digest)",
        &manifest["tickets_digest"],
        Value::from(digest::digest_of(&inputs.ingested.tickets)),
    )?;
    if manifest["guidance"]["reused_from_previous_run"] == Value::Bool(true) {
        return Err(refuse(
            ErrorCode::ResumeMismatch,
            &manifest_path,
            "cannot resume a run that continued a previous run's guidance \
             (guidance.reset_on_rerun: false): the attempt overwrote the guidance it started from; \
             pass --overwrite to start over"
                .into(),
        ));
    }
    let pinned_fingerprint = manifest["model"]["fingerprint"]
        .as_str()
        .map(str::to_string);
    let limits = &manifest["effective_limits"];
    let pinned_context = serde_json::from_value(limits["context_source"].clone())
        .ok()
        .zip(
            limits["context"]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok()),
        )
        .map(|(source, tokens)| RunContext { tokens, source });
    let journal = dir.join(JOURNAL_FILE);
    let replay = ReplayCache::load(&journal).map_err(|source| RunError::Io {
        path: journal.clone(),
        source,
    })?;
    tracing::info!(
        run_dir = %dir.display(),
        answers = replay.len(),
        model = pinned_fingerprint.as_deref().unwrap_or("not recorded"),
        "resuming: replaying the earlier attempt's answers, then continuing"
    );
    Ok(StartPlan {
        dir,
        resuming: true,
        pinned_fingerprint,
        pinned_context,
        replay,
    })
}

/// The model fingerprint an earlier attempt in `inputs`' run directory recorded, if any (lets
/// an embedded run refuse another model before starting anything).
pub fn recorded_fingerprint(inputs: &RunInputs) -> Option<String> {
    let dir = run_dir(&inputs.config, &inputs.ingested.mission).ok()?;
    let manifest = read_manifest(&dir.join(files::MANIFEST)).ok()?;
    manifest["model"]["fingerprint"]
        .as_str()
        .map(str::to_string)
}

/// An earlier run's `manifest.json`, or why it cannot be read.
fn read_manifest(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the earlier run's manifest: {e}"))?;
    serde_json::from_str(&text)
        .map_err(|e| format!("the earlier run's manifest is not valid JSON: {e}"))
}

impl StartPlan {
    /// Opens the journal this run appends to: continued when resuming, fresh otherwise.
    pub fn open_journal(&self) -> Result<Journal, RunError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| RunError::Io {
            path: self.dir.clone(),
            source,
        })?;
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
