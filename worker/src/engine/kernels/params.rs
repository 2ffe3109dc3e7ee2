//! The kernels' parameter types and shape checks, shared by the ops, their CUDA launches and
//! the reference compositions; and which partial kernel the CUDA decode attention launches
//! (`decode_attn`, set from the engine's switches at load).

use candle_core::{DType, Layout, Shape, Tensor};

use super::pool::BLOCK;
use super::shape_err;

/// Positions per partition of one (row, head)'s reduction: fixed, never chosen by the batch.
pub const PARTITION: usize = 512;

/// Key positions per tile of the flash prefill's online softmax: fixed, and tiles start at
/// multiples of it, so a query row's reduction order depends on its position alone.
pub const KEY_TILE: usize = 32;

/// Dimensions read from the inputs' shapes.
#[derive(Debug, Clone, Copy)]
pub(super) struct AttnDims {
    pub rows: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub d: usize,
    pub num_blocks: usize,
    pub width: usize,
}

pub(super) fn attn_dims(q: &Shape, pool: &Shape, table: &Shape) -> candle_core::Result<AttnDims> {
    let (rows, n_head, d) = q.dims3()?;
    let (num_blocks, two, block, n_kv, d2) = pool.dims5()?;
    let (rows2, width) = table.dims2()?;
    if two != 2 || block != BLOCK || d2 != d || rows2 != rows || width == 0 {
        return Err(shape_err(format!(
            "paged attention: q {q:?}, pool {pool:?}, table {table:?} do not fit"
        )));
    }
    if n_kv == 0 || !n_head.is_multiple_of(n_kv) {
        return Err(shape_err(format!("{n_head} heads over {n_kv} KV heads")));
    }
    Ok(AttnDims {
        rows,
        n_head,
        n_kv,
        d,
        num_blocks,
        width,
    })
}

/// Dimensions of a flash prefill: `rows` query rows of one job (its chunk), the table one row.
#[derive(Debug, Clone, Copy)]
pub(super) struct PrefillDims {
    pub rows: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub d: usize,
    pub num_blocks: usize,
    pub width: usize,
}

pub(super) fn prefill_dims(
    q: &Shape,
    pool: &Shape,
    table: &Shape,
) -> candle_core::Result<PrefillDims> {
    let (rows, n_head, d) = q.dims3()?;
    let (num_blocks, two, block, n_kv, d2) = pool.dims5()?;
    let (one, width) = table.dims2()?;
    if two != 2 || block != BLOCK || d2 != d || one != 1 || width < 2 || rows == 0 {
        return Err(shape_err(format!(
            "flash prefill: q {q:?}, pool {pool:?}, table {table:?} do not fit"
        )));
    }
    if n_kv == 0 || !n_head.is_multiple_of(n_kv) {
        return Err(shape_err(format!("{n_head} heads over {n_kv} KV heads")));
    }
    Ok(PrefillDims {
        rows,
        n_head,
        n_kv,
        d,
        num_blocks,
        width,
    })
}

/// How the two halves of a rotated pair sit in a head vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopePairs {
    /// Pairs `(2i, 2i+1)` (GGUF llama).
    Interleaved,
    /// Pairs `(i, i + d/2)` (HF checkpoints, Qwen).
    Halves,
}

/// The RoPE tables `(max_context, head_dim/2)` in the compute dtype and how pairs sit.
#[derive(Debug, Clone, Copy)]
pub struct Rope<'a> {
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub pairs: RopePairs,
}

/// How a concatenated `q|k|v` row is laid out and normalized.
#[derive(Debug, Clone, Copy)]
pub struct QkvSpec<'a> {
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    /// Per-head RMS norm weights `(head_dim,)` in f32 (Qwen3), or none.
    pub q_norm: Option<&'a Tensor>,
    pub k_norm: Option<&'a Tensor>,
    pub eps: f32,
}

impl QkvSpec<'_> {
    pub fn width(&self) -> usize {
        (self.n_head + 2 * self.n_kv) * self.head_dim
    }
}

/// The q/k norm + RoPE (+ K/V write) op of [`super::qkv_rope`]; the optional part is the `q|k|v` rows and the slots for the write.
pub struct QkvRope<'a> {
    pub(super) spec: QkvSpec<'a>,
    pub(super) rope: Rope<'a>,
    pub(super) positions: &'a Tensor,
    pub(super) write: Option<(&'a Tensor, &'a Tensor)>,
}

impl<'a> QkvRope<'a> {
    pub(super) fn new(
        spec: &QkvSpec<'a>,
        rope: &Rope<'a>,
        positions: &'a Tensor,
        write: Option<(&'a Tensor, &'a Tensor)>,
    ) -> candle_core::Result<Self> {
        let d = spec.head_dim;
        if !d.is_multiple_of(2)
            || rope.cos.dims() != rope.sin.dims()
            || rope.cos.dims2()?.1 * 2 != d
        {
            candle_core::bail!("q/k rope: tables {:?} for head dim {d}", rope.cos.dims())
        }
        for w in spec.q_norm.iter().chain(&spec.k_norm) {
            if w.dtype() != DType::F32 || w.dims() != [d] {
                candle_core::bail!("q/k rope: a norm weight must be f32 ({d},)")
            }
        }
        if positions.dtype() != DType::U32 || write.is_some_and(|(_, s)| s.dtype() != DType::U32) {
            candle_core::bail!("q/k rope: positions and slots are u32")
        }
        Ok(QkvRope {
            spec: *spec,
            rope: *rope,
            positions,
            write,
        })
    }

    pub(super) fn rows(&self, qkv: &Shape) -> candle_core::Result<usize> {
        let (rows, w) = qkv.dims2()?;
        if w != self.spec.width() || self.positions.dims() != [rows] {
            return Err(shape_err(format!(
                "q/k rope: q|k|v {qkv:?} with {:?} positions for width {}",
                self.positions.dims(),
                self.spec.width()
            )));
        }
        Ok(rows)
    }
}

pub(super) fn silu_mul_shape(l: &Layout) -> candle_core::Result<(usize, usize)> {
    let (rows, w) = l.shape().dims2()?;
    if !w.is_multiple_of(2) {
        return Err(shape_err(format!("silu_mul: odd width {w}")));
    }
    Ok((rows, w / 2))
}

static DECODE_ATTN_V1: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs the first partial kernel (`decode_attn=v1`) instead of v2, from now on, in this process
/// (the switches are the process's: the engine sets this when it loads a model).
pub fn set_decode_attn_v1(v1: bool) {
    DECODE_ATTN_V1.store(v1, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the CUDA decode attention runs the first partial kernel (the engine's choice; the
/// last model loaded in a process sets it for all, as the switches are the process's).
pub(super) fn decode_attn_v1() -> bool {
    DECODE_ATTN_V1.load(std::sync::atomic::Ordering::Relaxed)
}
