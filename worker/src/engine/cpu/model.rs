//! The CPU fast path: our transformer (llama, qwen2, qwen3) on plain f32 buffers and the
//! kernels of [`super::kernels`], with GGUF Q4_1/Q8_0 weights read in their block format.
//!
//! Why not candle on CPU: candle 0.11.1 has no SIMD Q4_1 kernel, its f32 gemm repacks the
//! weight matrix on every small-batch call, and batched attention is ~1,400 tiny gemm calls per
//! decode step. Here every step reads each weight once (dequantized block by block into L1,
//! exact), attention reads the shared prompt's keys/values once per row, and every output
//! element follows one fixed recipe (see [`super::kernels`]), so a candidate's tokens do not
//! depend on which other rows are in the batch: finished rows are simply dropped from the
//! batch, and a row decoded alone gives the same bits.
//!
//! KV cache ([`CpuCache`], paged: blocks from the model's [`KvPool`]): the prompt's
//! keys/values are stored once, each candidate row has its own short suffix; keys are stored
//! transposed (`d × B` per KV head and block) so 16 keys load as one vector. A finished job's
//! prompt blocks can seed the next job's cache ([`CpuCache::on_prefix`], the engine's prefix
//! store: shared, not copied). What a layer does per position before attention (bias, q/k
//! norms, RoPE, the cache writes) is in `positions`.

use candle_core::quantized::{GgmlDType, QTensor};
use rayon::prelude::*;

use std::sync::Arc;

use super::attention::{self, Own};
pub use super::cache::{CpuCache, Slot};
use super::int8::{self, Int8Workspace};
use super::kernels;
use super::kv_pool::{BLOCK_POSITIONS as B, Block};
pub use super::kv_pool::{KvPool, PoolStats};
use super::tasks;
use super::weights::{Interleaved, PackedMatrix};
use crate::engine::transformer::TransformerConfig;

mod positions;

/// Prompt positions whose attention shares each tile of keys and values (prefill): with 3
/// query heads per KV head, 48 queries per pass over a KV head's cache.
const PREFILL_ATTENTION_BLOCK: usize = 16;

/// Rows per task of the row-wise steps (norms, SiLU, residual adds, RoPE) of a forward call of
/// at least [`PAR_MIN_ROWS`] rows (a prefill chunk); smaller calls run them on the calling
/// thread. Each row is computed alone, so the split changes no bit.
const ROW_TASK: usize = 16;
/// Rows from which the row-wise steps run in parallel.
const PAR_MIN_ROWS: usize = 64;

/// `f` over `a` and `b` in matching chunks of [`ROW_TASK`] rows (`na` and `nb` values a row),
/// in parallel where `a` has at least [`PAR_MIN_ROWS`] rows.
fn rows_mut<T: Sync, F>(a: &mut [f32], na: usize, b: &[T], nb: usize, f: F)
where
    F: Fn(&mut [f32], &[T]) + Sync,
{
    if a.len() < PAR_MIN_ROWS * na {
        return f(a, b);
    }
    a.par_chunks_mut(ROW_TASK * na)
        .zip(b.par_chunks(ROW_TASK * nb))
        .for_each(|(a, b)| f(a, b));
}

/// The attention output of a forward call while its tasks fill it: each (block of positions,
/// KV head) task writes its own heads' slices.
struct HeadsOut {
    att: *mut f32,
    len: usize,
}

// SAFETY: tasks write disjoint slices (see `put`).
unsafe impl Sync for HeadsOut {}

impl HeadsOut {
    /// `att[at..at + src.len()] = src`.
    ///
    /// # Safety
    /// `att` is valid for `len` floats, and no other thread touches this slice meanwhile.
    unsafe fn put(&self, at: usize, src: &[f32]) {
        assert!(at + src.len() <= self.len);
        // SAFETY: in bounds (asserted); the slice is this task's alone (the contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.att.add(at), src.len()) };
    }
}

/// The arithmetic of the matmuls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuNumerics {
    /// Activations quantized to 8 bits per block, integer dot products with Q4_1/Q8_0 weights
    /// ([`int8`]); f32 weights keep the f32 path.
    #[default]
    Int8,
    /// Exact weights, f32 activations ([`kernels::matmul`]).
    F32,
}

impl CpuNumerics {
    /// The fingerprint's dtype: the numerics change every logit, so workers that differ in
    /// them must not serve one run.
    pub fn fingerprint_dtype(self) -> &'static str {
        match self {
            CpuNumerics::Int8 => "cpu-q8-fixed-order",
            CpuNumerics::F32 => "cpu-f32-fixed-order",
        }
    }
}

