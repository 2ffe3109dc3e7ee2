//! Integer dot products of the CPU fast path: activations quantized per block of 32 to 8 bits
//! (llama.cpp's Q8_1 scheme) and multiplied with the GGUF Q4_1 / Q8_0 weight blocks in integers,
//! with one kernel per instruction set picked once at run time ([`isa`]).
//!
//! # Why
//! In f32 every weight costs a fused multiply-add of 8 lanes; an integer multiply-add
//! (`vpdpbusd` with AVX-512 VNNI, `vpmaddubsw`+`vpmaddwd` otherwise) does 4 bytes per lane.
//! The weights are stored [`Interleaved`]: 16 rows side by side, so one integer instruction
//! advances 16 outputs by 4 elements each and a block's float work (scale, min) is one vector
//! operation per 16 outputs. The price is activation rounding (≤ 1/254 of a block's largest
//! value per element), which the architecture test bounds against the f64 reference;
//! `--numerics f32` keeps the exact-weights f32 path.
//!
//! # Numerics: one recipe, every instruction set
//! The integers are exact whatever instructions compute them, so the recipe pins down only the
//! float steps. For activation row `x` and weight row `w` of `nb` blocks:
//! 1. quantize each block of `x` ([`QuantizedRows::quantize`]): `d = amax/127`,
//!    `q = round_even(x·(1/d))` clamped to ±127, `s = d·Σq`;
//! 2. `acc = 0`; for each block `b` in order: `acc = fma(dw_b·dx_b, Σ_j qw_j·qx_j, acc)`, then
//!    for Q4_1 (its `+m` term) `acc = fma(mw_b, s_b, acc)`; the result is `acc`.
//!
//! Each output is one lane from start to end, so the AVX-512 VNNI, AVX-512BW, AVX2 and scalar
//! copies return the same bits (unit tests), and since an output depends only on its own two
//! rows, results never depend on batch, tiling or threads.

// Kernels index lanes and rows explicitly: the order of operations is the contract.
#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use rayon::prelude::*;

use super::kernels::PackedMatrix;

/// Weight rows per interleaved group: the f32 lanes of one 512-bit register.
pub const GROUP: usize = 16;

/// The instruction set of the integer kernels, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512Bw,
    Avx512Vnni,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Bw => "avx512bw",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }
}

/// Which kernels to use: the best the CPU has, or at most a given level (benchmarks, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelChoice {
    #[default]
    Auto,
    AtMost(Isa),
}

impl std::str::FromStr for KernelChoice {
    type Err = String;

    /// `auto`, `avx512vnni`, `avx512bw`, `avx2` or `scalar`.
    fn from_str(s: &str) -> Result<Self, String> {
        let isa = match s {
            "auto" => return Ok(KernelChoice::Auto),
            "scalar" => Isa::Scalar,
            "avx2" => Isa::Avx2,
            "avx512bw" => Isa::Avx512Bw,
            "avx512vnni" => Isa::Avx512Vnni,
            _ => {
                return Err(format!(
                    "unknown kernels `{s}` (auto, avx512vnni, avx512bw, avx2, scalar)"
                ));
            }
        };
        Ok(KernelChoice::AtMost(isa))
    }
}

static CHOICE: OnceLock<KernelChoice> = OnceLock::new();
static ISA: OnceLock<Isa> = OnceLock::new();

/// Caps the kernels of this process (the CLI's `--kernels`). Effective only before the first
/// kernel runs; returns false when the choice was already made. Without it, the environment
/// variable `STAGEB_KERNELS` (same values) is read.
pub fn choose(choice: KernelChoice) -> bool {
    CHOICE.set(choice).is_ok() && ISA.get().is_none()
}

