//! The job journal (`jobs.jsonl`): every model result rank 0 accepted, keyed by a digest of the
//! job that produced it. It is what makes `--resume` exact.
//!
//! A run is a deterministic function of its inputs and of the model's answers: the epoch order,
//! the prompts, the seeds, every selection and every guidance edit follow from them. A resumed
//! run starts from the last step checkpoint ([`crate::run::checkpoint`]), or from epoch 1 when
//! there is none, with the same inputs. The scheduler answers each job whose payload digest
//! is in the journal at once (a *replay*) and leases the rest to workers. The replayed part
//! rewrites the same artifacts the crashed run wrote, and the run carries on where it stopped.
//! The result equals an uninterrupted run, whatever the crash point: mid-step, mid-reflection,
//! or between two writes.
//!
//! The journal is bounded: once a checkpoint covers a step boundary, no later job can ask for
//! an answer given before it, so the journal is emptied ([`Journal::restart`]). Its size and
//! the time a resume spends replaying it follow the work since the last checkpoint, not all
//! the work of the run.
//!
//! The journal is only a cache of answers. A row is written when the scheduler accepts a result,
//! with one `write_all` (a crash leaves at most a torn last line, which loading skips). A lost
//! row costs a recomputation, never a wrong answer: the digest covers the whole payload
//! (messages with the guidance in force, seeds, sampling parameters, schema), so a replayed
//! answer is always the answer to the same question. The manifest pins the model: a resumed run
//! refuses workers with another model fingerprint. Failures are never journaled, so they are
//! retried.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{self, BufRead};
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use stageb_shared::digest;

use super::job::{JobOutput, JobPayload};
use crate::artifacts::{JsonlWriter, seal};

/// File name of the journal inside the run directory.
pub const JOURNAL_FILE: &str = "jobs.jsonl";

/// Version of the row format (and of the payload digest): rows of another version are ignored.
pub const JOURNAL_VERSION: u64 = 1;

/// One row of the journal: an accepted answer and the digest of the job it answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournalRow<'a> {
    /// [`JOURNAL_VERSION`]; rows of another version are skipped on load.
    pub journal_version: u64,
    /// [`payload_digest`] of the job.
    pub digest: Cow<'a, str>,
    pub output: Cow<'a, JobOutput>,
}

/// `sha256:` of the canonical JSON of everything that determines a job's answer: the whole
/// payload (messages, decode groups with their seeds, schema, sampling parameters).
pub fn payload_digest(payload: &JobPayload) -> String {
    digest::digest_of(payload)
}

/// Answers of an earlier attempt at this run, by payload digest.
#[derive(Debug, Default, Clone)]
pub struct ReplayCache {
    answers: HashMap<String, JobOutput>,
}

impl ReplayCache {
    /// Reads `path`; a missing file is an empty cache. Rows that do not parse (a torn last
    /// line, another journal version) are skipped: the job is recomputed instead.
    pub fn load(path: &Path) -> io::Result<ReplayCache> {
        let mut answers = HashMap::new();
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ReplayCache::default()),
            Err(e) => return Err(e),
        };
        let key = path.parent().map(seal::key_for).transpose()?.flatten();
        let (mut skipped, mut forged) = (0usize, 0usize);
        // Split on bytes, not `lines()`: one row that is not UTF-8 (a corrupt byte on disk) is
        // skipped like any other unreadable row instead of failing the whole replay.
        for raw in io::BufReader::new(file).split(b'\n') {
            let mut raw = raw?;
            if raw.last() == Some(&b'\r') {
                raw.pop();
            }
            let Ok(line) = String::from_utf8(raw) else {
                skipped += 1;
                continue;
            };
            // With a key, only a row whose mac matches is an answer rank 0 wrote.
            let row_text = match &key {
                Some(key) => match seal::check_row_mac(key, &line) {
                    Some(row) => row,
                    None => {
                        forged += 1;
                        continue;
                    }
                },
                None => line,
            };
            match serde_json::from_str::<JournalRow>(&row_text) {
                Ok(row) if row.journal_version == JOURNAL_VERSION => {
                    answers.insert(row.digest.into_owned(), row.output.into_owned());
                }
                _ => skipped += 1,
            }
        }
        if skipped > 0 {
            tracing::warn!(path = %path.display(), skipped, "journal rows skipped (their jobs will be recomputed)");
        }
        if forged > 0 {
            tracing::warn!(path = %path.display(), rows = forged, "journal rows that fail their integrity check (changed after rank 0 wrote them, or torn) are not replayed: their jobs will be recomputed");
        }
        Ok(ReplayCache { answers })
    }

    pub fn get(&self, digest: &str) -> Option<&JobOutput> {
        self.answers.get(digest)
    }

    pub fn len(&self) -> usize {
        self.answers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.answers.is_empty()
    }
}

