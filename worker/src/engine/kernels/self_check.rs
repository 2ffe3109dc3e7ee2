//! The kernels' self-check: on the first model load on a device, each kernel runs on a small
//! random input (a fixed host-side generator, so every device sees the same numbers) and is
//! compared with its composition from plain candle ops ([`super::reference`]) on that device,
//! in f32 and bf16, head dims 64 and 128, and at the model's own attention shape (its head
//! dim and heads per KV head: a kernel whose launcher does not take that shape, e.g. head dim
//! 16 for the q/k rope kernel, fails its check there instead of failing the model's first
//! step). A kernel whose error exceeds its dtype's tolerance,
//! or that fails to run, is marked unusable and logged loudly with the measured error: the
//! caller then runs the reference path for it. The report renders into a short fingerprint
//! suffix naming the kernels in use, so results of workers using different kernels never
//! compare as the same numerics.
//!
//! The error is `max |kernel - reference| / max(1, max |reference|)`. Tolerances: f32 1e-4
//! (summation order and `exp` differ, nothing else), bf16 1.6e-2 (two bf16 ulps at 1.0: the
//! kernels round once where the compositions round after every op).

use candle_core::{DType, Device, Tensor};

use super::fused;
use super::params::{QkvSpec, Rope, RopePairs};
use super::pool::{BLOCK, BlockTable, PagedKvPool, PoolShape, row_table_tensor};
use super::qkv_rope;
use super::{flash_prefill, paged_attention, reference};
use crate::engine::switches::KernelsOn;

/// A kernel that can be checked and switched off on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelId {
    PagedAttention,
    AddRmsNorm,
    QkNormRopeKv,
    SiluMul,
    FlashPrefill,
}

impl KernelId {
    pub const ALL: [KernelId; 5] = [
        KernelId::PagedAttention,
        KernelId::AddRmsNorm,
        KernelId::QkNormRopeKv,
        KernelId::SiluMul,
        KernelId::FlashPrefill,
    ];

    /// The short name the fingerprint suffix and the logs use.
    pub fn name(self) -> &'static str {
        match self {
            KernelId::PagedAttention => "paged-attn",
            KernelId::AddRmsNorm => "add-rmsnorm",
            KernelId::QkNormRopeKv => "qk-rope-kv",
            KernelId::SiluMul => "silu-mul",
            KernelId::FlashPrefill => "flash-prefill",
        }
    }

    /// Whether the switches in `on` select this kernel: `paged` the decode attention,
    /// `flash_prefill` the prefill attention, `fused` the others.
    pub fn selected(self, on: KernelsOn) -> bool {
        match self {
            KernelId::PagedAttention => on.paged,
            KernelId::FlashPrefill => on.flash_prefill,
            KernelId::AddRmsNorm | KernelId::QkNormRopeKv | KernelId::SiluMul => on.fused,
        }
    }
}

/// One kernel checked in one dtype and head dim.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelCheck {
    pub kernel: KernelId,
    pub dtype: DType,
    pub head_dim: usize,
    /// The measured error (see the module header); infinite when the kernel failed to run.
    pub error: f32,
    pub tolerance: f32,
    /// Why the kernel failed to run, if it did.
    pub failure: Option<String>,
}

impl KernelCheck {
    pub fn passed(&self) -> bool {
        self.failure.is_none() && self.error <= self.tolerance
    }
}

/// Every check run on one device.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfCheckReport {
    pub checks: Vec<KernelCheck>,
}

impl SelfCheckReport {
    /// Whether every check of `k` passed (never true for a kernel not checked).
    pub fn usable(&self, k: KernelId) -> bool {
        let mut of_k = self.checks.iter().filter(|c| c.kernel == k).peekable();
        of_k.peek().is_some() && of_k.all(KernelCheck::passed)
    }

    /// The kernels to use: usable ones the switches in `on` select ([`KernelId::selected`]).
    pub fn in_use(&self, on: KernelsOn) -> Vec<KernelId> {
        KernelId::ALL
            .into_iter()
            .filter(|k| k.selected(on))
            .filter(|&k| self.usable(k))
            .collect()
    }

