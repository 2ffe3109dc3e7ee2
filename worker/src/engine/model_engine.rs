//! [`ModelEngine`]: the [`Engine`] on a loaded model, from loading it to returning candidates:
//! one batch loop over a [`Backend`] (the CPU fast path or the candle transformer,
//! [`super::backend`]).
//!
//! A job runs in a fixed schedule so its output depends only on the request:
//! 1. render the messages with the model's chat template and tokenize (no extra specials);
//! 2. prefill the prompt at b=1 in chunks of [`PREFILL_CHUNK`] tokens from position 0
//!    ([`chunk_end`], the one statement of the schedule; on the
//!    candle backend chunk boundaries change logits, so they are fixed, never derived from other
//!    work; on the CPU fast path a position's logits depend only on the tokens up to it, so a
//!    job may start after a prefix kept from an earlier prompt of its kind, [`super::prefix_cache`]:
//!    rollouts and generations keep separate stores, see [`Reuse`]);
//! 3. give every candidate (all decodes of the ticket) a row after the prompt's KV, which the
//!    rows share, and decode them as one batch; a finished row leaves the batch (CPU path and
//!    candle's paged path) or keeps being fed a pad token whose output is ignored (candle's
//!    lockstep path); candle's projections run in fixed tiles of rows
//!    (`transformer::DecodeTile`);
//! 4. per row and token: logits → constraint mask (if any) →
//!    [`sampler::sample`](super::sampler::sample) with `uniform_at(candidate seed, token
//!    index)` → constraint `consume`; a row stops on a stop token, when its constraint is
//!    finished, or at `max_new_tokens`;
//! 5. forced-token fast-forward (CPU path): while the constraint allows exactly one token, it
//!    is taken without sampling (the sampler could return nothing else) and the run is fed in
//!    one multi-token forward; each position's arithmetic is what it would be step by step.
//!
//! The text returned is the tokenizer's decoding of the generated tokens without special
//! tokens, never normalized.
//!
//! Children, each an `impl ModelEngine` over this file's fields: `load.rs` (a model file into
//! an engine and its backend), `batch.rs` (the batch loop: admission, steps 2 and 3, the
//! prefix stores' look-up and publication), `rows.rs` (steps 4 and 5 for one row, and its
//! text). What differs between the backends is behind the [`Backend`] trait.

mod batch;
mod draft;
mod load;
mod rows;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use stageb_shared::domain::ChatMessage;
use tokenizers::Tokenizer;

use super::backend::candle::CandleBackend;
use super::backend::chunk_end;
use super::backend::cpu::CpuBackend;
use super::backend::readback::StepLogits;
pub use super::backend::{Backend, BackendKind, PREFILL_CHUNK};
use super::backend::{Input, JobKv, Reuse, StepOut};
use super::chat_template::ChatTemplate;
use super::cpu::model::CpuModel;
pub use super::options::{DEFAULT_PREFIX_CACHE_BYTES, DeviceSpec, EngineOptions};
use super::prompt_text::PromptEncoder;
use super::sampler::SamplingParams;
use super::step_split::StepSplit;
use super::switches::EngineSwitches;
use super::transformer::Transformer;
use super::{
    CancelFlag, DecodeRequest, Engine, EngineError, GenerateOutput, GenerateRequest, Job,
    JobOutput, ModelFingerprint, RolloutOutput, RolloutRequest,
};
use crate::constraint::{ConstraintFactory, Vocabulary};
pub use load::declared_context;
pub(crate) use load::sha256_files;
use rows::Row;

pub use super::backend::candle::CANDLE_VERSION;

/// A constrained row's last this many tokens are spent ending it cleanly (see
/// `finishing_mask`): one character is at most 3 more byte tokens, plus EOS.
pub const FINISH_MARGIN: usize = 4;

/// Candidates checked on a fork per finishing step (highest logits first).
const FINISH_LOOKAHEAD: usize = 64;

/// The smallest `max_new_tokens` of a constrained rollout: the fixed `Verdict: 不通过\nReason: `
/// prefix (about 10 tokens) plus a reason of a few tokens plus [`FINISH_MARGIN`].
pub const MIN_CONSTRAINED_NEW_TOKENS: u32 = stageb_shared::config::MIN_CONSTRAINED_NEW_TOKENS;

