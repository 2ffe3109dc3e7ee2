//! One ticket decided and recorded: its rollout answer unpacked, every candidate parsed by the
//! contract, the vote, overrides and eligibility (pure functions of `crate::decide`), then its
//! rows written in a fixed order: `failure_malformed` rows as candidates break the contract,
//! the trajectory rows, a hard failure row when no verdict came out, the selection row.

use std::collections::BTreeMap;

use stageb_shared::SCHEMA_VERSION;
use stageb_shared::config::RunConfig;
use stageb_shared::contract;
use stageb_shared::domain::Ticket;
use stageb_shared::observe;
use stageb_shared::seed::candidate_seed;

use super::{RunError, RunLoop, io_err};
use crate::artifacts::rows::{
    CandidateResult, DecodeRecord, FailureRow, RolloutTiming, RowRuntime, SelectionResult,
    SelectionRow, TicketHead, TrajectoryRow, ViolationRecord, failure_reason,
};
use crate::cluster::scheduler::{Completion, JobFailure, JobOutput};
use crate::decide::eligibility;
use crate::decide::fail_first;
use crate::decide::selection::{self, Selection, VoteCandidate};
use crate::learn::reflection::TicketOutcome;

impl RunLoop {
    /// Parse, vote, override and write one ticket's rows. Pure decisions come from
    /// `selection`, `signals` and `eligibility`; this function only orders and records them.
    pub(super) fn decide_ticket(
        &mut self,
        at: &TicketAt<'_>,
        g0: &str,
        ticket_index: usize,
        completion: Completion,
    ) -> Result<TicketOutcome, RunError> {
        let ticket = at.ticket;
        let provenance = completion.provenance;
        if let (
            Some(_),
            Ok(JobOutput::Rollout {
                prompt_tokens,
                prefix_tokens,
                ..
            }),
        ) = (&provenance, &completion.result)
        {
            self.prefix_reuse.add(*prompt_tokens, *prefix_tokens);
        }
        let answer = RolloutAnswer::from_result(completion.result);
        let judged = self.judge_candidates(at, answer.texts)?;

        let evidence = fail_first::extract_mission_evidence(&ticket.per_image, g0);
        let selection = selection::select(
            &judged.vote,
            &evidence,
            ticket.label,
            at.cfg.manual_review.min_verdict_agreement,
        );
        let eligibility = eligibility::assess(&selection, ticket.label);

        let runtime = RowRuntime {
            provenance,
            rollout: answer.timing,
        };
        self.write_trajectories(judged.rows, &selection, &runtime)?;
        if selection.verdict.is_none() {
            // A hard failure: logged, never routed to need-review (seed 003).
            self.write_hard_failure(at, answer.job_error.clone())?;
        }
        let ineligible_reason = match (&answer.job_error, selection.verdict) {
            (Some(f), _) => Some(format!("{}:{}", failure_reason::ENGINE_ERROR, f.code)),
            (None, None) => Some(failure_reason::NO_VALID_CANDIDATES.to_string()),
            _ => None,
        };
        let row = SelectionRow {
            ticket: at.head(),
            epoch_step: at.epoch_step,
            global_step: self.global_step,
            schedule_step: self.schedule_step,
            result: SelectionResult {
                selection,
                guidance_step: at.guidance_step,
                reflection_change: self.reflector.last_applied_reflection(),
                reflection_cycle: self.reflector.cycles(),
                eligible: ineligible_reason.is_none(),
                ineligible_reason,
            },
            eligibility,
            guidance_hash: self.guidance.head_hash().to_string(),
            split: self.split_of(&at.ticket.group_id),
            runtime: RowRuntime {
                provenance: runtime.provenance,
                rollout: None,
            },
        };
        self.writers
            .selections
            .append(&row)
            .map_err(io_err(&self.dir))?;
        Ok(TicketOutcome {
            ticket_index,
            selection: row.result.selection,
            eligibility: row.eligibility,
            candidates: judged.vote,
            raw_texts: judged.raw_texts,
        })
    }

