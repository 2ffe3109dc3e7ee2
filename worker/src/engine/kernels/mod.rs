//! Kernels of the candle backend's decode step and prefill, each a candle op with a CPU
//! reference of the very same computation (run on CPU and in CI) and a CUDA kernel
//! (`worker/kernels/*.cu`, compiled to PTX at build time under the `cuda` feature), and the
//! paged KV pool they read and write. The candle backend runs them behind the `paged`, `fused` and `flash_prefill`
//! engine switches ([`dispatch`]), only those the device's [`self_check`] found right.
//!
//! # Modules
//! - [`pool`]: the paged KV pool (blocks, reference counts, copy-on-write, slot mapping).
//! - [`paged_attention`]: batched paged decode attention, one fixed reduction order per
//!   (row, head) whatever the batch.
//! - [`flash_prefill`]: one job's prefill chunk attending over the pool, an online softmax
//!   over fixed key tiles (no mask, no score matrix).
//! - [`fused`]: residual add + RMS norm, SiLU·mul.
//! - [`qkv_rope`]: q/k norm + RoPE, and the K/V write into the pool.
//! - [`params`]: the parameter types and shape checks the ops and launches share.
//! - [`weights`]: Q/K/V and gate/up weights concatenated at load (one GEMM each).
//! - [`reference`]: each kernel's composition from plain candle ops (the self-check's and
//!   the tests' yardstick).
//! - [`self_check`]: each kernel against its composition on the device; which are usable.
//! - [`dispatch`]: the kernels a step runs, each else its composition.

use candle_core::{CpuStorage, Layout, Storage, Tensor, WithDType};

#[cfg(feature = "cuda")]
mod cuda;
pub mod dispatch;
pub mod flash_prefill;
pub mod fused;
pub mod paged_attention;
pub mod params;
pub mod pool;
pub mod qkv_rope;
pub mod reference;
pub mod self_check;
pub mod weights;

#[cfg(test)]
mod tests;

pub use dispatch::KernelUse;
pub use flash_prefill::flash_prefill_attention;
pub use fused::{add_rms_norm, silu_mul};
pub use paged_attention::{paged_decode_attention, paged_decode_attention_with};
pub use params::{KEY_TILE, PARTITION, QkvSpec, Rope, RopePairs};
pub use pool::{BLOCK, BlockTable, PAD_SLOT, PagedKvPool, PoolError, PoolShape, row_table_tensor};
pub use qkv_rope::{kv_norm_rope_write, q_norm_rope};
pub use self_check::{
    AttnShape, KernelCheck, KernelId, SelfCheckReport, self_check, self_check_for, suffix_known,
};

fn shape_err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// `s`'s elements under `l` (which must be contiguous) as `T`.
fn cpu_slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| shape_err("a kernel input must be contiguous".into()))?;
    Ok(&s.as_slice::<T>()?[a..b])
}

/// Runs `f` on `t`'s CPU storage (an op's extra input, held by the op).
fn with_cpu<R>(
    t: &Tensor,
    f: impl FnOnce(&CpuStorage, &Layout) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(c) => f(c, l),
        _ => candle_core::bail!("a kernel's extra input is not on the CPU like its main input"),
    }
}

/// Reads a CPU tensor's contiguous data as `T` (a helper for ops holding extra inputs).
fn cpu_vec<T: WithDType>(t: &Tensor) -> candle_core::Result<Vec<T>> {
    with_cpu(t, |s, l| Ok(cpu_slice::<T>(s, l)?.to_vec()))
}