/// The best instruction set this CPU supports.
pub fn detected() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        let bw =
            avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
        if bw && is_x86_feature_detected!("avx512vnni") {
            return Isa::Avx512Vnni;
        }
        if bw {
            return Isa::Avx512Bw;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// The kernels asked for: [`choose`]'s choice, else `STAGEB_KERNELS`, else auto.
pub fn choice() -> KernelChoice {
    CHOICE.get().copied().unwrap_or_else(|| {
        std::env::var("STAGEB_KERNELS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_default()
    })
}

/// The instruction set the integer kernels run with in this process: the detected one, capped
/// by [`choice`]. Every choice gives the same bits.
pub fn isa() -> Isa {
    *ISA.get_or_init(|| match choice() {
        KernelChoice::Auto => detected(),
        KernelChoice::AtMost(cap) => detected().min(cap),
    })
}

/// The block format of an [`Interleaved`] matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Q4_1,
    Q8_0,
}

/// A Q4_1 or Q8_0 matrix with its rows interleaved in groups of [`GROUP`] (the last group
/// padded with zero rows). For group `g` and block `b` (`gb = g·nb + b`):
/// - Q4_1: 4 vectors of 64 bytes at `qs[(gb·4 + t)·64]`; bytes `4i..4i+4` of vector `t` are
///   bytes `4t..4t+4` of row `i`'s block, whose low nibbles are elements `4t..4t+4` and high
///   nibbles elements `16+4t..16+4t+4`; `d` and `m` at `[gb·16 + i]`;
/// - Q8_0: 8 vectors of 64 bytes at `qs[(gb·8 + t)·64]`, bytes `4i..4i+4` = elements
///   `4t..4t+4` of row `i` (signed); `d` at `[gb·16 + i]`, and `bias[gb·16 + i] = −128·Σw`
///   (the VNNI kernel multiplies `x + 128`, unsigned, by the signed weights).
#[derive(Debug, Clone)]
pub struct Interleaved {
    kind: BlockKind,
    rows: usize,
    cols: usize,
    nb: usize,
    groups: usize,
    qs: Vec<u8>,
    d: Vec<f32>,
    m: Vec<f32>,
    bias: Vec<i32>,
}

impl Interleaved {
    /// The interleaved copy of a Q4_1 / Q8_0 matrix (`None` for other formats).
    pub fn from_packed(w: &PackedMatrix) -> Option<Interleaved> {
        let (kind, rows, cols) = match w {
            PackedMatrix::Q4_1 { rows, cols, .. } => (BlockKind::Q4_1, *rows, *cols),
            PackedMatrix::Q8_0 { rows, cols, .. } => (BlockKind::Q8_0, *rows, *cols),
            _ => return None,
        };
        let nb = cols / 32;
        let groups = rows.div_ceil(GROUP);
        let vectors = if kind == BlockKind::Q4_1 { 4 } else { 8 };
        let mut out = Interleaved {
            kind,
            rows,
            cols,
            nb,
            groups,
            qs: vec![0; groups * nb * vectors * 64],
            d: vec![0.0; groups * nb * GROUP],
            m: Vec::new(),
            bias: Vec::new(),
        };
        match w {
            PackedMatrix::Q4_1 { dm, qs, .. } => {
                out.m = vec![0.0; groups * nb * GROUP];
                for row in 0..rows {
                    let (g, i) = (row / GROUP, row % GROUP);
                    for b in 0..nb {
                        let gb = g * nb + b;
                        let src = &qs[row * nb + b];
                        for t in 0..4 {
                            let at = (gb * 4 + t) * 64 + i * 4;
                            out.qs[at..at + 4].copy_from_slice(&src[4 * t..4 * t + 4]);
                        }
                        out.d[gb * GROUP + i] = dm[row * nb + b][0];
                        out.m[gb * GROUP + i] = dm[row * nb + b][1];
                    }
                }
            }
            PackedMatrix::Q8_0 { d, qs, .. } => {
                out.bias = vec![0; groups * nb * GROUP];
                for row in 0..rows {
                    let (g, i) = (row / GROUP, row % GROUP);
                    for b in 0..nb {
                        let gb = g * nb + b;
                        let src = &qs[row * nb + b];
                        for t in 0..8 {
                            let at = (gb * 8 + t) * 64 + i * 4;
                            for u in 0..4 {
                                out.qs[at + u] = src[4 * t + u] as u8;
                            }
                        }
                        out.d[gb * GROUP + i] = d[row * nb + b];
                        out.bias[gb * GROUP + i] =
                            -128 * src.iter().map(|&v| v as i32).sum::<i32>();
                    }
                }
            }
            _ => return None,
        }
        Some(out)
    }

    pub fn kind(&self) -> BlockKind {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        self.qs.len() + 4 * (self.d.len() + self.m.len() + self.bias.len())
    }

    /// The 32 quantized values of row `row`'s block `b` (zeros for padded rows).
    fn quants(&self, row: usize, b: usize) -> [i32; 32] {
        let (g, i) = (row / GROUP, row % GROUP);
        let gb = g * self.nb + b;
        let mut v = [0i32; 32];
        match self.kind {
            BlockKind::Q4_1 => {
                for t in 0..4 {
                    for u in 0..4 {
                        let byte = self.qs[(gb * 4 + t) * 64 + i * 4 + u];
                        v[4 * t + u] = (byte & 0x0f) as i32;
                        v[16 + 4 * t + u] = (byte >> 4) as i32;
                    }
                }
            }
            BlockKind::Q8_0 => {
                for t in 0..8 {
                    for u in 0..4 {
                        v[4 * t + u] = self.qs[(gb * 8 + t) * 64 + i * 4 + u] as i8 as i32;
                    }
                }
            }
        }
        v
    }

    /// Rows `r0..r0+n` as f32 into `out[..n·cols]`, exactly as GGUF dequantizes them (Q4_1:
    /// `q·d + m`, two roundings; Q8_0: `q·d`), so embedding lookups are unchanged.
    pub fn dequant_rows(&self, r0: usize, n: usize, out: &mut [f32]) {
        for (row, o) in (r0..r0 + n).zip(out.chunks_exact_mut(self.cols)) {
            let (g, i) = (row / GROUP, row % GROUP);
            for b in 0..self.nb {
                let at = (g * self.nb + b) * GROUP + i;
                let q = self.quants(row, b);
                for j in 0..32 {
                    o[b * 32 + j] = match self.kind {
                        BlockKind::Q4_1 => q[j] as f32 * self.d[at] + self.m[at],
                        BlockKind::Q8_0 => q[j] as f32 * self.d[at],
                    };
                }
            }
        }
    }
}

/// A batch of activation rows quantized per block (see the module docs): `q` (`k` bytes per
/// row), the same plus 128 as unsigned bytes (`qu`, for the VNNI Q8_0 kernel), and per block
/// the scale `d` and `s = d·Σq`.
#[derive(Debug, Default)]
pub struct QuantizedRows {
    rows: usize,
    k: usize,
    nb: usize,
    q: Vec<i8>,
    qu: Vec<u8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl QuantizedRows {
    /// Quantizes `m` rows of `k` values (`k % 32 == 0`), reusing the buffers.
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        assert!(k.is_multiple_of(32) && x.len() == m * k, "quantize shape");
        let nb = k / 32;
        (self.rows, self.k, self.nb) = (m, k, nb);
        self.q.resize(m * k, 0);
        self.qu.resize(m * k, 0);
        self.d.resize(m * nb, 0.0);
        self.s.resize(m * nb, 0.0);
        let rows = self
            .q
            .par_chunks_mut(k)
            .zip(self.qu.par_chunks_mut(k))
            .zip(self.d.par_chunks_mut(nb))
            .zip(self.s.par_chunks_mut(nb))
            .zip(x.par_chunks(k));
        rows.for_each(|((((q, qu), d), s), x)| quantize_row(x, q, qu, d, s));
    }
}

/// 1.5·2²³: `(v + M) − M` rounds `|v| < 2²²` to the nearest integer, ties to even, with two
/// IEEE additions (so every compiled copy rounds alike, vectorized or not).
const ROUND_MAGIC: f32 = 12_582_912.0;

/// The scalar recipe of a row's quantization (and the fallback): per block, `amax` by
/// `|x| > m` comparisons (a NaN never wins), `d = amax/127`, `q = round_even(x·(1/d))` clamped to
/// ±127 in float (NaN → 0), `s = d·Σq`. [`x86::quantize_row`] computes the same bits.
fn quantize_row_impl(x: &[f32], q: &mut [i8], qu: &mut [u8], d: &mut [f32], s: &mut [f32]) {
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let mut amax = 0f32;
        for v in xb {
            let a = v.abs();
            if a > amax {
                amax = a;
            }
        }
        let db = amax / 127.0;
        let id = if db == 0.0 { 0.0 } else { 1.0 / db };
        let mut sum = 0i32;
        for (j, v) in xb.iter().enumerate() {
            let r = ((v * id) + ROUND_MAGIC) - ROUND_MAGIC;
            let r = if r.is_nan() {
                0.0
            } else {
                r.clamp(-127.0, 127.0)
            };
            let qi = r as i32;
            q[b * 32 + j] = qi as i8;
            qu[b * 32 + j] = (qi + 128) as u8;
            sum += qi;
        }
        d[b] = db;
        s[b] = db * sum as f32;
    }
}

