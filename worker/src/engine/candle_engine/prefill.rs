//! The prefill of a job's prompt in the fixed schedule (chunks of [`PREFILL_CHUNK`] from
//! position 0, the candle backend's and the CPU fast path's), and on the CPU path the prompt
//! prefix stores around it: a prefill starts after the longest prefix kept from an earlier
//! prompt of its kind, and a finished job's prompt is kept (rollouts and generations in stores
//! of their own, [`Reuse`]). Split from `candle_engine.rs`, whose
//! fields it uses.

use std::sync::Arc;

use candle_core::Tensor;

use super::{Backend, CandleEngine, DecodeCache, PREFILL_CHUNK, Reuse, store_of};
use crate::engine::EngineError;
use crate::engine::cpu::model::{CpuCache, CpuModel, Slot, Workspace};
use crate::engine::prefix_cache::PrefixStore;

impl CandleEngine {
    /// Logits of the last prompt token after the fixed prefill schedule (chunks of
    /// [`PREFILL_CHUNK`] from position 0), the prompt's cache, and the leading positions
    /// copied from the prefix store `reuse` names (on the CPU fast path).
    pub(super) fn prefill(
        &mut self,
        prompt: &[u32],
        reuse: Reuse,
    ) -> Result<(Vec<f32>, DecodeCache, usize), EngineError> {
        let me = |e: candle_core::Error| EngineError::Model(e.to_string());
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("empty prompt".into()));
        }
        match &self.model {
            Backend::Candle(model) => {
                let mut cache = model.new_cache(1, prompt.len()).map_err(me)?;
                let mut logits = None;
                for chunk in prompt.chunks(PREFILL_CHUNK) {
                    let input = Tensor::new(chunk, model.device())
                        .and_then(|t| t.unsqueeze(0))
                        .map_err(me)?;
                    logits = Some(model.forward(&input, &mut cache).map_err(me)?);
                }
                let v = logits
                    .ok_or_else(|| EngineError::InvalidRequest("empty prompt".into()))?
                    .squeeze(0)
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(me)?;
                Ok((v, DecodeCache::Candle(Some(cache)), 0))
            }
            Backend::Cpu(model) => {
                let store = store_of(&mut self.prefix, &mut self.generate_prefix, reuse);
                let (logits, cache, reused) =
                    cpu_prefill(model, prompt, store, &mut self.workspace)
                        .map_err(EngineError::Model)?;
                Ok((logits, DecodeCache::Cpu(cache), reused))
            }
        }
    }
}

/// The CPU fast path's prefill of `prompt`: the logits of its last token, its cache, and how
/// many leading positions were copied from `store` (0 without a store or on a miss).
///
/// The schedule is the fixed one (forward calls ending at multiples of [`PREFILL_CHUNK`] and
/// at the prompt's end), entered at the reused length. On this path a position's keys,
/// values and logits follow one recipe whatever the call they are computed in (see
/// [`crate::engine::cpu::kernels`]): so where the prefix ends changes no bit, which
/// `tests/prefix_cache.rs` checks on the real model. (The candle backend has no such
/// guarantee, and no prefix reuse.)
fn cpu_prefill(
    model: &CpuModel,
    prompt: &[u32],
    store: Option<&mut PrefixStore<Arc<CpuCache>>>,
    ws: &mut Workspace,
) -> Result<(Vec<f32>, CpuCache, usize), String> {
    let (mut cache, mut pos) = match store.and_then(|s| s.lookup(prompt)) {
        Some(hit) => (
            CpuCache::on_prefix(hit.value, hit.len, prompt.len())?,
            hit.len,
        ),
        None => (model.new_cache(prompt.len()), 0),
    };
    let reused = pos;
    let mut logits = Vec::new();
    while pos < prompt.len() {
        let end = ((pos / PREFILL_CHUNK + 1) * PREFILL_CHUNK).min(prompt.len());
        let chunk = &prompt[pos..end];
        let slots = vec![Slot::Shared; chunk.len()];
        logits = model.forward(chunk, &slots, &mut cache, chunk.len() - 1, ws)?;
        pos = end;
    }
    if logits.is_empty() {
        return Err("empty prompt".into());
    }
    Ok((logits, cache, reused))
}

/// Keeps a finished job's prompt blocks in `store`, which is on (its candidate rows dropped).
pub(super) fn keep(store: &mut PrefixStore<Arc<CpuCache>>, prompt: &[u32], cache: CpuCache) {
    let cache = cache.prompt_part();
    let bytes = cache.shared_bytes();
    store.insert(prompt.to_vec(), Arc::new(cache), bytes);
}
