//! Our decoder-only transformer (llama family: llama, qwen2, qwen3) and its KV cache.
//!
//! Written in the candle idiom after `candle-transformers`' `quantized_llama`, but owned here
//! because the engine needs what the stock model cannot give:
//! - the weights ([`Transformer`], immutable, `&self` forward) are separate from the per-batch
//!   state ([`KvCache`]), so one loaded model serves many caches;
//! - a b=1 prompt cache can be expanded to b=n rows ([`KvCache::expand`]) so a ticket's prompt
//!   is prefilled once and all its candidates decode together;
//! - the cache is preallocated to a fixed capacity and written in place (`slice_set`), never
//!   rebuilt with `Tensor::cat` per step;
//! - attention is GQA-aware: query heads are grouped per KV head by a free reshape, so keys and
//!   values are never repeated in memory;
//! - b>1 with seq_len>1 works (the last-position slice is made contiguous).
//!
//! Weights are either kept quantized (`QMatMul`) or dequantized once at load to dense tensors
//! (exact for GGUF block formats: dequantization is the format's definition of the weight).
//!
//! # Compute dtype
//!
//! A model computes in f32 or bf16 ([`Transformer::dtype`]): the embedding, the dense
//! projections, the activations and the KV cache are in that dtype. Whatever it is, the norm
//! statistics (every RMS norm runs on f32 with f32 weights), the attention softmax (scores
//! upcast, the causal mask added in f32) and the returned logits are f32, as transformers'
//! bf16 models compute them (`Qwen3RMSNorm` upcasts, eager attention's softmax runs in f32,
//! `generate` samples from float logits). RoPE tables are computed in f32 and cast to the
//! compute dtype, as transformers casts `cos`/`sin`.

mod attention;
mod decode;
pub mod ops;
mod paged;
mod paged_prefill;
mod projections;

use candle_core::quantized::QMatMul;

use candle_core::{DType, Device, Module, Tensor};
pub use decode::{DecodePart, DecodeTile};
pub use paged::PagedStep;
pub use paged_prefill::PagedChunk;
pub use projections::Projections;

pub use super::model_config::{RopeStyle, TransformerConfig};

/// One projection: quantized or dense, with an optional bias (qwen2 q/k/v).
#[derive(Debug, Clone)]
pub enum LinearWeight {
    Quantized(QMatMul),
    /// Stored transposed, `(in, out)` contiguous: the matmul's right-hand side is then
    /// row-major, which gemm reads without a strided repack of the whole matrix every call
    /// (that repack dominated small-batch decode).
    Dense(Tensor),
}

#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: LinearWeight,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A dense layer from a checkpoint matrix `(out, in)`.
    pub fn dense(w: &Tensor, bias: Option<Tensor>) -> candle_core::Result<Linear> {
        Ok(Linear {
            weight: LinearWeight::Dense(w.t()?.contiguous()?),
            bias,
        })
    }

    /// `x` is `(rows, in)`; returns `(rows, out)`.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.weight {
            LinearWeight::Quantized(q) => ops::one(q.forward(x))?,
            LinearWeight::Dense(w) => ops::one(x.matmul(w))?,
        };
        match &self.bias {
            Some(b) => ops::one(y.broadcast_add(b)),
            None => Ok(y),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Layer {
    pub attn_norm: Tensor,
    /// `q`, `k`, `v`.
    pub qkv: Projections<3>,
    pub wo: Linear,
    /// qwen3: RMS norm over each head's query/key vector before RoPE.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub ffn_norm: Tensor,
    /// `gate`, `up`.
    pub gate_up: Projections<2>,
    pub w_down: Linear,
}

/// The weights of a loaded model. Immutable after load; every forward takes `&self`.
#[derive(Debug)]
pub struct Transformer {
    pub config: TransformerConfig,
    /// `(vocab, hidden)`, dense (looked up by row).
    pub embedding: Tensor,
    pub layers: Vec<Layer>,
    pub final_norm: Tensor,
    pub lm_head: Linear,
    /// RoPE tables `(max_context, rot_dim/2)`.
    cos: Tensor,
    sin: Tensor,
    max_context: usize,
    device: Device,
}

/// The attention state of a batch of `b` rows that all sit at the same position (lockstep).
///
/// After [`KvCache::expand`] the rows share one read-only copy of the prompt's keys and values
/// (the one-row cache it was prefilled into) and hold only their own positions after it, so a
/// ticket's 8 candidates keep the prompt once, and a decode step reads it once for all rows.
///
/// Deliberately not `Clone`: the tensors are written in place, so a shallow clone would alias.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer `(k, v)`, each `(b, n_kv_head, capacity, head_dim)`: the rows' own positions.
    layers: Vec<(Tensor, Tensor)>,
    /// Per layer `(k, v)`, each `(1, n_kv_head, shared_len, head_dim)`: positions every row
    /// shares, before its own (empty before `expand`).
    shared: Vec<(Tensor, Tensor)>,
    shared_len: usize,
    batch: usize,
    /// The rows' own positions written.
    len: usize,
    capacity: usize,
}

