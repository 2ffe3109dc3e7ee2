//! Batched paged decode attention: one query position per row, for all rows of all jobs in one
//! op, over the [`PagedKvPool`](super::pool::PagedKvPool)'s blocks through each row's table.
//!
//! Batch invariance by construction: every (row, head) is reduced in one fixed order that
//! depends only on that row's length, never on the batch. A row's positions are cut into
//! partitions of [`PARTITION`] positions (a fixed size, so the count depends only on the row's
//! own length); in each partition the scores are `scale * Σ_j q_j k_j` in f32, the partition's
//! maximum `m_p`, its sum `l_p = Σ exp(s - m_p)` and its weighted values
//! `acc_p = Σ exp(s - m_p) v` (positions ascending); the partitions are then merged in
//! ascending order: `M = max m_p`, `out = Σ_p acc_p e^(m_p - M) / Σ_p l_p e^(m_p - M)`.
//!
//! The CPU reference ([`candle_core::CustomOp3::cpu_fwd`]) sums each dot product and each
//! partition sum sequentially; the CUDA kernel (`worker/kernels/paged_attention.cu`) sums a
//! dot product as a fixed warp butterfly and a partition's `l_p` as a fixed block tree, and
//! `acc_p` sequentially like the CPU. So CPU and CUDA agree to rounding, and each is
//! bit-for-bit the same for a row whatever else is in the batch.
//!
//! Inputs: `q` `(rows, n_head, head_dim)`, the pool layer
//! `(num_blocks, 2, BLOCK, n_kv, head_dim)` in the same dtype (f32 or bf16), and the row table
//! of [`super::pool::row_table_tensor`]. Output `(rows, n_head, head_dim)` in `q`'s dtype.
//!
//! The CUDA partial step has two kernels computing the same bits (`decode_attn=v1|v2`,
//! [`set_decode_attn_v1`](super::params::set_decode_attn_v1)); v2, the default, keeps more loads in flight.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::cpu_slice;
use super::params::{AttnDims, PARTITION, attn_dims};
use super::pool::BLOCK;

/// The paged decode attention op. See the module header.
#[derive(Debug, Clone, Copy)]
pub struct PagedDecodeAttention {
    pub scale: f32,
    /// On CUDA, the first partial kernel (`decode_attn=v1`) rather than v2 (the same bits).
    pub v1: bool,
}

/// Batched paged decode attention over `pool_layer` (see the module header), on CUDA with the
/// partial kernel the engine's `decode_attn` switch chose.
pub fn paged_decode_attention(
    q: &Tensor,
    pool_layer: &Tensor,
    table: &Tensor,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let v1 = super::params::decode_attn_v1();
    paged_decode_attention_with(q, pool_layer, table, scale, v1)
}

/// [`paged_decode_attention`] with the partial kernel named: `v1` or v2 (CUDA; the CPU has one).
pub fn paged_decode_attention_with(
    q: &Tensor,
    pool_layer: &Tensor,
    table: &Tensor,
    scale: f32,
    v1: bool,
) -> candle_core::Result<Tensor> {
    if q.dtype() != pool_layer.dtype() || table.dtype() != DType::U32 {
        candle_core::bail!(
            "paged attention: q {:?}, pool {:?}, table {:?} (want equal dtypes and a u32 table)",
            q.dtype(),
            pool_layer.dtype(),
            table.dtype()
        )
    }
    q.contiguous()?.apply_op3_no_bwd(
        &pool_layer.contiguous()?,
        &table.contiguous()?,
        &PagedDecodeAttention { scale, v1 },
    )
}

