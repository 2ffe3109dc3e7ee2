//! The key schema of each config section and pass 1 of validation: every key is known,
//! accepted-but-ignored (a notice) or unknown (an error with a "did you mean" suggestion).

use super::location::{Doc, Seg, dotted, dotted_with, key_text};
use super::types::ConfigNotice;
use crate::error::{ErrorCode, InputError};
use serde_norway::{Mapping, Value};

/// The keys one mapping may have. `prefix` is the dotted path of the section as shown in
/// suggestions (`sampler.grid[]` for grid entries).
pub(super) struct SectionSchema {
    prefix: &'static str,
    /// Keys stageb reads.
    known: &'static [&'static str],
    /// Keys accepted and reported as notices, with why they are ignored.
    ignored: &'static [(&'static str, &'static str)],
}

const NO_DOMAIN_PACKS: &str =
    "stageb has no domain packs; the rollout prompt carries no domain block";
const LEGACY_UNUSED: &str = "a legacy key that the Python original did not use either";
const NO_HYPOTHESIS_POOL: &str = "stageb has no hypothesis pool (reflection closure is L == E)";
const MODEL_PLACEMENT: &str = "the candle engine takes dtype, device and attention kernels from the model file and the worker's device";

pub(super) const TOP_SCHEMA: SectionSchema = SectionSchema {
    prefix: "",
    known: &[
        "seed",
        "stage_a_paths",
        "model",
        "guidance",
        "output",
        "sampler",
        "reflection",
        "selection",
        "manual_review",
        "runner",
        "guidance_lifecycle",
    ],
    ignored: &[
        ("default_domain", NO_DOMAIN_PACKS),
        ("domain_map", NO_DOMAIN_PACKS),
        (
            "stage_b_distillation",
            "distill_chatml.jsonl export is not implemented",
        ),
    ],
};

const MODEL_SCHEMA: SectionSchema = SectionSchema {
    prefix: "model",
    known: &["model_name_or_path", "max_model_len", "weights_sha256"],
    ignored: &[
        ("torch_dtype", MODEL_PLACEMENT),
        ("device_map", MODEL_PLACEMENT),
        ("attn_implementation", MODEL_PLACEMENT),
        ("attn_impl", MODEL_PLACEMENT),
    ],
};

const GUIDANCE_SCHEMA: SectionSchema = SectionSchema {
    prefix: "guidance",
    known: &["path", "retention", "reset_on_rerun"],
    ignored: &[],
};

const OUTPUT_SCHEMA: SectionSchema = SectionSchema {
    prefix: "output",
    known: &["root", "run_name"],
    ignored: &[(
        "group_report",
        "group_report.jsonl is not written; selections.jsonl has the per-ticket rows",
    )],
};

const SAMPLER_SCHEMA: SectionSchema = SectionSchema {
    prefix: "sampler",
    known: &["grid", "samples_per_decode", "constrained"],
    ignored: &[],
};

const GRID_ENTRY_SCHEMA: SectionSchema = SectionSchema {
    prefix: "sampler.grid[]",
    known: &[
        "temperature",
        "top_p",
        "max_new_tokens",
        "repetition_penalty",
    ],
    ignored: &[
        ("no_repeat_ngram_size", "the sampler has no n-gram blocking"),
        (
            "seed",
            "stageb derives a seed per candidate from (seed, epoch, ticket, decode index, sample index)",
        ),
        (
            "stop",
            "the two-line contract ends every candidate; no stop strings are applied",
        ),
    ],
};

const REFLECTION_SCHEMA: SectionSchema = SectionSchema {
    prefix: "reflection",
    known: &[
        "decision_prompt_path",
        "ops_prompt_path",
        "batch_size",
        "max_operations",
        "change_cap_per_epoch",
        "temperature",
        "top_p",
        "repetition_penalty",
        "max_new_tokens",
        "max_reflection_length",
        "token_budget",
        "retry_budget_per_group_per_epoch",
        "max_calls_per_epoch",
        "gate",
    ],
    ignored: &[
        ("allow_uncertain", LEGACY_UNUSED),
        ("eligibility_policy", LEGACY_UNUSED),
        ("all_wrong_strategy", LEGACY_UNUSED),
        ("hypothesis_min_support_cycles", NO_HYPOTHESIS_POOL),
        ("hypothesis_min_unique_ticket_keys", NO_HYPOTHESIS_POOL),
    ],
};

