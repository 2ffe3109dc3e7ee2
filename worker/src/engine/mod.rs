//! The inference engine interface every job runs through.
//!
//! A worker holds one [`Engine`]. Rollout jobs sample several candidates of one ticket that
//! share the prompt (prefilled once, decoded together); generate jobs produce one text, usually
//! in JSON-schema mode for reflection. Everything random is derived from the seeds in the
//! request, so results never depend on which worker ran the job or what else it was doing.
//!
//! # Modules
//! - [`model_engine`]: [`ModelEngine`], the [`Engine`] on a loaded model: loading
//!   (`load.rs`), the batch loop (admission, chunked prefill beside decode rows, cancellation,
//!   the prefix stores' look-up; `batch.rs`), and a row's sampling, finishing mask and forced
//!   tokens (`rows.rs`).
//! - [`backend`]: the [`Backend`] trait the loop runs a model through, with the prefill chunk
//!   schedule, and its two implementations: the CPU fast path (`backend/cpu.rs`) and the
//!   candle transformer, lockstep or paged (`backend/candle.rs`).
//! - [`device_info`]: the fingerprint's device part (on CUDA the GPU model, compute
//!   capability, SM count and cuBLAS version).
//! - [`options`]: how an engine is asked to load and run a model ([`EngineOptions`]).
//! - [`model_config`]: a loaded model's hyper-parameters ([`model_config::TransformerConfig`]).
//! - [`gguf`], [`safetensors`]: reading a GGUF file or an HF safetensors directory into a model.
//! - [`tokenizer`]: the model's tokenizer and its stop tokens.
//! - [`chat_template`]: rendering chat messages into a prompt with the model's template.
//! - [`transformer`]: our transformer on candle tensors (CUDA, safetensors, explicit weight
//!   formats) and its lockstep KV cache.
//! - [`cpu`]: the CPU fast path: the model and its shared-prompt KV cache, the weight formats,
//!   and kernels with one fixed recipe per output element.
//! - [`prefix_cache`]: a generic store of prompts' prefilled state, LRU by bytes, looked up
//!   by longest common token prefix.
//! - [`sampler`]: the next token from one row of logits: the exhaustive sampler of record and
//!   its max-logit prefilter.
//! - [`step_split`]: where decode steps spend their time ([`step_split::StepSplit`]).
//! - [`switches`]: the run-time switches ([`EngineSwitches`], `STAGEB_ENGINE_SWITCHES`) that
//!   A/B engine changes in one binary.
//! - [`int8`]: only the old path of [`cpu::isa::choose`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use stageb_shared::domain::ChatMessage;

pub mod backend;
pub mod chat_template;
pub mod cpu;
pub mod device_info;
pub mod gguf;
pub mod kernels;
pub mod model_config;
pub mod model_engine;
pub mod options;
pub mod prefix_cache;
pub mod prompt_text;
pub mod safetensors;
pub mod sampler;
pub mod step_split;
pub mod switches;
pub mod tokenizer;
pub mod transformer;

pub use backend::candle::CANDLE_VERSION;
pub use backend::{Backend, BackendKind};
pub use cpu::isa::KernelChoice;
pub use cpu::kv_pool::PoolStats;
pub use cpu::model::CpuNumerics;
pub use gguf::WeightFormat;
pub use model_engine::{
    DEFAULT_PREFIX_CACHE_BYTES, DeviceSpec, EngineOptions, ModelEngine, declared_context,
    default_model_path,
};
pub use options::Numerics;
pub use switches::{EngineSwitches, Readback};

/// The kernel choice at its old path (`engine::int8::choose`), which the root package's CLI
/// still names; it lives in [`cpu::isa`].
pub mod int8 {
    pub use super::cpu::isa::choose;
}

/// How one group of candidates is decoded (one `sampler.grid` entry with its seeds).
pub use stageb_shared::domain::DecodeGroup as DecodeRequest;

/// Sample candidate verdicts for one ticket.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutRequest {
    pub messages: Vec<ChatMessage>,
    pub decodes: Vec<DecodeRequest>,
    /// Constrain every candidate to the two-line contract.
    pub constrained: bool,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model (or the constraint) ended the sequence.
    Stop,
    /// `max_new_tokens` was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct CandidateOutput {
    pub decode_index: u32,
    pub sample_index: u32,
    pub seed: u64,
    /// The decoded text, exactly as generated (special tokens the model emitted included, only
    /// the terminating stop token left out; never normalized).
    pub text: String,
    pub completion_tokens: u32,
    pub finish: FinishReason,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RolloutOutput {
    /// In request order: decode by decode, sample by sample.
    pub candidates: Vec<CandidateOutput>,
    pub prompt_tokens: u32,
    /// Leading prompt tokens whose KV came from the prefix store instead of a prefill.
    pub prefix_tokens: u32,
    pub prefill_us: u64,
    pub decode_us: u64,
    pub batch: BatchShare,
}

