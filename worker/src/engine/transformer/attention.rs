//! One layer's attention for one job's rows: q/k norms, RoPE, the new keys and values written
//! to the job's [`KvCache`], and softmax attention over the positions the rows share (the
//! prompt, kept once) followed by each row's own.
//!
//! With a shared prompt the scores are computed in two parts and joined before one softmax:
//! against the prompt, every row's queries go through one matmul (the prompt's keys are read
//! once for all rows), against its own positions each row through its own; the weighted values
//! are the two parts' sum. Every shape is the job's own (its rows, its lengths), never that of
//! other work sharing a forward call.

use candle_core::{DType, Tensor};

use super::{KvCache, Layer, Transformer, ops, rms_norm};

/// `(b, n_kv, m, x)` → `(n_kv, b*m, x)`: every row's queries (or weights) of a KV head
/// side by side, for one matmul against that head's shared keys (or values).
fn heads_first(x: &Tensor) -> candle_core::Result<Tensor> {
    let (b, h, m, d) = x.dims4()?;
    ops::contiguous(&x.transpose(0, 1)?)?.reshape((h, b * m, d))
}

/// The inverse of [`heads_first`] for `b` rows.
fn rows_first(x: &Tensor, b: usize) -> candle_core::Result<Tensor> {
    let (h, bm, d) = x.dims3()?;
    ops::contiguous(&x.reshape((h, b, bm / b, d))?.transpose(0, 1)?)
}

impl Transformer {
    /// One layer's attention for the `b` rows of `cache`, `t` new positions each, from the
    /// rows' projections `q, k, v` (`(b*t, heads*head_dim)`, row-major by row then position).
    /// Returns `(b*t, n_head*head_dim)`; `mask` is the additive causal mask `(t, kv_len)`
    /// over every position (shared first) when `t > 1`.
    pub(super) fn attend(
        &self,
        li: usize,
        layer: &Layer,
        [q, k, v]: [&Tensor; 3],
        t: usize,
        cache: &KvCache,
        mask: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let (b, pos) = (cache.batch, cache.len());
        let kv_len = pos + t;
        let n_rep = cfg.n_head / cfg.n_kv_head;
        let scale = 1.0 / (cfg.head_dim as f64).sqrt();
        let q = ops::reshape(q, (b, t, cfg.n_head, cfg.head_dim))?;
        let k = ops::reshape(k, (b, t, cfg.n_kv_head, cfg.head_dim))?;
        let v = ops::reshape(v, (b, t, cfg.n_kv_head, cfg.head_dim))?;
        let q = match &layer.q_norm {
            Some(w) => rms_norm(&q, w, cfg.rms_eps)?,
            None => q,
        };
        let k = match &layer.k_norm {
            Some(w) => rms_norm(&k, w, cfg.rms_eps)?,
            None => k,
        };
        let q = self.rope(&ops::contiguous(&q.transpose(1, 2)?)?, pos, t)?;
        let k = self.rope(&ops::contiguous(&k.transpose(1, 2)?)?, pos, t)?;
        let v = ops::contiguous(&v.transpose(1, 2)?)?;
        let ((kc, vc), shared) = cache.append(li, &k, &v)?;
        // GQA without repeat_kv: query heads h*n_rep..(h+1)*n_rep share KV head h, and they
        // are adjacent in `q`, so `(b, n_head, t, d)` → `(b, n_kv, n_rep*t, d)` is a free
        // reshape and every KV head is read once per step.
        let q = ops::reshape(&q, (b, cfg.n_kv_head, n_rep * t, cfg.head_dim))?;
        // Scores in the compute dtype, then softmax (and the mask) in f32.
        let own = ops::one(q.matmul(&kc.t()?))?;
        let att = match shared {
            None => own,
            Some((ks, _)) => {
                let ks = ks.squeeze(0)?.t()?; // (n_kv, d, shared)
                let prompt = rows_first(&ops::one(heads_first(&q)?.matmul(&ks))?, b)?;
                ops::cat(&[&prompt, &own], 3)?
            }
        };
        let att = ops::cast(&ops::one(att * scale)?, DType::F32)?;
        let att = match mask {
            Some(m) => {
                let wide = ops::reshape(&att, (b, cfg.n_kv_head, n_rep, t, kv_len))?;
                let masked = ops::one(wide.broadcast_add(m))?;
                ops::reshape(&masked, (b, cfg.n_kv_head, n_rep * t, kv_len))?
            }
            None => att,
        };
        let att = ops::one(candle_nn::ops::softmax_last_dim(&att))?;
        let att = ops::cast(&att, vc.dtype())?;
        let y = match shared {
            None => ops::one(att.matmul(&vc))?,
            Some((_, vs)) => {
                let n = cache.shared_len;
                let own = ops::contiguous(&att.narrow(3, n, kv_len - n)?)?;
                let own = ops::one(own.matmul(&vc))?;
                let w = heads_first(&att.narrow(3, 0, n)?)?;
                let prompt = rows_first(&ops::one(w.matmul(&vs.squeeze(0)?))?, b)?;
                ops::one(prompt + own)?
            }
        }; // (b, n_kv, n_rep*t, d)
        let y = ops::reshape(&y, (b, cfg.n_head, t, cfg.head_dim))?.transpose(1, 2)?;
        ops::reshape(&y, (b * t, cfg.n_head * cfg.head_dim))
    }
}