/// One loaded model with its tokenizer, chat template and stop tokens.
pub struct ModelEngine {
    backend: Box<dyn Backend>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    stop_ids: Vec<u32>,
    fingerprint: ModelFingerprint,
    constraints: OnceLock<Result<ConstraintFactory, String>>,
    pool: Option<rayon::ThreadPool>,
    /// Bench only: unconstrained rows run to `max_new_tokens` through stop tokens.
    ignore_eos: bool,
    /// Forced-token fast-forward on the CPU path (on; off only to prove it changes nothing).
    fast_forward: bool,
    /// Draft tokens fed after each row's sampled token ([`draft`]; the `draft` switch, on
    /// where rows take several tokens a call).
    draft: bool,
    /// Tokens the last job took by fast-forward ([`ModelEngine::forced_tokens_last_job`]).
    forced_tokens: u64,
    /// The last lockstep job's decode time split into sampling and forward calls, in µs
    /// ([`ModelEngine::decode_split_last_job`]).
    decode_split: (u64, u64),
    /// Prompt + generated tokens a job may use: the loaded context, or the run's when rank 0
    /// asked for less ([`Engine::limit_context`]).
    context_limit: usize,
    /// Raised by the worker to stop the job in progress ([`Engine::set_cancel`]).
    cancel: CancelFlag,
    /// KV-cache bytes the last job held at its peak ([`Engine::last_kv_cache_bytes`]).
    last_kv_bytes: u64,
    /// The tokenizer's image/video placeholder tokens, which a prompt may not hold.
    media_placeholders: Vec<(u32, String)>,
    /// Tokenizes prompts with special-token strings from the messages kept as text.
    prompt_encoder: PromptEncoder,
    /// The running batch ([`ModelEngine::admit_job`]; CPU fast path).
    live: Vec<batch::Live>,
    /// Positions and jobs of the batch's last forward call.
    last_step: (usize, usize),
    /// What the worker's jobs in hand may take ([`Engine::set_kv_budget`]); with the prefix
    /// stores' budgets, the capacity of the CPU path's pool of KV blocks.
    kv_budget: u64,
    /// The run-time switches the engine was loaded with.
    switches: EngineSwitches,
    /// Where the steps' time went since load ([`ModelEngine::step_split`]).
    split: StepSplit,
    /// The last decode step's logits on the host, which the rows sample from next.
    step_logits: StepLogits,
}

impl std::fmt::Debug for ModelEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelEngine")
            .field("fingerprint", &self.fingerprint)
            .field("stop_ids", &self.stop_ids)
            .finish_non_exhaustive()
    }
}

impl ModelEngine {
    /// Replaces both prompt-prefix stores with empty ones: the rollouts' of `bytes`, the
    /// generations' (reflection calls) of twice as many (0 = off). The CPU fast path reuses
    /// any prefix; the candle backend whole [`PREFILL_CHUNK`]s of it.
    pub fn set_prefix_cache_bytes(&mut self, bytes: usize) {
        self.backend.set_prefix_budget(bytes);
        self.size_kv_pool();
    }

    /// The pool of KV blocks holds the jobs' budget and what the prefix stores may keep: the
    /// CPU path's is resized; the paged path's is made again at the next job.
    fn size_kv_pool(&mut self) {
        let idle = self.live.is_empty();
        self.backend.size_kv(self.kv_budget, idle);
    }

    /// The run-time switches in force (`STAGEB_ENGINE_SWITCHES` at load, or the options').
    pub fn switches(&self) -> &EngineSwitches {
        &self.switches
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn chat_template(&self) -> &ChatTemplate {
        &self.template
    }

    /// Token ids that end a generation (sorted).
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The loaded model.
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The candle transformer, when the engine runs it (tests read its weights).
    pub fn candle_model(&self) -> Option<&Transformer> {
        let candle = self.backend.as_any().downcast_ref::<CandleBackend>();
        candle.map(CandleBackend::model)
    }

    /// The CPU fast path's model, when the engine runs it (tests run it directly).
    pub fn cpu_model(&self) -> Option<&CpuModel> {
        let cpu = self.backend.as_any().downcast_ref::<CpuBackend>();
        cpu.map(CpuBackend::model)
    }

    /// Bench only (fixed-length generation, like `llama-batched-bench`): unconstrained rows
    /// no longer stop on a stop token. Never set in production.
    #[doc(hidden)]
    pub fn set_ignore_eos(&mut self, on: bool) {
        self.ignore_eos = on;
    }

    /// Test only: turns the forced-token fast-forward off (step-by-step sampling of forced
    /// tokens), to show both give the same outputs.
    #[doc(hidden)]
    pub fn set_fast_forward(&mut self, on: bool) {
        self.fast_forward = on;
    }

    /// Test only: decode steps on the candle backend run their projections on tiles of `rows`
    /// rows instead of the device's (the CPU's 8, CUDA's 64): lets a CPU test count a step's
    /// operations at the tile a GPU runs. Changes the numerics; never set in production.
    #[doc(hidden)]
    pub fn set_decode_tile(&mut self, rows: usize) {
        self.backend.set_decode_tile(rows);
    }

    /// Test only: turns the draft tokens off or on, to show both give the same outputs.
    #[doc(hidden)]
    pub fn set_draft(&mut self, on: bool) {
        self.draft = on;
    }

    /// Tokens the last job took by forced-token fast-forward (fed without sampling).
    pub fn forced_tokens_last_job(&self) -> u64 {
        self.forced_tokens
    }

    /// The last lockstep job's decode time (µs) spent sampling the rows' tokens and in forward
    /// calls (the GPU check's probe reports where a step's time goes).
    pub fn decode_split_last_job(&self) -> (u64, u64) {
        self.decode_split
    }

    /// Where the engine's steps spent their time since it was loaded (both the one-job path
    /// and the running batch): a probe reports the difference across its work.
    pub fn step_split(&self) -> StepSplit {
        self.split
    }

    /// The prompt text for `messages` (chat template, generation prompt appended).
    pub fn render_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.template.render(messages)
    }