    /// Parse every candidate in grid order (`candidate_index = decode_index ×
    /// samples_per_decode + sample`): its trajectory row (written once the vote is known), its
    /// vote, and a `failure_malformed` row now when it breaks the contract.
    fn judge_candidates(
        &mut self,
        at: &TicketAt<'_>,
        mut texts: BTreeMap<(u32, u32), CandidateAnswer>,
    ) -> Result<JudgedCandidates, RunError> {
        let (ticket, cfg, key) = (at.ticket, at.cfg, at.ticket.key());
        let spd = cfg.sampler.samples_per_decode;
        let mut judged = JudgedCandidates::default();
        for (d, spec) in cfg.sampler.decode_specs().iter().enumerate() {
            let d = d as u32;
            for s in 0..spd {
                let candidate_index = d * spd + s;
                let Some(answer) = texts.remove(&(d, s)) else {
                    continue;
                };
                let (verdict, reason, violation) = match contract::parse(&answer.text) {
                    Ok(ok) => (Some(ok.verdict), ok.reason, None),
                    Err(v) => (
                        None,
                        String::new(),
                        Some(ViolationRecord {
                            code: v.code.code().to_string(),
                            detail: v.detail,
                        }),
                    ),
                };
                self.candidates_seen += 1;
                ::metrics::counter!(observe::CANDIDATES).increment(1);
                if let Some(v) = &violation {
                    self.write_malformed(at, candidate_index, d, v, &answer.text)?;
                }
                let result = CandidateResult {
                    candidate_index,
                    decode_index: d,
                    sample_index: s,
                    decode: DecodeRecord {
                        temperature: f64::from(spec.temperature),
                        top_p: f64::from(spec.top_p),
                        max_new_tokens: spec.max_new_tokens,
                        repetition_penalty: f64::from(spec.repetition_penalty),
                        seed: candidate_seed(cfg.seed, at.epoch, key.as_str(), d, s),
                    },
                    text: answer.text.clone(),
                    verdict,
                    reason: reason.clone(),
                    format_ok: violation.is_none(),
                    violation,
                    finish_reason: answer.finish_reason,
                    completion_tokens: answer.completion_tokens,
                    label_match: verdict.map(|v| v == ticket.label),
                    ..CandidateResult::default()
                };
                judged.rows.push(self.trajectory_row(at, result));
                judged.vote.push(VoteCandidate {
                    candidate_index,
                    temperature: spec.temperature,
                    verdict,
                    reason,
                });
                judged.raw_texts.push(answer.text);
            }
        }
        Ok(judged)
    }

    /// A candidate's trajectory row, before the vote's signals and the runtime are known.
    fn trajectory_row(&self, at: &TicketAt<'_>, result: CandidateResult) -> TrajectoryRow {
        TrajectoryRow {
            ticket: at.head(),
            global_step: self.global_step,
            guidance_step: at.guidance_step,
            reflection_cycle: self.reflector.cycles(),
            result,
            runtime: RowRuntime::default(),
        }
    }

    /// Trajectory rows carry the ticket-level signals, as in the original.
    fn write_trajectories(
        &mut self,
        rows: Vec<TrajectoryRow>,
        selection: &Selection,
        runtime: &RowRuntime,
    ) -> Result<(), RunError> {
        for mut row in rows {
            row.result.vote_strength = selection.vote_strength;
            row.result.low_agreement = selection.low_agreement;
            row.result.needs_manual_review = selection.needs_manual_review;
            row.runtime = runtime.clone();
            self.writers
                .trajectories
                .append(&row)
                .map_err(io_err(&self.dir))?;
        }
        Ok(())
    }

    /// A candidate that broke the contract: counted, logged, and its `failure_malformed` row
    /// written; it is dropped from the vote.
    fn write_malformed(
        &mut self,
        at: &TicketAt<'_>,
        candidate_index: u32,
        decode_index: u32,
        violation: &ViolationRecord,
        text: &str,
    ) -> Result<(), RunError> {
        self.malformed += 1;
        let code = violation.code.as_str();
        ::metrics::counter!(observe::CANDIDATES_MALFORMED, "code" => code.to_string()).increment(1);
        tracing::warn!(ticket = %at.ticket.key(), candidate_index, code, "malformed candidate dropped from the vote");
        let row = FailureRow {
            candidate_index: Some(candidate_index),
            decode_index: Some(decode_index),
            violation: Some(violation.clone()),
            raw_text: Some(text.to_string()),
            ..self.failure_row(at, failure_reason::FORMAT_ERROR)
        };
        self.writers
            .failures
            .append(&row)
            .map_err(io_err(&self.dir))
    }

