//! The prefill of a job's prompt in the fixed schedule (chunks of [`PREFILL_CHUNK`] from
//! position 0, the candle backend's and the CPU fast path's), and the prompt prefix stores
//! around it: a prefill starts after the longest prefix kept from an earlier prompt of its
//! kind, and a job's prompt is kept ([`Kept`]; rollouts and generations in stores of their
//! own, [`Reuse`]). On the CPU path any prefix length is reused (a position's arithmetic does
//! not depend on the call that computes it); on the candle backend only whole chunks (a
//! chunk's arithmetic depends on its shape, and whole chunks have the same shapes in every
//! prompt that holds them). Split from `candle_engine.rs`, whose fields it uses.

use candle_core::Tensor;

use super::paged::{Held, PagedJob};
use super::{Backend, CandleEngine, DecodeCache, PREFILL_CHUNK, Reuse, chunk_end, store_of};
use crate::engine::EngineError;
use crate::engine::cpu::model::{CpuCache, CpuModel, Slot, Workspace};
use crate::engine::prefix_cache::{PrefixHit, PrefixStore};
use crate::engine::transformer::{KvCache, KvPrefix};

/// A prompt the prefix store keeps: the CPU path's blocks (shared with the jobs that read
/// them), or on the candle backend a copy of its whole chunks' keys and values.
#[derive(Debug)]
pub(super) enum Kept {
    Cpu(CpuCache),
    Candle(KvPrefix),
    /// The paged path's prompt: a table sharing its whole chunks' blocks.
    Paged(Held),
}

/// A prefix store of either backend's prompts.
pub(super) type Store = PrefixStore<Kept>;