const GATE_SCHEMA: SectionSchema = SectionSchema {
    prefix: "reflection.gate",
    known: &[
        "enabled",
        "gate_fraction",
        "final_fraction",
        "remember_rejected",
        "check_edits",
        "tolerance",
        "min_p_better",
        "ablation_every",
    ],
    ignored: &[],
};

const SELECTION_SCHEMA: SectionSchema = SectionSchema {
    prefix: "selection",
    known: &["policy", "tie_break"],
    ignored: &[],
};

const MANUAL_REVIEW_SCHEMA: SectionSchema = SectionSchema {
    prefix: "manual_review",
    known: &["min_verdict_agreement"],
    ignored: &[],
};

const RUNNER_SCHEMA: SectionSchema = SectionSchema {
    prefix: "runner",
    known: &[
        "epochs",
        "per_rank_rollout_batch_size",
        "logging_steps",
        "lease_ttl_s",
        "heartbeat_interval_s",
        "speculation_multiple",
        "speculation_min_ms",
        "no_progress_multiple",
        "no_progress_floor_ms",
        "pipeline_steps",
        "pipeline_cycles",
    ],
    ignored: &[],
};

const LIFECYCLE_SCHEMA: SectionSchema = SectionSchema {
    prefix: "guidance_lifecycle",
    known: &[
        "confidence_drop_threshold",
        "min_miss_before_drop",
        "enable_auto_cleanup",
    ],
    ignored: &[],
};

/// The section is ignored as a whole (one notice at the top level), but a misspelled key in
/// it is still a misspelling.
const DISTILLATION_SCHEMA: SectionSchema = SectionSchema {
    prefix: "stage_b_distillation",
    known: &["enabled", "log_chatml_path"],
    ignored: &[],
};

const ALL_SCHEMAS: [&SectionSchema; 13] = [
    &TOP_SCHEMA,
    &MODEL_SCHEMA,
    &GUIDANCE_SCHEMA,
    &OUTPUT_SCHEMA,
    &SAMPLER_SCHEMA,
    &GRID_ENTRY_SCHEMA,
    &REFLECTION_SCHEMA,
    &GATE_SCHEMA,
    &SELECTION_SCHEMA,
    &MANUAL_REVIEW_SCHEMA,
    &RUNNER_SCHEMA,
    &LIFECYCLE_SCHEMA,
    &DISTILLATION_SCHEMA,
];

/// The schema of a mapping-valued top-level key.
fn section_schema(top_key: &str) -> Option<&'static SectionSchema> {
    Some(match top_key {
        "model" => &MODEL_SCHEMA,
        "guidance" => &GUIDANCE_SCHEMA,
        "output" => &OUTPUT_SCHEMA,
        "sampler" => &SAMPLER_SCHEMA,
        "reflection" => &REFLECTION_SCHEMA,
        "selection" => &SELECTION_SCHEMA,
        "manual_review" => &MANUAL_REVIEW_SCHEMA,
        "runner" => &RUNNER_SCHEMA,
        "guidance_lifecycle" => &LIFECYCLE_SCHEMA,
        "stage_b_distillation" => &DISTILLATION_SCHEMA,
        _ => return None,
    })
}

