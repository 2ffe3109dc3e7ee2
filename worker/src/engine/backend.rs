//! The model behind an engine ([`Backend`]): the few operations the batch loop of
//! [`ModelEngine`](super::ModelEngine) runs a job through, with two implementations, the CPU
//! fast path ([`cpu::CpuBackend`], `CpuModel` over a pool of KV blocks) and our transformer on
//! candle tensors ([`candle::CandleBackend`], CPU or CUDA, lockstep or paged KV).
//!
//! A job's KV ([`JobKv`]) is the backend's own type, opaque to the loop, and so are the
//! prompt prefix stores ([`PromptStores`]): what they keep is the backend's KV. The loop owns
//! everything else: admission, the prefill chunk schedule, sampling, cancellation and the
//! step's host-side logits ([`readback::StepLogits`]), which a forward call fills. The
//! prefill chunk schedule ([`chunk_end`]) is stated here: a backend's forward call gets the
//! chunks it says, whichever loop runs them.

pub mod candle;
pub mod cpu;
pub mod readback;

use std::any::Any;

use super::EngineError;
use super::cpu::kv_pool::PoolStats;
use super::cpu::model::Slot;
use super::model_config::TransformerConfig;
use super::prefix_cache::PrefixStore;
use super::step_split::StepSplit;
use readback::StepLogits;

/// Prompt tokens per prefill forward call. Fixed: it is part of every result's identity.
pub const PREFILL_CHUNK: usize = 512;

/// The end of the prefill chunk that starts at `pos` of a prompt of `len` tokens: the fixed
/// schedule's chunks end at multiples of [`PREFILL_CHUNK`] and at the prompt's end, wherever
/// the prefill started (after a reused prefix). The one statement of the schedule: every
/// prefill, on either backend, in a running batch or alone, goes by it.
pub(crate) fn chunk_end(pos: usize, len: usize) -> usize {
    ((pos / PREFILL_CHUNK + 1) * PREFILL_CHUNK).min(len)
}

/// One job's KV, of the backend that made it ([`Backend::new_job`]).
pub type JobKv = Box<dyn Any + Send + Sync>;

/// `kv` as the backend's own job type `T` (an error for a job of another backend).
pub(crate) fn kv_mut<T: 'static>(kv: &mut JobKv) -> Result<&mut T, EngineError> {
    kv.downcast_mut::<T>()
        .ok_or_else(|| EngineError::Model("a job of another backend".into()))
}

/// `kv` as the backend's own job type `T`, read only.
pub(crate) fn kv_ref<T: 'static>(kv: &JobKv) -> Result<&T, EngineError> {
    kv.downcast_ref::<T>()
        .ok_or_else(|| EngineError::Model("a job of another backend".into()))
}

/// Which backend an engine runs (for diagnostics and tests; the loop never asks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// The CPU fast path: GGUF on CPU with `WeightFormat::Auto`.
    CpuFastPath,
    /// Our transformer on candle tensors (CUDA, safetensors, explicit weight formats).
    Candle,
}

/// Which prefix store a job's prefill looks its prompt up in, and keeps it in afterwards.
///
/// Rollouts and generations (reflection calls) keep separate stores: a reflection prompt shares
/// its system prompt, guidance and cases with the cycle's other calls (JSON retries, the
/// revision round, the next cycle's call of the same pass) but nothing past the chat template's
/// first tokens with a rollout, and it is several times as long, so in one LRU store it would
/// evict the rollouts' shared heads without ever serving a rollout. The generations' store has
/// [`GENERATIONS_BUDGET_FACTOR`] times the rollouts' budget, so the latest prompt of each pass
/// stays while the other pass runs (see there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Neither looked up nor kept (reference computations).
    Off,
    Rollouts,
    Generations,
}

/// The generations' store holds this many times the rollouts' budget. A reflection call's
/// prompt is 4–5 times a rollout's (about 2,600 tokens against 600 in the README demo), and
/// the calls alternate between the decision and the ops pass, each sharing its head with the
/// same pass's call before: a store that holds less than one prompt of each pass evicts the
/// one the next call would reuse (at the 256 MiB default and SmolLM2's 46 KiB a position,
/// one 2,600-token prompt is 117 MiB, and the demo's stored prompts outgrew 256 MiB).
pub(crate) const GENERATIONS_BUDGET_FACTOR: usize = 2;

