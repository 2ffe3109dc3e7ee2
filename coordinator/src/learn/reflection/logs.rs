//! The reflector's two logs: `reflection.jsonl` (one row per cycle) and the need-review queue
//! (`need_review_queue.jsonl`, [`NeedReviewLog`]), and the run-end `need_review.json` made
//! from the queue. Opened together (fresh, or appended to after a checkpoint), synced together.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use stageb_shared::domain::TicketKey;

use super::need_review_log::NeedReviewLog;
use super::row::ReflectionRow;
use super::{GradientRecord, ReflectionError, io_err};
use crate::artifacts::{JsonlWriter, files, write_json_atomic};
use crate::learn::need_review::{self, NeedReviewReason, RoutingPoint};

/// The logs of a run's reflection.
pub struct ReflectionLogs {
    dir: PathBuf,
    need_review: NeedReviewLog,
    reflection: JsonlWriter,
}

impl ReflectionLogs {
    /// The logs under `dir`: fresh (`resume: false`, they start empty), or appended to after
    /// a checkpoint (the caller having already cut them back to the checkpoint's lengths; the
    /// need-review rows are read back from the queue).
    pub fn open(dir: &Path, resume: bool) -> Result<Self, ReflectionError> {
        let opener = match resume {
            true => JsonlWriter::open_resume,
            false => JsonlWriter::create,
        };
        let need_review = NeedReviewLog::open(dir, opener)?;
        let path = dir.join(files::REFLECTION);
        let reflection = opener(&path).map_err(io_err(&path))?;
        let mut logs = ReflectionLogs {
            dir: dir.to_path_buf(),
            need_review,
            reflection,
        };
        if resume {
            logs.need_review.read_back()?;
        }
        Ok(logs)
    }

    /// Route `record` to need-review for `reason`, at `at`.
    pub(super) fn route(
        &mut self,
        record: &GradientRecord,
        reason: NeedReviewReason,
        at: &RoutingPoint,
        note: Option<String>,
    ) -> Result<(), ReflectionError> {
        self.need_review.route(record, reason, at, note)
    }

    /// Append a cycle's row to `reflection.jsonl`.
    pub(super) fn append(&mut self, row: &ReflectionRow) -> Result<(), ReflectionError> {
        let path = self.dir.join(files::REFLECTION);
        self.reflection.append(row).map_err(io_err(&path))
    }

    /// Makes both logs durable (before a checkpoint names their lengths).
    pub(super) fn sync(&mut self) -> std::io::Result<()> {
        self.need_review.sync()?;
        self.reflection.sync()
    }

    /// [`ReflectionLogs::sync`], its failure named after `reflection.jsonl`.
    pub(super) fn sync_named(&mut self) -> Result<(), ReflectionError> {
        let path = self.dir.join(files::REFLECTION);
        self.sync().map_err(io_err(&path))
    }

    /// Rows of the need-review queue so far.
    pub(super) fn need_review_count(&self) -> usize {
        self.need_review.rows().len()
    }

    /// Tickets routed to need-review during `epoch`.
    pub(super) fn need_review_keys(&self, epoch: u32) -> BTreeSet<TicketKey> {
        self.need_review.keys(epoch)
    }

    /// Run end: write `need_review.json` (deterministic aggregation of every epoch's rows).
    pub(super) fn write_need_review(
        &self,
        mission: &str,
        final_epoch: u32,
    ) -> Result<(), ReflectionError> {
        let summary = need_review::aggregate(mission, self.need_review.rows(), final_epoch);
        let path = self.dir.join(files::NEED_REVIEW);
        write_json_atomic(&path, &summary).map_err(|source| ReflectionError::Io { path, source })
    }
}
