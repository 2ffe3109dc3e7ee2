//! `need_review_queue.jsonl` as the reflector keeps it: the file, every row written so far
//! (the run-end `need_review.json` aggregates them) and which tickets each epoch routed. The
//! three change together, in one place: a row is appended, kept and indexed by
//! [`NeedReviewLog::route`] only.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use stageb_shared::domain::TicketKey;

use super::{GradientRecord, ReflectionError, io_err};
use crate::artifacts::{JsonlWriter, files, read_jsonl};
use crate::learn::need_review::{NeedReviewReason, NeedReviewRow, RoutingPoint};

/// The need-review queue of a run.
pub(super) struct NeedReviewLog {
    path: PathBuf,
    log: JsonlWriter,
    rows: Vec<NeedReviewRow>,
    routed: BTreeMap<u32, BTreeSet<TicketKey>>,
}

impl NeedReviewLog {
    /// The queue under `dir`, opened with `open` (fresh or appended to), no rows known yet.
    pub(super) fn open(
        dir: &Path,
        open: fn(&Path) -> std::io::Result<JsonlWriter>,
    ) -> Result<Self, ReflectionError> {
        let path = dir.join(files::NEED_REVIEW_QUEUE);
        let log = open(&path).map_err(io_err(&path))?;
        Ok(NeedReviewLog {
            path,
            log,
            rows: Vec::new(),
            routed: BTreeMap::new(),
        })
    }

    /// On resume: the rows already in the file (cut back by the caller to the checkpoint's
    /// length) are read back. A checkpoint does not store them, as they grow with all the work
    /// done rather than the epoch's.
    pub(super) fn read_back(&mut self) -> Result<(), ReflectionError> {
        self.rows = read_queue(&self.path)?;
        for row in &self.rows {
            self.routed
                .entry(row.epoch)
                .or_default()
                .insert(row.ticket_key.clone());
        }
        Ok(())
    }

    /// Route `record` to need-review for `reason`, at `at`.
    pub(super) fn route(
        &mut self,
        record: &GradientRecord,
        reason: NeedReviewReason,
        at: &RoutingPoint,
        note: Option<String>,
    ) -> Result<(), ReflectionError> {
        let row =
            NeedReviewRow::from_selection(&record.identity(), &record.selection, reason, at, note);
        self.log.append(&row).map_err(io_err(&self.path))?;
        self.routed
            .entry(at.epoch)
            .or_default()
            .insert(record.ticket_key.clone());
        self.rows.push(row);
        Ok(())
    }

    /// Every row written in this run, in order.
    pub(super) fn rows(&self) -> &[NeedReviewRow] {
        &self.rows
    }

    /// Tickets routed to need-review during `epoch`.
    pub(super) fn keys(&self, epoch: u32) -> BTreeSet<TicketKey> {
        self.routed.get(&epoch).cloned().unwrap_or_default()
    }

    /// Makes the file durable (before a checkpoint names its length).
    pub(super) fn sync(&mut self) -> std::io::Result<()> {
        self.log.sync()
    }
}

/// The rows of `need_review_queue.jsonl`, as [`NeedReviewLog::route`] wrote them.
fn read_queue(path: &Path) -> Result<Vec<NeedReviewRow>, ReflectionError> {
    let bad = |e: serde_json::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    read_jsonl(path)
        .and_then(|rows| {
            rows.into_iter()
                .map(|v| serde_json::from_value(v).map_err(bad))
                .collect()
        })
        .map_err(io_err(path))
}
