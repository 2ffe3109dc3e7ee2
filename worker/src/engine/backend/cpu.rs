//! The CPU fast path as a [`Backend`]: [`CpuModel`] over its pool of KV blocks, a job's KV a
//! [`CpuCache`] (the prompt once, a suffix per row), every input of a step in one
//! [`CpuModel::forward_parts`] call.
//!
//! On this path a position's keys, values and logits follow one recipe whatever the call they
//! are computed in (see [`crate::engine::cpu::kernels`]): so a prefix of any length is reused
//! from the prompt stores, and where it ends changes no bit (`tests/prefix_cache.rs` checks it
//! on the real model). A stored prompt is the same blocks the job reads, shared, not copied.

use std::any::Any;
use std::time::Instant;

use super::{
    Backend, BackendKind, Blocks, Input, JobKv, PromptStores, Reuse, StepOut, kv_mut, kv_ref,
};
use crate::engine::EngineError;
use crate::engine::cpu::kv_pool::{BLOCK_POSITIONS, PoolStats};
use crate::engine::cpu::model::{CpuCache, CpuModel, Part, Workspace};
use crate::engine::model_config::TransformerConfig;
use crate::engine::prefix_cache::PrefixHit;

/// The CPU fast path with its forward workspace and prompt stores.
pub struct CpuBackend {
    model: CpuModel,
    workspace: Workspace,
    stores: PromptStores<CpuCache>,
}

impl CpuBackend {
    pub fn new(model: CpuModel) -> CpuBackend {
        CpuBackend {
            model,
            workspace: Workspace::default(),
            stores: PromptStores::new(0),
        }
    }

    /// The model (tests run it directly).
    pub fn model(&self) -> &CpuModel {
        &self.model
    }
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::CpuFastPath
    }

    fn config(&self) -> &TransformerConfig {
        &self.model.config
    }

    fn max_context(&self) -> usize {
        self.model.max_context()
    }

    fn kv_bytes_per_position(&self) -> u64 {
        let c = &self.model.config;
        (c.n_layer * 2 * c.n_kv_head * c.head_dim * 4) as u64
    }

    fn block_positions(&self) -> u64 {
        BLOCK_POSITIONS as u64
    }

    fn blocks(&self) -> Option<Blocks> {
        Some(Blocks {
            positions: BLOCK_POSITIONS,
            bytes: self.model.kv_pool().block_bytes(),
            per_row: 0,
        })
    }

    fn kv_stats(&self) -> Option<PoolStats> {
        Some(self.model.kv_pool().stats())
    }

    fn multi_token_rows(&self) -> bool {
        true
    }

    fn set_prefix_budget(&mut self, bytes: usize) {
        self.stores = PromptStores::new(bytes);
    }

    fn prefix_budget(&self) -> u64 {
        self.stores.budget()
    }

    fn prefix_bytes(&self) -> Option<u64> {
        self.stores.bytes()
    }

    fn size_kv(&mut self, kv_budget: u64, _idle: bool) {
        let bytes = kv_budget.saturating_add(self.stores.budget());
        self.model.kv_pool().set_capacity_bytes(bytes);
    }

    fn new_job(&mut self, prompt_len: usize) -> Result<JobKv, EngineError> {
        Ok(Box::new(self.model.new_cache(prompt_len)))
    }

    /// The job's cache becomes one over the longest prefix the store holds (its blocks
    /// shared); any length is reused.
    fn look_up(
        &mut self,
        reuse: Reuse,
        prompt: &[u32],
        kv: &mut JobKv,
    ) -> Result<usize, EngineError> {
        let cache = kv_mut::<CpuCache>(kv)?;
        match self.stores.of(reuse).and_then(|s| s.lookup(prompt)) {
            Some(PrefixHit { len, value }) => {
                *cache =
                    CpuCache::on_prefix(value, len, prompt.len()).map_err(EngineError::Model)?;
                Ok(len)
            }
            None => Ok(0),
        }
    }

    /// Every input's positions in one [`CpuModel::forward_parts`]. A step with a prefill
    /// chunk counts as prefill (one call computes both).
    fn forward(
        &mut self,
        jobs: Vec<&mut JobKv>,
        inputs: &[Input],
        out: StepOut<'_>,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        let mut caches: Vec<Option<&mut CpuCache>> = jobs
            .into_iter()
            .map(|kv| kv.downcast_mut::<CpuCache>())
            .collect();
        let mut parts = Vec::with_capacity(inputs.len());
        for i in inputs {
            let cache = caches
                .get_mut(i.job)
                .and_then(Option::take)
                .ok_or_else(|| {
                    EngineError::Model("a job appears twice in one forward call".into())
                })?;
            parts.push(Part {
                tokens: &i.tokens,
                slots: &i.slots,
                cache,
                logits_at: &i.logits_at,
            });
        }
        let t0 = Instant::now();
        let logits = self
            .model
            .forward_parts(&mut parts, &mut self.workspace)
            .map_err(EngineError::Model)?;
        let t1 = Instant::now();
        let vocab = self.model.config.vocab_size;
        let fed: usize = inputs
            .iter()
            .filter_map(|i| i.rows.as_ref())
            .map(Vec::len)
            .sum();
        out.logits.begin(fed);
        let (mut chunk, mut k) = (None, 0);
        for (i, logits) in inputs.iter().zip(logits) {
            if i.rows.is_none() {
                chunk = Some(logits);
                continue;
            }
            for row in logits.chunks_exact(vocab) {
                out.logits.row_mut(k).copy_from_slice(row);
                k += 1;
            }
        }
        let split = out.split;
        split.prefill_steps += u64::from(chunk.is_some());
        split.decode_steps += u64::from(fed > 0);
        match chunk.is_some() {
            true => split.prefill += t1 - t0,
            false => split.forward_issued += t1 - t0,
        }
        split.readback += t1.elapsed();
        Ok(chunk)
    }

    /// The store gets the job's prompt blocks (the same blocks, rows left out).
    fn publish(&mut self, reuse: Reuse, prompt: &[u32], kv: &JobKv) -> bool {
        let (Some(store), Ok(cache)) = (self.stores.of(reuse), kv_ref::<CpuCache>(kv)) else {
            return false;
        };
        let cache = cache.prompt_part();
        let bytes = cache.shared_bytes();
        store.insert(prompt.to_vec(), cache, bytes);
        true
    }

    fn add_rows(
        &mut self,
        kv: &mut JobKv,
        n: usize,
        max_new: usize,
        _prompt_len: usize,
    ) -> Result<(), EngineError> {
        kv_mut::<CpuCache>(kv)?.add_rows(n, max_new);
        Ok(())
    }

    fn rewind_row(&self, kv: &mut JobKv, row: usize, n: usize) -> Result<(), EngineError> {
        kv_mut::<CpuCache>(kv)?
            .rewind_row(row, n)
            .map_err(EngineError::Model)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
