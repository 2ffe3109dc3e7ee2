//! One ticket decided and recorded: its rollout answer unpacked, every candidate parsed by the
//! contract, the vote, overrides and eligibility (pure functions of `crate::decide`), then its
//! rows written in a fixed order: `failure_malformed` rows as candidates break the contract,
//! the trajectory rows, a hard failure row when no verdict came out, the selection row.

use std::collections::BTreeMap;

use serde_json::json;
use stageb_shared::SCHEMA_VERSION;
use stageb_shared::config::RunConfig;
use stageb_shared::contract;
use stageb_shared::domain::Ticket;
use stageb_shared::observe;
use stageb_shared::seed::candidate_seed;

use super::{RunError, RunLoop, io_err};
use crate::cluster::scheduler::{Completion, JobFailure, JobOutput, Provenance};
use crate::decide::eligibility;
use crate::decide::selection::{self, Selection, VoteCandidate};
use crate::decide::signals;
use crate::learn::reflection::TicketOutcome;

/// Where a row was produced: excluded from determinism comparisons.
fn runtime_json(p: Option<&Provenance>, extra: serde_json::Value) -> serde_json::Value {
    let mut v = match p {
        Some(p) => json!({"worker_id": p.worker_id, "lease_id": p.lease_id, "attempt": p.attempt}),
        None => json!({}),
    };
    if let (Some(obj), Some(more)) = (v.as_object_mut(), extra.as_object()) {
        for (k, val) in more {
            obj.insert(k.clone(), val.clone());
        }
    }
    v
}

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
        let provenance = completion.provenance.clone();
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

        let evidence = signals::extract_mission_evidence(&ticket.per_image, g0);
        let selection = selection::select(
            &judged.vote,
            &evidence,
            ticket.label,
            at.cfg.manual_review.min_verdict_agreement,
        );
        let eligibility = eligibility::assess(&selection, ticket.label);

        self.write_trajectories(judged.rows, &selection, provenance.as_ref(), &answer.timing)?;
        if selection.verdict.is_none() {
            // A hard failure: logged, never routed to need-review (seed 003).
            self.write_hard_failure(at, answer.job_error.as_ref())?;
        }
        let ineligible_reason = match (&answer.job_error, selection.verdict) {
            (Some(f), _) => Some(format!("engine_error:{}", f.code)),
            (None, None) => Some("no_valid_candidates".to_string()),
            _ => None,
        };
        let row = json!({
            "schema_version": SCHEMA_VERSION,
            "group_id": ticket.group_id,
            "mission": ticket.mission,
            "ticket_key": ticket.key(),
            "gt_label": ticket.label,
            "epoch": at.epoch,
            "epoch_step": at.epoch_step,
            "global_step": self.global_step,
            "schedule_step": self.schedule_step,
            "result": selection_result_json(
                &selection,
                at.guidance_step,
                self.reflector.last_applied_reflection(),
                self.reflector.cycles(),
                ineligible_reason,
            ),
            "eligibility": eligibility,
            "guidance_hash": self.guidance.head_hash(),
            "runtime": runtime_json(provenance.as_ref(), json!({})),
        });
        self.writers
            .selections
            .append(&row)
            .map_err(io_err(&self.dir))?;
        Ok(TicketOutcome {
            ticket_index,
            selection,
            eligibility,
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
            for s in 0..spd {
                let candidate_index = d as u32 * spd + s;
                let Some(answer) = texts.remove(&(d as u32, s)) else {
                    continue;
                };
                let (verdict, reason, violation) = match contract::parse(&answer.text) {
                    Ok(ok) => (Some(ok.verdict), ok.reason, None),
                    Err(v) => (None, String::new(), Some(v)),
                };
                self.candidates_seen += 1;
                ::metrics::counter!(observe::CANDIDATES).increment(1);
                if let Some(v) = &violation {
                    self.malformed += 1;
                    ::metrics::counter!(observe::CANDIDATES_MALFORMED, "code" => v.code.code())
                        .increment(1);
                    tracing::warn!(ticket = %key, candidate_index, code = v.code.code(), "malformed candidate dropped from the vote");
                    let row = json!({
                        "schema_version": SCHEMA_VERSION,
                        "ticket_key": key, "group_id": ticket.group_id, "mission": ticket.mission,
                        "gt_label": ticket.label, "epoch": at.epoch, "global_step": self.global_step,
                        "epoch_step": at.epoch_step, "guidance_step": at.guidance_step,
                        "guidance_hash": self.guidance.head_hash(),
                        "reason": "format_error", "candidate_index": candidate_index, "decode_index": d,
                        "violation": {"code": v.code.code(), "detail": v.detail}, "raw_text": answer.text, "error": null,
                    });
                    self.writers
                        .failures
                        .append(&row)
                        .map_err(io_err(&self.dir))?;
                }
                let seed = candidate_seed(cfg.seed, at.epoch, key.as_str(), d as u32, s);
                judged.rows.push(json!({
                    "schema_version": SCHEMA_VERSION,
                    "group_id": ticket.group_id,
                    "mission": ticket.mission,
                    "ticket_key": key,
                    "gt_label": ticket.label,
                    "epoch": at.epoch,
                    "global_step": self.global_step,
                    "guidance_step": at.guidance_step,
                    "reflection_cycle": self.reflector.cycles(),
                    "result": {
                        "candidate_index": candidate_index,
                        "decode_index": d,
                        "sample_index": s,
                        "decode": {"temperature": spec.temperature, "top_p": spec.top_p, "max_new_tokens": spec.max_new_tokens,
                                   "repetition_penalty": spec.repetition_penalty, "seed": seed},
                        "text": answer.text,
                        "verdict": verdict,
                        "reason": reason,
                        "format_ok": violation.is_none(),
                        "violation": violation.as_ref().map(|v| json!({"code": v.code.code(), "detail": v.detail})),
                        "finish_reason": answer.finish_reason,
                        "completion_tokens": answer.completion_tokens,
                        "label_match": verdict.map(|v| v == ticket.label),
                    },
                }));
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

    /// Trajectory rows carry the ticket-level signals, as in the original.
    fn write_trajectories(
        &mut self,
        rows: Vec<serde_json::Value>,
        selection: &Selection,
        provenance: Option<&Provenance>,
        timing: &serde_json::Value,
    ) -> Result<(), RunError> {
        for mut row in rows {
            if let Some(result) = row["result"].as_object_mut() {
                result.insert("vote_strength".into(), json!(selection.vote_strength));
                result.insert("low_agreement".into(), json!(selection.low_agreement));
                result.insert(
                    "needs_manual_review".into(),
                    json!(selection.needs_manual_review),
                );
            }
            row["runtime"] = runtime_json(provenance, timing.clone());
            self.writers
                .trajectories
                .append(&row)
                .map_err(io_err(&self.dir))?;
        }
        Ok(())
    }

    /// A ticket without a verdict: its `failure_malformed` row (engine error or no valid
    /// candidate), counted as a hard failure.
    fn write_hard_failure(
        &mut self,
        at: &TicketAt<'_>,
        job_error: Option<&JobFailure>,
    ) -> Result<(), RunError> {
        self.hard_failures += 1;
        let ticket = at.ticket;
        let row = json!({
            "schema_version": SCHEMA_VERSION,
            "ticket_key": ticket.key(), "group_id": ticket.group_id, "mission": ticket.mission,
            "gt_label": ticket.label, "epoch": at.epoch, "global_step": self.global_step,
            "epoch_step": at.epoch_step, "guidance_step": at.guidance_step,
            "guidance_hash": self.guidance.head_hash(),
            "reason": if job_error.is_some() { "engine_error" } else { "no_valid_candidates" },
            "candidate_index": null, "decode_index": null, "violation": null, "raw_text": null,
            "error": job_error.map(|f| json!({"code": f.code, "message": f.message})),
        });
        self.writers
            .failures
            .append(&row)
            .map_err(io_err(&self.dir))
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

/// One candidate's answer as the worker sent it.
struct CandidateAnswer {
    text: String,
    completion_tokens: u32,
    finish_reason: String,
}

/// A rollout job's result, unpacked: candidates by (decode, sample), timing, or the job error.
struct RolloutAnswer {
    texts: BTreeMap<(u32, u32), CandidateAnswer>,
    timing: serde_json::Value,
    job_error: Option<JobFailure>,
}

impl RolloutAnswer {
    fn from_result(result: Result<JobOutput, JobFailure>) -> Self {
        let mut answer = RolloutAnswer {
            texts: BTreeMap::new(),
            timing: json!({}),
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
                answer.timing = json!({"prompt_tokens": prompt_tokens, "prefix_tokens": prefix_tokens,
                                       "prefill_us": prefill_us, "decode_us": decode_us});
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
    rows: Vec<serde_json::Value>,
}

/// The `result` object of a selections row: the original's fields plus stageb's audit fields.
fn selection_result_json(
    selection: &Selection,
    guidance_step: u64,
    reflection_change: Option<String>,
    reflection_cycle: u64,
    ineligible_reason: Option<String>,
) -> serde_json::Value {
    let mut v = serde_json::to_value(selection).unwrap_or_else(|_| json!({}));
    if let Some(obj) = v.as_object_mut() {
        obj.insert("guidance_step".into(), json!(guidance_step));
        obj.insert("reflection_change".into(), json!(reflection_change));
        obj.insert("reflection_cycle".into(), json!(reflection_cycle));
        obj.insert("eligible".into(), json!(ineligible_reason.is_none()));
        obj.insert("ineligible_reason".into(), json!(ineligible_reason));
    }
    v
}