/// How much a job shared its forward steps: the steps it took part in and the rows (decoding
/// sequences and prefill chunks, its own and other jobs') those steps computed in all. A
/// runtime statistic, never part of a result; zero on the one-job path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchShare {
    pub steps: u32,
    pub rows: u64,
}

impl BatchShare {
    /// Counts one forward step of `rows` rows.
    pub fn add_step(&mut self, rows: usize) {
        self.steps = self.steps.saturating_add(1);
        self.rows = self.rows.saturating_add(rows as u64);
    }
}

/// One free generation (reflection passes).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub messages: Vec<ChatMessage>,
    /// Constrain the output to this JSON schema.
    pub json_schema: Option<serde_json::Value>,
    pub seed: u64,
    pub temperature: f32,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub max_new_tokens: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutput {
    pub text: String,
    pub prompt_tokens: u32,
    /// Leading prompt tokens whose KV came from the generations' prefix store.
    pub prefix_tokens: u32,
    pub completion_tokens: u32,
    pub finish: FinishReason,
    pub latency_us: u64,
    pub batch: BatchShare,
}

/// One job of a worker: a rollout or a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum Job {
    Rollout(RolloutRequest),
    Generate(GenerateRequest),
}

/// What a [`Job`] produced.
#[derive(Debug, Clone, PartialEq)]
pub enum JobOutput {
    Rollout(RolloutOutput),
    Generate(GenerateOutput),
}

impl JobOutput {
    /// The output with `batch` as its batching statistics.
    pub fn with_batch(mut self, batch: BatchShare) -> Self {
        match &mut self {
            JobOutput::Rollout(r) => r.batch = batch,
            JobOutput::Generate(g) => g.batch = batch,
        }
        self
    }
}

/// Identity of the model a worker runs: results are only comparable under the same one.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelFingerprint {
    /// sha256 over the weight files (in a fixed order).
    pub weights_sha256: String,
    pub candle_version: String,
    pub dtype: String,
    /// The device: its kind (`cpu`, `cuda`; the ordinal does not change results) and, on
    /// CUDA, what cuBLAS needs the same to give the same bits:
    /// `cuda(NVIDIA H200; cc 9.0; 132 SMs; cuBLAS 13.1.0)` ([`device_info`]).
    pub device: String,
    pub architecture: String,
}

/// The digest a fingerprint's `weights_sha256` holds for the model at `path` (a GGUF file or
/// a safetensors directory), computed without loading it: rank 0 pins a run's model with it.
pub fn weights_sha256(path: &std::path::Path) -> Result<String, EngineError> {
    let files = if path.is_dir() {
        safetensors::weight_files(path)?
    } else {
        vec![path.to_path_buf()]
    };
    model_engine::sha256_files(&files)
}

impl ModelFingerprint {
    /// The single string compared at Register and stored with every result.
    pub fn id(&self) -> String {
        format!(
            "{}|candle-{}|{}|{}",
            self.weights_sha256, self.candle_version, self.dtype, self.device
        )
    }

    /// The device kind alone (`cpu`, `cuda`), without a GPU's details.
    pub fn device_kind(&self) -> &str {
        device_info::device_kind(&self.device)
    }
}

/// Whether `numerics` (a fingerprint id after its weights digest: `candle-<ver>|dtype|device`)
/// is one this build produces: rank 0 refuses a made-up one before it could pin a run.
pub fn numerics_known(numerics: &str) -> bool {
    let mut parts = numerics.split('|');
    let (Some(candle), Some(dtype), Some(device), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let kind = device_info::device_kind(device);
    // The candle backend on the paged path appends the kernels it runs to its dtype.
    let dtype = match dtype.split_once(';') {
        Some((candle, kernels)) if kernels::suffix_known(kernels) => match candle {
            "cuda-f32" | "cuda-bf16" | "cpu-f32" | "cpu-bf16" => candle,
            "f32-dequantized" | "gguf-quantized" => candle,
            _ => return false,
        },
        Some(_) => return false,
        None => dtype,
    };
    let dtype_fits = match dtype {
        "cpu-q8-fixed-order" | "cpu-f32-fixed-order" | "cpu-f32" | "cpu-bf16" => kind == "cpu",
        "cuda-f32" | "cuda-bf16" => kind == "cuda",
        "f32-dequantized" | "gguf-quantized" => matches!(kind, "cpu" | "cuda"),
        _ => false,
    };
    candle.strip_prefix("candle-") == Some(CANDLE_VERSION)
        && device_info::device_part_known(device)
        && dtype_fits
}

/// Stops the job in progress at its next decode step: the worker raises it when the job's
/// lease was fenced (another worker has the job now) or the run is over, so a dead job does
/// not hold the device for the rest of its tokens. The engine then returns
/// [`EngineError::Cancelled`]. Shared between the worker's heartbeat task and the engine.
#[derive(Debug, Clone, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Clear the flag before the next job starts.
    pub fn reset(&self) {
        self.0.store(false, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Stable error codes a worker reports for a job it could not run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The prompt does not fit the model's context (never truncated).
    #[error(
        "a prompt of {tokens} tokens plus {max_new} tokens to generate exceeds the context of {context}"
    )]
    PromptTooLong {
        tokens: usize,
        max_new: usize,
        context: usize,
    },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("model error: {0}")]
    Model(String),
    #[error("constraint error: {0}")]
    Constraint(#[from] crate::constraint::ConstraintError),
    /// The worker cancelled the job ([`CancelFlag`]); its result is never submitted.
    #[error("the job was cancelled")]
    Cancelled,
}