impl CandleEngine {
    /// Logits of the last prompt token after the fixed prefill schedule (chunks of
    /// [`PREFILL_CHUNK`] from position 0), the prompt's cache, and the leading positions
    /// taken from the prefix store `reuse` names (any length on the CPU fast path, whole
    /// chunks on the candle backend).
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
                let store = store_of(&mut self.prefix, &mut self.generate_prefix, reuse);
                let reused = candle_lookup(store, prompt, &mut cache);
                let (mut logits, mut pos) = (None, reused);
                while pos < prompt.len() {
                    let end = chunk_end(pos, prompt.len());
                    let input = Tensor::new(&prompt[pos..end], model.device())
                        .and_then(|t| t.unsqueeze(0))
                        .map_err(me)?;
                    logits = Some(model.forward(&input, &mut cache).map_err(me)?);
                    pos = end;
                }
                let v = logits
                    .ok_or_else(|| EngineError::InvalidRequest("empty prompt".into()))?
                    .squeeze(0)
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(me)?;
                Ok((v, DecodeCache::Candle(Some(cache)), reused))
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
/// `tests/prefix_cache.rs` checks on the real model.
fn cpu_prefill(
    model: &CpuModel,
    prompt: &[u32],
    store: Option<&mut Store>,
    ws: &mut Workspace,
) -> Result<(Vec<f32>, CpuCache, usize), String> {
    let (mut cache, mut pos) = match cpu_lookup(store, prompt)? {
        Some(hit) => hit,
        None => (model.new_cache(prompt.len()), 0),
    };
    let reused = pos;
    let mut logits = Vec::new();
    while pos < prompt.len() {
        let end = chunk_end(pos, prompt.len());
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

/// A CPU-path cache of `prompt` over the longest prefix the store holds for it (its blocks
/// shared), and that prefix's length; `None` on a miss or without a store.
pub(super) fn cpu_lookup(
    store: Option<&mut Store>,
    prompt: &[u32],
) -> Result<Option<(CpuCache, usize)>, String> {
    match store.and_then(|s| s.lookup(prompt)) {
        Some(PrefixHit {
            len,
            value: Kept::Cpu(c),
        }) => Ok(Some((CpuCache::on_prefix(c, len, prompt.len())?, len))),
        _ => Ok(None),
    }
}

/// Keeps a job's prompt blocks in `store`, which is on (the same blocks, rows left out).
pub(super) fn keep(store: &mut Store, prompt: &[u32], cache: &CpuCache) {
    let cache = cache.prompt_part();
    let bytes = cache.shared_bytes();
    store.insert(prompt.to_vec(), Kept::Cpu(cache), bytes);
}

/// Keeps the whole chunks of a candle job's prompt (`cache`: its one-row prompt cache, or the
/// expanded cache whose rows share it) in `store`, which is on; nothing for a prompt shorter
/// than a chunk. The entry's tokens are the kept ones, so a match never runs past them.
pub(super) fn keep_candle(
    store: &mut Store,
    prompt: &[u32],
    cache: &KvCache,
) -> candle_core::Result<()> {
    let whole = prompt.len() / PREFILL_CHUNK * PREFILL_CHUNK;
    // A wave of jobs with the same head: the first one's copy serves, the others make none.
    if whole > 0 && !store.refresh(&prompt[..whole]) {
        let p = cache.prefix(whole)?;
        let bytes = p.bytes();
        store.insert(prompt[..whole].to_vec(), Kept::Candle(p), bytes);
    }
    Ok(())
}

/// Starts the empty one-row `cache` of `prompt` after the longest run of whole chunks the
/// store holds for it; returns the positions reused (0 on a miss or without a store). The
/// store only saves work: a prefix that cannot be loaded (device memory) is a miss, logged.
pub(super) fn candle_lookup(
    store: Option<&mut Store>,
    prompt: &[u32],
    cache: &mut KvCache,
) -> usize {
    let Some(hit) = store.and_then(|s| s.lookup(prompt)) else {
        return 0;
    };
    let Kept::Candle(p) = hit.value else {
        return 0;
    };
    let whole = hit.len / PREFILL_CHUNK * PREFILL_CHUNK;
    if whole == 0 {
        return 0;
    }
    match cache.load_prefix(p, whole) {
        Ok(()) => whole,
        Err(e) => {
            tracing::debug!("stored prefix not reused: {e}");
            0
        }
    }
}

/// Keeps the whole chunks of a paged job's sealed prompt in `store`, which is on: a table
/// sharing their blocks (no copy). Nothing for a prompt shorter than a chunk, or not yet in
/// the pool.
pub(super) fn keep_paged(store: &mut Store, prompt: &[u32], job: &PagedJob) {
    let whole = prompt.len() / PREFILL_CHUNK * PREFILL_CHUNK;
    if whole == 0 || job.prompt.len() < whole || store.refresh(&prompt[..whole]) {
        return;
    }
    match job.prompt.share(whole) {
        Ok(held) => {
            let bytes = held.bytes();
            store.insert(prompt[..whole].to_vec(), Kept::Paged(held), bytes);
        }
        Err(e) => tracing::debug!("prompt not kept for reuse: {e}"),
    }
}

/// Starts the paged `job` of `prompt` (nothing prefilled yet) after the longest run of whole
/// chunks the store holds for it: its prompt table shares their blocks, and its prefill cache
/// gets a copy of their keys and values (the prefill attends to them). Returns the positions
/// reused (0 on a miss, without a store, or when the prefix cannot be read: logged).
pub(super) fn paged_lookup(store: Option<&mut Store>, prompt: &[u32], job: &mut PagedJob) -> usize {
    let Some(hit) = store.and_then(|s| s.lookup(prompt)) else {
        return 0;
    };
    let Kept::Paged(stored) = hit.value else {
        return 0;
    };
    let whole = hit.len / PREFILL_CHUNK * PREFILL_CHUNK;
    let Some(cache) = job.prefill.as_mut() else {
        return 0;
    };
    if whole == 0 || !stored.same_pool(&job.prompt) || job.prompt.len() != 0 {
        return 0;
    }
    let loaded = stored
        .share(whole)
        .map_err(|e| e.to_string())
        .and_then(|table| {
            let layers = stored.read(whole).map_err(|e| e.to_string())?;
            let prefix = KvPrefix::from_positions(layers).map_err(|e| e.to_string())?;
            cache
                .load_prefix(&prefix, whole)
                .map_err(|e| e.to_string())?;
            Ok(table)
        });
    match loaded {
        Ok(table) => {
            job.prompt = table;
            whole
        }
        Err(e) => {
            tracing::debug!("stored prefix not reused: {e}");
            0
        }
    }
}