/// A backend's two prompt prefix stores (rollouts', generations').
pub(crate) struct PromptStores<T> {
    rollouts: PrefixStore<T>,
    generations: PrefixStore<T>,
}

impl<T> PromptStores<T> {
    /// Two empty stores: the rollouts' of `bytes`, the generations' of
    /// [`GENERATIONS_BUDGET_FACTOR`] times as many (0 = both off).
    pub(crate) fn new(bytes: usize) -> Self {
        PromptStores {
            rollouts: PrefixStore::new(bytes),
            generations: PrefixStore::new(bytes.saturating_mul(GENERATIONS_BUDGET_FACTOR)),
        }
    }

    /// The store a job of kind `reuse` uses (`None` for [`Reuse::Off`] or a store turned off).
    pub(crate) fn of(&mut self, reuse: Reuse) -> Option<&mut PrefixStore<T>> {
        let store = match reuse {
            Reuse::Off => return None,
            Reuse::Rollouts => &mut self.rollouts,
            Reuse::Generations => &mut self.generations,
        };
        store.enabled().then_some(store)
    }

    /// Bytes the two stores may hold together.
    pub(crate) fn budget(&self) -> u64 {
        (self.rollouts.budget() + self.generations.budget()) as u64
    }

    /// Bytes the two stores hold (`None` when they are off).
    pub(crate) fn bytes(&self) -> Option<u64> {
        let bytes = self.rollouts.bytes() + self.generations.bytes();
        self.rollouts.enabled().then_some(bytes as u64)
    }

    /// Empties both stores, keeping their budgets.
    pub(crate) fn clear(&mut self) {
        *self = PromptStores::new(self.rollouts.budget());
    }
}

/// One job's share of a forward call.
pub struct Input {
    /// Its index in the call's jobs.
    pub job: usize,
    pub tokens: Vec<u32>,
    pub slots: Vec<Slot>,
    pub logits_at: Vec<usize>,
    /// The row of each logit; `None` for a prefill chunk (one logit: the chunk's last).
    pub rows: Option<Vec<usize>>,
}

impl Input {
    /// A prefill chunk of `tokens` of job `job`.
    pub(crate) fn chunk(job: usize, tokens: Vec<u32>) -> Input {
        let n = tokens.len();
        Input {
            job,
            tokens,
            slots: vec![Slot::Shared; n],
            logits_at: vec![n - 1],
            rows: None,
        }
    }
}

/// Where a forward call puts the decoded rows' logits and its time.
pub struct StepOut<'a> {
    pub logits: &'a mut StepLogits,
    pub split: &'a mut StepSplit,
}

/// What admission counts a job's worst case in: blocks of `positions` positions and `bytes`
/// bytes, plus `per_row` blocks per row (a copy of the prompt's partial last block).
#[derive(Debug, Clone, Copy)]
pub struct Blocks {
    pub positions: usize,
    pub bytes: usize,
    pub per_row: usize,
}