/// One transformer block.
#[derive(Debug)]
pub struct CpuLayer {
    pub attn_norm: Vec<f32>,
    /// q | k | v stacked (`(n_head + 2·n_kv)·d` outputs).
    pub qkv: PackedMatrix,
    pub qkv_bias: Option<Vec<f32>>,
    pub wo: PackedMatrix,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// gate | up stacked (`2·ffn` outputs).
    pub gate_up: PackedMatrix,
    pub down: PackedMatrix,
}

/// The weights of a model on the CPU fast path. Immutable after load.
#[derive(Debug)]
pub struct CpuModel {
    pub config: TransformerConfig,
    /// `vocab × hidden`; rows are looked up (dequantized one at a time).
    pub embedding: PackedMatrix,
    /// `None`: tied to the embedding.
    pub lm_head: Option<PackedMatrix>,
    pub layers: Vec<CpuLayer>,
    pub final_norm: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    max_context: usize,
    numerics: CpuNumerics,
    /// The blocks of this model's caches (capacity set by the engine: the worker's budget).
    pool: Arc<KvPool>,
}

/// A weight from GGUF: Q4_1 and Q8_0 stay in their blocks, anything else becomes f32 (exact).
pub fn pack(q: &QTensor) -> candle_core::Result<PackedMatrix> {
    let (rows, cols) = q.shape().dims2()?;
    let packed = match q.dtype() {
        GgmlDType::Q4_1 => PackedMatrix::from_q4_1(&q.data()?, rows, cols),
        GgmlDType::Q8_0 => PackedMatrix::from_q8_0(&q.data()?, rows, cols),
        _ => None,
    };
    match packed {
        Some(p) => Ok(p),
        None => {
            let t = q
                .dequantize(&candle_core::Device::Cpu)?
                .to_dtype(candle_core::DType::F32)?;
            Ok(PackedMatrix::F32 {
                rows,
                cols,
                w: t.flatten_all()?.to_vec1::<f32>()?,
            })
        }
    }
}

/// Where the slots of one forward call go ([`CpuModel::forward_at`]).
#[derive(Debug)]
struct Placement {
    /// Each slot's absolute position.
    positions: Vec<usize>,
    /// For a row slot, its position within the row's own segment (0 for prompt slots).
    row_pos: Vec<usize>,
    /// Positions the call feeds to each candidate row.
    fed: Vec<usize>,
    /// Prompt positions cached once the call is done.
    shared_after: usize,
}

/// One job's share of a batched forward call ([`CpuModel::forward_parts`]): its tokens (one
/// per slot), where they go in its cache, and which of them need logits (ascending).
pub struct Part<'a> {
    pub tokens: &'a [u32],
    pub slots: &'a [Slot],
    pub cache: &'a mut CpuCache,
    pub logits_at: &'a [usize],
}

/// Reusable activation buffers (one per engine), so steps do not allocate.
#[derive(Debug, Default)]
pub struct Workspace {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    mm: MatmulBuffers,
}

/// Reusable buffers of the matmuls (both numerics).
#[derive(Debug, Default)]
struct MatmulBuffers {
    yt: Vec<f32>,
    int8: Int8Workspace,
}

