//! One prefill chunk of one job straight into the paged KV pool (the `flash_prefill` engine
//! switch): per layer the chunk's keys and values go into the job's slots first (the q/k
//! norm + RoPE and K/V write, kernel or composition, [`KernelUse`]), then its queries attend
//! over the pool through the job's block table ([`crate::engine::kernels::flash_prefill`]):
//! the prefix's positions (shared blocks) and the chunk's own, causally by position. No mask
//! is built on the host and no score matrix exists. The rest is the one-row prefill's
//! arithmetic ([`Transformer::forward`]): the same projections over the chunk's rows, the
//! same norms and MLP, the last position's logits.

use candle_core::{DType, Device, Tensor};

use super::{Linear, RopeStyle, Transformer, ops, rms_norm};
use crate::engine::kernels::{
    BlockTable, KernelUse, PagedKvPool, QkvSpec, Rope, RopePairs, row_table_tensor,
};

/// One chunk of a job's prompt on the device: its tokens, positions, slots and the job's table.
pub struct PagedChunk {
    ids: Tensor,
    /// Positions `start..start + C`.
    positions: Tensor,
    slots: Tensor,
    host_slots: Vec<u32>,
    /// The job's table as one row ([`row_table_tensor`]), the chunk's slots included.
    table: Tensor,
    rows: usize,
}

impl PagedChunk {
    /// The chunk `tokens`, whose `slots` were just appended to `table` (they are its last
    /// positions).
    pub fn new(
        tokens: &[u32],
        table: &BlockTable,
        slots: Vec<u32>,
        device: &Device,
    ) -> candle_core::Result<PagedChunk> {
        let rows = tokens.len();
        if rows == 0 || slots.len() != rows || table.len() < rows {
            candle_core::bail!(
                "a chunk of {rows} tokens with {} slots in a table of {}",
                slots.len(),
                table.len()
            )
        }
        let start = (table.len() - rows) as u32;
        let positions: Vec<u32> = (start..start + rows as u32).collect();
        Ok(PagedChunk {
            ids: ops::one(Tensor::new(tokens, device))?,
            positions: ops::one(Tensor::from_vec(positions, rows, device))?,
            slots: ops::one(Tensor::new(slots.as_slice(), device))?,
            host_slots: slots,
            table: ops::one(row_table_tensor(&[table], device))?,
            rows,
        })
    }
}

impl Transformer {
    /// The RoPE tables as the pool's kernels take them.
    fn pool_rope(&self) -> Rope<'_> {
        Rope {
            cos: &self.cos,
            sin: &self.sin,
            pairs: match self.config.rope_style {
                RopeStyle::Interleaved => RopePairs::Interleaved,
                RopeStyle::Neox => RopePairs::Halves,
            },
        }
    }

    /// One prefill chunk into `pool` (see the module docs): the chunk's keys and values land
    /// in its slots, and the logits of its last position come back, `(vocab,)` in f32.
    pub fn forward_prefill_paged(
        &self,
        chunk: &PagedChunk,
        pool: &PagedKvPool,
        k: &KernelUse,
    ) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let rows = chunk.rows;
        let rope = self.pool_rope();
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        let mut x = ops::one(self.embedding.index_select(&chunk.ids, 0))?; // (rows, hidden)
        for (li, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let qkv = layer.qkv.joined(&h, Linear::forward)?;
            let spec = QkvSpec {
                n_head: cfg.n_head,
                n_kv: cfg.n_kv_head,
                head_dim: cfg.head_dim,
                q_norm: layer.q_norm.as_ref(),
                k_norm: layer.k_norm.as_ref(),
                eps: cfg.rms_eps as f32,
            };
            let q = k.q_norm_rope(&qkv, &spec, &rope, &chunk.positions)?;
            let slots = (&chunk.slots, chunk.host_slots.as_slice());
            k.kv_norm_rope_write(
                pool.layer(li),
                &qkv,
                (&spec, &rope),
                &chunk.positions,
                slots,
            )?;
            let y = k.flash_prefill_attention(&q, pool.layer(li), &chunk.table, scale)?;
            let y = ops::reshape(&y, (rows, cfg.n_head * cfg.head_dim))?;
            let x1 = ops::one(layer.wo.forward(&y)? + &x)?;
            let h = rms_norm(&x1, &layer.ffn_norm, cfg.rms_eps)?;
            let [gate, up] = layer.gate_up.outputs(&h, Linear::forward)?;
            let act = ops::one(ops::one(candle_nn::ops::silu(&gate))? * up)?;
            x = ops::one(layer.w_down.forward(&act)? + x1)?;
        }
        let last = x.narrow(0, rows - 1, 1)?;
        let last = rms_norm(&ops::contiguous(&last)?, &self.final_norm, cfg.rms_eps)?;
        let logits = self.lm_head.forward(&last)?.squeeze(0)?;
        ops::cast(&logits, DType::F32)
    }
}