impl EngineError {
    /// The stable code sent to rank 0 in `JobError.code`.
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::PromptTooLong { .. } => "PROMPT_TOO_LONG",
            EngineError::InvalidRequest(_) => "INVALID_REQUEST",
            EngineError::Model(_) => "ENGINE_ERROR",
            EngineError::Constraint(_) => "CONSTRAINT_ERROR",
            EngineError::Cancelled => "CANCELLED",
        }
    }
}

/// A model that runs stageb jobs. Synchronous and CPU/GPU-bound: callers run it on a blocking
/// thread.
pub trait Engine: Send {
    fn fingerprint(&self) -> &ModelFingerprint;
    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError>;
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError>;
    /// Tokens (prompt + generated) one job may use. Engines without a context bound (test
    /// doubles) keep the default.
    fn max_context(&self) -> u32 {
        u32::MAX
    }
    /// Use at most `tokens` of context from now on (the run's context, told by rank 0 at
    /// Register), so whether a prompt fits never depends on which worker ran it.
    fn limit_context(&mut self, _tokens: u32) {}
    /// Watch `flag` from now on: a raised flag ends the job in progress at its next decode
    /// step with [`EngineError::Cancelled`]. Engines that cannot stop early ignore it.
    fn set_cancel(&mut self, _flag: CancelFlag) {}
    /// Bytes of KV cache the last job reserved (a metric; 0 where unknown).
    fn last_kv_cache_bytes(&self) -> u64 {
        0
    }
    /// Bytes the prompt-prefix store holds, `None` when the engine has none (off, or a
    /// backend without prefix reuse): a metric.
    fn prefix_cache_bytes(&self) -> Option<u64> {
        None
    }
    /// Whether [`admit`](Engine::admit) and [`step`](Engine::step) run many jobs in one
    /// continuous batch. Engines that do not run jobs one at a time through
    /// [`rollout`](Engine::rollout) and [`generate`](Engine::generate).
    fn batches(&self) -> bool {
        false
    }
    /// Adds `job` to the running batch under `key` (a batching engine); it is cancelled when
    /// `cancel` is raised. Refused at once when it cannot run.
    fn admit(&mut self, _key: u64, _job: &Job, _cancel: CancelFlag) -> Result<(), EngineError> {
        Err(EngineError::Model("this engine does not batch jobs".into()))
    }
    /// Rows and jobs the last [`step`](Engine::step)'s forward call took (a metric).
    fn last_step_size(&self) -> (usize, usize) {
        (0, 0)
    }
    /// One step of the running batch: the jobs that ended, with their outputs.
    fn step(&mut self) -> Vec<(u64, Result<JobOutput, EngineError>)> {
        Vec::new()
    }
    /// Bytes of KV cache one position takes (every layer's keys and values), so the worker can
    /// bound what its jobs in hand take; 0 where unknown.
    fn kv_bytes_per_position(&self) -> u64 {
        0
    }
    /// The KV-cache budget of a worker that was given none (`--kv-cache-mib` unset): on the
    /// CPU [`DEFAULT_KV_CACHE_BYTES`], on a GPU a share of the memory left after loading.
    fn default_kv_budget(&self) -> u64 {
        DEFAULT_KV_CACHE_BYTES
    }
    /// Positions of one KV block: a job's prompt and each of its rows take whole blocks (1
    /// where the cache is not paged).
    fn kv_block_positions(&self) -> u64 {
        1
    }
    /// The worker's KV budget from now on (what its jobs in hand may take at their worst):
    /// sizes the engine's pool of KV blocks.
    fn set_kv_budget(&mut self, _bytes: u64) {}
    /// Sets the KV budget a worker (and the probe, measuring as one) runs with: `given`
    /// (`--kv-cache-mib`), else [`Self::default_kv_budget`]; returns it.
    fn use_kv_budget(&mut self, given: Option<u64>) -> u64 {
        let budget = given.unwrap_or_else(|| self.default_kv_budget());
        self.set_kv_budget(budget);
        budget
    }
    /// The engine's pool of KV blocks now (a metric); `None` where it keeps no pool.
    fn kv_blocks(&self) -> Option<PoolStats> {
        None
    }
    /// How far the job admitted under `key` has got in the running batch (a liveness sign
    /// finer than its steps: a job whose tokens grow is decoding); `None` when no such job is
    /// in the batch, or the engine does not say.
    fn job_progress(&self, _key: u64) -> Option<JobProgress> {
        None
    }
}

