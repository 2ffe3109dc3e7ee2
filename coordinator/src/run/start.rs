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

use crate::cluster::scheduler::journal::{JOURNAL_FILE, ReplayCache};
use crate::run::checkpoint::CHECKPOINT_FILE;
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

pub(super) fn refuse(code: ErrorCode, manifest: &Path, message: String) -> StartError {
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
    let recorded_tickets = &manifest["tickets_digest"];
    let tickets_now = match Value::from(resolved_tickets_digest(inputs)) {
        // Recorded by a stageb that named each ticket's file by its resolved path.
        resolved if resolved == *recorded_tickets => resolved,
        _ => Value::from(digest::digest_of(&inputs.ingested.tickets)),
    };
    mismatch("the tickets (digest)", recorded_tickets, tickets_now)?;
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

/// Before an embedded run starts anything: `--resume` with a model other than the one the
/// earlier attempt recorded is refused (`E_RESUME_MISMATCH` on `model`'s file, saying both and
/// the way out). `fingerprint` is the loaded model's fingerprint id (as workers register it);
/// the other modes pass.
pub fn check_resume_model(
    inputs: &RunInputs,
    mode: StartMode,
    model: &Path,
    fingerprint: &str,
) -> Result<(), InputError> {
    if mode != StartMode::Resume {
        return Ok(());
    }
    match recorded_fingerprint(inputs) {
        Some(recorded) if recorded != fingerprint => Err(InputError::new(
            ErrorCode::ResumeMismatch,
            model.display().to_string(),
            None,
            format!(
                "cannot resume: the run used the model {recorded}, this one is {fingerprint}; \
                 use that model, or pass --overwrite to start over"
            ),
        )),
        _ => Ok(()),
    }
}

/// What a start would do with the run directory, for `stageb validate` (which runs nothing):
/// `None` when it holds no run (a plain start is fine), else a note saying how to `--resume`
/// it (and how many answers are journaled) or `--overwrite` it, or why it cannot be resumed.
pub fn existing_run_note(inputs: &RunInputs) -> Result<Option<String>, RunError> {
    let dir = run_dir(&inputs.config, &inputs.ingested.mission)?;
    if !dir.join(files::MANIFEST).exists() {
        return Ok(None);
    }
    // The journal only holds what was answered since the last step checkpoint.
    let since = if dir.join(CHECKPOINT_FILE).exists() {
        " since its last step checkpoint"
    } else {
        ""
    };
    Ok(Some(match plan(inputs, StartMode::Resume) {
        Ok(plan) => format!(
            "{} holds a run; start with --resume to continue it ({} answers journaled{since}) or --overwrite to replace it",
            dir.display(),
            plan.replay.len()
        ),
        Err(e) => format!(
            "{} holds a run that cannot be resumed ({e}); start with --overwrite to replace it",
            dir.display()
        ),
    }))
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

/// The tickets' digest with each ticket's file named by its resolved path instead of the path
/// the config wrote, as manifests recorded it before they became the same from any checkout:
/// such a run still resumes, and a changed ticket still changes this digest too.
fn resolved_tickets_digest(inputs: &RunInputs) -> String {
    let written = &inputs.config_as_written.stage_a_paths;
    let resolved = &inputs.config.stage_a_paths;
    let mut tickets = inputs.ingested.tickets.clone();
    for ticket in &mut tickets {
        if let Some(i) = written
            .iter()
            .position(|w| w.display().to_string() == ticket.source.file)
            && let Some(path) = resolved.get(i)
        {
            ticket.source.file = path.display().to_string();
        }
    }
    digest::digest_of(&tickets)
}

/// An earlier run's `manifest.json`, or why it cannot be read.
fn read_manifest(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the earlier run's manifest: {e}"))?;
    serde_json::from_str(&text)
        .map_err(|e| format!("the earlier run's manifest is not valid JSON: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stageb_shared::ingest::Ingested;

    /// A run of no tickets whose directory is under `root`.
    fn inputs(root: &Path) -> RunInputs {
        let text = format!(
            "seed: 17\nstage_a_paths: [a.jsonl]\nmodel: {{model_name_or_path: m.gguf}}\n\
             guidance: {{path: g.json, retention: 2}}\noutput: {{root: '{}', run_name: t}}\n\
             sampler: {{samples_per_decode: 2, grid: [{{temperature: 0.5, top_p: 0.9, \
             max_new_tokens: 32}}]}}\nreflection: {{batch_size: 4}}\n\
             selection: {{policy: top_label, tie_break: temperature}}\nrunner: {{epochs: 1}}\n",
            root.display()
        );
        let config = stageb_shared::config::parse_config(&text, "t.yaml")
            .unwrap()
            .config;
        RunInputs {
            config_as_written: config.clone(),
            config,
            config_path: "t.yaml".into(),
            config_sha256: "c0ffee".into(),
            notices: vec![],
            ingested: Ingested {
                mission: "m".into(),
                tickets: vec![],
                input_digests: vec![],
            },
            mode: "embedded".into(),
            tuning: None,
        }
    }

    /// The manifest an earlier attempt of `inputs` left, ran with the model `fingerprint`.
    fn earlier_run(inputs: &RunInputs, config_sha256: &str, fingerprint: &str) -> PathBuf {
        let dir = run_dir(&inputs.config, &inputs.ingested.mission).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        let manifest = serde_json::json!({
            "schema_version": SCHEMA_VERSION,
            "config_sha256": config_sha256,
            "tickets_digest": digest::digest_of(&inputs.ingested.tickets),
            "model": {"fingerprint": fingerprint},
        });
        std::fs::write(dir.join(files::MANIFEST), manifest.to_string()).unwrap();
        dir
    }

    #[test]
    fn resuming_with_another_model_is_refused_naming_both_and_the_way_out() {
        let tmp = tempfile::tempdir().unwrap();
        let inputs = inputs(tmp.path());
        let model = Path::new("models/other.gguf");
        let check = |mode, fingerprint| check_resume_model(&inputs, mode, model, fingerprint);
        assert!(check(StartMode::Resume, "B").is_ok(), "no earlier run");
        earlier_run(&inputs, "c0ffee", "A");
        let e = check(StartMode::Resume, "B").unwrap_err();
        assert_eq!(
            (e.code, e.file.as_str()),
            (ErrorCode::ResumeMismatch, "models/other.gguf")
        );
        assert!(
            e.message
                .contains("the run used the model A, this one is B")
                && e.message.contains("--overwrite"),
            "{e}"
        );
        assert!(check(StartMode::Resume, "A").is_ok(), "the same model");
        assert!(check(StartMode::Overwrite, "B").is_ok(), "replaced anyway");
        assert!(
            check(StartMode::Fresh, "B").is_ok(),
            "refused later, as E_RUN_EXISTS"
        );
    }

    #[test]
    fn a_run_that_recorded_its_tickets_by_resolved_path_resumes_and_a_changed_ticket_does_not() {
        use stageb_shared::domain::{SourceLocation, Ticket, Verdict};
        let tmp = tempfile::tempdir().unwrap();
        let mut inputs = inputs(tmp.path());
        inputs.config = inputs
            .config_as_written
            .with_paths_resolved(Path::new("/checkout"));
        inputs.config.output.root = tmp.path().to_path_buf();
        let ticket = |file: &str, group: &str| Ticket {
            group_id: group.into(),
            mission: "m".into(),
            label: Verdict::Pass,
            per_image: vec![],
            images: vec![],
            label_source: "human".into(),
            label_timestamp: None,
            source: SourceLocation {
                file: file.into(),
                line: 1,
            },
        };
        // What this stageb records: the file as the config wrote it.
        inputs.ingested.tickets = vec![ticket("a.jsonl", "QC-1")];
        // What an earlier stageb recorded: the file where the run opened it.
        let earlier = digest::digest_of(&[ticket("/checkout/a.jsonl", "QC-1")]);
        let dir = earlier_run(&inputs, "c0ffee", "A");
        let mut manifest = read_manifest(&dir.join(files::MANIFEST)).unwrap();
        manifest["tickets_digest"] = Value::from(earlier);
        std::fs::write(dir.join(files::MANIFEST), manifest.to_string()).unwrap();
        assert!(plan(&inputs, StartMode::Resume).is_ok(), "the same tickets");
        inputs.ingested.tickets = vec![ticket("a.jsonl", "QC-2")];
        match plan(&inputs, StartMode::Resume) {
            Err(StartError::Input(e)) => {
                assert_eq!(e.code, ErrorCode::ResumeMismatch);
                assert!(e.message.contains("the tickets (digest)"), "{e}");
            }
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("a changed ticket resumed"),
        }
    }

    #[test]
    fn validate_notes_a_run_to_resume_or_one_only_overwrite_can_replace() {
        let tmp = tempfile::tempdir().unwrap();
        let inputs = inputs(tmp.path());
        assert_eq!(existing_run_note(&inputs).unwrap(), None, "no run there");
        let dir = earlier_run(&inputs, "c0ffee", "A");
        let note = existing_run_note(&inputs).unwrap().unwrap();
        assert_eq!(
            note,
            format!(
                "{} holds a run; start with --resume to continue it (0 answers journaled) or \
                 --overwrite to replace it",
                dir.display()
            )
        );
        std::fs::write(dir.join(CHECKPOINT_FILE), "{}").unwrap();
        let note = existing_run_note(&inputs).unwrap().unwrap();
        assert!(
            note.contains("(0 answers journaled since its last step checkpoint)"),
            "{note}"
        );
        earlier_run(&inputs, "another config", "A");
        let note = existing_run_note(&inputs).unwrap().unwrap();
        assert!(
            note.contains("holds a run that cannot be resumed (")
                && note.contains("the config file (sha256) differs")
                && note.ends_with("start with --overwrite to replace it"),
            "{note}"
        );
    }
}