/// The closest known key to `unknown`, as a full dotted path. Keys of the same section win;
/// a key of another section is suggested only when its name is (nearly) the same, which
/// catches keys put in the wrong section (`logging_steps` at the top level).
fn suggest(unknown: &str, here: &[Seg], schema: &SectionSchema) -> Option<String> {
    const SAME_SECTION_MIN: f64 = 0.6;
    const OTHER_SECTION_MIN: f64 = 0.85;
    let similarity = |candidate: &str| {
        let edit = strsim::normalized_damerau_levenshtein(unknown, candidate);
        // A key that is a part of the real one (`rollout_batch_size` in
        // `per_rank_rollout_batch_size`) is a likely intent whatever the edit distance says.
        let (short, long) = if unknown.len() <= candidate.len() {
            (unknown, candidate)
        } else {
            (candidate, unknown)
        };
        if short.len() >= 4 && long.contains(short) {
            edit.max(0.75)
        } else {
            edit
        }
    };
    let mut best: Option<(f64, String)> = None;
    let mut consider = |score: f64, path: String| {
        if best
            .as_ref()
            .is_none_or(|(best_score, _)| score > *best_score)
        {
            best = Some((score, path));
        }
    };
    for candidate in schema
        .known
        .iter()
        .chain(schema.ignored.iter().map(|(key, _)| key))
    {
        let score = similarity(candidate);
        if score >= SAME_SECTION_MIN {
            consider(score + 0.1, dotted_with(here, candidate));
        }
    }
    for other in ALL_SCHEMAS
        .iter()
        .filter(|other| other.prefix != schema.prefix)
    {
        for candidate in other
            .known
            .iter()
            .chain(other.ignored.iter().map(|(key, _)| key))
        {
            let score = similarity(candidate);
            if score >= OTHER_SECTION_MIN {
                let path = if other.prefix.is_empty() {
                    candidate.to_string()
                } else {
                    format!("{}.{candidate}", other.prefix)
                };
                consider(score, path);
            }
        }
    }
    best.map(|(_, path)| path)
}

impl Doc<'_> {
    /// Pass 1: every key of `map` (a mapping at `path` described by `schema`) is known or
    /// ignored; recurses into sub-sections and grid entries. Ignored keys become notices.
    pub(super) fn check_keys(
        &mut self,
        map: &Mapping,
        path: &[Seg],
        schema: &SectionSchema,
    ) -> Result<(), InputError> {
        for (key, value) in map {
            let name = key_text(key);
            let mut key_path = path.to_vec();
            key_path.push(Seg::Key(name.clone()));
            let is_string_key = matches!(key, Value::String(_));
            if is_string_key && schema.known.contains(&name.as_str()) {
                self.check_nested_keys(&name, value, &key_path, schema)?;
            } else if let Some((_, why)) = schema
                .ignored
                .iter()
                .find(|(ignored, _)| is_string_key && *ignored == name)
            {
                self.notices.push(ConfigNotice {
                    code: ErrorCode::UnsupportedConfigKey,
                    file: self.file.to_string(),
                    key: dotted(&key_path),
                    line: self.line_of(&key_path),
                    message: format!("accepted but ignored: {why}"),
                });
                // Ignored sections are still spell-checked.
                self.check_nested_keys(&name, value, &key_path, schema)?;
            } else {
                let message = match suggest(&name, path, schema) {
                    Some(suggestion) => {
                        format!(
                            "unknown key `{}`; did you mean `{suggestion}`?",
                            dotted(&key_path)
                        )
                    }
                    None => format!(
                        "unknown key `{}`; the keys allowed here are: {}",
                        dotted(&key_path),
                        schema.known.join(", ")
                    ),
                };
                return Err(self.error(ErrorCode::UnknownConfigKey, &key_path, message));
            }
        }
        Ok(())
    }

    /// Descends into the value of `name` when it is a section or the grid. Values of the
    /// wrong shape are left to pass 2, which reports them with their type.
    fn check_nested_keys(
        &mut self,
        name: &str,
        value: &Value,
        key_path: &[Seg],
        schema: &SectionSchema,
    ) -> Result<(), InputError> {
        let nested_schema = if schema.prefix.is_empty() {
            section_schema(name)
        } else if schema.prefix == "sampler" && name == "grid" {
            if let Value::Sequence(entries) = value {
                for (index, entry) in entries.iter().enumerate() {
                    if let Value::Mapping(entry_map) = entry {
                        let mut entry_path = key_path.to_vec();
                        entry_path.push(Seg::Index(index));
                        self.check_keys(entry_map, &entry_path, &GRID_ENTRY_SCHEMA)?;
                    }
                }
            }
            None
        } else if schema.prefix == "reflection" && name == "gate" {
            Some(&GATE_SCHEMA)
        } else {
            None
        };
        if let (Some(nested_schema), Value::Mapping(nested)) = (nested_schema, value) {
            self.check_keys(nested, key_path, nested_schema)?;
        }
        Ok(())
    }
}