/// The operations of a loaded model the batch loop runs jobs through.
///
/// A job's life: [`new_job`](Self::new_job) when it joins; [`look_up`](Self::look_up) when its
/// prefill starts; [`forward`](Self::forward) with its prefill chunks, then its rows' tokens;
/// when its prompt is complete [`prompt_prefilled`](Self::prompt_prefilled),
/// [`publish`](Self::publish) and [`add_rows`](Self::add_rows); its KV is released when the
/// loop drops it (ended, failed or cancelled).
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;

    fn config(&self) -> &TransformerConfig;

    /// The context the model was loaded with.
    fn max_context(&self) -> usize;

    /// Bytes of keys and values one position takes over all layers.
    fn kv_bytes_per_position(&self) -> u64;

    /// Positions of the unit the KV is held in (1 for a cache that is not paged).
    fn block_positions(&self) -> u64;

    /// The blocks admission counts in (`None`: KV that admission does not bound).
    #[doc(hidden)]
    fn blocks(&self) -> Option<Blocks>;

    /// The pool of KV blocks now (`None` without one).
    fn kv_stats(&self) -> Option<PoolStats>;

    /// Free memory of the model's GPU (`None` on the CPU).
    fn device_free_bytes(&self) -> Option<u64> {
        None
    }

    /// Whether a row may take several tokens in one forward call (forced-token
    /// fast-forward): per-row positions, the CPU fast path's alone.
    fn multi_token_rows(&self) -> bool;

    /// Replaces both prompt prefix stores with empty ones: the rollouts' of `bytes`, the
    /// generations' of [`GENERATIONS_BUDGET_FACTOR`] times as many (0 = off).
    #[doc(hidden)]
    fn set_prefix_budget(&mut self, bytes: usize);

    /// Bytes the prefix stores may hold together.
    #[doc(hidden)]
    fn prefix_budget(&self) -> u64;

    /// Bytes the prefix stores hold (`None` when they are off).
    #[doc(hidden)]
    fn prefix_bytes(&self) -> Option<u64>;

    /// The KV pool holds `kv_budget` for the jobs and what the prefix stores may keep;
    /// `idle` when no job holds KV (a pool may then be made again).
    #[doc(hidden)]
    fn size_kv(&mut self, kv_budget: u64, idle: bool);

    /// A joining job's KV, for a prompt of `prompt_len` tokens.
    #[doc(hidden)]
    fn new_job(&mut self, prompt_len: usize) -> Result<JobKv, EngineError>;

    /// Starts the job's empty KV after the longest prefix of `prompt` the store `reuse`
    /// names holds; returns the positions reused. Where a prefill starts changes no bit.
    #[doc(hidden)]
    fn look_up(
        &mut self,
        reuse: Reuse,
        prompt: &[u32],
        kv: &mut JobKv,
    ) -> Result<usize, EngineError>;

    /// One forward call over `jobs` (indexed by [`Input::job`]): the logits of a prefill
    /// chunk among `inputs` come back; the decoded rows' land in `out`, input by input, row
    /// by row.
    #[doc(hidden)]
    fn forward(
        &mut self,
        jobs: Vec<&mut JobKv>,
        inputs: &[Input],
        out: StepOut<'_>,
    ) -> Result<Option<Vec<f32>>, EngineError>;

    /// The job's prompt is complete (before its rows start).
    #[doc(hidden)]
    fn prompt_prefilled(&mut self, _kv: &mut JobKv) -> Result<(), EngineError> {
        Ok(())
    }

    /// Keeps the job's prompt in the store `reuse` names; `false` when nothing was handed
    /// to a store (no store, or a KV the store does not take).
    #[doc(hidden)]
    fn publish(&mut self, reuse: Reuse, prompt: &[u32], kv: &JobKv) -> bool;

    /// Makes room for `n` rows of up to `max_new` tokens after the prompt.
    #[doc(hidden)]
    fn add_rows(
        &mut self,
        kv: &mut JobKv,
        n: usize,
        max_new: usize,
        prompt_len: usize,
    ) -> Result<(), EngineError>;

    /// Forgets the last `n` positions of row `row` of a job (draft tokens it did not take;
    /// backends with [`multi_token_rows`](Self::multi_token_rows) alone).
    #[doc(hidden)]
    fn rewind_row(&self, _kv: &mut JobKv, _row: usize, _n: usize) -> Result<(), EngineError> {
        Err(EngineError::Model(
            "this backend does not rewind a row's positions".into(),
        ))
    }

    /// Test only: decode steps run their projections on tiles of `rows` rows instead of the
    /// device's (the candle backend; others ignore it).
    #[doc(hidden)]
    fn set_decode_tile(&mut self, _rows: usize) {}

    /// The backend as its own type (tests reach the CPU fast path's model).
    fn as_any(&self) -> &dyn Any;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (the README demo): reflection prompts of ~2,600 tokens alternate between the
    /// decision and the ops pass; in a store of the rollouts' budget the latest of one pass
    /// evicted the other's, which the next call of that pass would have reused.
    #[test]
    fn the_generations_store_holds_twice_the_rollouts_budget_and_zero_turns_both_off() {
        let mut stores = PromptStores::<()>::new(256 << 20);
        assert_eq!(stores.of(Reuse::Rollouts).unwrap().budget(), 256 << 20);
        assert_eq!(stores.of(Reuse::Generations).unwrap().budget(), 512 << 20);
        assert_eq!(stores.budget(), 768 << 20);
        assert!(stores.of(Reuse::Off).is_none());
        stores.clear();
        assert_eq!(stores.budget(), 768 << 20, "clearing keeps the budgets");
        let mut off = PromptStores::<()>::new(0);
        assert!(off.of(Reuse::Rollouts).is_none() && off.of(Reuse::Generations).is_none());
        assert_eq!(off.bytes(), None);
    }
}