/// One (row, head)'s partial over positions `start..end`: `(m, l, acc)`.
fn partition<T: WithDType>(
    q: &[f32],
    pool: &[T],
    blocks: &[u32],
    (start, end): (usize, usize),
    (kvh, n_kv, d, scale): (usize, usize, usize, f32),
    acc: &mut [f32],
) -> (f32, f32) {
    let at = |pos: usize, kv: usize| {
        let b = blocks[pos / BLOCK] as usize;
        (((b * 2 + kv) * BLOCK + pos % BLOCK) * n_kv + kvh) * d
    };
    let scores: Vec<f32> = (start..end)
        .map(|pos| {
            let k = &pool[at(pos, 0)..at(pos, 0) + d];
            let dot = q
                .iter()
                .zip(k)
                .fold(0f32, |s, (a, b)| s + a * b.to_f64() as f32);
            dot * scale
        })
        .collect();
    let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    acc.fill(0.0);
    let mut l = 0f32;
    for (i, s) in scores.iter().enumerate() {
        let e = (s - m).exp();
        l += e;
        let v = &pool[at(start + i, 1)..at(start + i, 1) + d];
        for (a, x) in acc.iter_mut().zip(v) {
            *a += e * x.to_f64() as f32;
        }
    }
    (m, l)
}

fn cpu_attention<T: WithDType>(
    q: &[T],
    pool: &[T],
    table: &[u32],
    dims: AttnDims,
    scale: f32,
) -> candle_core::Result<Vec<T>> {
    let AttnDims {
        n_head,
        n_kv,
        d,
        num_blocks,
        width,
        ..
    } = dims;
    let n_rep = n_head / n_kv;
    if q.len() != dims.rows * n_head * d || table.len() != dims.rows * width {
        candle_core::bail!("paged attention: inputs of {} rows do not fit", dims.rows)
    }
    for row in table.chunks(width) {
        let len = row[0] as usize;
        let blocks = &row[1..];
        if len.div_ceil(BLOCK) > blocks.len()
            || blocks[..len.div_ceil(BLOCK)]
                .iter()
                .any(|&b| b as usize >= num_blocks)
        {
            candle_core::bail!("paged attention: a row's table does not hold its {len} positions")
        }
    }
    let mut out = vec![T::from_f64(0.0); q.len()];
    out.par_chunks_mut(d).enumerate().for_each(|(rh, out)| {
        let (r, h) = (rh / n_head, rh % n_head);
        let row = &table[r * width..(r + 1) * width];
        let len = row[0] as usize;
        let qf: Vec<f32> = q[rh * d..(rh + 1) * d]
            .iter()
            .map(|x| x.to_f64() as f32)
            .collect();
        let parts = len.div_ceil(PARTITION);
        let mut accs = vec![0f32; parts * d];
        let mut ml = Vec::with_capacity(parts);
        for (p, acc) in accs.chunks_mut(d).enumerate() {
            let span = (p * PARTITION, len.min((p + 1) * PARTITION));
            ml.push(partition(
                &qf,
                pool,
                &row[1..],
                span,
                (h / n_rep, n_kv, d, scale),
                acc,
            ));
        }
        merge_partitions(&ml, &accs, out);
    });
    Ok(out)
}

/// Merges partitions in ascending order (see the module header); zeros for an empty row.
fn merge_partitions<T: WithDType>(ml: &[(f32, f32)], accs: &[f32], out: &mut [T]) {
    let d = out.len();
    let big_m = ml.iter().fold(f32::NEG_INFINITY, |a, &(m, _)| a.max(m));
    let big_l = ml.iter().fold(0f32, |s, &(m, l)| s + l * (m - big_m).exp());
    for (j, o) in out.iter_mut().enumerate() {
        let num = ml.iter().enumerate().fold(0f32, |s, (p, &(m, _))| {
            s + accs[p * d + j] * (m - big_m).exp()
        });
        let v = if big_l > 0.0 { num / big_l } else { 0.0 };
        *o = T::from_f64(v as f64);
    }
}

impl candle_core::CustomOp3 for PagedDecodeAttention {
    fn name(&self) -> &'static str {
        "stageb-paged-decode-attention"
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
        let dims = attn_dims(l1.shape(), l2.shape(), l3.shape())?;
        let table = cpu_slice::<u32>(s3, l3)?;
        let storage = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(cpu_attention(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                table,
                dims,
                self.scale,
            )?),
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => CpuStorage::BF16(cpu_attention(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                table,
                dims,
                self.scale,
            )?),
            _ => candle_core::bail!("paged attention: f32 or bf16 inputs of one dtype"),
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
        let dims = attn_dims(l1.shape(), l2.shape(), l3.shape())?;
        let kernel = (self.scale, self.v1);
        let out = super::cuda::paged_attention(kernel, dims, (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, l1.shape().clone()))
    }
}
