//! One decode step for many jobs at once: every job's rows feed one token each, the
//! projections and the MLP run over all of them together (each weight read once per step),
//! and attention stays per job, over the job's own [`KvCache`].
//!
//! A row's arithmetic must not depend on what shares its step. Attention, norms, RoPE and the
//! elementwise ops already compute each row alone, in shapes that are the job's own. The
//! matmuls are the risk: a GEMM's blocking (and on CUDA cuBLAS's algorithm choice) follows its
//! shape, so the same row could round differently in a batch of 8 rows than in one of 72. So
//! every projection here runs on exactly [`DecodeTile`] rows per call: the rows of a step are
//! laid out in tiles of that many (the last one padded), whatever their number, and a tile's
//! rows are independent outputs of one fixed-shape GEMM. The tile is part of the numerics (it
//! differs per device, not per load), so one-job decoding uses it too.

use candle_core::{DType, Tensor};

use super::{KvCache, Linear, Transformer, ops, rms_norm};

/// Rows per projection call in a decode step (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeTile(pub usize);

impl DecodeTile {
    /// On CUDA a decode step reads every weight whatever its rows, so a wide tile costs little
    /// and lets one GEMM carry many tickets' rows; on the CPU (candle's reference path) every
    /// padded row costs its share of compute, so the tile is one ticket's usual rows.
    pub fn for_device(device: &candle_core::Device) -> DecodeTile {
        if device.is_cuda() {
            DecodeTile(64)
        } else {
            DecodeTile(8)
        }
    }
}

/// One job's share of a decode step: one token per row of `cache` (a finished row is fed a
/// pad token whose logits the caller ignores: the cache is lockstep).
pub struct DecodePart<'a> {
    pub tokens: Vec<u32>,
    pub cache: &'a mut KvCache,
}

/// `l` applied to `x` (`(m, in)`, `m` a multiple of the tile) one tile of rows at a time.
pub(super) fn tiled(l: &Linear, x: &Tensor, tile: usize) -> candle_core::Result<Tensor> {
    let m = x.dim(0)?;
    if m == tile {
        return l.forward(x);
    }
    let outs = (0..m / tile)
        .map(|i| l.forward(&x.narrow(0, i * tile, tile)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    ops::cat(&outs, 0)
}

impl Transformer {
    /// One decode step of every part: each row's token goes through the model at its cache's
    /// position, the caches grow by one, and each part's logits come back (`(rows, vocab)`,
    /// f32), in the parts' order.
    pub fn forward_decode(
        &self,
        parts: &mut [DecodePart<'_>],
        tile: DecodeTile,
    ) -> candle_core::Result<Vec<Tensor>> {
        let Some(logits) = self.forward_decode_logits(parts, tile)? else {
            return Ok(Vec::new());
        };
        let logits = ops::cast(&logits, DType::F32)?;
        let mut out = Vec::with_capacity(parts.len());
        let mut at = 0;
        for p in parts.iter() {
            out.push(logits.narrow(0, at, p.cache.batch)?);
            at += p.cache.batch;
        }
        Ok(out)
    }

    /// [`Self::forward_decode`]'s step with every row's logits in one tensor, as the output head
    /// computed them (bf16 in a bf16 model, f32 otherwise): `(padded, vocab)`, the parts' rows
    /// in order from row 0, then pad rows up to a whole tile. `None` when no part has a row.
    pub fn forward_decode_logits(
        &self,
        parts: &mut [DecodePart<'_>],
        tile: DecodeTile,
    ) -> candle_core::Result<Option<Tensor>> {
        let tile = tile.0.max(1);
        let mut ids = Vec::new();
        for p in parts.iter() {
            if p.tokens.len() != p.cache.batch {
                candle_core::bail!(
                    "{} tokens fed to a cache of {} rows",
                    p.tokens.len(),
                    p.cache.batch
                )
            }
            if p.cache.len + 1 > p.cache.capacity {
                candle_core::bail!("a decode step past the cache capacity {}", p.cache.capacity)
            }
            ids.extend_from_slice(&p.tokens);
        }
        let n = ids.len();
        if n == 0 {
            return Ok(None);
        }
        let padded = n.div_ceil(tile) * tile;
        // Pad rows look up token 0; their outputs are dropped and touch no cache.
        ids.resize(padded, 0);
        let cfg = &self.config;
        let ids = ops::one(Tensor::from_vec(ids, padded, &self.device))?;
        let mut x = ops::one(self.embedding.index_select(&ids, 0))?; // (padded, hidden)
        let width = cfg.n_head * cfg.head_dim;
        // The pad rows' attention output: zeros, made once a step.
        let pad = (padded > n)
            .then(|| ops::one(Tensor::zeros((padded - n, width), x.dtype(), &self.device)))
            .transpose()?;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let [q, k, v] = layer.qkv.outputs(&h, |l, h| tiled(l, h, tile))?;
            let mut ys = Vec::with_capacity(parts.len() + 1);
            let mut at = 0;
            for p in parts.iter() {
                let b = p.cache.batch;
                let qkv = [
                    &q.narrow(0, at, b)?,
                    &k.narrow(0, at, b)?,
                    &v.narrow(0, at, b)?,
                ];
                ys.push(self.attend(li, layer, qkv, 1, p.cache, None)?);
                at += b;
            }
            ys.extend(pad.clone());
            let y = ops::cat(&ys, 0)?;
            let x1 = ops::one(tiled(&layer.wo, &y, tile)? + &x)?;
            let h = rms_norm(&x1, &layer.ffn_norm, cfg.rms_eps)?;
            let [gate, up] = layer.gate_up.outputs(&h, |l, h| tiled(l, h, tile))?;
            let act = ops::one(ops::one(candle_nn::ops::silu(&gate))? * up)?;
            let ff = tiled(&layer.w_down, &act, tile)?;
            x = ops::one(ff + x1)?;
        }
        for p in parts.iter_mut() {
            p.cache.len += 1;
        }
        let last = rms_norm(&x, &self.final_norm, cfg.rms_eps)?;
        tiled(&self.lm_head, &last, tile).map(Some)
    }
}