    /// The fingerprint suffix naming the kernels in use, e.g. `kernels=paged-attn+silu-mul`,
    /// or `kernels=none`.
    pub fn fingerprint_suffix(&self, on: KernelsOn) -> String {
        let names: Vec<_> = self.in_use(on).iter().map(|k| k.name()).collect();
        match names.is_empty() {
            true => "kernels=none".into(),
            false => format!("kernels={}", names.join("+")),
        }
    }
}

/// Whether `suffix` is one [`SelfCheckReport::fingerprint_suffix`] can write: `kernels=none`
/// or kernel names joined by `+` in their fixed order, each once.
pub fn suffix_known(suffix: &str) -> bool {
    let Some(names) = suffix.strip_prefix("kernels=") else {
        return false;
    };
    if names == "none" {
        return true;
    }
    let mut rest = KernelId::ALL.iter().map(|k| k.name());
    !names.is_empty() && names.split('+').all(|n| rest.any(|k| k == n))
}

/// A model's attention shape, which the self-check runs every kernel at besides its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub head_dim: usize,
    pub n_head: usize,
    pub n_kv: usize,
    /// The hidden size (the residual add + RMS norm's width).
    pub hidden: usize,
}

/// Checks every kernel on `device` at the fixed shapes (see the module header).
pub fn self_check(device: &Device) -> SelfCheckReport {
    check_all(device, None, None)
}

/// Checks every kernel on `device` at the fixed shapes and at `model`'s.
pub fn self_check_for(device: &Device, model: AttnShape) -> SelfCheckReport {
    check_all(device, None, Some(model))
}

/// The self-check with `perturb`'s output shifted before it is compared (tests only: a kernel
/// forced to disagree).
pub(crate) fn check_all(
    device: &Device,
    perturb: Option<KernelId>,
    model: Option<AttnShape>,
) -> SelfCheckReport {
    // (head dim, model): the fixed shapes, then the model's.
    let mut shapes = vec![(64, None), (128, None)];
    if let Some(m) = model {
        shapes.push((m.head_dim, Some(m)));
    }
    let mut checks = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let tolerance = if dtype == DType::F32 { 1e-4 } else { 1.6e-2 };
        for &(head_dim, model) in &shapes {
            for kernel in KernelId::ALL {
                let shift = if perturb == Some(kernel) { 0.5 } else { 0.0 };
                let run = Input {
                    device,
                    dtype,
                    head_dim,
                    model,
                    shift,
                };
                let (error, failure) = match run.check(kernel) {
                    Ok(e) => (e, None),
                    Err(e) => (f32::INFINITY, Some(e.to_string())),
                };
                let check = KernelCheck {
                    kernel,
                    dtype,
                    head_dim,
                    error,
                    tolerance,
                    failure,
                };
                if !check.passed() {
                    log_failure(device, &check);
                }
                checks.push(check);
            }
        }
    }
    SelfCheckReport { checks }
}

fn log_failure(device: &Device, check: &KernelCheck) {
    tracing::error!(
        kernel = check.kernel.name(),
        dtype = ?check.dtype,
        head_dim = check.head_dim,
        error = check.error,
        tolerance = check.tolerance,
        failure = check.failure.as_deref().unwrap_or(""),
        "KERNEL SELF-CHECK FAILED on {device:?}: the kernel disagrees with its reference \
         composition or does not take this shape, and will not be used; the reference path runs"
    );
}

/// A small deterministic generator (xorshift), so every device checks the same inputs.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                lo + (hi - lo) * ((self.0 >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }
}

struct Input<'a> {
    device: &'a Device,
    dtype: DType,
    head_dim: usize,
    /// A model's shape for its pass (heads, hidden size); `None`: each check's own.
    model: Option<AttnShape>,
    shift: f64,
}

/// `max |a - b| / max(1, max |b|)`, on the host: a non-finite value on either side is an
/// infinite error. (A device-side `max` drops NaN, so a kernel that writes NaN, or leaves
/// an element of its uninitialised output unwritten, would otherwise pass.)
pub(crate) fn error(a: &Tensor, b: &Tensor) -> candle_core::Result<f32> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if a.len() != b.len() {
        candle_core::bail!("self-check: {} values against {}", a.len(), b.len());
    }
    let (mut diff, mut scale) = (0f32, 1f32);
    for (x, y) in a.iter().zip(&b) {
        let d = (x - y).abs();
        if !d.is_finite() {
            return Ok(f32::INFINITY);
        }
        diff = diff.max(d);
        scale = scale.max(y.abs());
    }
    Ok(diff / scale)
}