/// The append side of the journal, shared by the scheduler's submit path.
pub struct Journal {
    writer: Mutex<JsonlWriter>,
    /// The run's sealing key: every row carries a `mac` under it ([`seal`]).
    key: Option<seal::SealKey>,
}

impl Journal {
    /// A fresh journal (truncates `path`).
    pub fn create(path: &Path) -> io::Result<Journal> {
        Ok(Journal {
            writer: Mutex::new(JsonlWriter::create(path)?),
            key: path.parent().map(seal::key_for).transpose()?.flatten(),
        })
    }

    /// Continues `path` after a crash (a torn last line is cut off, nothing else rewritten).
    pub fn append_to(path: &Path) -> io::Result<Journal> {
        Ok(Journal {
            writer: Mutex::new(JsonlWriter::open_resume(path)?),
            key: path.parent().map(seal::key_for).transpose()?.flatten(),
        })
    }

    fn writer(&self) -> std::sync::MutexGuard<'_, JsonlWriter> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records an accepted answer. A failed write only costs a recomputation on resume, so it
    /// is logged, not fatal.
    pub fn record(&self, digest: &str, output: &JobOutput) {
        let row = JournalRow {
            journal_version: JOURNAL_VERSION,
            digest: Cow::Borrowed(digest),
            output: Cow::Borrowed(output),
        };
        let line = match serde_json::to_vec(&row) {
            Ok(line) => line,
            Err(e) => {
                tracing::warn!("cannot serialize a journal row: {e}");
                return;
            }
        };
        let line = match &self.key {
            Some(key) => seal::with_row_mac(key, &line),
            None => line,
        };
        let mut w = self.writer();
        if let Err(e) = w.append_raw(line) {
            tracing::warn!(path = %w.path().display(), "cannot append to the job journal: {e}");
        }
    }

    /// Makes every row written so far durable (called at step boundaries).
    pub fn sync(&self) -> io::Result<()> {
        self.writer().sync()
    }

    /// Bytes of the journal on disk (written since it was created or last restarted).
    pub fn bytes(&self) -> u64 {
        self.writer().bytes()
    }

