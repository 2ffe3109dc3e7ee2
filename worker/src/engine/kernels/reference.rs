//! Each kernel's computation composed from plain candle ops (the way the unfused decode path
//! computes it): what [`super::self_check`] and the tests measure the kernels against. Not
//! built from the kernels' CPU references, so a mistake shared by a kernel and its CPU twin
//! still shows.

use candle_core::{D, DType, Device, Tensor};

use super::params::{QkvSpec, Rope, RopePairs};
use super::pool::BLOCK;

/// RMS norm with f32 statistics and an f32 weight over the last dimension, in `x`'s dtype.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?.contiguous()?;
    candle_nn::ops::rms_norm(&xf, w, eps)?.to_dtype(x.dtype())
}

/// `(x + residual, rms_norm(x + residual))`.
pub fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    w: &Tensor,
    eps: f32,
) -> candle_core::Result<(Tensor, Tensor)> {
    let s = (x + residual)?;
    let n = rms_norm(&s, w, eps)?;
    Ok((s, n))
}

/// `silu(gate) * up` from `gate | up`.
pub fn silu_mul(gate_up: &Tensor) -> candle_core::Result<Tensor> {
    let ff = gate_up.dim(D::Minus1)? / 2;
    let g = gate_up.narrow(D::Minus1, 0, ff)?;
    let u = gate_up.narrow(D::Minus1, ff, ff)?;
    candle_nn::ops::silu(&g)? * u
}

/// Heads `first..first+n` of `qkv` `(rows, width)`, normed by `norm` and rotated at each
/// row's position: `(rows, n, head_dim)`.
fn heads_rope(
    qkv: &Tensor,
    (first, n, d): (usize, usize, usize),
    norm: Option<&Tensor>,
    eps: f32,
    rope: &Rope,
    positions: &Tensor,
) -> candle_core::Result<Tensor> {
    let rows = qkv.dim(0)?;
    let x = qkv.narrow(1, first * d, n * d)?.reshape((rows, n, d))?;
    let x = match norm {
        Some(w) => rms_norm(&x, w, eps)?,
        None => x,
    };
    // RoPE as one sequence of `rows` positions, each at its own table row.
    let x = x.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
    let cos = rope.cos.index_select(positions, 0)?.contiguous()?;
    let sin = rope.sin.index_select(positions, 0)?.contiguous()?;
    let x = match rope.pairs {
        RopePairs::Interleaved => candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?,
        RopePairs::Halves => candle_nn::rotary_emb::rope(&x, &cos, &sin)?,
    };
    x.squeeze(0)?.transpose(0, 1)?.contiguous()
}

/// The rotated queries `(rows, n_head, head_dim)`.
pub fn q_norm_rope(
    qkv: &Tensor,
    spec: &QkvSpec,
    rope: &Rope,
    positions: &Tensor,
) -> candle_core::Result<Tensor> {
    let heads = (0, spec.n_head, spec.head_dim);
    heads_rope(qkv, heads, spec.q_norm, spec.eps, rope, positions)
}

/// The rotated keys and the values `(rows, n_kv, head_dim)` the write puts into the pool.
pub fn kv_norm_rope(
    qkv: &Tensor,
    spec: &QkvSpec,
    rope: &Rope,
    positions: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, d) = (qkv.dim(0)?, spec.head_dim);
    let heads = (spec.n_head, spec.n_kv, d);
    let k = heads_rope(qkv, heads, spec.k_norm, spec.eps, rope, positions)?;
    let v = qkv
        .narrow(1, (spec.n_head + spec.n_kv) * d, spec.n_kv * d)?
        .reshape((rows, spec.n_kv, d))?;
    Ok((k, v))
}

/// The keys and values `(slots, n_kv, head_dim)` a pool layer holds at `slots` (u32).
pub fn gather_slots(pool_layer: &Tensor, slots: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let (nb, _, _, n_kv, d) = pool_layer.dims5()?;
    let part = |i: usize| -> candle_core::Result<Tensor> {
        pool_layer
            .narrow(1, i, 1)?
            .contiguous()?
            .reshape((nb * BLOCK, n_kv, d))?
            .index_select(slots, 0)
    };
    Ok((part(0)?, part(1)?))
}