    /// A ticket without a verdict: its `failure_malformed` row (engine error or no valid
    /// candidate), counted as a hard failure.
    fn write_hard_failure(
        &mut self,
        at: &TicketAt<'_>,
        job_error: Option<JobFailure>,
    ) -> Result<(), RunError> {
        self.hard_failures += 1;
        let reason = match job_error {
            Some(_) => failure_reason::ENGINE_ERROR,
            None => failure_reason::NO_VALID_CANDIDATES,
        };
        let row = FailureRow {
            error: job_error,
            ..self.failure_row(at, reason)
        };
        self.writers
            .failures
            .append(&row)
            .map_err(io_err(&self.dir))
    }

    /// The ticket's part of a failure row; the candidate's part and the error are `null`.
    fn failure_row(&self, at: &TicketAt<'_>, reason: &str) -> FailureRow {
        let ticket = at.ticket;
        FailureRow {
            schema_version: SCHEMA_VERSION,
            ticket_key: ticket.key().0,
            group_id: ticket.group_id.clone(),
            mission: ticket.mission.clone(),
            gt_label: Some(ticket.label),
            epoch: at.epoch,
            global_step: self.global_step,
            epoch_step: at.epoch_step,
            guidance_step: at.guidance_step,
            guidance_hash: self.guidance.head_hash().to_string(),
            reason: reason.to_string(),
            ..FailureRow::default()
        }
    }
}

/// Where a ticket is decided: its place in the run and the config it runs under.
pub(super) struct TicketAt<'a> {
    pub(super) epoch: u32,
    pub(super) epoch_step: u64,
    pub(super) guidance_step: u64,
    pub(super) ticket: &'a Ticket,
    pub(super) cfg: &'a RunConfig,
}

impl TicketAt<'_> {
    /// The first keys of the ticket's selection and trajectory rows.
    fn head(&self) -> TicketHead {
        TicketHead {
            schema_version: SCHEMA_VERSION,
            group_id: self.ticket.group_id.clone(),
            mission: self.ticket.mission.clone(),
            ticket_key: self.ticket.key().0,
            gt_label: Some(self.ticket.label),
            epoch: self.epoch,
        }
    }
}

/// One candidate's answer as the worker sent it.
struct CandidateAnswer {
    text: String,
    completion_tokens: u32,
    finish_reason: String,
}

/// A rollout job's result, unpacked: candidates by (decode, sample), timing, or the job error.
struct RolloutAnswer {
    texts: BTreeMap<(u32, u32), CandidateAnswer>,
    timing: Option<RolloutTiming>,
    job_error: Option<JobFailure>,
}

impl RolloutAnswer {
    fn from_result(result: Result<JobOutput, JobFailure>) -> Self {
        let mut answer = RolloutAnswer {
            texts: BTreeMap::new(),
            timing: None,
            job_error: None,
        };
        match result {
            Ok(JobOutput::Rollout {
                candidates,
                prompt_tokens,
                prefix_tokens,
                prefill_us,
                decode_us,
            }) => {
                answer.timing = Some(RolloutTiming {
                    prompt_tokens,
                    prefix_tokens,
                    prefill_us,
                    decode_us,
                });
                for c in candidates {
                    answer.texts.insert(
                        (c.decode_index, c.sample_index),
                        CandidateAnswer {
                            text: c.text,
                            completion_tokens: c.completion_tokens,
                            finish_reason: c.finish_reason,
                        },
                    );
                }
            }
            Ok(JobOutput::Generate { .. }) => {
                answer.job_error = Some(JobFailure {
                    code: "WRONG_RESULT_KIND".into(),
                    message: "a rollout returned a generation".into(),
                })
            }
            Err(f) => answer.job_error = Some(f),
        }
        answer
    }
}

/// The candidates of one ticket, judged by the contract parser.
#[derive(Default)]
struct JudgedCandidates {
    vote: Vec<VoteCandidate>,
    raw_texts: Vec<String>,
    /// Trajectory rows, completed with the vote's signals before they are written.
    rows: Vec<TrajectoryRow>,
}