impl CpuModel {
    pub fn new(
        config: TransformerConfig,
        embedding: PackedMatrix,
        lm_head: Option<PackedMatrix>,
        layers: Vec<CpuLayer>,
        final_norm: Vec<f32>,
        max_context: usize,
    ) -> Result<Self, String> {
        let d = config.head_dim;
        let half = d / 2;
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1f32 / (config.rope_theta as f32).powf((2 * i) as f32 / d as f32))
            .collect();
        if let Some(f) = &config.rope_freq_factors {
            if f.len() != half {
                return Err(format!(
                    "rope_freqs has {} entries, expected {half}",
                    f.len()
                ));
            }
            for (a, s) in inv_freq.iter_mut().zip(f) {
                *a /= *s;
            }
        }
        let mut cos = Vec::with_capacity(max_context * half);
        let mut sin = Vec::with_capacity(max_context * half);
        for p in 0..max_context {
            for f in &inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let qkv_n = (config.n_head + 2 * config.n_kv_head) * d;
        for (i, l) in layers.iter().enumerate() {
            if l.qkv.rows() != qkv_n
                || l.qkv.cols() != config.hidden
                || l.down.rows() != config.hidden
            {
                return Err(format!("layer {i}: unexpected projection shapes"));
            }
        }
        let pool = KvPool::new(&config, 0);
        Ok(CpuModel {
            pool,
            config,
            embedding,
            lm_head,
            layers,
            final_norm,
            cos,
            sin,
            max_context,
            numerics: CpuNumerics::default(),
        })
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub fn numerics(&self) -> CpuNumerics {
        self.numerics
    }

    /// Chooses the matmul arithmetic; [`CpuNumerics::Int8`] interleaves the Q4_1/Q8_0 matrices
    /// (the embedding too when the head is tied to it: lookups read the same values).
    pub fn set_numerics(&mut self, numerics: CpuNumerics) {
        self.numerics = numerics;
        if numerics != CpuNumerics::Int8 {
            return;
        }
        let interleave = |w: &mut PackedMatrix| {
            if let Some(i) = Interleaved::from_packed(w) {
                *w = PackedMatrix::Interleaved(Box::new(i));
            }
        };
        for l in &mut self.layers {
            for w in [&mut l.qkv, &mut l.wo, &mut l.gate_up, &mut l.down] {
                interleave(w);
            }
        }
        interleave(self.lm_head.as_mut().unwrap_or(&mut self.embedding));
    }

    /// `y = x · wᵀ` with this model's numerics.
    fn matmul(&self, x: &[f32], m: usize, w: &PackedMatrix, y: &mut [f32], ws: &mut MatmulBuffers) {
        if self.numerics == CpuNumerics::Int8 && int8::supports(w) {
            int8::matmul(x, m, w, y, &mut ws.int8);
        } else {
            kernels::matmul(x, m, w, y, &mut ws.yt);
        }
    }

    /// `f(rows, out)` for each [`int8::ROWS_PER_CALL`] rows of `x·wᵀ` and the matching item
    /// of `outs`, as [`Self::matmul`] into `y` (sized here) and then `f` over `y`'s rows would:
    /// on the int8 path the matmul's rows go to `f` as they are turned back into rows from its
    /// sums ([`int8::matmul_into`]), and `y` is neither sized nor used.
    #[allow(clippy::too_many_arguments)]
    fn matmul_then<T, O, F>(
        &self,
        x: &[f32],
        m: usize,
        w: &PackedMatrix,
        y: &mut Vec<f32>,
        ws: &mut MatmulBuffers,
        outs: O,
        f: F,
    ) where
        T: Send,
        O: IndexedParallelIterator<Item = T>,
        F: Fn(&[f32], T) + Sync,
    {
        if self.numerics == CpuNumerics::Int8 && int8::supports(w) {
            int8::matmul_into(x, m, w, &mut ws.int8, outs, f);
        } else {
            y.resize(m * w.rows(), 0.0);
            self.matmul(x, m, w, y, ws);
            let rows = y.par_chunks(int8::ROWS_PER_CALL * w.rows());
            outs.zip(rows).for_each(|(out, y)| f(y, out));
        }
    }

    /// Weight bytes held in memory.
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.wo.bytes() + l.gate_up.bytes() + l.down.bytes())
            .sum();
        l + self.embedding.bytes() + self.lm_head.as_ref().map_or(0, |h| h.bytes())
    }

    /// An empty cache with room for `prompt_cap` prompt positions (it takes blocks from the
    /// model's pool as it fills).
    pub fn new_cache(&self, prompt_cap: usize) -> CpuCache {
        CpuCache::new(&self.pool, prompt_cap)
    }

    /// The pool of this model's KV blocks.
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Attention of layer `li` for every position of a forward call, into `att` (`m × n_head·d`).
    /// Parallel over blocks of positions; one [`attention::attend`] call per block and KV head
    /// takes every query of the block, so the cache is read once per block: in prefill
    /// [`PREFILL_ATTENTION_BLOCK`] positions (their common run is the prompt so far), in a
    /// decode step the rows of a thread's share (common: the whole prompt; own: each row's
    /// suffix), or every position of a part of one row. Each query's arithmetic is the same
    /// whatever its block.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        li: usize,
        cache: &CpuCache,
        qkv: &[f32],
        slots: &[Slot],
        positions: &[usize],
        row_pos: &[usize],
        shared_after: usize,
        att: &mut [f32],
    ) {
        let cfg = &self.config;
        let (d, nh, nkv) = (cfg.head_dim, cfg.n_head, cfg.n_kv_head);
        let n_rep = nh / nkv;
        let qkv_n = (nh + 2 * nkv) * d;
        let scale = 1.0 / (d as f32).sqrt();
        let m = slots.len();
        let prefill = slots.iter().all(|s| *s == Slot::Shared);
        // A part of one row (its token and its drafts) reads the whole cache for a few
        // queries: one block reads it once, where a block per thread read it once per thread
        // (10% slower decode at a 2.6k-token prompt, 2 threads). Several rows still split.
        let one_row = matches!(slots[0], Slot::Row(_)) && slots.iter().all(|s| *s == slots[0]);
        let block = if prefill {
            PREFILL_ATTENTION_BLOCK
        } else if one_row {
            m
        } else {
            m.div_ceil(rayon::current_num_threads().max(1))
        };
        // One task per block of positions and KV head: a decode step of one row still spreads
        // its KV heads over the threads (its attention reads the whole cache, the step's
        // largest read).
        let blocks = m.div_ceil(block);
        let heads = HeadsOut {
            att: att.as_mut_ptr(),
            len: att.len(),
        };
        // The last blocks of a prefill see the most keys: they go first.
        tasks::heaviest_first(
            blocks * nkv,
            || {
                let b = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                (b, Vec::new(), Vec::new(), Vec::new())
            },
            |((s, qbuf, obuf, limits), common, own, ends), task| {
                let (bi, g) = (blocks - 1 - task / nkv, task % nkv);
                let i0 = bi * block;
                let nb = block.min(m - i0);
                // Prefill: keys up to the block's last position; decode: the whole prompt.
                let common_len = if prefill {
                    positions[i0 + nb - 1] + 1
                } else {
                    shared_after
                };
                common.clear();
                cache.prompt_runs(li, g, d, common_len.min(shared_after), common);
                qbuf.clear();
                limits.clear();
                own.clear();
                ends.clear();
                for i in i0..i0 + nb {
                    qbuf.extend_from_slice(
                        &qkv[i * qkv_n + g * n_rep * d..i * qkv_n + (g + 1) * n_rep * d],
                    );
                    let limit = match slots[i] {
                        Slot::Shared => positions[i] + 1,
                        Slot::Row(r) => {
                            // The row's runs once per query head of the group.
                            let from = own.len();
                            cache.row_runs(r, li, g, d, row_pos[i] + 1, own);
                            let n = own.len() - from;
                            ends.push(own.len());
                            for _ in 1..n_rep {
                                own.extend_from_within(from..from + n);
                                ends.push(own.len());
                            }
                            shared_after + row_pos[i] + 1
                        }
                    };
                    limits.extend(std::iter::repeat_n(limit, n_rep));
                }
                let nq = nb * n_rep;
                obuf.resize(nq * d, 0.0);
                let own = Own {
                    runs: &own[..],
                    ends: &ends[..],
                };
                attention::attend(qbuf, nq, limits, common, own, d, scale, s, obuf);
                for pi in 0..nb {
                    let at = (i0 + pi) * nh * d + g * n_rep * d;
                    // SAFETY: `heads` points at `att` (borrowed for this call); this task alone
                    // writes the heads of group g at positions i0..i0 + nb.
                    unsafe { heads.put(at, &obuf[pi * n_rep * d..(pi + 1) * n_rep * d]) };
                }
            },
        );
    }

    /// Runs `tokens` (one per slot) through the model, appends their keys/values to `cache`,
    /// and returns the logits of positions `logits_from..` (`(len - logits_from) × vocab`).
    /// See [`CpuModel::forward_at`].
    pub fn forward(
        &self,
        tokens: &[u32],
        slots: &[Slot],
        cache: &mut CpuCache,
        logits_from: usize,
        ws: &mut Workspace,
    ) -> Result<Vec<f32>, String> {
        let at: Vec<usize> = (logits_from..tokens.len()).collect();
        self.forward_at(tokens, slots, cache, &at, ws)
    }

    /// Runs `tokens` (one per slot) through the model, appends their keys/values to `cache`,
    /// and returns the logits of the positions listed in `logits_at` (ascending; `len × vocab`).
    /// A forward call either extends the prompt (all [`Slot::Shared`], before any row exists)
    /// or advances rows; a row may take several consecutive positions in one call (forced
    /// tokens), its occurrences in order. Every position's arithmetic is the same as if it
    /// were fed alone. One [`Part`] of [`CpuModel::forward_parts`].
    pub fn forward_at(
        &self,
        tokens: &[u32],
        slots: &[Slot],
        cache: &mut CpuCache,
        logits_at: &[usize],
        ws: &mut Workspace,
    ) -> Result<Vec<f32>, String> {
        let mut parts = [Part {
            tokens,
            slots,
            cache,
            logits_at,
        }];
        let mut out = self.forward_parts(&mut parts, ws)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One forward call over several jobs' caches at once (continuous batching): each
    /// [`Part`] is what [`forward_at`](Self::forward_at) takes for one cache. The matmuls run
    /// over every position of every part together (each weight read once per step, whatever
    /// the number of jobs); keys and values are stored, and attention reads, per part. Every
    /// position's arithmetic is the same as if its part were run alone: which parts share a
    /// call, and in which order, changes no bit. Returns each part's logits, in order.
    pub fn forward_parts(
        &self,
        parts: &mut [Part<'_>],
        ws: &mut Workspace,
    ) -> Result<Vec<Vec<f32>>, String> {
        let mut places = Vec::with_capacity(parts.len());
        let (mut tokens, mut at) = (Vec::new(), Vec::new());
        for p in parts.iter() {
            let m = p.tokens.len();
            if m == 0
                || p.slots.len() != m
                || p.logits_at.is_empty()
                || p.logits_at.windows(2).any(|w| w[0] >= w[1])
                || p.logits_at.last().is_some_and(|&i| i >= m)
            {
                return Err("forward: empty input, bad slots or bad logit positions".into());
            }
            places.push(self.place(p.slots, p.cache)?);
            at.extend(p.logits_at.iter().map(|&i| tokens.len() + i));
            tokens.extend_from_slice(p.tokens);
        }
        if parts.is_empty() {
            return Err("forward: no input".into());
        }
        self.embed(&tokens, ws)?;
        for (p, place) in parts.iter_mut().zip(&places) {
            let row_to: Vec<usize> = p
                .cache
                .row_len
                .iter()
                .zip(&place.fed)
                .map(|(l, f)| l + f)
                .collect();
            p.cache.make_room(place.shared_after, &row_to);
        }
        for (li, layer) in self.layers.iter().enumerate() {
            self.block(li, layer, parts, &places, ws);
        }
        for (p, place) in parts.iter_mut().zip(places) {
            p.cache.shared_len = place.shared_after;
            for (len, n) in p.cache.row_len.iter_mut().zip(place.fed) {
                *len += n;
            }
        }
        let logits = self.head_logits(&ws.x, &at, &mut ws.mm);
        let vocab = logits.len() / at.len();
        let mut out = Vec::with_capacity(parts.len());
        let mut from = 0;
        for p in parts.iter() {
            let n = p.logits_at.len() * vocab;
            out.push(logits[from..from + n].to_vec());
            from += n;
        }
        Ok(out)
    }

    /// Where each slot of a forward call goes (see [`Placement`]), or why it cannot: prompt
    /// positions after rows, a prompt or a row beyond its cache, a position beyond the context.
    fn place(&self, slots: &[Slot], cache: &CpuCache) -> Result<Placement, String> {
        let m = slots.len();
        let shared_new = slots.iter().filter(|s| **s == Slot::Shared).count();
        if shared_new > 0 && (shared_new != m || !cache.rows.is_empty()) {
            return Err("forward: prompt positions after rows were added".into());
        }
        if cache.shared_len + shared_new > cache.shared_cap {
            return Err("forward: prompt exceeds the cache".into());
        }
        // Absolute positions, and for row slots the position within the row's own segment.
        let mut positions = Vec::with_capacity(m);
        let mut row_pos = vec![0usize; m];
        let mut fed = vec![0usize; cache.rows.len()];
        for (i, s) in slots.iter().enumerate() {
            positions.push(match *s {
                Slot::Shared => cache.shared_len + i,
                Slot::Row(r) => {
                    if r >= cache.rows.len() || cache.row_len[r] + fed[r] >= cache.row_cap {
                        return Err(format!("forward: row {r} out of range or full"));
                    }
                    row_pos[i] = cache.row_len[r] + fed[r];
                    fed[r] += 1;
                    cache.shared_len + row_pos[i]
                }
            });
        }
        if positions.iter().any(|&p| p >= self.max_context) {
            return Err("forward: position beyond the context".into());
        }
        Ok(Placement {
            positions,
            row_pos,
            fed,
            shared_after: cache.shared_len + shared_new,
        })
    }

    /// Sizes the activation buffers for `tokens` and looks their embeddings up into `ws.x`.
    fn embed(&self, tokens: &[u32], ws: &mut Workspace) -> Result<(), String> {
        let cfg = &self.config;
        let m = tokens.len();
        let (hid, d, nh, nkv) = (cfg.hidden, cfg.head_dim, cfg.n_head, cfg.n_kv_head);
        let qkv_n = (nh + 2 * nkv) * d;
        ws.x.resize(m * hid, 0.0);
        ws.h.resize(m * hid, 0.0);
        ws.qkv.resize(m * qkv_n, 0.0);
        ws.att.resize(m * nh * d, 0.0);
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= self.embedding.rows() {
                return Err(format!("token {t} out of the vocabulary"));
            }
            kernels::dequant_rows(
                &self.embedding,
                t as usize,
                1,
                &mut ws.x[i * hid..(i + 1) * hid],
            );
        }
        Ok(())
    }

    /// Layer `li` over every position of a forward call, on the residual stream `ws.x`:
    /// attention (each part's keys and values stored in its cache first, then read from it),
    /// then the MLP, each added to the stream. The matmuls take every part's positions at once.
    fn block(
        &self,
        li: usize,
        layer: &CpuLayer,
        parts: &mut [Part<'_>],
        places: &[Placement],
        ws: &mut Workspace,
    ) {
        let cfg = &self.config;
        let eps = cfg.rms_eps as f32;
        let (qkv_n, att_n) = (
            (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim,
            cfg.n_head * cfg.head_dim,
        );
        let m: usize = parts.iter().map(|p| p.slots.len()).sum();
        let Workspace {
            x,
            h,
            qkv,
            att,
            tmp,
            gu,
            act,
            mm,
        } = ws;
        let hid = cfg.hidden;
        rows_mut(h, hid, x, hid, |h, x| {
            kernels::rms_norm(x, &layer.attn_norm, eps, h)
        });
        self.matmul(h, m, &layer.qkv, qkv, mm);
        let mut o = 0;
        for (p, place) in parts.iter_mut().zip(places) {
            let mi = p.slots.len();
            let q = &mut qkv[o * qkv_n..(o + mi) * qkv_n];
            self.store_kv(li, layer, p.slots, place, q, p.cache);
            self.attention(
                li,
                p.cache,
                q,
                p.slots,
                &place.positions,
                &place.row_pos,
                place.shared_after,
                &mut att[o * att_n..(o + mi) * att_n],
            );
            o += mi;
        }
        // Each matmul's rows go straight on: the residual add and the next norm, SiLU·up.
        let r = int8::ROWS_PER_CALL;
        let (xs, hs) = (x.par_chunks_mut(r * hid), h.par_chunks_mut(r * hid));
        self.matmul_then(att, m, &layer.wo, tmp, mm, xs.zip(hs), |y, (x, h)| {
            add(x, y);
            kernels::rms_norm(x, &layer.ffn_norm, eps, h)
        });
        let ffn = layer.gate_up.rows() / 2;
        act.resize(m * ffn, 0.0);
        let acts = act.par_chunks_mut(r * ffn);
        self.matmul_then(h, m, &layer.gate_up, gu, mm, acts, |gu, act| {
            kernels::silu_mul(gu, ffn, act)
        });
        let xs = x.par_chunks_mut(r * hid);
        self.matmul_then(act, m, &layer.down, tmp, mm, xs, |y, x| add(x, y));
    }

    /// The logits of positions `at` of the residual stream `x`: the final norm, then the head
    /// (`at.len() × vocab`).
    fn head_logits(&self, x: &[f32], at: &[usize], mm: &mut MatmulBuffers) -> Vec<f32> {
        let (hid, eps) = (self.config.hidden, self.config.rms_eps as f32);
        let nl = at.len();
        let mut picked = Vec::with_capacity(nl * hid);
        for &p in at {
            picked.extend_from_slice(&x[p * hid..(p + 1) * hid]);
        }
        let mut last = vec![0f32; nl * hid];
        kernels::rms_norm(&picked, &self.final_norm, eps, &mut last);
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        let mut logits = vec![0f32; nl * head.rows()];
        self.matmul(&last, nl, head, &mut logits, mm);
        logits
    }
}

/// `x += y`, element by element (a residual add, a bias).
fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}