/// Dense decode attention of each row over its table's positions, in f32 with one softmax
/// (gathering the row's keys and values by slot first): `(rows, n_head, head_dim)` in `q`'s
/// dtype; zeros for a row of length 0 (a pad row). The table is the one
/// [`super::pool::row_table_tensor`] makes.
pub fn paged_decode_attention(
    q: &Tensor,
    pool_layer: &Tensor,
    table: &Tensor,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let (rows, n_head, d) = q.dims3()?;
    let n_kv = pool_layer.dim(3)?;
    let table = table.to_vec2::<u32>()?;
    let mut outs = Vec::with_capacity(rows);
    for (r, row) in table.iter().enumerate() {
        let len = row[0] as usize;
        if len == 0 {
            // A pad row attends to nothing: zeros, as the kernel gives.
            outs.push(Tensor::zeros((n_head, d), DType::F32, q.device())?);
            continue;
        }
        let slots: Vec<u32> = (0..len)
            .map(|p| row[1 + p / BLOCK] * BLOCK as u32 + (p % BLOCK) as u32)
            .collect();
        let slots = Tensor::from_vec(slots, len, &Device::Cpu)?.to_device(q.device())?;
        let (k, v) = gather_slots(pool_layer, &slots)?;
        let f32_heads = |x: &Tensor| x.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous();
        let (k, v) = (f32_heads(&k)?, f32_heads(&v)?); // (n_kv, len, d)
        let qr = q
            .get(r)?
            .to_dtype(DType::F32)?
            .reshape((n_kv, n_head / n_kv, d))?;
        let scores = (qr.matmul(&k.t()?)? * scale as f64)?;
        let w = candle_nn::ops::softmax_last_dim(&scores)?;
        outs.push(w.matmul(&v)?.reshape((n_head, d))?);
    }
    Tensor::stack(&outs, 0)?.to_dtype(q.dtype())
}

/// Causal attention of one job's chunk `q` `(C, n_head, head_dim)` at positions
/// `start..start + C` (`start` = the table's length less `C`) over the positions `0..start + C`
/// its one-row table holds, as the one-row prefill computes it: the keys and values gathered
/// by slot, the scores of every query head in one f32 matmul per KV head, an additive causal
/// mask, one softmax. A yardstick: it holds the chunk's `C × (start + C)` scores.
pub fn flash_prefill_attention(
    q: &Tensor,
    pool_layer: &Tensor,
    table: &Tensor,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let (c, n_head, d) = q.dims3()?;
    let n_kv = pool_layer.dim(3)?;
    let n_rep = n_head / n_kv;
    let row = table.to_vec2::<u32>()?.remove(0);
    let len = row[0] as usize;
    if len < c {
        candle_core::bail!("a table of {len} positions for a chunk of {c}")
    }
    let start = len - c;
    let slots: Vec<u32> = (0..len)
        .map(|p| row[1 + p / BLOCK] * BLOCK as u32 + (p % BLOCK) as u32)
        .collect();
    let slots = Tensor::from_vec(slots, len, &Device::Cpu)?.to_device(q.device())?;
    let (k, v) = gather_slots(pool_layer, &slots)?;
    let f32_heads = |x: &Tensor| x.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous();
    let (k, v) = (f32_heads(&k)?, f32_heads(&v)?); // (n_kv, len, d)
    // (C, n_kv, n_rep, d) -> (n_kv, n_rep * C, d): query heads of a KV head side by side.
    let qr = q
        .to_dtype(DType::F32)?
        .reshape((c, n_kv, n_rep, d))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((n_kv, n_rep * c, d))?;
    let scores = (qr.matmul(&k.t()?)? * scale as f64)?.reshape((n_kv, n_rep, c, len))?;
    let mask: Vec<f32> = (0..c * len)
        .map(|i| match i % len > start + i / len {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    let mask = Tensor::from_vec(mask, (c, len), q.device())?;
    let w = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    let y = w.reshape((n_kv, n_rep * c, len))?.matmul(&v)?; // (n_kv, n_rep * C, d)
    y.reshape((n_kv, n_rep, c, d))?
        .permute((2, 0, 1, 3))?
        .contiguous()?
        .reshape((c, n_head, d))?
        .to_dtype(q.dtype())
}

/// Writes keys and values `(rows, n_kv, head_dim)` into `pool_layer` at `slots` (host slot
/// ids; a [`super::pool::PAD_SLOT`] row is skipped) with one scatter: the K/V write of the
/// unfused path, and how a prefilled prompt's positions reach the pool.
pub fn write_slots(
    pool_layer: &Tensor,
    k: &Tensor,
    v: &Tensor,
    slots: &[u32],
) -> candle_core::Result<()> {
    let (nb, _, _, n_kv, d) = pool_layer.dims5()?;
    let (rows, w) = (slots.len(), n_kv * d);
    // The pool as rows of one position's heads: keys of slot s at row (s/B)*2B + s%B, values
    // B rows further.
    let flat = pool_layer.reshape((nb * 2 * BLOCK, w))?;
    let mut idx = Vec::with_capacity(2 * rows * w);
    for value in [0, BLOCK as u32] {
        for &s in slots {
            let row = match s {
                super::pool::PAD_SLOT => u32::MAX,
                s => (s / BLOCK as u32) * 2 * BLOCK as u32 + s % BLOCK as u32 + value,
            };
            idx.extend(std::iter::repeat_n(row, w));
        }
    }
    let idx = Tensor::from_vec(idx, (2 * rows, w), pool_layer.device())?;
    let src = Tensor::cat(&[k.reshape((rows, w))?, v.reshape((rows, w))?], 0)?;
    flat.scatter_set(&idx, &src.to_dtype(pool_layer.dtype())?, 0)
}
