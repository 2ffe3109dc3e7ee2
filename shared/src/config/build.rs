//! Pass 2 of validation: the checked YAML mapping into a typed [`RunConfig`], section by
//! section, with required keys, defaults, ranges and the cross-key rules.

use super::location::{Doc, Seg, dotted};
use super::section::{FloatRule, Section, describe};
use super::types::{
    GateConfig, GridEntry, GuidanceConfig, LifecycleConfig, MIN_CONSTRAINED_NEW_TOKENS,
    MIN_MODEL_LEN, ManualReviewConfig, ModelConfig, OutputConfig, ReflectionConfig, RunConfig,
    RunnerConfig, SamplerConfig, SelectionConfig, SelectionPolicy, TieBreak, WrittenTuning,
    default_no_progress_floor_ms, default_no_progress_multiple, default_pipeline_cycles,
    default_pipeline_steps, default_speculation_min_ms, default_speculation_multiple,
};
use crate::error::{ErrorCode, InputError};
use serde_norway::Value;
use std::path::PathBuf;

/// The most steps `runner.pipeline_steps` may queue ahead: each holds a step's rollout answers at
/// rank 0 until its turn.
pub const MAX_PIPELINE_STEPS: u32 = 16;
/// The most reflection cycles `runner.pipeline_cycles` may queue calls for ahead.
pub const MAX_PIPELINE_CYCLES: u32 = 16;

/// f64 → f32 for decode parameters; the values are range-checked small numbers.
fn to_f32(value: f64) -> f32 {
    value as f32
}

/// Pass 2: typed values, required keys, ranges.
pub(super) fn build_run_config(doc: &Doc, top: &Section) -> Result<RunConfig, InputError> {
    let seed = {
        let value = top.required(doc, "seed")?;
        top.int_value(doc, "seed", value, 0, u64::MAX)?
    };
    let stage_a_paths = build_stage_a_paths(doc, top)?;

    let model_section = top.req_section(doc, "model")?;
    let model = ModelConfig {
        model_name_or_path: model_section.req_string(doc, "model_name_or_path")?,
        max_model_len: model_section.nullable_u32(doc, "max_model_len", MIN_MODEL_LEN)?,
        weights_sha256: build_weights_sha256(doc, &model_section)?,
    };

    let guidance_section = top.req_section(doc, "guidance")?;
    let guidance = GuidanceConfig {
        path: PathBuf::from(guidance_section.req_string(doc, "path")?),
        retention: guidance_section.req_u32(doc, "retention", 1)?,
        reset_on_rerun: guidance_section.opt_bool(doc, "reset_on_rerun", true)?,
    };

    let output_section = top.req_section(doc, "output")?;
    let output = OutputConfig {
        root: PathBuf::from(output_section.req_string(doc, "root")?),
        run_name: build_run_name(doc, &output_section)?,
    };

    let sampler = build_sampler(doc, &top.req_section(doc, "sampler")?)?;
    let reflection = build_reflection(doc, &top.req_section(doc, "reflection")?)?;
    let selection = build_selection(doc, &top.req_section(doc, "selection")?)?;

    let manual_review = match top.section(doc, "manual_review")? {
        Some(section) => ManualReviewConfig {
            min_verdict_agreement: section.opt_float(
                doc,
                "min_verdict_agreement",
                0.8,
                FloatRule::UnitClosed,
            )?,
        },
        None => ManualReviewConfig {
            min_verdict_agreement: 0.8,
        },
    };

    let runner = build_runner(doc, &top.req_section(doc, "runner")?)?;

    let guidance_lifecycle = match top.section(doc, "guidance_lifecycle")? {
        Some(section) => Some(LifecycleConfig {
            confidence_drop_threshold: section.opt_float(
                doc,
                "confidence_drop_threshold",
                0.35,
                FloatRule::UnitClosed,
            )?,
            min_miss_before_drop: section.opt_u32(doc, "min_miss_before_drop", 3, 0)?,
            enable_auto_cleanup: section.opt_bool(doc, "enable_auto_cleanup", true)?,
        }),
        None => None,
    };

    // The ignored distillation section must at least be a mapping (or null) to be a config
    // of the original at all.
    top.section(doc, "stage_b_distillation")?;

    Ok(RunConfig {
        seed,
        stage_a_paths,
        model,
        guidance,
        output,
        sampler,
        reflection,
        selection,
        manual_review,
        runner,
        guidance_lifecycle,
    })
}