impl Input<'_> {
    fn tensor(
        &self,
        rng: &mut Rng,
        dims: &[usize],
        lo: f32,
        hi: f32,
    ) -> candle_core::Result<Tensor> {
        let n = dims.iter().product();
        Tensor::from_vec(rng.uniform(n, lo, hi), dims, self.device)?.to_dtype(self.dtype)
    }

    fn check(&self, kernel: KernelId) -> candle_core::Result<f32> {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ self.head_dim as u64);
        match kernel {
            KernelId::AddRmsNorm => self.add_rms_norm(&mut rng),
            KernelId::SiluMul => {
                let gu = self.tensor(&mut rng, &[3, 2 * 160], -4.0, 4.0)?;
                let got = (fused::silu_mul(&gu)? + self.shift)?;
                error(&got, &reference::silu_mul(&gu)?)
            }
            KernelId::QkNormRopeKv => self.qk_rope_kv(&mut rng),
            KernelId::PagedAttention => self.paged_attention(&mut rng),
            KernelId::FlashPrefill => self.flash_prefill(&mut rng),
        }
    }

    fn heads(&self) -> Option<(usize, usize)> {
        self.model.map(|m| (m.n_head, m.n_kv))
    }

    /// At 256 wide, and at the model's hidden size in its pass.
    fn add_rms_norm(&self, rng: &mut Rng) -> candle_core::Result<f32> {
        let h = self.model.map_or(256, |m| m.hidden);
        let x = self.tensor(rng, &[3, h], -1.0, 1.0)?;
        let r = self.tensor(rng, &[3, h], -1.0, 1.0)?;
        let w = Tensor::from_vec(rng.uniform(h, 0.5, 1.5), h, self.device)?;
        let (s, n) = fused::add_rms_norm(&x, &r, &w, 1e-6)?;
        let (rs, rn) = reference::add_rms_norm(&x, &r, &w, 1e-6)?;
        Ok(error(&(s + self.shift)?, &rs)?.max(error(&n, &rn)?))
    }

    /// With the q/k norms (Qwen3: 2 query heads a KV head) and without (Llama, SmolLM2: 3).
    fn qk_rope_kv(&self, rng: &mut Rng) -> candle_core::Result<f32> {
        let d = self.head_dim;
        let w_q = Tensor::from_vec(rng.uniform(d, 0.5, 1.5), d, self.device)?;
        let w_k = Tensor::from_vec(rng.uniform(d, 0.5, 1.5), d, self.device)?;
        let mut worst = 0f32;
        let variants = match self.model {
            Some(m) => [(m.n_head, m.n_kv, true), (m.n_head, m.n_kv, false)],
            None => [(4, 2, true), (6, 2, false)],
        };
        for (n_head, n_kv, norms) in variants {
            let spec = QkvSpec {
                n_head,
                n_kv,
                head_dim: d,
                q_norm: norms.then_some(&w_q),
                k_norm: norms.then_some(&w_k),
                eps: 1e-6,
            };
            worst = worst.max(self.qk_rope_kv_with(rng, &spec)?);
        }
        Ok(worst)
    }

    fn qk_rope_kv_with(&self, rng: &mut Rng, spec: &QkvSpec) -> candle_core::Result<f32> {
        let (d, n_kv, ctx) = (spec.head_dim, spec.n_kv, 64);
        let angles: Vec<f32> = (0..ctx * d / 2)
            .map(|i| (i / (d / 2)) as f32 / 10000f32.powf((2 * (i % (d / 2))) as f32 / d as f32))
            .collect();
        let angles = Tensor::from_vec(angles, (ctx, d / 2), self.device)?;
        let (cos, sin) = (
            angles.cos()?.to_dtype(self.dtype)?,
            angles.sin()?.to_dtype(self.dtype)?,
        );
        let qkv = self.tensor(rng, &[3, spec.width()], -2.0, 2.0)?;
        let positions = Tensor::new(&[0u32, 7, 33], self.device)?;
        let slots = Tensor::new(&[5u32, BLOCK as u32 + 3, 2 * BLOCK as u32], self.device)?;
        let mut worst = 0f32;
        for pairs in [RopePairs::Halves, RopePairs::Interleaved] {
            let rope = Rope {
                cos: &cos,
                sin: &sin,
                pairs,
            };
            let shape = PoolShape {
                n_layer: 1,
                n_kv_head: n_kv,
                head_dim: d,
                num_blocks: 4,
            };
            let pool = PagedKvPool::new(shape, self.dtype, self.device).map_err(to_candle)?;
            let q = qkv_rope::q_norm_rope(&qkv, spec, &rope, &positions)?;
            qkv_rope::kv_norm_rope_write(pool.layer(0), &qkv, spec, &rope, &positions, &slots)?;
            let (k, v) = reference::gather_slots(pool.layer(0), &slots)?;
            let (rk, rv) = reference::kv_norm_rope(&qkv, spec, &rope, &positions)?;
            let rq = reference::q_norm_rope(&qkv, spec, &rope, &positions)?;
            worst = worst
                .max(error(&q, &rq)?)
                .max(error(&(k + self.shift)?, &rk)?)
                .max(error(&v, &rv)?);
        }
        Ok(worst)
    }

    fn paged_attention(&self, rng: &mut Rng) -> candle_core::Result<f32> {
        let d = self.head_dim;
        let ((n_head, n_kv), blocks) = (self.heads().unwrap_or((8, 2)), 48);
        let shape = PoolShape {
            n_layer: 1,
            n_kv_head: n_kv,
            head_dim: d,
            num_blocks: blocks,
        };
        let mut pool = PagedKvPool::new(shape, self.dtype, self.device).map_err(to_candle)?;
        let fill = self.tensor(rng, &[blocks, 2, BLOCK, n_kv, d], -1.5, 1.5)?;
        pool.layer(0).slice_set(&fill, 0, 0)?;
        // Three rows: one position, a shared prompt and a row past one partition.
        let mut tables: Vec<BlockTable> = Vec::new();
        for len in [1, 37, super::params::PARTITION + 88] {
            let mut t = pool.empty_table();
            pool.append_slots(&mut t, len).map_err(to_candle)?;
            tables.push(t);
        }
        let row = pool.fork(&tables[1]);
        tables.push(row);
        let table = row_table_tensor(&tables.iter().collect::<Vec<_>>(), self.device)?;
        let q = self.tensor(rng, &[tables.len(), n_head, d], -1.0, 1.0)?;
        let scale = 1.0 / (d as f32).sqrt();
        let got = paged_attention::paged_decode_attention(&q, pool.layer(0), &table, scale)?;
        let want = reference::paged_decode_attention(&q, pool.layer(0), &table, scale)?;
        error(&(got + self.shift)?, &want)
    }
}