    /// The prompt's token ids for `messages`: rendered, tokenized with the messages' text
    /// never read as special tokens ([`PromptEncoder`]), and refused when it holds an image or
    /// video placeholder token (only the template can put one there; the text tower has no
    /// pixels and no 3-D positions for them; see
    /// [`tokenizer::MEDIA_PLACEHOLDERS`](super::tokenizer::MEDIA_PLACEHOLDERS)).
    pub fn prompt_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        let ids = self
            .prompt_encoder
            .encode(&self.tokenizer, &self.template, messages)?;
        if let Some((_, name)) = self
            .media_placeholders
            .iter()
            .find(|(id, _)| ids.contains(id))
        {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt holds the image/video placeholder token `{name}`: stageb runs the model's text tower on text only"
            )));
        }
        Ok(ids)
    }

    /// Token ids of `text` with special tokens parsed and none added (as the prompt path
    /// tokenizes the template's own text).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EngineError::InvalidRequest(format!("tokenize: {e}")))
    }

    /// The constraint factory over this model's vocabulary (built on first use: it walks the
    /// whole token trie).
    pub fn constraint_factory(&self) -> Result<&ConstraintFactory, EngineError> {
        let r = self.constraints.get_or_init(|| {
            let vocab = Vocabulary::from_tokenizer(&self.tokenizer, &self.stop_ids)
                .map_err(|e| e.to_string())?;
            let vocab = if vocab.len() < self.backend.config().vocab_size {
                vocab.padded_to(self.backend.config().vocab_size)
            } else {
                vocab
            };
            ConstraintFactory::new(vocab).map_err(|e| e.to_string())
        });
        r.as_ref()
            .map_err(|e| EngineError::Model(format!("constraint vocabulary: {e}")))
    }

    /// The next-token logits after `prompt` (the same prefill every rollout runs). Lets a test
    /// compare the loaders and both compute paths against an independent reference forward.
    #[doc(hidden)]
    pub fn prompt_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.run_pooled(|eng| eng.prefill(prompt, Reuse::Off).map(|(logits, ..)| logits))
    }

    /// The same logits through the prefix store, as a rollout's prefill: the store's longest
    /// match is reused and the prompt kept afterwards. Also returns the positions reused.
    #[doc(hidden)]
    pub fn prompt_logits_reusing(
        &mut self,
        prompt: &[u32],
    ) -> Result<(Vec<f32>, usize), EngineError> {
        self.run_pooled(|eng| {
            let (logits, kv, reused) = eng.prefill(prompt, Reuse::Rollouts)?;
            eng.backend.publish(Reuse::Rollouts, prompt, &kv);
            Ok((logits, reused))
        })
    }

    /// Logits of the last prompt token after the fixed prefill schedule ([`chunk_end`]) from
    /// the leading positions taken from the prefix store `reuse` names (any length on the CPU
    /// fast path, whole chunks on the candle backend), the prompt's KV, and that length. Runs
    /// apart from the running batch: its step logits and time are its own.
    fn prefill(
        &mut self,
        prompt: &[u32],
        reuse: Reuse,
    ) -> Result<(Vec<f32>, JobKv, usize), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("empty prompt".into()));
        }
        let mut kv = self.backend.new_job(prompt.len())?;
        let reused = self.backend.look_up(reuse, prompt, &mut kv)?;
        let mut logits = StepLogits::new(self.backend.config().vocab_size);
        let mut split = StepSplit::default();
        let (mut last, mut pos) = (None, reused);
        while pos < prompt.len() {
            let end = chunk_end(pos, prompt.len());
            let input = Input::chunk(0, prompt[pos..end].to_vec());
            let out = StepOut {
                logits: &mut logits,
                split: &mut split,
            };
            last = self.backend.forward(vec![&mut kv], &[input], out)?;
            pos = end;
        }
        let last = last.ok_or_else(|| EngineError::InvalidRequest("empty prompt".into()))?;
        Ok((last, kv, reused))
    }

    fn run_pooled<T: Send>(&mut self, f: impl FnOnce(&mut Self) -> T + Send) -> T {
        match self.pool.take() {
            Some(pool) => {
                let r = pool.install(|| f(self));
                self.pool = Some(pool);
                r
            }
            None => f(self),
        }
    }

    /// Runs one job of `prompt` and `rows` to its end through the batch loop
    /// ([`batch`]), apart from the running batch: the one-job path ([`Engine::rollout`],
    /// [`Engine::generate`]). Its prompt is looked up in, and kept in, the prefix store `reuse`
    /// names; the engine's flag ([`Engine::set_cancel`]) cancels it. Returns the ended job
    /// (its rows hold their tokens) and its decode time (µs).
    fn run_rows(
        &mut self,
        prompt: &[u32],
        rows: (Vec<Row>, Option<batch::RowIds>),
        reuse: Reuse,
    ) -> Result<(batch::Live, u64), EngineError> {
        let max_new = rows.0.iter().map(|r| r.max_new).max().unwrap_or(0);
        // The prompt's positions once, then each row's own.
        self.last_kv_bytes = self.kv_bytes(prompt.len(), rows.0.len(), max_new);
        let split = self.split;
        let others = std::mem::take(&mut self.live);
        // The running batch's rows read the step logits: a job run apart reads its own.
        let vocab = self.backend.config().vocab_size;
        let logits = (!others.is_empty())
            .then(|| std::mem::replace(&mut self.step_logits, StepLogits::new(vocab)));
        let ran = self.run_alone(prompt.to_vec(), rows, reuse);
        self.live = others;
        if let Some(logits) = logits {
            self.step_logits = logits;
        }
        let job = ran?;
        let d = self.split.since(&split);
        let forward = d.forward_issued + d.forward_done + d.readback;
        self.decode_split = (d.sampling.as_micros() as u64, forward.as_micros() as u64);
        self.forced_tokens = job.forced;
        let decode_us = job.decode_us();
        Ok((job, decode_us))
    }
}