fn build_stage_a_paths(doc: &Doc, top: &Section) -> Result<Vec<PathBuf>, InputError> {
    const KEY: &str = "stage_a_paths";
    match top.required(doc, KEY)? {
        Value::String(_) => Ok(vec![PathBuf::from(top.req_string(doc, KEY)?)]),
        Value::Sequence(items) if items.is_empty() => Err(top.invalid(
            doc,
            KEY,
            "must list at least one Stage-A JSONL file".to_string(),
        )),
        Value::Sequence(items) => items
            .iter()
            .enumerate()
            .map(|(index, item)| match item {
                Value::String(text) if !text.trim().is_empty() => Ok(PathBuf::from(text)),
                other => {
                    let mut item_path = top.key_path(KEY);
                    item_path.push(Seg::Index(index));
                    Err(doc.error(
                        ErrorCode::InvalidConfigValue,
                        &item_path,
                        format!(
                            "`{}` must be a non-empty path string, got {}",
                            dotted(&item_path),
                            describe(other)
                        ),
                    ))
                }
            })
            .collect(),
        other => Err(top.invalid(
            doc,
            KEY,
            format!("must be a path or a list of paths, got {}", describe(other)),
        )),
    }
}

/// `run_name` names a directory under `output.root`: one plain component, so a run can never
/// write outside its root.
fn build_run_name(doc: &Doc, output: &Section) -> Result<String, InputError> {
    let run_name = output.req_string(doc, "run_name")?;
    let plain = run_name != "." && run_name != ".." && !run_name.contains(['/', '\\', '\0']);
    if plain {
        Ok(run_name)
    } else {
        Err(output.invalid(
            doc,
            "run_name",
            format!(
                "must be a single directory name (no `/`, `\\`, `.` or `..`), got {run_name:?}"
            ),
        ))
    }
}

fn build_sampler(doc: &Doc, sampler: &Section) -> Result<SamplerConfig, InputError> {
    let grid = match sampler.required(doc, "grid")? {
        Value::Sequence(entries) if entries.is_empty() => {
            return Err(sampler.invalid(doc, "grid", "must have at least one entry".to_string()));
        }
        Value::Sequence(entries) => {
            // Constrained rollouts need room for the forced `Verdict: …\nReason: ` prefix, one
            // reason character and the end token (the engine refuses less at run time; say it
            // here, with the line).
            let constrained = sampler.opt_bool(doc, "constrained", true)?;
            let min_new_tokens = if constrained {
                MIN_CONSTRAINED_NEW_TOKENS
            } else {
                1
            };
            let mut grid = Vec::with_capacity(entries.len());
            for (index, entry) in entries.iter().enumerate() {
                let mut entry_path = sampler.key_path("grid");
                entry_path.push(Seg::Index(index));
                let Value::Mapping(map) = entry else {
                    return Err(doc.error(
                        ErrorCode::InvalidConfigValue,
                        &entry_path,
                        format!(
                            "`{}` must be a mapping (temperature, top_p, max_new_tokens, ...), got {}",
                            dotted(&entry_path),
                            describe(entry)
                        ),
                    ));
                };
                let entry = Section {
                    path: entry_path,
                    map,
                };
                grid.push(GridEntry {
                    temperature: to_f32(entry.req_float(
                        doc,
                        "temperature",
                        FloatRule::NonNegative,
                    )?),
                    top_p: to_f32(entry.req_float(doc, "top_p", FloatRule::UnitOpenBelow)?),
                    max_new_tokens: entry.req_u32(doc, "max_new_tokens", min_new_tokens)?,
                    repetition_penalty: to_f32(entry.opt_float(
                        doc,
                        "repetition_penalty",
                        1.0,
                        FloatRule::Positive,
                    )?),
                });
            }
            grid
        }
        other => {
            return Err(sampler.invalid(
                doc,
                "grid",
                format!("must be a list of decode entries, got {}", describe(other)),
            ));
        }
    };
    let samples_per_decode = sampler.req_u32(doc, "samples_per_decode", 1)?;
    let cap = crate::wire::MAX_CANDIDATES_PER_JOB;
    let total = (grid.len() as u64).saturating_mul(u64::from(samples_per_decode));
    if total > cap as u64 {
        return Err(sampler.invalid(
            doc,
            "samples_per_decode",
            format!(
                "times {} grid entries is {total} candidates per ticket; at most {cap}",
                grid.len()
            ),
        ));
    }
    Ok(SamplerConfig {
        grid,
        samples_per_decode,
        constrained: sampler.opt_bool(doc, "constrained", true)?,
    })
}

