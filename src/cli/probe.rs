//! `stageb probe`'s flags: the hidden diagnostics the GPU check runs (docs/GPU-TEST.md,
//! `scripts/gpu/gpu-check.sh`), over [`stageb_worker::probe`]. Each subcommand writes one JSON
//! file.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::ModelArgs;

/// `stageb probe`.
#[derive(Args)]
pub(crate) struct ProbeArgs {
    #[command(subcommand)]
    pub(crate) probe: Probe,
}

#[derive(Subcommand)]
pub(crate) enum Probe {
    /// Prompts of exact token lengths from built-in ticket text, with the model's tokenizer
    /// (no weights loaded): a JSON array of token-id arrays.
    Ids(ProbeIdsArgs),
    /// Next-token logits after one prompt and its greedy continuation, through the engine.
    Logits(ProbeLogitsArgs),
    /// The rollout workload: every prompt a ticket, its candidates decoded together to a fixed
    /// length (stop tokens ignored, unconstrained), timed ticket by ticket. One prompt and one
    /// candidate make a reflection-shaped call.
    Rollout(ProbeRolloutArgs),
}

/// `stageb probe ids`.
#[derive(Args)]
pub(crate) struct ProbeIdsArgs {
    /// Model file (GGUF) or directory (safetensors); only its tokenizer is read.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Number of prompts.
    #[arg(long, default_value_t = 1)]
    pub(crate) tickets: usize,
    /// Tokens per prompt.
    #[arg(long)]
    pub(crate) tokens: usize,
    /// Prompt i is `tokens - (37 i mod (jitter + 1))` tokens long (0: all equal).
    #[arg(long, default_value_t = 0)]
    pub(crate) jitter: usize,
    #[arg(long)]
    pub(crate) out: PathBuf,
}

/// `stageb probe logits`.
#[derive(Args)]
pub(crate) struct ProbeLogitsArgs {
    /// Model file (GGUF) or directory (safetensors).
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// JSON file of token ids: one array, or an array of arrays (see --prompt).
    #[arg(long)]
    pub(crate) ids: PathBuf,
    /// Which prompt of an array of arrays.
    #[arg(long, default_value_t = 0)]
    pub(crate) prompt: usize,
    /// Greedy tokens to generate after the prompt.
    #[arg(long, default_value_t = 32)]
    pub(crate) steps: u32,
    #[arg(long)]
    pub(crate) out: PathBuf,
    #[command(flatten)]
    pub(crate) model_args: ModelArgs,
}

/// `stageb probe rollout`.
#[derive(Args)]
pub(crate) struct ProbeRolloutArgs {
    /// Model file (GGUF) or directory (safetensors).
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// JSON file of token ids: an array of arrays, one prompt per ticket (or one array).
    #[arg(long)]
    pub(crate) ids: PathBuf,
    /// Run only the first N prompts.
    #[arg(long)]
    pub(crate) tickets: Option<usize>,
    #[arg(long, default_value_t = 8)]
    pub(crate) candidates: u32,
    /// New tokens per candidate, exactly.
    #[arg(long, default_value_t = 256)]
    pub(crate) new_tokens: u32,
    /// Timed passes over the tickets (after one untimed warm-up ticket).
    #[arg(long, default_value_t = 1)]
    pub(crate) reps: u32,
    /// Start no ticket after this many seconds of timed passes.
    #[arg(long)]
    pub(crate) budget_s: Option<f64>,
    #[arg(long, default_value_t = 0.7)]
    pub(crate) temperature: f32,
    #[arg(long, default_value_t = 0.9)]
    pub(crate) top_p: f32,
    /// New tokens of the warm-up ticket.
    #[arg(long, default_value_t = 16)]
    pub(crate) warmup_tokens: u32,
    /// Tickets in flight at once: 1 runs them one after another; more runs them in one
    /// continuous batch, as a worker holding that many jobs (the probe reads this, not
    /// `--max-jobs`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(crate) jobs: u64,
    #[arg(long)]
    pub(crate) out: PathBuf,
    #[command(flatten)]
    pub(crate) model_args: ModelArgs,
}