/// One row's blocks quantized (see [`QuantizedRows`]).
fn quantize_row(x: &[f32], q: &mut [i8], qu: &mut [u8], d: &mut [f32], s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: `isa()` is at least Avx2 only after `is_x86_feature_detected!` confirmed
        // avx2 and fma; the slices are one row (k values, k bytes twice, k/32 blocks).
        return unsafe { x86::quantize_row(x, q, qu, d, s) };
    }
    quantize_row_impl(x, q, qu, d, s)
}

/// The recipe of the module docs, plainly: the scalar fallback and the reference of the tests.
fn dot_scalar(a: &QuantizedRows, r: usize, w: &Interleaved, row: usize) -> f32 {
    let (g, i) = (row / GROUP, row % GROUP);
    let mut acc = 0f32;
    for b in 0..w.nb {
        let wq = w.quants(row, b);
        let xq = &a.q[r * a.k + b * 32..r * a.k + b * 32 + 32];
        let sumi: i32 = (0..32).map(|j| wq[j] * xq[j] as i32).sum();
        let at = (g * w.nb + b) * GROUP + i;
        acc = (w.d[at] * a.d[r * a.nb + b]).mul_add(sumi as f32, acc);
        if w.kind == BlockKind::Q4_1 {
            acc = w.m[at].mul_add(a.s[r * a.nb + b], acc);
        }
    }
    acc
}

