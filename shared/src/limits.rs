//! The run's token limits: what a config asks for, what the model can hold, what is used.
//!
//! A config from the Python original asks for lengths its 32k-context model could hold
//! (`reflection.max_new_tokens: 12000`, `max_reflection_length`/`token_budget: 24000`,
//! `sampler.grid[].max_new_tokens: 1024`). On a model with a smaller context the same values
//! would make every call fail on the worker (`PROMPT_TOO_LONG`), silently turning reflection
//! off. So rank 0 plans every call with the run's context `C` (the model's own, or
//! `model.max_model_len`) and fits the asked values into it, by one deterministic rule:
//!
//! - a rollout generates at most `C / 2` tokens (the rest holds the ticket's prompt);
//! - a reflection call generates `min(asked, max(C / 2, C − asked prompt))` tokens, and its
//!   prompt (`min(token_budget, max_reflection_length)`, what case packing budgets) gets at
//!   most what is left: `prompt + max_new_tokens ≤ C` always holds.
//!
//! Values that fit are used as asked. Every lowered value is an [`LimitAdjustment`] (key,
//! asked, used, why), said once at start and recorded in `manifest.json` with the limits used;
//! the config itself is recorded as written. The rule depends on the config and `C` only, never
//! on which or how many workers run, so the artifacts stay deterministic.

use crate::config::RunConfig;
use serde::{Deserialize, Serialize};

/// Where the run's context length came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextSource {
    /// The model file's own declaration (GGUF `*.context_length`, `max_position_embeddings`).
    Model,
    /// `model.max_model_len` in the config.
    Config,
    /// Rank 0 could not read the model: the first worker to register stated it.
    FirstWorker,
}

/// The run's context: tokens of prompt plus generated text any one call may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunContext {
    pub tokens: u32,
    pub source: ContextSource,
}

/// One config value lowered to fit the context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitAdjustment {
    /// The config key, e.g. `reflection.max_new_tokens` or `sampler.grid[2].max_new_tokens`.
    pub key: String,
    pub asked: u32,
    pub used: u32,
    pub why: String,
}

/// The token limits a run plans with (recorded in `manifest.json` as `effective_limits`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EffectiveLimits {
    pub context: u32,
    pub context_source: ContextSource,
    /// Per `sampler.grid[]` entry, in grid order.
    pub rollout_max_new_tokens: Vec<u32>,
    pub reflection_max_new_tokens: u32,
    /// The reflection prompt's length cap (`max_reflection_length`, fitted).
    pub reflection_max_prompt_tokens: u32,
    /// The case-packing budget (`token_budget`, fitted).
    pub reflection_token_budget: u32,
    /// Every value used below what the config asked, in key order of the config.
    pub adjusted: Vec<LimitAdjustment>,
}

impl EffectiveLimits {
    /// Fit `config`'s lengths into `context` (see the module header for the rule).
    pub fn fit(config: &RunConfig, context: RunContext) -> EffectiveLimits {
        let c = context.tokens;
        let half = c / 2;
        let mut adjusted = Vec::new();
        let mut fit_key = |key: String, asked: u32, used: u32, why: String| {
            if used < asked {
                adjusted.push(LimitAdjustment {
                    key,
                    asked,
                    used,
                    why,
                });
            }
            used
        };
        let rollout_max_new_tokens = config
            .sampler
            .grid
            .iter()
            .enumerate()
            .map(|(i, g)| {
                fit_key(
                    format!("sampler.grid[{i}].max_new_tokens"),
                    g.max_new_tokens,
                    g.max_new_tokens.min(half),
                    format!("a rollout may generate at most half of the {c}-token context; the rest holds the ticket's prompt"),
                )
            })
            .collect();
        let r = &config.reflection;
        let asked_prompt = r.token_budget.min(r.max_reflection_length);
        let new = r
            .max_new_tokens
            .min(half.max(c.saturating_sub(asked_prompt)));
        let reflection_max_new_tokens = fit_key(
            "reflection.max_new_tokens".into(),
            r.max_new_tokens,
            new,
            format!(
                "prompt and output of a reflection call share the {c}-token context; the output gets at most half unless the prompt needs less"
            ),
        );
        let room = c - reflection_max_new_tokens;
        let why_prompt = format!(
            "a reflection prompt may use what the {reflection_max_new_tokens} output tokens leave of the {c}-token context"
        );
        let reflection_max_prompt_tokens = fit_key(
            "reflection.max_reflection_length".into(),
            r.max_reflection_length,
            r.max_reflection_length.min(room),
            why_prompt.clone(),
        );
        let reflection_token_budget = fit_key(
            "reflection.token_budget".into(),
            r.token_budget,
            r.token_budget.min(room),
            why_prompt,
        );
        EffectiveLimits {
            context: c,
            context_source: context.source,
            rollout_max_new_tokens,
            reflection_max_new_tokens,
            reflection_max_prompt_tokens,
            reflection_token_budget,
            adjusted,
        }
    }