fn build_reflection(doc: &Doc, reflection: &Section) -> Result<ReflectionConfig, InputError> {
    let max_reflection_length = reflection.opt_u32(doc, "max_reflection_length", 4096, 1)?;
    Ok(ReflectionConfig {
        decision_prompt_path: reflection.nullable_path(doc, "decision_prompt_path")?,
        ops_prompt_path: reflection.nullable_path(doc, "ops_prompt_path")?,
        batch_size: reflection.req_u32(doc, "batch_size", 1)?,
        max_operations: reflection.nullable_u32(doc, "max_operations", 1)?,
        change_cap_per_epoch: reflection.nullable_u32(doc, "change_cap_per_epoch", 1)?,
        temperature: to_f32(reflection.opt_float(
            doc,
            "temperature",
            1.0,
            FloatRule::NonNegative,
        )?),
        top_p: to_f32(reflection.opt_float(doc, "top_p", 0.95, FloatRule::UnitOpenBelow)?),
        repetition_penalty: to_f32(reflection.opt_float(
            doc,
            "repetition_penalty",
            1.0,
            FloatRule::Positive,
        )?),
        max_new_tokens: reflection.opt_u32(doc, "max_new_tokens", 1024, 1)?,
        max_reflection_length,
        token_budget: reflection.opt_u32(doc, "token_budget", max_reflection_length, 1)?,
        retry_budget_per_group_per_epoch: reflection.opt_u32(
            doc,
            "retry_budget_per_group_per_epoch",
            2,
            0,
        )?,
        max_calls_per_epoch: reflection.nullable_u32(doc, "max_calls_per_epoch", 1)?,
        gate: build_gate(doc, reflection)?,
    })
}

/// `reflection.gate`: absent or `enabled: false` is off; the two fractions leave some train.
fn build_gate(doc: &Doc, reflection: &Section) -> Result<GateConfig, InputError> {
    let Some(gate) = reflection.section(doc, "gate")? else {
        return Ok(GateConfig::default());
    };
    let config = GateConfig {
        enabled: gate.opt_bool(doc, "enabled", false)?,
        gate_fraction: gate.opt_float(doc, "gate_fraction", 0.2, FloatRule::UnitClosed)?,
        final_fraction: gate.opt_float(doc, "final_fraction", 0.2, FloatRule::UnitClosed)?,
        remember_rejected: gate.opt_u32(doc, "remember_rejected", 16, 0)?,
        check_edits: gate.opt_bool(doc, "check_edits", true)?,
        tolerance: gate.opt_float(doc, "tolerance", 0.0, FloatRule::UnitClosed)?,
        min_p_better: gate.opt_float(doc, "min_p_better", 0.8, FloatRule::UnitClosed)?,
        ablation_every: gate.opt_u32(doc, "ablation_every", 0, 0)?,
    };
    if config.gate_fraction + config.final_fraction >= 1.0 {
        let key = if gate.get("final_fraction").is_some() {
            "final_fraction"
        } else {
            "gate_fraction"
        };
        return Err(gate.invalid(
            doc,
            key,
            format!(
                "gate_fraction + final_fraction must stay below 1 (some groups must be left to learn from), got {} + {}",
                config.gate_fraction, config.final_fraction
            ),
        ));
    }
    Ok(config)
}

fn build_selection(doc: &Doc, selection: &Section) -> Result<SelectionConfig, InputError> {
    let policy = match selection.req_string(doc, "policy")?.as_str() {
        "top_label" => SelectionPolicy::TopLabel,
        "top_semantic" => {
            return Err(selection.invalid(
                doc,
                "policy",
                "value `top_semantic` is not implemented by stageb; use `top_label` (majority vote, ties to fail)".to_string(),
            ));
        }
        other => {
            return Err(selection.invalid(
                doc,
                "policy",
                format!("must be `top_label`, got {other:?}"),
            ));
        }
    };
    let tie_break = match selection.req_string(doc, "tie_break")?.as_str() {
        "temperature" => TieBreak::Temperature,
        other => {
            return Err(selection.invalid(
                doc,
                "tie_break",
                format!("must be `temperature`, got {other:?}"),
            ));
        }
    };
    Ok(SelectionConfig { policy, tie_break })
}

