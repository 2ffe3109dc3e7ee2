//! Flash prefill attention: one job's prefill chunk of `C` query rows at positions
//! `start..start + C` attends, causally, to the positions `0..start + C` the job's block table
//! holds in the [`PagedKvPool`](super::pool::PagedKvPool): the prefix (blocks shared by
//! reference, from the prefix store or earlier chunks) and the chunk itself, whose keys and
//! values were written into its slots just before (the K/V write of [`super::qkv_rope`] or its
//! composition). No causal mask is built and no `C × T` score matrix exists: each (row, head)
//! runs an online softmax over key tiles.
//!
//! The recipe, per (row at position `p`, head `h`, reading KV head `h / n_rep`): key positions
//! `0..=p` are cut into tiles of [`KEY_TILE`] starting at multiples of it, taken in ascending
//! order. With `m = -inf`, `l = 0`, `acc = 0`: for a tile, the scores `s_j = scale * Σ_e q_e
//! k_je` in f32, the tile's maximum `m_t`, `m' = max(m, m_t)`, `c = exp(m - m')`; then
//! `l = l c` and `acc = acc c`, and for each position in ascending order `e_j = exp(s_j - m')`,
//! `l += e_j`, `acc += e_j v_j`; `m = m'`. The output is `acc / l` in the query's dtype. The
//! order depends on the row's position alone: not on the chunk, its length, or where the chunk
//! starts, so a row gives the same bits in any chunking of the same keys and values.
//!
//! The CPU reference ([`candle_core::CustomOp3::cpu_fwd`]) sums each dot product
//! sequentially; the CUDA kernel (`flash_prefill_*` in `worker/kernels/paged_attention.cu`)
//! sums it as a fixed warp butterfly and everything else in the recipe's order, so the two
//! agree to rounding. The reference holds one tile of scores per (row, head), never the
//! chunk's score matrix.
//!
//! Inputs: `q` `(C, n_head, head_dim)`, the pool layer `(num_blocks, 2, BLOCK, n_kv, head_dim)`
//! in the same dtype (f32 or bf16), and the job's table as one row of
//! [`super::pool::row_table_tensor`] (`(1, 1 + blocks)`: its length `start + C`, then its
//! blocks). Output `(C, n_head, head_dim)` in `q`'s dtype.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::cpu_slice;
use super::params::{KEY_TILE, PrefillDims, prefill_dims};
use super::pool::BLOCK;

/// The flash prefill attention op. See the module header.
#[derive(Debug, Clone, Copy)]
pub struct FlashPrefill {
    pub scale: f32,
}

/// Flash prefill attention of the chunk `q` over `pool_layer` through `table` (see the
/// module header).
pub fn flash_prefill_attention(
    q: &Tensor,
    pool_layer: &Tensor,
    table: &Tensor,
    scale: f32,
) -> candle_core::Result<Tensor> {
    if q.dtype() != pool_layer.dtype() || table.dtype() != DType::U32 {
        candle_core::bail!(
            "flash prefill: q {:?}, pool {:?}, table {:?} (want equal dtypes and a u32 table)",
            q.dtype(),
            pool_layer.dtype(),
            table.dtype()
        )
    }
    q.contiguous()?.apply_op3_no_bwd(
        &pool_layer.contiguous()?,
        &table.contiguous()?,
        &FlashPrefill { scale },
    )
}

/// The chunk's first position: the table's length less the chunk's rows. Checks the table
/// holds its length in blocks of the pool.
pub(super) fn chunk_start(table: &[u32], dims: &PrefillDims) -> candle_core::Result<usize> {
    let len = table[0] as usize;
    let blocks = &table[1..];
    let held = len.div_ceil(BLOCK);
    if len < dims.rows
        || held > blocks.len()
        || blocks[..held]
            .iter()
            .any(|&b| b as usize >= dims.num_blocks)
    {
        candle_core::bail!(
            "flash prefill: a table of {len} positions does not hold a chunk of {} rows",
            dims.rows
        )
    }
    Ok(len - dims.rows)
}

/// One (row, head): the recipe of the module header over positions `0..=pos`.
fn row_head<T: WithDType>(
    q: &[f32],
    pool: &[T],
    blocks: &[u32],
    (pos, kvh, n_kv, scale): (usize, usize, usize, f32),
    out: &mut [T],
) {
    let d = q.len();
    let at = |p: usize, kv: usize| {
        let b = blocks[p / BLOCK] as usize;
        (((b * 2 + kv) * BLOCK + p % BLOCK) * n_kv + kvh) * d
    };
    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
    let mut acc = vec![0f32; d];
    let mut scores = [0f32; KEY_TILE];
    for t0 in (0..=pos).step_by(KEY_TILE) {
        let n = KEY_TILE.min(pos + 1 - t0);
        for (j, s) in scores[..n].iter_mut().enumerate() {
            let k = &pool[at(t0 + j, 0)..at(t0 + j, 0) + d];
            let dot = q
                .iter()
                .zip(k)
                .fold(0f32, |s, (a, b)| s + a * b.to_f64() as f32);
            *s = dot * scale;
        }
        let m_tile = scores[..n].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let m_new = m.max(m_tile);
        let c = (m - m_new).exp();
        l *= c;
        acc.iter_mut().for_each(|a| *a *= c);
        for (j, s) in scores[..n].iter().enumerate() {
            let e = (s - m_new).exp();
            l += e;
            let v = &pool[at(t0 + j, 1)..at(t0 + j, 1) + d];
            for (a, x) in acc.iter_mut().zip(v) {
                *a += e * x.to_f64() as f32;
            }
        }
        m = m_new;
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = T::from_f64((a / l) as f64);
    }
}

fn cpu_prefill<T: WithDType>(
    q: &[T],
    pool: &[T],
    table: &[u32],
    dims: PrefillDims,
    scale: f32,
) -> candle_core::Result<Vec<T>> {
    let PrefillDims {
        n_head, n_kv, d, ..
    } = dims;
    if q.len() != dims.rows * n_head * d || table.len() != dims.width {
        candle_core::bail!("flash prefill: inputs of {} rows do not fit", dims.rows)
    }
    let start = chunk_start(table, &dims)?;
    let n_rep = n_head / n_kv;
    let mut out = vec![T::from_f64(0.0); q.len()];
    out.par_chunks_mut(d).enumerate().for_each(|(rh, out)| {
        let (r, h) = (rh / n_head, rh % n_head);
        let qf: Vec<f32> = q[rh * d..(rh + 1) * d]
            .iter()
            .map(|x| x.to_f64() as f32)
            .collect();
        let at = (start + r, h / n_rep, n_kv, scale);
        row_head(&qf, pool, &table[1..], at, out);
    });
    Ok(out)
}

impl candle_core::CustomOp3 for FlashPrefill {
    fn name(&self) -> &'static str {
        "stageb-flash-prefill"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = prefill_dims(l1.shape(), l2.shape(), l3.shape())?;
        let table = cpu_slice::<u32>(s3, l3)?;
        let storage = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(cpu_prefill(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                table,
                dims,
                self.scale,
            )?),
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => CpuStorage::BF16(cpu_prefill(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                table,
                dims,
                self.scale,
            )?),
            _ => candle_core::bail!("flash prefill: f32 or bf16 inputs of one dtype"),
        };
        Ok((storage, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let dims = prefill_dims(l1.shape(), l2.shape(), l3.shape())?;
        let out = super::cuda::flash_prefill(self.scale, dims, (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, l1.shape().clone()))
    }
}