fn check_params(
    temperature: f32,
    top_p: f32,
    repetition_penalty: f32,
) -> Result<SamplingParams, EngineError> {
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(EngineError::InvalidRequest(format!(
            "temperature must be >= 0, got {temperature}"
        )));
    }
    if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
        return Err(EngineError::InvalidRequest(format!(
            "top_p must be in (0, 1], got {top_p}"
        )));
    }
    if !repetition_penalty.is_finite() || repetition_penalty <= 0.0 {
        return Err(EngineError::InvalidRequest(format!(
            "repetition_penalty must be > 0, got {repetition_penalty}"
        )));
    }
    Ok(SamplingParams {
        temperature,
        top_p,
        repetition_penalty,
    })
}

impl Engine for ModelEngine {
    fn fingerprint(&self) -> &ModelFingerprint {
        &self.fingerprint
    }

    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        self.run_pooled(|eng| eng.rollout_inner(request))
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.run_pooled(|eng| eng.generate_inner(request))
    }

    fn max_context(&self) -> u32 {
        u32::try_from(self.context_limit).unwrap_or(u32::MAX)
    }

    fn limit_context(&mut self, tokens: u32) {
        self.context_limit = (tokens as usize).clamp(2, self.backend.max_context());
    }

    fn set_cancel(&mut self, flag: CancelFlag) {
        self.cancel = flag;
    }

    fn last_kv_cache_bytes(&self) -> u64 {
        self.last_kv_bytes
    }

    fn prefix_cache_bytes(&self) -> Option<u64> {
        self.backend.prefix_bytes()
    }

    fn batches(&self) -> bool {
        ModelEngine::batches(self)
    }

    fn admit(&mut self, key: u64, job: &Job, cancel: CancelFlag) -> Result<(), EngineError> {
        self.admit_job(key, job, cancel)
    }

    fn step(&mut self) -> Vec<(u64, Result<JobOutput, EngineError>)> {
        self.step_batch()
    }

    fn last_step_size(&self) -> (usize, usize) {
        self.last_step
    }

    fn kv_bytes_per_position(&self) -> u64 {
        self.backend.kv_bytes_per_position()
    }

    /// On a GPU the share of its free memory and its own pool, less what the prefix stores may
    /// hold there ([`super::gpu_kv_budget`]).
    fn default_kv_budget(&self) -> u64 {
        let Some(free) = self.backend.device_free_bytes() else {
            return super::DEFAULT_KV_CACHE_BYTES;
        };
        let own = self
            .backend
            .kv_stats()
            .map_or(0, |p| (p.capacity * p.block_bytes) as u64);
        super::gpu_kv_budget(free, own, self.backend.prefix_budget())
    }

    fn kv_block_positions(&self) -> u64 {
        self.backend.block_positions()
    }

    fn set_kv_budget(&mut self, bytes: u64) {
        self.kv_budget = bytes;
        self.size_kv_pool();
    }

    fn kv_blocks(&self) -> Option<super::PoolStats> {
        self.backend.kv_stats()
    }

    fn job_progress(&self, key: u64) -> Option<super::JobProgress> {
        ModelEngine::job_progress(self, key)
    }
}

