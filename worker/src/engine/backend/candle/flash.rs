//! The flash prefill on the paged path (the `flash_prefill` engine switch, where the kernel
//! passed its self-check): a prompt chunk takes its slots at the end of the job's prompt table
//! and goes through
//! [`Transformer::forward_prefill_paged`](crate::engine::transformer::Transformer::forward_prefill_paged),
//! which writes its keys and values there and attends over the pool. Nothing is copied into
//! the pool afterwards: the table holds the prompt as it is prefilled, and a prefix shared
//! from the store is read through its blocks.

use super::me;
use super::paged::{PagedJob, lock};
use crate::engine::EngineError;
use crate::engine::kernels::KernelUse;
use crate::engine::transformer::{PagedChunk, Transformer};

/// One prompt chunk of `job` (which has no one-row prefill cache) into the pool: the logits of
/// its last token.
pub(super) fn prefill_chunk(
    model: &Transformer,
    kernels: &KernelUse,
    tokens: &[u32],
    job: &mut PagedJob,
) -> Result<Vec<f32>, EngineError> {
    let prompt = &mut job.prompt;
    let mut pool = lock(&prompt.pool);
    let slots = pool
        .append_slots(&mut prompt.table, tokens.len())
        .map_err(me)?;
    let chunk = PagedChunk::new(tokens, &prompt.table, slots, model.device()).map_err(me)?;
    let logits = model
        .forward_prefill_paged(&chunk, &pool, kernels)
        .map_err(me)?;
    drop(pool);
    logits.to_vec1().map_err(me)
}