/// `out[((g − g0)·m + r)·16 + l] = dot(row r of a, weight row 16g + l)` for groups
/// `g0..g0+ng` (padded rows included), with the instruction set `isa`.
fn dots(isa: Isa, a: &QuantizedRows, w: &Interleaved, g0: usize, ng: usize, out: &mut [f32]) {
    let m = a.rows;
    assert!(out.len() >= ng * m * GROUP && g0 + ng <= w.groups && w.cols == a.k);
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: `isa` never exceeds what `detected()` found (callers pass `isa()` or, in
        // tests, a level at most `detected()`), and the shapes the kernels rely on are
        // asserted just above.
        unsafe { x86::dots(isa, a, w, g0, ng, out) };
        return;
    }
    let _ = isa;
    for g in 0..ng {
        for r in 0..m {
            for l in 0..GROUP {
                out[(g * m + r) * GROUP + l] = dot_scalar(a, r, w, (g0 + g) * GROUP + l);
            }
        }
    }
}

/// Whether the integer path handles `w` (interleaved Q4_1/Q8_0; everything else keeps f32).
pub fn supports(w: &PackedMatrix) -> bool {
    matches!(w, PackedMatrix::Interleaved(_))
}

/// Reusable buffers of [`matmul`].
#[derive(Debug, Default)]
pub struct Int8Workspace {
    acts: QuantizedRows,
    yt: Vec<f32>,
}

/// `y = x · wᵀ` through the integer kernels: `x` is `m × k`, `w` is `n × k`
/// ([`PackedMatrix::Interleaved`]), `y` is `m × n`. Parallel over groups of output rows on the
/// current rayon pool.
pub fn matmul(x: &[f32], m: usize, w: &PackedMatrix, y: &mut [f32], ws: &mut Int8Workspace) {
    let PackedMatrix::Interleaved(w) = w else {
        panic!("integer matmul of weights that are not interleaved");
    };
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "matmul input shape");
    assert_eq!(y.len(), m * n, "matmul output shape");
    ws.acts.quantize(x, m, k);
    let isa = isa();
    // Decode steps: about 8 tasks per thread; prefill: one group per task (its weights stay in
    // L1 while every input row passes).
    let per_task = if m > 16 {
        1
    } else {
        (w.groups / (8 * rayon::current_num_threads().max(1))).max(1)
    };
    ws.yt.resize(w.groups * m * GROUP, 0.0);
    let acts = &ws.acts;
    ws.yt
        .par_chunks_mut(per_task * m * GROUP)
        .enumerate()
        .for_each(|(ci, out)| dots(isa, acts, w, ci * per_task, out.len() / (m * GROUP), out));
    let yt = &ws.yt;
    y.par_chunks_mut(n).enumerate().for_each(|(r, row)| {
        for (g, dst) in row.chunks_mut(GROUP).enumerate() {
            let at = (g * m + r) * GROUP;
            dst.copy_from_slice(&yt[at..at + dst.len()]);
        }
    });
}

#[cfg(test)]
mod tests;
