//! Throughput from the timing fields the artifacts have: the metrics window rows' `timing`
//! (wall clock since the epoch started, every `logging_steps` tickets), the rollout jobs'
//! `runtime` in `trajectories.jsonl` (prefill and decode time, tokens, worker), and the run's
//! elapsed time and scheduler counters in `summary.json`.
//!
//! No artifact timestamps each ticket, so the wall-clock view is as coarse as `logging_steps`;
//! the report says so next to the chart.

use std::collections::BTreeMap;
use std::path::Path;

use stageb_coordinator::artifacts::files;
use stageb_coordinator::artifacts::rows::TrajectoryRow;

use super::load::{FileStatus, stream_jsonl};
use super::outcomes::bump;

/// Model work of one epoch's rollouts. A job's `runtime` is repeated on each of its
/// candidates' rows, so job-level sums count the row of candidate 0 only.
#[derive(Debug, Clone, Copy, Default)]
pub struct EpochCompute {
    pub jobs: u64,
    pub candidates: u64,
    pub completion_tokens: u64,
    pub prompt_tokens: u64,
    pub prefill_us: u64,
    pub decode_us: u64,
}

impl EpochCompute {
    /// Generated tokens per second of decoding (a job decodes all its candidates together).
    pub fn decode_tokens_per_second(&self) -> Option<f64> {
        (self.decode_us > 0).then(|| self.completion_tokens as f64 / (self.decode_us as f64 / 1e6))
    }
}

#[derive(Debug, Clone, Default)]
pub struct Compute {
    pub per_epoch: BTreeMap<u32, EpochCompute>,
    /// Rollout jobs by the worker that answered them (`journal-replay` for replayed answers).
    pub jobs_by_worker: BTreeMap<String, u64>,
    pub file: FileStatus,
}

pub fn collect(dir: &Path) -> Compute {
    let mut out = Compute::default();
    out.file = stream_jsonl::<TrajectoryRow>(dir, files::TRAJECTORIES, |row| {
        let e = out.per_epoch.entry(row.ticket.epoch).or_default();
        e.candidates += 1;
        e.completion_tokens += u64::from(row.result.completion_tokens);
        if row.result.candidate_index != 0 {
            return;
        }
        e.jobs += 1;
        if let Some(timing) = row.runtime.rollout {
            e.prompt_tokens += u64::from(timing.prompt_tokens);
            e.prefill_us += timing.prefill_us;
            e.decode_us += timing.decode_us;
        }
        if let Some(provenance) = row.runtime.provenance {
            bump(&mut out.jobs_by_worker, &provenance.worker_id);
        }
    });
    out
}