impl Input<'_> {
    /// Two chunks over one pool: one from position 0, and one after a prefix of 37 positions
    /// shared with the first job (a partial block copied on write), crossing key tiles.
    fn flash_prefill(&self, rng: &mut Rng) -> candle_core::Result<f32> {
        let d = self.head_dim;
        let ((n_head, n_kv), blocks) = (self.heads().unwrap_or((8, 2)), 16);
        let shape = PoolShape {
            n_layer: 1,
            n_kv_head: n_kv,
            head_dim: d,
            num_blocks: blocks,
        };
        let mut pool = PagedKvPool::new(shape, self.dtype, self.device).map_err(to_candle)?;
        let fill = self.tensor(rng, &[blocks, 2, BLOCK, n_kv, d], -1.5, 1.5)?;
        pool.layer(0).slice_set(&fill, 0, 0)?;
        let mut first = pool.empty_table();
        pool.append_slots(&mut first, 45).map_err(to_candle)?;
        let mut second = pool.share_prefix(&first, 37).map_err(to_candle)?;
        pool.append_slots(&mut second, 40).map_err(to_candle)?;
        let scale = 1.0 / (d as f32).sqrt();
        let mut worst = 0f32;
        for (t, c) in [(&first, 45), (&second, 40)] {
            let table = row_table_tensor(&[t], self.device)?;
            let q = self.tensor(rng, &[c, n_head, d], -1.0, 1.0)?;
            let got = flash_prefill::flash_prefill_attention(&q, pool.layer(0), &table, scale)?;
            let want = reference::flash_prefill_attention(&q, pool.layer(0), &table, scale)?;
            worst = worst.max(error(&(got + self.shift)?, &want)?);
        }
        Ok(worst)
    }
}

fn to_candle(e: super::pool::PoolError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}
