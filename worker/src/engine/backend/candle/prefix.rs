//! The candle backend's prompt prefix stores: a prefill starts after the longest run of whole
//! chunks ([`PREFILL_CHUNK`]) kept from an earlier prompt of its kind, and a job's prompt's
//! whole chunks are kept ([`Kept`]). Only whole chunks: a chunk's arithmetic depends on its
//! shape, and whole chunks have the same shapes in every prompt that holds them.

use super::paged::{Held, PagedJob};
use crate::engine::backend::PREFILL_CHUNK;
use crate::engine::prefix_cache::PrefixStore;
use crate::engine::transformer::{KvCache, KvPrefix};

/// A prompt a store keeps: a copy of its whole chunks' keys and values (lockstep), or a table
/// sharing their blocks of the paged pool.
#[derive(Debug)]
pub(super) enum Kept {
    Lockstep(KvPrefix),
    Paged(Held),
}

/// A prefix store of the candle backend's prompts.
type Store = PrefixStore<Kept>;

/// Keeps the whole chunks of a lockstep job's prompt (`cache`: its one-row prompt cache, or the
/// expanded cache whose rows share it) in `store`, which is on; nothing for a prompt shorter
/// than a chunk. The entry's tokens are the kept ones, so a match never runs past them.
pub(super) fn keep_lockstep(
    store: &mut Store,
    prompt: &[u32],
    cache: &KvCache,
) -> candle_core::Result<()> {
    let whole = prompt.len() / PREFILL_CHUNK * PREFILL_CHUNK;
    // A wave of jobs with the same head: the first one's copy serves, the others make none.
    if whole > 0 && !store.refresh(&prompt[..whole]) {
        let p = cache.prefix(whole)?;
        let bytes = p.bytes();
        store.insert(prompt[..whole].to_vec(), Kept::Lockstep(p), bytes);
    }
    Ok(())
}

/// Starts the empty one-row `cache` of `prompt` after the longest run of whole chunks the
/// store holds for it; returns the positions reused (0 on a miss or without a store). The
/// store only saves work: a prefix that cannot be loaded (device memory) is a miss, logged.
pub(super) fn lockstep_lookup(
    store: Option<&mut Store>,
    prompt: &[u32],
    cache: &mut KvCache,
) -> usize {
    let Some(hit) = store.and_then(|s| s.lookup(prompt)) else {
        return 0;
    };
    let Kept::Lockstep(p) = hit.value else {
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
/// chunks the store holds for it: its prompt table shares their blocks, and its one-row
/// prefill cache, if it has one, gets a copy of their keys and values (that prefill attends
/// to them; the flash prefill reads the shared blocks). Returns the positions reused (0 on a
/// miss, without a store, or when the prefix cannot be read: logged).
pub(super) fn paged_lookup(store: Option<&mut Store>, prompt: &[u32], job: &mut PagedJob) -> usize {
    let Some(hit) = store.and_then(|s| s.lookup(prompt)) else {
        return 0;
    };
    let Kept::Paged(stored) = hit.value else {
        return 0;
    };
    let whole = hit.len / PREFILL_CHUNK * PREFILL_CHUNK;
    if whole == 0 || !stored.same_pool(&job.prompt) || job.prompt.len() != 0 {
        return 0;
    }
    let loaded = stored
        .share(whole)
        .map_err(|e| e.to_string())
        .and_then(|table| {
            if let Some(cache) = job.prefill.as_mut() {
                let layers = stored.read(whole).map_err(|e| e.to_string())?;
                let prefix = KvPrefix::from_positions(layers).map_err(|e| e.to_string())?;
                cache
                    .load_prefix(&prefix, whole)
                    .map_err(|e| e.to_string())?;
            }
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