impl ModelEngine {
    fn rollout_inner(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        let prompt = self.prompt_ids(&request.messages)?;
        let (out, _) = self.rollout_prompt(&prompt, &request.decodes, request.constrained)?;
        Ok(out)
    }

    /// Diagnostics (`stageb probe`): a rollout of `prompt`, token ids used as they are (no chat
    /// template, no placeholder check), in the same schedule as [`Engine::rollout`]; also
    /// returns each candidate's token ids, in the output's order. With
    /// [`set_ignore_eos`](Self::set_ignore_eos) unconstrained rows run to `max_new_tokens`.
    #[doc(hidden)]
    pub fn rollout_ids(
        &mut self,
        prompt: &[u32],
        decodes: &[DecodeRequest],
        constrained: bool,
    ) -> Result<(RolloutOutput, Vec<Vec<u32>>), EngineError> {
        self.run_pooled(|eng| eng.rollout_prompt(prompt, decodes, constrained))
    }

    fn rollout_prompt(
        &mut self,
        prompt: &[u32],
        decodes: &[DecodeRequest],
        constrained: bool,
    ) -> Result<(RolloutOutput, Vec<Vec<u32>>), EngineError> {
        let (rows, ids) = self.rollout_rows(decodes, constrained)?;
        // Rollouts of a step share their head (system prompt, mission, guidance): reuse it.
        let (job, decode_us) = self.run_rows(prompt, (rows, None), Reuse::Rollouts)?;
        let (reused, prefill_us) = (job.reused, job.prefill_us);
        let rows = job.rows;
        let out = self.rollout_output(&rows, &ids, prompt.len(), reused, prefill_us, decode_us)?;
        let tokens = rows.into_iter().map(|r| r.tokens).collect();
        Ok((out, tokens))
    }

    fn generate_inner(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        let t0 = Instant::now();
        let prompt = self.prompt_ids(&request.messages)?;
        let rows = vec![self.generate_row(request)?];
        // A cycle's calls share their head (system prompt, guidance, cases): reuse it, from a
        // store of their own so the rollouts' heads stay.
        let (job, _) = self.run_rows(&prompt, (rows, None), Reuse::Generations)?;
        let latency_us = t0.elapsed().as_micros() as u64;
        self.generate_output(&job.rows[0], prompt.len(), job.reused, latency_us)
    }
}

/// The model file named by `STAGEB_MODEL`, else the demo model under the workspace's
/// `.cache/models/`, if it exists (tests and `stageb generate` use this).
pub fn default_model_path(workspace_root: &Path) -> Option<PathBuf> {
    if let Ok(p) = std::env::var("STAGEB_MODEL")
        && !p.is_empty()
    {
        return Some(PathBuf::from(p));
    }
    let p = workspace_root.join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

#[cfg(test)]
mod tests {
    use super::rows::without_terminator;

    #[test]
    fn regression_raw_text_keeps_special_tokens_the_model_emitted() {
        // 2 = EOS, 7 = a special token emitted mid-answer: only the terminator goes.
        let stop = [2, 3];
        assert_eq!(without_terminator(&[5, 7, 6, 2], &stop), &[5, 7, 6]);
        assert_eq!(without_terminator(&[5, 2, 6], &stop), &[5, 2, 6]);
        assert_eq!(without_terminator(&[5, 6], &stop), &[5, 6]);
        assert_eq!(without_terminator(&[], &stop), &[] as &[u32]);
    }
}