/// What a job in the running batch has done so far ([`Engine::job_progress`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobProgress {
    /// Prompt positions in its KV (prefilled or reused); its prompt's length once it decodes.
    pub prompt_done: u32,
    /// Tokens its rows decoded, all rows together.
    pub tokens: u64,
    /// Its rows, and those that ended.
    pub rows: u32,
    pub rows_finished: u32,
}

/// The KV-cache budget of a CPU worker given none (`--kv-cache-mib`).
pub const DEFAULT_KV_CACHE_BYTES: u64 = 2 << 30;

/// The share of a GPU's free memory (after the model is loaded) a worker given no KV budget
/// takes for it: the rest is left for activations, logits and the allocator's slack.
pub const GPU_KV_SHARE: f64 = 0.6;

/// The KV budget of a GPU worker given none: [`GPU_KV_SHARE`] of the memory free to it, which
/// is the device's free memory and the KV pool it holds now (its own to size again: a worker
/// registering a second time still holds its first session's pool when it asks), less what
/// the prefix stores may take.
pub fn gpu_kv_budget(free: u64, own_pool: u64, prefix_budget: u64) -> u64 {
    let usable = free.saturating_add(own_pool) as f64 * GPU_KV_SHARE;
    (usable as u64).saturating_sub(prefix_budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found in review (2026-11-29): a GPU worker re-registering measured the free memory with
    /// its first session's pool still allocated, and took 0.6 of the 0.4 left: 0.24 of it.
    #[test]
    fn regression_a_gpu_worker_s_second_session_counts_its_own_pool_as_free() {
        let gib = 1u64 << 30;
        let first = gpu_kv_budget(100 * gib, 0, gib);
        assert_eq!(first, 59 * gib);
        // The pool made for the first session (its budget and the stores') is still held.
        let second = gpu_kv_budget(100 * gib - (first + gib), first + gib, gib);
        assert_eq!(second, first);
        assert_eq!(gpu_kv_budget(gib, 0, 2 * gib), 0, "never below zero");
    }

    #[test]
    fn only_numerics_this_build_produces_are_known() {
        let v = CANDLE_VERSION;
        for ok in [
            format!("candle-{v}|cpu-q8-fixed-order|cpu"),
            format!("candle-{v}|cuda-bf16|cuda"),
            format!("candle-{v}|gguf-quantized|cuda"),
            format!("candle-{v}|cuda-bf16|cuda(NVIDIA H200; cc 9.0; 132 SMs; cuBLAS 13.1.0)"),
            format!("candle-{v}|cuda-bf16;kernels=paged-attn+silu-mul|cuda"),
            format!("candle-{v}|cpu-f32;kernels=none|cpu"),
            format!(
                "candle-{v}|f32-dequantized;kernels=paged-attn+add-rmsnorm+qk-rope-kv+silu-mul|cpu"
            ),
        ] {
            assert!(numerics_known(&ok), "{ok}");
        }
        for made_up in [
            format!("candle-{v}|cpu-q8-fixed-order|cpu-made-up"),
            format!("candle-{v}|cuda-bf16|cpu"),
            "candle-0.0.1|cpu-f32|cpu".to_string(),
            format!("candle-{v}|cpu-f32|cpu|extra"),
            format!("candle-{v}|cpu-f32|cpu(NVIDIA H200; cc 9.0; 132 SMs; cuBLAS 13.1.0)"),
            format!("candle-{v}|cuda-bf16|cuda(made up"),
            format!("candle-{v}|cuda-bf16;kernels=made-up|cuda"),
            format!("candle-{v}|cuda-bf16;kernels=silu-mul+paged-attn|cuda"),
            format!("candle-{v}|cuda-bf16;kernels=silu-mul+silu-mul|cuda"),
            format!("candle-{v}|cuda-bf16;kernels=|cuda"),
            format!("candle-{v}|cpu-q8-fixed-order;kernels=none|cpu"),
            format!("candle-{v}|cpu-f32;kernels=none|cuda"),
            String::new(),
        ] {
            assert!(!numerics_known(&made_up), "{made_up}");
        }
    }
}