/// The keys and values of a prompt's first positions, one row, copied out of a
/// [`KvCache`] ([`KvCache::prefix`]): the candle backend's entry in the prefix store.
#[derive(Debug)]
pub struct KvPrefix {
    /// Per layer `(k, v)`, each `(1, n_kv_head, len, head_dim)`.
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
}

impl KvPrefix {
    /// A prefix from each layer's keys and values `(len, n_kv_head, head_dim)` (read from
    /// the paged pool).
    pub fn from_positions(layers: Vec<(Tensor, Tensor)>) -> candle_core::Result<KvPrefix> {
        let len = match layers.first() {
            Some((k, _)) => k.dim(0)?,
            None => 0,
        };
        let heads = |t: &Tensor| t.transpose(0, 1)?.unsqueeze(0)?.contiguous();
        let layers = layers
            .iter()
            .map(|(k, v)| Ok((heads(k)?, heads(v)?)))
            .collect::<candle_core::Result<_>>()?;
        Ok(KvPrefix { layers, len })
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the keys and values held.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }
}

impl KvCache {
    pub fn new(
        config: &TransformerConfig,
        batch: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let shape = (batch, config.n_kv_head, capacity, config.head_dim);
        let mut layers = Vec::with_capacity(config.n_layer);
        for _ in 0..config.n_layer {
            layers.push((
                Tensor::zeros(shape, dtype, device)?,
                Tensor::zeros(shape, dtype, device)?,
            ));
        }
        Ok(KvCache {
            layers,
            shared: Vec::new(),
            shared_len: 0,
            batch,
            len: 0,
            capacity,
        })
    }

