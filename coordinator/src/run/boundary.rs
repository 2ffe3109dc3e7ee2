//! The epoch boundary: reflection drained, the epoch's metrics closed with the tickets routed
//! to need-review, the rule ablation when due, settled predictions and lifecycle cleanup. Also
//! what the gate needs from the run (its split's tickets and rollouts).

use stageb_shared::config::RunConfig;
use stageb_shared::domain::Ticket;
use stageb_shared::observe;

use super::{EpochRun, RunError, RunLoop, io_err, rollout_prompt};
use crate::decide::accuracy;
use crate::decide::split::{Split, Splits};
use crate::learn::reflection::GateProbe;
use crate::progress::Phase;

/// The Prometheus gauges of a finished epoch's accuracy (need-review counted wrong, and left
/// out), labelled by epoch: a run has few epochs, so the label set stays small.
pub(super) fn record_epoch_accuracy(epoch: u32, row: &accuracy::MetricsRow) {
    for (review, counts) in [
        ("included", &row.include_manual_review),
        ("excluded", &row.exclude_manual_review),
    ] {
        ::metrics::gauge!(observe::EPOCH_ACCURACY, "epoch" => epoch.to_string(), "review" => review)
            .set(counts.acc);
    }
}

impl RunLoop {
    /// Epoch end: drain reflection (including retries), then close the epoch's metrics with
    /// the tickets reflection routed to need-review. Returns the epoch row.
    pub(super) async fn close_epoch(
        &mut self,
        run: EpochRun<'_>,
    ) -> Result<serde_json::Value, RunError> {
        let EpochRun {
            epoch,
            mut window,
            started,
            ..
        } = run;
        self.reflection_round(epoch, true).await?;
        crate::progress::enter(&self.progress, Phase::Writing);
        let routed = self.reflector.need_review_keys(epoch);
        window.mark_need_review(&routed);
        if let Some(row) = window.partial_row(self.global_step, started.elapsed()) {
            self.append_metrics(&row)?;
        }
        let mut epoch_row = window.epoch_row(self.global_step);
        epoch_row.ablation = self.ablation(epoch).await?;
        let settled = self
            .reflector
            .take_settled_predictions(&mut self.guidance)?;
        let settled: Vec<serde_json::Value> = settled
            .iter()
            .filter_map(|p| serde_json::to_value(p).ok())
            .collect();
        epoch_row.predictions = (!settled.is_empty()).then_some(settled);
        record_epoch_accuracy(epoch, &epoch_row);
        self.append_metrics(&epoch_row)?;
        self.writers.sync().map_err(io_err(&self.dir))?;
        self.reflector.end_epoch(epoch, &mut self.guidance)?;
        Ok(serde_json::to_value(&epoch_row).unwrap_or_default())
    }

    /// The epoch's rule ablation, when one is due and the guidance has learned rules.
    pub(super) async fn ablation(
        &mut self,
        epoch: u32,
    ) -> Result<Option<Vec<serde_json::Value>>, RunError> {
        if !self.reflector.ablation_due(epoch) {
            return Ok(None);
        }
        let rules = self
            .reflector
            .ablate(epoch, &self.guidance, &mut self.dispatch)
            .await?;
        let rows: Vec<serde_json::Value> = rules
            .iter()
            .filter_map(|r| serde_json::to_value(r).ok())
            .collect();
        Ok((!rows.is_empty()).then_some(rows))
    }

    /// The ticket group's split, when `reflection.gate` is on.
    pub(super) fn split_of(&self, group_id: &str) -> Option<Split> {
        self.splits.as_ref().map(|s| s.of(group_id))
    }

    pub(super) fn append_metrics(&mut self, row: &accuracy::MetricsRow) -> Result<(), RunError> {
        self.writers.metrics.append(row).map_err(io_err(&self.dir))
    }
}

/// The gate split's tickets and rollouts for the reflector's gate phase and rule ablation,
/// when the gate checks edits or ablates rules.
pub(super) fn gate_probe(
    splits: Option<&Splits>,
    cfg: &RunConfig,
    tickets: &[Ticket],
) -> Option<GateProbe> {
    let splits = splits?;
    let gate = &cfg.reflection.gate;
    if !gate.check_edits && gate.ablation_every == 0 {
        return None;
    }
    let gate: Vec<Ticket> = tickets
        .iter()
        .filter(|t| splits.of(&t.group_id) == Split::Gate)
        .cloned()
        .collect();
    if gate.is_empty() {
        tracing::warn!(
            "reflection.gate: the gate split holds no group (gate_fraction × groups rounds to 0): no edit is checked and no rule ablated"
        );
    }
    Some(GateProbe {
        tickets: gate,
        config: cfg.clone(),
        payload: rollout_prompt::rollout_payload,
    })
}
