//! The gate phase of a cycle (`reflection.gate.check_edits`), between
//! the ops rounds and apply: the guidance the accepted ops would make (the candidate) and the
//! current one (its parent) are both rolled out on the gate split as ordinary rollout jobs with
//! the epoch's seeds, each ticket decided by the same vote as a step's, and
//! [`crate::learn::gate_decision::judge`] decides. A refused candidate's ops move from
//! `accepted_ops` to `rejected_ops` as `gate_regression` (remembered like other rejected edits),
//! so for closure they were never validated: their evidence retries, then goes to need-review
//! as `budget_exhausted`.
//!
//! Outcomes are kept for the epoch by (ticket, rendered guidance): a parent evaluated before,
//! or the guidance a step already rolled the gate tickets out under, costs nothing again. The
//! outcome of a rollout depends only on its payload, so what is reused equals what a rollout
//! would give; the counts of rollouts run and reused are runtime facts (`summary.json`
//! `runtime.gate`).

use std::collections::BTreeMap;

use stageb_shared::config::{GateConfig, RunConfig};
use stageb_shared::contract;
use stageb_shared::digest::digest_of;
use stageb_shared::domain::{Ticket, TicketKey};
use stageb_shared::observe;
use stageb_shared::seed::derived_seed;

use super::ReflectionError;
use super::ops::ROUND_INDEX_STRIDE;
use super::row::ReflectionRow;
use crate::artifacts::documents::GateCost;
use crate::cluster::dispatch::Dispatch;
use crate::cluster::scheduler::{Completion, JobOutput, JobPayload};
use crate::decide::fail_first;
use crate::decide::selection::{self, VoteCandidate};
use crate::guidance::{GuidanceRepo, MissionGuidance, apply_ops};
use crate::learn::gate_decision::{self, GateFigures};
use crate::learn::op_check::{OpsValidation, RejectReason, RejectedOp};
use crate::progress::{Phase, ProgressHandle, ReflectPass};

/// Builds a ticket's rollout job under a guidance (the run layer's
/// `run::rollout_prompt::rollout_payload`, passed in so that learning does not import the run).
pub type RolloutPayloadFn = fn(&RunConfig, u32, &Ticket, &[(String, String)]) -> JobPayload;

/// What the gate phase needs from the run: the gate split's tickets, the config their rollouts
/// are built under (lengths fitted to the model) and the rollout job builder.
pub struct GateProbe {
    pub tickets: Vec<Ticket>,
    pub config: RunConfig,
    pub payload: RolloutPayloadFn,
}

/// Gate outcomes known in the current epoch: (ticket, digest of the rendered guidance) →
/// decided correctly.
#[derive(Debug, Default)]
pub(super) struct GateOutcomes {
    epoch: u32,
    known: BTreeMap<(TicketKey, String), bool>,
}

/// The gate of a run: its settings, its split's tickets and rollouts, the outcomes known this
/// epoch and what it cost. Outcomes and costs change only here.
pub(super) struct Gate {
    /// `reflection.gate`.
    pub(super) config: GateConfig,
    /// `None` when the gate checks no edit and ablates no rule.
    probe: Option<GateProbe>,
    /// The run seed (the bootstrap's seeds derive from it).
    pub(super) run_seed: u64,
    /// Where the gate phase is shown, when set.
    progress: Option<ProgressHandle>,
    /// Runtime only: recomputed identically after a resume.
    outcomes: GateOutcomes,
    pub(super) cost: GateCost,
}

impl Gate {
    /// The gate of a run under `config`, rolling out `probe`'s tickets.
    pub(super) fn new(
        config: GateConfig,
        probe: Option<GateProbe>,
        run_seed: u64,
        progress: Option<ProgressHandle>,
    ) -> Self {
        Gate {
            config,
            probe,
            run_seed,
            progress,
            outcomes: GateOutcomes::default(),
            cost: GateCost::default(),
        }
    }

    /// Whether the gate has tickets to roll out.
    pub(super) fn has_tickets(&self) -> bool {
        self.probe.as_ref().is_some_and(|p| !p.tickets.is_empty())
    }

    /// Count one candidate evaluated, and whether it was refused.
    fn count_check(&mut self, refused: bool) {
        self.cost.checks += 1;
        self.cost.refused += u64::from(refused);
    }