    /// Empties the journal, durably. Only once a step checkpoint covering every row is on disk
    /// ([`crate::run::checkpoint`]): a crash in here leaves the old rows or none, and the
    /// checkpoint needs neither.
    pub fn restart(&self) -> io::Result<()> {
        let mut w = self.writer();
        let fresh = JsonlWriter::create(w.path())?;
        *w = fresh;
        w.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::scheduler::job::{CandidateText, DecodeJob};
    use stageb_shared::domain::ChatMessage;

    fn rollout(seed: u64) -> JobPayload {
        JobPayload::Rollout {
            messages: vec![ChatMessage::user("票据 ticket")],
            decodes: vec![DecodeJob {
                decode_index: 0,
                temperature: 0.7,
                top_p: 0.9,
                repetition_penalty: 1.05,
                max_new_tokens: 48,
                seeds: vec![seed, seed + 1],
            }],
            constrained: true,
        }
    }

    fn generated() -> JobOutput {
        JobOutput::Generate {
            text: "{}".into(),
            prompt_tokens: 3,
            prefix_tokens: 2,
            completion_tokens: 1,
            finish_reason: "stop".into(),
            latency_us: 4,
        }
    }

    #[test]
    fn the_digest_covers_every_field_that_changes_the_answer() {
        assert_eq!(payload_digest(&rollout(1)), payload_digest(&rollout(1)));
        assert_ne!(payload_digest(&rollout(1)), payload_digest(&rollout(2)));
        let mut other_prompt = rollout(1);
        if let JobPayload::Rollout { messages, .. } = &mut other_prompt {
            messages[0].content.push('!');
        }
        assert_ne!(payload_digest(&rollout(1)), payload_digest(&other_prompt));
    }

    #[test]
    fn an_answer_journaled_before_prefix_tokens_existed_reads_as_no_reuse() {
        let old = serde_json::json!({"kind": "rollout", "candidates": [], "prompt_tokens": 9,
                                     "prefill_us": 1, "decode_us": 2});
        match serde_json::from_value::<JobOutput>(old).unwrap() {
            JobOutput::Rollout { prefix_tokens, .. } => assert_eq!(prefix_tokens, 0),
            other => panic!("{other:?}"),
        }
        let old = serde_json::json!({"kind": "generate", "text": "{}", "prompt_tokens": 3,
                                     "completion_tokens": 1, "finish_reason": "stop",
                                     "latency_us": 4});
        match serde_json::from_value::<JobOutput>(old).unwrap() {
            JobOutput::Generate { prefix_tokens, .. } => assert_eq!(prefix_tokens, 0),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_row_is_its_version_digest_and_output_and_other_versions_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        let generated = generated();
        Journal::create(&path)
            .unwrap()
            .record("sha256:a", &generated);
        let row = r#"{"journal_version":1,"digest":"sha256:a","output":{"kind":"generate","text":"{}","prompt_tokens":3,"prefix_tokens":2,"completion_tokens":1,"finish_reason":"stop","latency_us":4}}"#;
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{row}\n"));
        std::fs::write(
            &path,
            row.replace(r#""journal_version":1"#, r#""journal_version":2"#),
        )
        .unwrap();
        assert!(ReplayCache::load(&path).unwrap().is_empty());
    }

    #[test]
    fn a_row_that_is_not_utf8_is_skipped_and_the_rows_around_it_replay() {
        // Found by the journal_replay fuzz target: one corrupt byte failed the whole replay.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        let generated = generated();
        Journal::create(&path)
            .unwrap()
            .record("sha256:a", &generated);
        let good = std::fs::read(&path).unwrap();
        let mut bytes = good.clone();
        bytes.extend_from_slice(b"{\"journal_version\":1,\xff\xfe}\n");
        let second = String::from_utf8(good)
            .unwrap()
            .replace("sha256:a", "sha256:b");
        bytes.extend_from_slice(second.as_bytes());
        std::fs::write(&path, bytes).unwrap();
        let cache = ReplayCache::load(&path).unwrap();
        assert_eq!(cache.len(), 2);
        assert!(cache.get("sha256:a").is_some() && cache.get("sha256:b").is_some());
    }

    #[test]
    fn answers_round_trip_and_torn_rows_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        let answer = JobOutput::Rollout {
            candidates: vec![CandidateText {
                decode_index: 0,
                sample_index: 1,
                seed: u64::MAX,
                text: "Verdict: 通过\nReason: 无异常".into(),
                completion_tokens: 9,
                finish_reason: "stop".into(),
            }],
            prompt_tokens: 600,
            prefix_tokens: 580,
            prefill_us: 1,
            decode_us: 2,
        };
        let generated = generated();
        {
            let j = Journal::create(&path).unwrap();
            j.record("sha256:a", &answer);
            j.record("sha256:b", &generated);
            j.sync().unwrap();
        }
        // A crash in the middle of a third row.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(br#"{"journal_version":1,"digest":"sha256:c","out"#);
        std::fs::write(&path, &bytes).unwrap();
        let cache = ReplayCache::load(&path).unwrap();
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get("sha256:a"), Some(&answer));
        assert_eq!(cache.get("sha256:b"), Some(&generated));
        // Appending after the crash cuts the torn row off first.
        let j = Journal::append_to(&path).unwrap();
        j.record("sha256:c", &generated);
        assert_eq!(ReplayCache::load(&path).unwrap().len(), 3);
        assert_eq!(j.bytes(), std::fs::metadata(&path).unwrap().len());

        // A restart (after a checkpoint) leaves an empty journal that is appended to as before.
        j.restart().unwrap();
        assert_eq!((j.bytes(), std::fs::metadata(&path).unwrap().len()), (0, 0));
        j.record("sha256:d", &generated);
        let cache = ReplayCache::load(&path).unwrap();
        assert_eq!((cache.len(), cache.get("sha256:d")), (1, Some(&generated)));
    }
}