fn build_runner(doc: &Doc, runner: &Section) -> Result<RunnerConfig, InputError> {
    let config = RunnerConfig {
        epochs: runner.req_u32(doc, "epochs", 1)?,
        per_rank_rollout_batch_size: runner.opt_u32(doc, "per_rank_rollout_batch_size", 1, 1)?,
        logging_steps: runner.opt_u32(doc, "logging_steps", 256, 1)?,
        lease_ttl_s: runner.opt_u64(doc, "lease_ttl_s", 60, 1)?,
        heartbeat_interval_s: runner.opt_u64(doc, "heartbeat_interval_s", 5, 1)?,
        speculation_multiple: runner.opt_u32(
            doc,
            "speculation_multiple",
            default_speculation_multiple(),
            0,
        )?,
        speculation_min_ms: runner.opt_u64(
            doc,
            "speculation_min_ms",
            default_speculation_min_ms(),
            0,
        )?,
        no_progress_multiple: runner.opt_u32(
            doc,
            "no_progress_multiple",
            default_no_progress_multiple(),
            0,
        )?,
        no_progress_floor_ms: runner.opt_u64(
            doc,
            "no_progress_floor_ms",
            default_no_progress_floor_ms(),
            0,
        )?,
        pipeline_steps: runner.opt_u32(doc, "pipeline_steps", default_pipeline_steps(), 0)?,
        pipeline_cycles: runner.opt_u32(doc, "pipeline_cycles", default_pipeline_cycles(), 0)?,
        written: WrittenTuning {
            pipeline_steps: runner.get("pipeline_steps").is_some(),
            pipeline_cycles: runner.get("pipeline_cycles").is_some(),
        },
    };
    if config.pipeline_steps > MAX_PIPELINE_STEPS {
        return Err(runner.invalid(
            doc,
            "pipeline_steps",
            format!(
                "must be 0..={MAX_PIPELINE_STEPS} (steps queued ahead while reflection runs), got {}",
                config.pipeline_steps
            ),
        ));
    }
    if config.pipeline_cycles > MAX_PIPELINE_CYCLES {
        return Err(runner.invalid(
            doc,
            "pipeline_cycles",
            format!(
                "must be 0..={MAX_PIPELINE_CYCLES} (reflection cycles whose calls are queued \
                 ahead), got {}",
                config.pipeline_cycles
            ),
        ));
    }
    if config.heartbeat_interval_s >= config.lease_ttl_s {
        // Point at whichever of the two the user wrote (the heartbeat if both).
        let key = if runner.get("heartbeat_interval_s").is_some() {
            "heartbeat_interval_s"
        } else {
            "lease_ttl_s"
        };
        return Err(runner.invalid(
            doc,
            key,
            format!(
                "must keep runner.heartbeat_interval_s ({}) below runner.lease_ttl_s ({}), or leases expire between heartbeats",
                config.heartbeat_interval_s, config.lease_ttl_s
            ),
        ));
    }
    Ok(config)
}

/// `model.weights_sha256`: absent or `null`, else 64 hex digits (kept lowercase, as a worker's
/// fingerprint writes them).
fn build_weights_sha256(doc: &Doc, model: &Section) -> Result<Option<String>, InputError> {
    let Some(value) = model.get("weights_sha256").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let text = model.string_value(doc, "weights_sha256", value)?;
    parse_weights_sha256(&text)
        .map(Some)
        .map_err(|why| model.invalid(doc, "weights_sha256", why))
}

/// A weights digest as a user writes it (`--model-digest`, `model.weights_sha256`): 64 hex
/// digits, returned lowercase; the error says what was wrong.
pub fn parse_weights_sha256(text: &str) -> Result<String, String> {
    let digest = text.trim();
    if digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(digest.to_ascii_lowercase())
    } else {
        Err(format!(
            "must be the model weights' sha256, 64 hex digits (a worker logs it as \
             weights_sha256=… when its model is loaded), got {digest:?}"
        ))
    }
}