    /// Whether each gate ticket is decided correctly under each of `guidances` (outer order
    /// that of `guidances`, inner that of the gate tickets): known outcomes reused, the rest
    /// rolled out together.
    pub(super) async fn outcomes_of(
        &mut self,
        epoch: u32,
        guidances: &[&MissionGuidance],
        dispatch: &mut Dispatch,
    ) -> Result<Vec<Vec<bool>>, ReflectionError> {
        let probe = self.probe.as_ref().expect("checked by the caller");
        let rendered: Vec<Vec<(String, String)>> =
            guidances.iter().map(|g| g.render_for_prompt()).collect();
        let digests: Vec<String> = rendered.iter().map(|r| rendered_digest(r)).collect();
        let known = self.outcomes.at_epoch(epoch);
        let mut queued = Vec::new();
        for (g, lines) in rendered.iter().enumerate() {
            if digests[..g].contains(&digests[g]) {
                continue; // renders as an earlier one: its rollouts are queued already
            }
            for (t, ticket) in probe.tickets.iter().enumerate() {
                let key = (ticket.key(), digests[g].clone());
                if known.contains_key(&key) {
                    continue;
                }
                let payload = (probe.payload)(&probe.config, epoch, ticket, lines);
                let job = dispatch.scheduler.enqueue(payload);
                queued.push((job, key, g, t));
            }
        }
        let total = guidances.len() * probe.tickets.len();
        self.cost.rollouts += queued.len() as u64;
        self.cost.reused += (total - queued.len()) as u64;
        let ids: Vec<_> = queued.iter().map(|(j, ..)| *j).collect();
        let mut done = dispatch.await_all(&ids).await?;
        let probe = self.probe.as_ref().expect("checked by the caller");
        let known = self.outcomes.at_epoch(epoch);
        for (job, key, g, t) in queued {
            let completion = done
                .remove(&job)
                .expect("await_completions returns every job");
            let g0 = guidances[g].g0();
            let correct = decided_correctly(&probe.config, &probe.tickets[t], g0, completion);
            known.insert(key, correct);
        }
        Ok(digests
            .iter()
            .map(|d| {
                probe
                    .tickets
                    .iter()
                    .map(|t| known[&(t.key(), d.clone())])
                    .collect()
            })
            .collect())
    }
}

/// The guidance digest the outcomes are kept under.
pub fn rendered_digest(lines: &[(String, String)]) -> String {
    digest_of(&lines)
}

impl Gate {
    /// A gate ticket was decided by a step of `epoch` under the guidance rendered as `digest`:
    /// a later gate evaluation of that guidance reuses it.
    pub(super) fn note_outcome(
        &mut self,
        epoch: u32,
        key: TicketKey,
        digest: String,
        correct: bool,
    ) {
        self.outcomes.at_epoch(epoch).insert((key, digest), correct);
    }

    /// The gate phase of a cycle: `validation` as it goes on to apply (its accepted ops gone
    /// when the candidate is refused), and the ops it refused (for the memory of rejected
    /// edits). The caller has checked that the epoch's change cap leaves room.
    pub(super) async fn check(
        &mut self,
        row: &mut ReflectionRow,
        mut validation: OpsValidation,
        guidance: &GuidanceRepo,
        dispatch: &mut Dispatch,
    ) -> Result<(OpsValidation, Vec<RejectedOp>), ReflectionError> {
        let gate = self.config;
        let wanted = gate.enabled && gate.check_edits && !validation.accepted.is_empty();
        if !wanted || !self.has_tickets() {
            return Ok((validation, Vec::new()));
        }
        // What apply would write; when it would write nothing, apply says so itself.
        let Ok(candidate) = apply_ops(
            guidance.current(),
            &validation.ops(),
            &row.reflection_id,
            "",
        ) else {
            return Ok((validation, Vec::new()));
        };
        self.show(row.reflection_cycle);
        let guidances = [guidance.current(), &candidate.guidance];
        let mut outcomes = self.outcomes_of(row.epoch, &guidances, dispatch).await?;
        let candidate_correct = outcomes.pop().expect("two guidances");
        let parent_correct = outcomes.pop().expect("two guidances");
        let seed = derived_seed(
            self.run_seed,
            "reflection.gate/bootstrap",
            &[row.reflection_id.as_bytes()],
        );
        let figures = gate_decision::judge(
            &parent_correct,
            &candidate_correct,
            gate.tolerance,
            gate.min_p_better,
            seed,
        );
        self.count_check(!figures.passed);
        let refused = if figures.passed {
            Vec::new()
        } else {
            refuse(row, &mut validation, &figures)
        };
        row.gate = Some(figures);
        Ok((validation, refused))
    }