    /// The config the run executes: `config` with the fitted lengths in place. (The manifest
    /// keeps the config as written beside these limits.)
    pub fn apply(&self, config: &RunConfig) -> RunConfig {
        let mut out = config.clone();
        for (g, used) in out
            .sampler
            .grid
            .iter_mut()
            .zip(&self.rollout_max_new_tokens)
        {
            g.max_new_tokens = *used;
        }
        out.reflection.max_new_tokens = self.reflection_max_new_tokens;
        out.reflection.max_reflection_length = self.reflection_max_prompt_tokens;
        out.reflection.token_budget = self.reflection_token_budget;
        out
    }

    /// The packing budget of a reflection prompt: `prompt + max_new_tokens ≤ context`.
    pub fn reflection_prompt_budget(&self) -> u32 {
        self.reflection_token_budget
            .min(self.reflection_max_prompt_tokens)
    }
}

/// Why a run's context cannot be decided (the caller names the config file and line).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContextError {
    #[error(
        "model.max_model_len asks for {asked} tokens, but the model declares a context of {declared}"
    )]
    AboveModel { asked: u32, declared: u32 },
    #[error("the model does not declare its context length; set model.max_model_len")]
    Undeclared,
}

/// The run's context from `model.max_model_len` and what the model file declares:
/// `Ok(None)` when rank 0 cannot read the model and the config names no length (the first
/// worker to register then states it).
pub fn decide_context(
    max_model_len: Option<u32>,
    declared: Option<Result<Option<u32>, String>>,
) -> Result<Option<RunContext>, ContextError> {
    let by_config = |tokens| RunContext {
        tokens,
        source: ContextSource::Config,
    };
    match (max_model_len, declared) {
        (Some(asked), Some(Ok(Some(declared)))) if asked > declared => {
            Err(ContextError::AboveModel { asked, declared })
        }
        (Some(asked), _) => Ok(Some(by_config(asked))),
        (None, Some(Ok(Some(tokens)))) => Ok(Some(RunContext {
            tokens,
            source: ContextSource::Model,
        })),
        (None, Some(Ok(None))) => Err(ContextError::Undeclared),
        (None, None | Some(Err(_))) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_config;

    fn config(reflection: &str, grid_new: u32) -> RunConfig {
        let yaml = format!(
            "seed: 1\nstage_a_paths: [a.jsonl]\nmodel: {{model_name_or_path: m.gguf}}\n\
             guidance: {{path: g.json, retention: 1}}\noutput: {{root: out, run_name: r}}\n\
             sampler: {{samples_per_decode: 1, grid: [{{temperature: 0.1, top_p: 0.9, max_new_tokens: {grid_new}}}]}}\n\
             reflection: {{batch_size: 4, {reflection}}}\n\
             selection: {{policy: top_label, tie_break: temperature}}\nrunner: {{epochs: 1}}\n"
        );
        parse_config(&yaml, "c.yaml").unwrap().config
    }

    fn ctx(tokens: u32) -> RunContext {
        RunContext {
            tokens,
            source: ContextSource::Model,
        }
    }

    #[test]
    fn the_originals_production_values_fit_an_8k_model_by_halving() {
        let cfg = config(
            "max_new_tokens: 12000, max_reflection_length: 24000, token_budget: 24000",
            1024,
        );
        let l = EffectiveLimits::fit(&cfg, ctx(8192));
        assert_eq!(l.rollout_max_new_tokens, vec![1024]);
        assert_eq!(l.reflection_max_new_tokens, 4096);
        assert_eq!(l.reflection_prompt_budget(), 4096);
        let keys: Vec<_> = l.adjusted.iter().map(|a| a.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "reflection.max_new_tokens",
                "reflection.max_reflection_length",
                "reflection.token_budget"
            ]
        );
        assert_eq!((l.adjusted[0].asked, l.adjusted[0].used), (12000, 4096));
    }

    #[test]
    fn values_that_fit_are_used_as_asked_and_nothing_is_reported() {
        let cfg = config(
            "max_new_tokens: 320, max_reflection_length: 4096, token_budget: 4096",
            48,
        );
        let l = EffectiveLimits::fit(&cfg, ctx(8192));
        assert!(l.adjusted.is_empty());
        assert_eq!(l.apply(&cfg), cfg);
    }

    #[test]
    fn a_short_prompt_leaves_the_output_more_than_half() {
        let cfg = config(
            "max_new_tokens: 12000, max_reflection_length: 1000, token_budget: 800",
            48,
        );
        let l = EffectiveLimits::fit(&cfg, ctx(8192));
        assert_eq!(l.reflection_max_new_tokens, 8192 - 800);
        assert_eq!(l.reflection_prompt_budget(), 800);
        // max_reflection_length's 1000 could never be used beside token_budget's 800.
        let keys: Vec<_> = l.adjusted.iter().map(|a| a.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "reflection.max_new_tokens",
                "reflection.max_reflection_length"
            ]
        );
    }

    #[test]
    fn every_planned_call_fits_the_context_whatever_was_asked() {
        for c in [256u32, 257, 1000, 4096, 8192, 32768] {
            for asked_new in [1u32, 100, 5000, 12000, 40000] {
                for asked_prompt in [1u32, 200, 4096, 24000, 100000] {
                    let cfg = config(
                        &format!(
                            "max_new_tokens: {asked_new}, max_reflection_length: {asked_prompt}, token_budget: {asked_prompt}"
                        ),
                        asked_new.max(20),
                    );
                    let l = EffectiveLimits::fit(&cfg, ctx(c));
                    assert!(
                        l.reflection_prompt_budget() + l.reflection_max_new_tokens <= c,
                        "c={c} new={asked_new} prompt={asked_prompt}: {l:?}"
                    );
                    assert!(l.rollout_max_new_tokens[0] <= c / 2);
                    assert!(l.reflection_max_new_tokens >= 1.min(asked_new));
                    assert!(l.reflection_prompt_budget() >= (c / 2).min(asked_prompt));
                }
            }
        }
    }

    #[test]
    fn the_context_comes_from_the_model_unless_the_config_lowers_it() {
        let model = |n| Some(Ok(Some(n)));
        assert_eq!(decide_context(None, model(8192)), Ok(Some(ctx(8192))));
        assert_eq!(
            decide_context(Some(2048), model(8192))
                .unwrap()
                .unwrap()
                .source,
            ContextSource::Config
        );
        assert_eq!(
            decide_context(Some(9000), model(8192)),
            Err(ContextError::AboveModel {
                asked: 9000,
                declared: 8192
            })
        );
        assert_eq!(
            decide_context(None, Some(Ok(None))),
            Err(ContextError::Undeclared)
        );
        // Rank 0 cannot read the model: the config's length stands, else a worker states it.
        assert_eq!(decide_context(None, Some(Err("no file".into()))), Ok(None));
        assert_eq!(
            decide_context(Some(4096), None).unwrap().unwrap().tokens,
            4096
        );
    }
}