    /// Tokens already in the cache, shared and own (the position of the next token).
    pub fn len(&self) -> usize {
        self.shared_len + self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Positions the cache can hold in all.
    pub fn capacity(&self) -> usize {
        self.shared_len + self.capacity
    }

    /// A cache of `n` rows that share this one-row cache's positions (no copy: the new cache
    /// holds views of them, which nothing writes again) and have room for `capacity` positions
    /// in all. The prompt is prefilled once at b=1 and then expanded for the candidates.
    pub fn expand(self, n: usize, capacity: usize) -> candle_core::Result<KvCache> {
        let total = self.len();
        if capacity < total {
            candle_core::bail!("cannot expand a cache of {total} tokens to capacity {capacity}")
        }
        if self.batch != 1 || !self.shared.is_empty() {
            candle_core::bail!("only a one-row cache that shares nothing expands")
        }
        let own = capacity - total;
        let mut layers = Vec::with_capacity(self.layers.len());
        let mut shared = Vec::with_capacity(self.layers.len());
        for (k, v) in &self.layers {
            let (_, h, _, d) = k.dims4()?;
            let shape = (n, h, own, d);
            layers.push((
                Tensor::zeros(shape, k.dtype(), k.device())?,
                Tensor::zeros(shape, v.dtype(), v.device())?,
            ));
            shared.push((
                k.narrow(2, 0, total)?.contiguous()?,
                v.narrow(2, 0, total)?.contiguous()?,
            ));
        }
        Ok(KvCache {
            layers,
            shared,
            shared_len: total,
            batch: n,
            len: 0,
            capacity: own,
        })
    }

    /// A copy of the first `len` prompt positions: from a one-row cache before
    /// [`expand`](Self::expand), or from the shared part after it (what the prefix store
    /// keeps on the candle backend).
    pub fn prefix(&self, len: usize) -> candle_core::Result<KvPrefix> {
        let from = if self.shared.is_empty() {
            if self.batch != 1 || len > self.len {
                candle_core::bail!("a prefix of {len} positions from a cache of {}", self.len)
            }
            &self.layers
        } else {
            if len > self.shared_len {
                candle_core::bail!("a prefix of {len} positions from {}", self.shared_len)
            }
            &self.shared
        };
        let copy = |t: &Tensor| -> candle_core::Result<Tensor> {
            let (b, h, _, d) = t.dims4()?;
            let out = Tensor::zeros((b, h, len, d), t.dtype(), t.device())?;
            out.slice_set(&t.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            Ok(out)
        };
        let layers = from
            .iter()
            .map(|(k, v)| Ok((copy(k)?, copy(v)?)))
            .collect::<candle_core::Result<_>>()?;
        Ok(KvPrefix { layers, len })
    }

    /// Layer `li`'s keys and values at positions `from..from + len` of this one-row cache
    /// (before [`expand`](Self::expand)), each `(len, n_kv_head, head_dim)` contiguous: what
    /// the paged pool receives after a prefill.
    pub fn positions(
        &self,
        li: usize,
        from: usize,
        len: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        if self.batch != 1 || !self.shared.is_empty() || from + len > self.len {
            candle_core::bail!(
                "positions {from}..{} of a cache of {}",
                from + len,
                self.len
            )
        }
        let (k, v) = &self.layers[li];
        let rows = |t: &Tensor| {
            let part = t.narrow(2, from, len)?.squeeze(0)?.transpose(0, 1)?;
            ops::contiguous(&part)
        };
        Ok((rows(k)?, rows(v)?))
    }

    /// Starts this empty one-row cache at position `len`, its first `len` positions copied
    /// from `p`: what follows is computed as after a prefill of the same tokens in the same
    /// chunks.
    pub fn load_prefix(&mut self, p: &KvPrefix, len: usize) -> candle_core::Result<()> {
        if self.batch != 1 || !self.shared.is_empty() || self.len != 0 {
            candle_core::bail!("a prefix loads into an empty one-row cache only")
        }
        if len > p.len || len > self.capacity || p.layers.len() != self.layers.len() {
            candle_core::bail!("a prefix of {len} positions does not fit")
        }
        for ((kc, vc), (k, v)) in self.layers.iter().zip(&p.layers) {
            kc.slice_set(&k.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            vc.slice_set(&v.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
        }
        self.len = len;
        Ok(())
    }

    /// Writes this step's keys/values (`(b, n_kv, t, d)`, contiguous) at the current position of
    /// `layer` and returns views over the rows' own positions so far, including them, and the
    /// shared positions before them (`None` when there are none).
    #[allow(clippy::type_complexity)]
    fn append(
        &self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<((Tensor, Tensor), Option<&(Tensor, Tensor)>)> {
        let t = k.dim(2)?;
        let (kc, vc) = &self.layers[layer];
        ops::one(kc.slice_set(k, 2, self.len))?;
        ops::one(vc.slice_set(v, 2, self.len))?;
        let own = (
            kc.narrow(2, 0, self.len + t)?,
            vc.narrow(2, 0, self.len + t)?,
        );
        Ok((own, self.shared.get(layer)))
    }
}

/// RMS norm with f32 statistics and an f32 weight, returned in `x`'s dtype.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let xf = ops::contiguous(&ops::cast(x, DType::F32)?)?;
    ops::cast(
        &ops::one(candle_nn::ops::rms_norm(&xf, w, eps as f32))?,
        x.dtype(),
    )
}

/// Checks that the weights are in the dtypes [`Transformer::forward`] computes with: norms in
/// f32, the embedding and dense projections (and their biases) in `dtype`, quantized
/// projections only with f32 activations.
fn check_dtypes(
    dtype: DType,
    embedding: &Tensor,
    layers: &[Layer],
    final_norm: &Tensor,
    lm_head: &Linear,
) -> candle_core::Result<()> {
    let want = |t: &Tensor, d: DType, what: &str| match t.dtype() == d {
        true => Ok(()),
        false => Err(candle_core::Error::Msg(format!(
            "{what} is {:?}, expected {d:?}",
            t.dtype()
        ))),
    };
    let linear = |l: &Linear, what: &str| -> candle_core::Result<()> {
        match &l.weight {
            LinearWeight::Dense(w) => want(w, dtype, what)?,
            LinearWeight::Quantized(_) if dtype != DType::F32 => candle_core::bail!(
                "{what} is quantized, which computes with f32 activations, not {dtype:?}"
            ),
            LinearWeight::Quantized(_) => {}
        }
        l.bias.as_ref().map_or(Ok(()), |b| want(b, dtype, what))
    };
    want(embedding, dtype, "the embedding")?;
    want(final_norm, DType::F32, "the final norm")?;
    linear(lm_head, "the output head")?;
    for (i, l) in layers.iter().enumerate() {
        for (n, what) in [(&l.attn_norm, "attn_norm"), (&l.ffn_norm, "ffn_norm")] {
            want(n, DType::F32, &format!("layer {i} {what}"))?;
        }
        for n in l.q_norm.iter().chain(&l.k_norm) {
            want(n, DType::F32, &format!("layer {i} q/k norm"))?;
        }
        let all = [(l.qkv.linears(), "q/k/v"), (l.gate_up.linears(), "gate/up")];
        let one = [(&l.wo, "o"), (&l.w_down, "down")];
        let one = one
            .iter()
            .map(|(p, what)| (std::slice::from_ref(*p), *what));
        for (ps, what) in all.into_iter().chain(one) {
            for p in ps {
                linear(p, &format!("layer {i} {what} projection"))?;
            }
        }
    }
    Ok(())
}

impl Transformer {
    /// A model computing in `embedding`'s dtype (f32 or bf16; see the module docs), whose
    /// weights must already be in the dtypes it computes with.
    pub fn new(
        config: TransformerConfig,
        embedding: Tensor,
        layers: Vec<Layer>,
        final_norm: Tensor,
        lm_head: Linear,
        max_context: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let dtype = embedding.dtype();
        if !matches!(dtype, DType::F32 | DType::BF16) {
            candle_core::bail!("compute dtype {dtype:?} is not supported (f32, bf16)")
        }
        check_dtypes(dtype, &embedding, &layers, &final_norm, &lm_head)?;
        let rot = config.head_dim;
        let half = rot / 2;
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1f32 / (config.rope_theta as f32).powf((2 * i) as f32 / rot as f32))
            .collect();
        if let Some(factors) = &config.rope_freq_factors {
            if factors.len() != half {
                candle_core::bail!("rope_freqs has {} entries, expected {half}", factors.len())
            }
            for (f, s) in inv_freq.iter_mut().zip(factors) {
                *f /= *s;
            }
        }
        let inv_freq = Tensor::new(inv_freq.as_slice(), device)?.reshape((1, half))?;
        let pos = Tensor::arange(0u32, max_context as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_context, 1))?;
        let freqs = pos.matmul(&inv_freq)?;
        Ok(Transformer {
            cos: freqs.cos()?.to_dtype(dtype)?,
            sin: freqs.sin()?.to_dtype(dtype)?,
            config,
            embedding,
            layers,
            final_norm,
            lm_head,
            max_context,
            device: device.clone(),
        })
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Concatenates every layer's `q|k|v` and `gate|up` projections when all of them are
    /// dense (quantized ones keep their separate GEMMs); returns whether it did. The separate
    /// matrices are dropped: the prefill and the decode steps all read the concatenated ones.
    pub fn fuse_weights(&mut self) -> candle_core::Result<bool> {
        let dense = |l: &Layer| l.qkv.all_dense() && l.gate_up.all_dense();
        if !self.layers.iter().all(dense) {
            return Ok(false);
        }
        for l in &mut self.layers {
            l.qkv.fuse()?;
            l.gate_up.fuse()?;
        }
        Ok(true)
    }

    /// Whether the projections are concatenated ([`Self::fuse_weights`]).
    pub fn is_fused(&self) -> bool {
        self.layers
            .iter()
            .all(|l| matches!(l.qkv, Projections::Fused { .. }))
            && !self.layers.is_empty()
    }

    /// Bytes of the layers' projection matrices and biases as held (quantized ones in their
    /// blocks): what fusing must leave unchanged.
    pub fn projection_bytes(&self) -> usize {
        let tensor = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let linear = |l: &Linear| {
            let w = match &l.weight {
                LinearWeight::Dense(w) => tensor(w),
                LinearWeight::Quantized(q) => match q {
                    QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                    QMatMul::Tensor(t) | QMatMul::TensorF16(t) => tensor(t),
                },
            };
            w + l.bias.as_ref().map_or(0, tensor)
        };
        let layer = |l: &Layer| -> usize {
            let held = l.qkv.linears().iter().chain(l.gate_up.linears());
            held.chain([&l.wo, &l.w_down]).map(linear).sum()
        };
        self.layers.iter().map(layer).sum()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute dtype (f32 or bf16): activations, dense weights and the KV cache.
    pub fn dtype(&self) -> DType {
        self.embedding.dtype()
    }

    /// A fresh cache of `batch` rows with room for `capacity` tokens.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> candle_core::Result<KvCache> {
        KvCache::new(
            &self.config,
            batch,
            capacity.min(self.max_context),
            self.dtype(),
            &self.device,
        )
    }

    fn rope(&self, x: &Tensor, pos: usize, t: usize) -> candle_core::Result<Tensor> {
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        ops::one(match self.config.rope_style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, &cos, &sin),
            RopeStyle::Neox => candle_nn::rotary_emb::rope(x, &cos, &sin),
        })
    }

    /// Runs `tokens` (`(b, t)` u32, all rows at position `cache.len()`) through the model,
    /// appends their keys/values to `cache`, and returns the logits of the last position,
    /// `(b, vocab)` in f32.
    pub fn forward(&self, tokens: &Tensor, cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let pos = cache.len();
        if b != cache.batch {
            candle_core::bail!("batch of {b} rows fed to a cache of {} rows", cache.batch)
        }
        if t == 0 {
            candle_core::bail!("empty input")
        }
        if cache.len + t > cache.capacity {
            candle_core::bail!(
                "{} positions exceed the cache capacity {}",
                pos + t,
                cache.capacity()
            )
        }
        let cfg = &self.config;
        let kv_len = pos + t;
        // Additive causal mask over the new rows: (t, kv_len), 0 where visible, -inf where not.
        let mask = if t > 1 {
            let mut m = vec![0f32; t * kv_len];
            for i in 0..t {
                for j in (pos + i + 1)..kv_len {
                    m[i * kv_len + j] = f32::NEG_INFINITY;
                }
            }
            Some(ops::one(Tensor::from_vec(m, (t, kv_len), &self.device))?)
        } else {
            None
        };
        let flat = tokens.flatten_all()?;
        let mut x = ops::one(self.embedding.index_select(&flat, 0))?; // (b*t, hidden)
        for (li, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let [q, k, v] = layer.qkv.outputs(&h, Linear::forward)?;
            let y = self.attend(li, layer, [&q, &k, &v], t, cache, mask.as_ref())?;
            let x1 = ops::one(layer.wo.forward(&y)? + &x)?;
            let h = rms_norm(&x1, &layer.ffn_norm, cfg.rms_eps)?;
            let [gate, up] = layer.gate_up.outputs(&h, Linear::forward)?;
            let act = ops::one(ops::one(candle_nn::ops::silu(&gate))? * up)?;
            let ff = layer.w_down.forward(&act)?;
            x = ops::one(ff + x1)?;
        }
        cache.len += t;
        // Only the last position of every row needs logits.
        let last = x
            .reshape((b, t, cfg.hidden))?
            .narrow(1, t - 1, 1)?
            .squeeze(1)?;
        let last = rms_norm(&ops::contiguous(&last)?, &self.final_norm, cfg.rms_eps)?;
        let logits = self.lm_head.forward(&last)?;
        ops::cast(&logits, DType::F32)
    }
}