    fn show(&self, cycle: u64) {
        if let Some(progress) = &self.progress {
            let pass = ReflectPass::Gate;
            crate::progress::enter(progress, Phase::Reflecting { cycle, pass });
        }
    }
}

/// The gate refused the candidate: its ops become `gate_regression` rejections, so none is
/// applied. Returns them (to be remembered).
fn refuse(
    row: &mut ReflectionRow,
    validation: &mut OpsValidation,
    f: &GateFigures,
) -> Vec<RejectedOp> {
    row.warnings.push("gate_regression".into());
    let detail = format!(
        "gate accuracy {:.3} under the candidate against {:.3} under its parent ({} gate tickets, {} fixed, {} broken{})",
        f.candidate_accuracy,
        f.parent_accuracy,
        f.tickets,
        f.fixed,
        f.broken,
        f.p_better
            .map(|p| format!(", P(better) {p:.3}, needed {}", f.min_p_better))
            .unwrap_or_default()
    );
    let proposals = row.proposals.as_deref().unwrap_or_default();
    let refused: Vec<RejectedOp> = std::mem::take(&mut validation.accepted)
        .into_iter()
        .filter_map(|a| {
            let (round, at) = (a.index / ROUND_INDEX_STRIDE, a.index % ROUND_INDEX_STRIDE);
            let proposed = proposals
                .iter()
                .find(|p| p.round as usize == round)?
                .operations
                .get(at)?
                .clone();
            Some(RejectedOp {
                index: a.index,
                proposed,
                reason: RejectReason::GateRegression,
                detail: detail.clone(),
            })
        })
        .collect();
    ::metrics::counter!(observe::REFLECTION_OPS, "outcome" => "gate_refused")
        .increment(refused.len() as u64);
    validation.rejected.extend(refused.iter().cloned());
    validation.rejected.sort_by_key(|r| r.index);
    row.accepted_ops = Some(Vec::new());
    row.rejected_ops = Some(validation.rejected.clone());
    refused
}

impl GateOutcomes {
    /// The outcomes of `epoch` (those of an earlier epoch are dropped: seeds differ).
    fn at_epoch(&mut self, epoch: u32) -> &mut BTreeMap<(TicketKey, String), bool> {
        if self.epoch != epoch {
            self.epoch = epoch;
            self.known.clear();
        }
        &mut self.known
    }
}

/// Whether a gate ticket's rollout is decided with its label, by the vote and overrides a
/// step's ticket gets (a failed job or no valid candidate is not correct).
fn decided_correctly(cfg: &RunConfig, ticket: &Ticket, g0: &str, completion: Completion) -> bool {
    let Ok(JobOutput::Rollout { candidates, .. }) = completion.result else {
        return false;
    };
    // As a step reads them: by (decode, sample), the last answer for a cell kept, in grid
    // order, cells outside the grid ignored.
    let mut texts: BTreeMap<(u32, u32), String> = candidates
        .into_iter()
        .map(|c| ((c.decode_index, c.sample_index), c.text))
        .collect();
    let spd = cfg.sampler.samples_per_decode;
    let mut vote = Vec::new();
    for (d, spec) in (0u32..).zip(cfg.sampler.decode_specs()) {
        for s in 0..spd {
            let Some(text) = texts.remove(&(d, s)) else {
                continue;
            };
            let parsed = contract::parse(&text).ok();
            vote.push(VoteCandidate {
                candidate_index: d * spd + s,
                temperature: spec.temperature,
                verdict: parsed.as_ref().map(|p| p.verdict),
                reason: parsed.map(|p| p.reason).unwrap_or_default(),
            });
        }
    }
    let evidence = fail_first::extract_mission_evidence(&ticket.per_image, g0);
    let min_agreement = cfg.manual_review.min_verdict_agreement;
    let selection = selection::select(&vote, &evidence, ticket.label, min_agreement);
    selection.verdict == Some(ticket.label)
}
