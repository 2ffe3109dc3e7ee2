//! One decode step on the paged KV pool for every fed row of every job at once: the
//! projections on fixed tiles of rows (as the unfused step, [`super::decode`]), and per layer
//! one residual add + RMS norm, one `q|k|v` GEMM, the q/k norm + RoPE and the K/V write into
//! the rows' slots, one paged attention over all rows, and one `gate|up` GEMM followed by
//! SiLU·mul ([`crate::engine::kernels`], each kernel else its composition, [`KernelUse`]).
//!
//! A row's arithmetic does not depend on what shares its step: the GEMMs keep the decode
//! tile, the kernels work row by row, and the attention reduces each (row, head) in an order
//! fixed by the row's own length. Pad rows (up to a whole tile) read nothing (an empty
//! table), write nothing (the pad slot) and their outputs are dropped.

use candle_core::{Device, Tensor};

use super::decode::tiled;
use super::{DecodeTile, RopeStyle, Transformer, ops, rms_norm};
use crate::engine::kernels::{
    BlockTable, KernelId, KernelUse, PAD_SLOT, PagedKvPool, QkvSpec, Rope, RopePairs,
    row_table_tensor,
};

/// What one paged decode step feeds and where it writes, on the device once per step.
pub struct PagedStep {
    /// Each row's token, then token 0 for the pad rows up to a whole tile.
    ids: Vec<u32>,
    /// Each row's position (its table's length after this step's slot, less one); pads 0.
    positions: Tensor,
    /// Each row's slot for this step's keys and values; pads [`PAD_SLOT`].
    slots: Tensor,
    host_slots: Vec<u32>,
    /// The rows' tables ([`row_table_tensor`]); pads empty.
    table: Tensor,
}

impl PagedStep {
    /// A step of `rows`: each row's token, its table (this step's slot already appended) and
    /// that slot; padded up to a whole `tile`.
    pub fn new(
        rows: &[(u32, &BlockTable, u32)],
        tile: DecodeTile,
        device: &Device,
    ) -> candle_core::Result<PagedStep> {
        let tile = tile.0.max(1);
        let padded = rows.len().div_ceil(tile) * tile;
        let pad = BlockTable::default();
        let mut ids = Vec::with_capacity(padded);
        let mut positions = Vec::with_capacity(padded);
        let mut host_slots = Vec::with_capacity(padded);
        let mut tables = Vec::with_capacity(padded);
        for &(token, table, slot) in rows {
            if table.is_empty() {
                candle_core::bail!("a decoded row's table holds no position")
            }
            ids.push(token);
            positions.push((table.len() - 1) as u32);
            host_slots.push(slot);
            tables.push(table);
        }
        ids.resize(padded, 0);
        positions.resize(padded, 0);
        host_slots.resize(padded, PAD_SLOT);
        tables.resize(padded, &pad);
        Ok(PagedStep {
            ids,
            positions: ops::one(Tensor::from_vec(positions, padded, device))?,
            slots: ops::one(Tensor::new(host_slots.as_slice(), device))?,
            host_slots,
            table: ops::one(row_table_tensor(&tables, device))?,
        })
    }

    /// Rows in the step, pads included.
    pub fn padded(&self) -> usize {
        self.ids.len()
    }
}

impl Transformer {
    /// One paged decode step (see the module docs): the rows' keys and values go into their
    /// slots of `pool`, and every row's logits come back, `(padded, vocab)` as the output head
    /// computed them, the step's rows first in order.
    pub fn forward_decode_paged(
        &self,
        step: &PagedStep,
        pool: &PagedKvPool,
        k: &KernelUse,
        tile: DecodeTile,
    ) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let (tile, rows) = (tile.0.max(1), step.padded());
        let eps = cfg.rms_eps as f32;
        let ids = ops::one(Tensor::new(step.ids.as_slice(), &self.device))?;
        let mut x = ops::one(self.embedding.index_select(&ids, 0))?; // (rows, hidden)
        let rope = Rope {
            cos: &self.cos,
            sin: &self.sin,
            pairs: match cfg.rope_style {
                RopeStyle::Interleaved => RopePairs::Interleaved,
                RopeStyle::Neox => RopePairs::Halves,
            },
        };
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        let width = cfg.n_head * cfg.head_dim;
        // The last layer's MLP output, which the next norm adds to the residual stream.
        let mut ff: Option<Tensor> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let h;
            (x, h) = match ff.take() {
                None => {
                    let h = rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
                    (x, h)
                }
                Some(ff) => {
                    ops::add(k.launches(KernelId::AddRmsNorm, rows));
                    k.add_rms_norm(&ff, &x, &layer.attn_norm, eps)?
                }
            };
            // One GEMM on the concatenated weights, or the three projections joined.
            let qkv = layer.qkv.joined(&h, |l, h| tiled(l, h, tile))?;
            let spec = QkvSpec {
                n_head: cfg.n_head,
                n_kv: cfg.n_kv_head,
                head_dim: cfg.head_dim,
                q_norm: layer.q_norm.as_ref(),
                k_norm: layer.k_norm.as_ref(),
                eps,
            };
            ops::add(k.launches(KernelId::QkNormRopeKv, rows));
            let q = k.q_norm_rope(&qkv, &spec, &rope, &step.positions)?;
            let slots = (&step.slots, step.host_slots.as_slice());
            k.kv_norm_rope_write(pool.layer(li), &qkv, (&spec, &rope), &step.positions, slots)?;
            ops::add(k.launches(KernelId::PagedAttention, rows));
            let y = k.paged_decode_attention(&q, pool.layer(li), &step.table, scale)?;
            let y = ops::reshape(&y, (rows, width))?;
            ops::add(k.launches(KernelId::AddRmsNorm, rows));
            let (x1, h) = k.add_rms_norm(&tiled(&layer.wo, &y, tile)?, &x, &layer.ffn_norm, eps)?;
            let gate_up = layer.gate_up.joined(&h, |l, h| tiled(l, h, tile))?;
            ops::add(k.launches(KernelId::SiluMul, rows));
            let act = k.silu_mul(&gate_up)?;
            ff = Some(tiled(&layer.w_down, &act, tile)?);
            x = x1;
        }
        let last = match ff {
            Some(ff) => {
                ops::add(k.launches(KernelId::AddRmsNorm, rows));
                k.add_rms_norm(&ff, &x, &self.final_norm, eps)?.1
            }
            None => rms_norm(&x, &self.final_norm, cfg.rms_eps)?,
        };
        tiled(&self.lm_head, &last, tile)
    }
}
