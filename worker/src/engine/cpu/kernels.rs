//! CPU kernels of the engine's fast path ([`super::model`]): f32 matmul over
//! block-quantized weights (`--numerics f32`; the default integer matmuls are
//! [`super::int8`]'s, the weight formats [`super::weights`]'), RMS norm, SiLU and a polynomial
//! `exp` (attention is [`super::attention`]).
//!
//! # Numerics: every output element has one fixed recipe
//!
//! Each kernel defines the exact sequence of IEEE operations behind every output element, and
//! that sequence never depends on how the work is tiled, threaded or batched:
//! - a dot product over `k` (matmul) accumulates in [`LANES`] lanes, lane `l` summing
//!   `x[i]·w[i]` for `i ≡ l (mod 8)` in increasing `i` by fused multiply-add, then reduces the
//!   lanes in a fixed tree ([`reduce`]);
//! - block-quantized weights are dequantized exactly as GGUF defines them (Q4_1: `q·d + m`,
//!   two roundings; Q8_0: `q·d`) into f32 before use, so they equal candle's dequantized tensors;
//!
//! So a row's result is the same whether it is computed alone or in a batch of 8, in a prefill
//! chunk or a decode step, on one thread or two, and with AVX-512, AVX2 or the scalar fallback
//! (which runs the same generic code, `f32::mul_add` being an exact fused multiply-add
//! everywhere): batch composition can never change a candidate.
//!
//! # SIMD
//!
//! Elementwise kernels are written once as plain Rust and compiled three times: with
//! AVX-512F+AVX2+FMA, with AVX2+FMA, and without extra features; [`F32Copy::in_use`] picks one
//! at run time from `is_x86_feature_detected!` and `--kernels`. The only `unsafe` is calling
//! the `#[target_feature]` copies after that check. The matmul tiles are
//! written with AVX2/FMA intrinsics in [`avx2`] (8 lanes = one `__m256`, `_mm256_fmadd_ps` is
//! the same fused operation as `f32::mul_add`); the generic bodies are their scalar reference,
//! and the tests check the two agree bit for bit.

// Kernels index lanes and rows explicitly: the order of operations is the contract.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use rayon::prelude::*;

use super::isa::{F32Isa, f32_isa, f32_wide};
use super::weights::{PackedMatrix, dequant_rows_impl};

/// Lanes of the dot-product accumulators (one AVX2 register of f32).
pub const LANES: usize = 8;

/// Output rows (weights) handled by one parallel matmul task: dequantized once into a
/// task-local buffer, then used for every input row.
const TASK_OUTPUTS: usize = 12;

/// Up to this many input rows (decode steps) block-quantized weights are dequantized in
/// registers; above it (prefill) once per task into f32. Same bits either way.
const FUSED_MAX_ROWS: usize = 16;

/// Which compiled copy of an elementwise kernel runs. Every copy is the same Rust code, and
/// target features change the instructions, never the IEEE operations, so all give the same
/// bits (the tests compare them anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F32Copy {
    Scalar,
    /// Compiled with AVX2 and FMA: 8 lanes.
    Avx2,
    /// Compiled with AVX-512F too: 16 lanes where the loops vectorize.
    Avx512,
}

impl F32Copy {
    /// The copy this process runs: AVX-512 where the 16-lane kernels run ([`f32_wide`]; not
    /// under `--kernels avx2`), else as [`f32_isa`].
    pub fn in_use() -> F32Copy {
        match f32_isa() {
            F32Isa::Avx2 if f32_wide() => F32Copy::Avx512,
            F32Isa::Avx2 => F32Copy::Avx2,
            F32Isa::Scalar => F32Copy::Scalar,
        }
    }

    /// Every copy this CPU can run, whatever `--kernels` says (the tests' list).
    #[cfg(test)]
    pub fn available() -> Vec<F32Copy> {
        let mut all = vec![F32Copy::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            all.push(F32Copy::Avx2);
            if is_x86_feature_detected!("avx512f") {
                all.push(F32Copy::Avx512);
            }
        }
        all
    }
}

/// Defines `$name`, which runs the copy in use ([`F32Copy::in_use`]) of the
/// `#[inline(always)]` generic body `$imp` (auto-vectorized elementwise kernels), and
/// `$copies`, which runs a given copy (for the tests).
macro_rules! dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?
     => $imp:ident; copies $copies:ident) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            // SAFETY: `in_use` returns a copy only after `is_x86_feature_detected!` confirmed
            // the features it is compiled with.
            unsafe { $copies(F32Copy::in_use(), $($arg),*) }
        }

        #[doc = concat!("[`", stringify!($name), "`] by the given copy.")]
        ///
        /// # Safety
        /// The CPU has the features `copy` is compiled with.
        unsafe fn $copies(copy: F32Copy, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $imp($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,avx512f")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $imp($($arg),*)
                }
                match copy {
                    // SAFETY: the caller's contract.
                    F32Copy::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: the caller's contract.
                    F32Copy::Avx2 => return unsafe { avx2($($arg),*) },
                    F32Copy::Scalar => {}
                }
            }
            let _ = copy;
            $imp($($arg),*)
        }
    };
}

/// Sums the lanes in a fixed tree: halves added pairwise (lane `l` += lane `l+4`, then `+2`, `+1`).
#[inline(always)]
pub fn reduce(a: &[f32; LANES]) -> f32 {
    let mut v = *a;
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            v[l] += v[l + w];
        }
        w /= 2;
    }
    v[0]
}

// ---------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------

dispatch! {
    /// Rows `r0..r0+n` of `m` as f32 into `out[..n*cols]` (exact).
    pub fn dequant_rows(m: &PackedMatrix, r0: usize, n: usize, out: &mut [f32]) => dequant_rows_impl;
    copies dequant_rows_in
}

// ---------------------------------------------------------------------------------------------
// Matmul
// ---------------------------------------------------------------------------------------------

/// `R × C` dot products of length `k` (see the module docs for the exact recipe).
#[inline(always)]
fn dot_tile<const R: usize, const C: usize>(
    xs: [&[f32]; R],
    ws: [&[f32]; C],
    k: usize,
) -> [[f32; C]; R] {
    let mut acc = [[[0f32; LANES]; C]; R];
    let full = k / LANES;
    for b in 0..full {
        let o = b * LANES;
        let mut wv = [[0f32; LANES]; C];
        for c in 0..C {
            wv[c].copy_from_slice(&ws[c][o..o + LANES]);
        }
        for r in 0..R {
            let xv: &[f32] = &xs[r][o..o + LANES];
            for c in 0..C {
                for l in 0..LANES {
                    acc[r][c][l] = xv[l].mul_add(wv[c][l], acc[r][c][l]);
                }
            }
        }
    }
    for i in full * LANES..k {
        let l = i - full * LANES;
        for r in 0..R {
            for c in 0..C {
                acc[r][c][l] = xs[r][i].mul_add(ws[c][i], acc[r][c][l]);
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = reduce(&acc[r][c]);
        }
    }
    out
}

/// `out[c*m + r] = dot(x[r], w[c])` for `nc` weight rows `w` (each `k`) and `m` input rows.
#[inline(always)]
fn matmul_block_impl(x: &[f32], m: usize, k: usize, w: &[f32], nc: usize, out: &mut [f32]) {
    let xr = |r: usize| &x[r * k..(r + 1) * k];
    let wr = |c: usize| &w[c * k..(c + 1) * k];
    let mut c = 0;
    while c < nc {
        let cc = (nc - c).min(4);
        let mut r = 0;
        while r < m {
            let rr = (m - r).min(4);
            if rr == 4 && cc == 4 {
                let t = dot_tile::<4, 4>(
                    [xr(r), xr(r + 1), xr(r + 2), xr(r + 3)],
                    [wr(c), wr(c + 1), wr(c + 2), wr(c + 3)],
                    k,
                );
                for (i, row) in t.iter().enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        out[(c + j) * m + r + i] = *v;
                    }
                }
            } else if cc == 4 {
                for i in 0..rr {
                    let t =
                        dot_tile::<1, 4>([xr(r + i)], [wr(c), wr(c + 1), wr(c + 2), wr(c + 3)], k);
                    for (j, v) in t[0].iter().enumerate() {
                        out[(c + j) * m + r + i] = *v;
                    }
                }
            } else {
                for i in 0..rr {
                    for j in 0..cc {
                        out[(c + j) * m + r + i] =
                            dot_tile::<1, 1>([xr(r + i)], [wr(c + j)], k)[0][0];
                    }
                }
            }
            r += rr;
        }
        c += cc;
    }
}

fn matmul_block(x: &[f32], m: usize, k: usize, w: &[f32], nc: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if f32_isa() == F32Isa::Avx2 && k.is_multiple_of(LANES) {
        assert!(x.len() >= m * k && w.len() >= nc * k && out.len() >= nc * m);
        // SAFETY: AVX2 and FMA were detected at run time (`f32_isa`); the bounds the kernel relies
        // on (`x` holds `m·k`, `w` holds `nc·k`, `out` holds `nc·m`, `k % 8 == 0`) are asserted
        // just above.
        unsafe { avx2::matmul_block(x, m, k, w, nc, out) };
        return;
    }
    matmul_block_impl(x, m, k, w, nc, out)
}

/// Output rows (of `n`) per parallel matmul task for `m` input rows: about 8 tasks per thread
/// in decode steps (load balance without per-task overhead dominating small steps), whole
/// multiples of [`TASK_OUTPUTS`]; [`TASK_OUTPUTS`] in prefill. The split never changes a result.
pub fn outputs_per_task(n: usize, m: usize) -> usize {
    if m > FUSED_MAX_ROWS {
        return TASK_OUTPUTS;
    }
    (n / (8 * rayon::current_num_threads().max(1)))
        .div_ceil(TASK_OUTPUTS)
        .max(1)
        * TASK_OUTPUTS
}

/// `y[r·n + c] = yt[c·m + r]`: the tasks' column-major results back to row-major, 16 rows per
/// task (each line of `yt` read once, 16 sequential writers).
pub fn transpose_into(yt: &[f32], m: usize, n: usize, y: &mut [f32]) {
    y.par_chunks_mut(16 * n).enumerate().for_each(|(bi, out)| {
        let r0 = bi * 16;
        let rows = out.len() / n;
        for c in 0..n {
            let col = &yt[c * m + r0..c * m + r0 + rows];
            for (i, v) in col.iter().enumerate() {
                out[i * n + c] = *v;
            }
        }
    });
}

/// `y = x · wᵀ`: `x` is `m × k` (row-major), `w` is `n × k`, `y` is `m × n`. Parallel over
/// output rows of `w` on the current rayon pool; `yt` is a reusable `n × m` buffer.
pub fn matmul(x: &[f32], m: usize, w: &PackedMatrix, y: &mut [f32], yt: &mut Vec<f32>) {
    let (n, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), m * k, "matmul input shape");
    assert_eq!(y.len(), m * n, "matmul output shape");
    yt.resize(n * m, 0.0);
    let per_task = outputs_per_task(n, m);
    yt.par_chunks_mut(per_task * m).enumerate().for_each_init(
        Vec::new,
        |buf: &mut Vec<f32>, (ci, out)| {
            let r0 = ci * per_task;
            let nc = out.len() / m;
            #[cfg(target_arch = "x86_64")]
            if m <= FUSED_MAX_ROWS && f32_isa() == F32Isa::Avx2 {
                // SAFETY: AVX2/FMA detected at run time; `x` holds m·k (asserted above), `out`
                // holds nc·m (its chunk), rows r0..r0+nc exist (chunking of n·m).
                if unsafe { avx2::matmul_fused(x, m, w, r0, nc, out) } {
                    return;
                }
            }
            let rows: &[f32] = match w {
                PackedMatrix::F32 { w, .. } => &w[r0 * k..(r0 + nc) * k],
                _ => {
                    buf.resize(nc * k, 0.0);
                    dequant_rows(w, r0, nc, buf);
                    &buf[..nc * k]
                }
            };
            matmul_block(x, m, k, rows, nc, out);
        },
    );
    transpose_into(yt, m, n, y);
}

// ---------------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------------

/// `e^x` by Cody–Waite range reduction and a degree-6 polynomial (Cephes `expf`, ≤ 2 ulp on the
/// clamped range). Built from basic IEEE operations only, so it vectorizes and gives the same
/// bits in every copy of a kernel (libm's `expf` neither vectorizes nor promises that).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let (y, n) = exp_reduced(x);
    // The clamp keeps `n` within −125..=127, or NaN (a NaN `x`), which becomes 0 as the
    // saturating `n as i32` would make it. Written out, the conversion vectorizes
    // (`vcvttps2dq`); the saturating cast is eight scalar conversions a register.
    let n = if n.is_nan() { 0.0 } else { n };
    // SAFETY: `n` is finite and within i32 (above).
    let ni: i32 = unsafe { n.to_int_unchecked() };
    y * f32::from_bits(((ni + 127) as u32) << 23)
}

/// [`exp`] before its scaling by `2ⁿ`: `(e^r, n)` with `x = n·ln 2 + r` on the clamped range.
#[inline(always)]
fn exp_reduced(x: f32) -> (f32, f32) {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = n.mul_add(-0.693_359_4, x);
    let r = n.mul_add(2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5); // Cephes' 5.0000001201e-1 is exactly 0.5 in f32
    (p.mul_add(r * r, r) + 1.0, n)
}

#[inline(always)]
fn rms_norm_impl(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut acc = [0f32; LANES];
        let full = n / LANES;
        for b in 0..full {
            for l in 0..LANES {
                let v = xr[b * LANES + l];
                acc[l] = v.mul_add(v, acc[l]);
            }
        }
        for i in full * LANES..n {
            let v = xr[i];
            acc[i - full * LANES] = v.mul_add(v, acc[i - full * LANES]);
        }
        let scale = 1.0 / (reduce(&acc) / n as f32 + eps).sqrt();
        for i in 0..n {
            or[i] = xr[i] * scale * w[i];
        }
    }
}

dispatch! {
    /// Row-wise RMS norm of `x` (rows of `w.len()`) into `out`: `x · (1/√(mean(x²)+eps)) · w`.
    pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) => rms_norm_impl;
    copies rms_norm_in
}

#[inline(always)]
fn silu_mul_impl(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    for (gu, o) in gate_up.chunks_exact(2 * ffn).zip(out.chunks_exact_mut(ffn)) {
        let (g, u) = gu.split_at(ffn);
        for i in 0..ffn {
            o[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
        }
    }
}

dispatch! {
    /// `silu(gate) · up` per row, rows laid out `[gate (ffn) | up (ffn)]`.
    pub fn silu_mul(gate_up: &[f32], ffn: usize, out: &mut [f32]) => silu_mul_impl;
    copies silu_mul_in
}

#[inline(always)]
fn exp_sub_impl(s: &mut [f32], max: f32) -> f32 {
    // Summed in 8 lanes (element j into lane j mod 8, in order), then the fixed tree of
    // `reduce`: every copy adds the same numbers in the same order. One loop for both, 16
    // elements at a time: the AVX-512 copy takes `exp` a register at a time while the lanes'
    // additions (a chain of one 8-lane add per 8 elements) run beside it, where a second pass
    // for the sum waited on that chain alone.
    let mut lanes = [0f32; LANES];
    let mut pairs = s.chunks_exact_mut(2 * LANES);
    for c in &mut pairs {
        let c: &mut [f32; 2 * LANES] = c.try_into().expect("a whole pair of lanes");
        for v in c.iter_mut() {
            *v = exp(*v - max);
        }
        for l in 0..LANES {
            lanes[l] += c[l];
        }
        for l in 0..LANES {
            lanes[l] += c[LANES + l];
        }
    }
    let rest = pairs.into_remainder();
    for v in rest.iter_mut() {
        *v = exp(*v - max);
    }
    for (i, v) in rest.iter().enumerate() {
        lanes[i % LANES] += v;
    }
    reduce(&lanes)
}

dispatch! {
    /// `s[j] = e^(s[j]-max)` in place; returns `Σ s[j]` (8 lanes, then [`reduce`]).
    pub fn exp_sub(s: &mut [f32], max: f32) -> f32 => exp_sub_impl;
    copies exp_sub_in
}

/// Lanes of [`scale_max`]'s maximum: 16, a register of the AVX-512 copy (the order of the
/// comparisons does not matter, see there).
const MAX_LANES: usize = 16;

#[inline(always)]
fn scale_max_impl(s: &mut [f32], scale: f32) -> f32 {
    // `v > m ? v : m` per lane: a NaN never wins, and the maximum is the same number whatever
    // the order of the comparisons (only the sign of a zero maximum can depend on it, and
    // `exp_sub` gives the same bits for either: `v − (±0)` is `v` but for `v = ±0`, whose
    // `exp` is 1 either way; the tests check it).
    let mut lanes = [f32::NEG_INFINITY; MAX_LANES];
    let mut chunks = s.chunks_exact_mut(MAX_LANES);
    for c in &mut chunks {
        for l in 0..MAX_LANES {
            c[l] *= scale;
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    for (l, v) in chunks.into_remainder().iter_mut().enumerate() {
        *v *= scale;
        lanes[l] = if *v > lanes[l] { *v } else { lanes[l] };
    }
    let mut m = lanes[0];
    for v in &lanes[1..] {
        m = if *v > m { *v } else { m };
    }
    m
}

dispatch! {
    /// `s[j] *= scale` in place; returns the largest (NaN ignored; `−∞` for none).
    pub fn scale_max(s: &mut [f32], scale: f32) -> f32 => scale_max_impl;
    copies scale_max_in
}

// ---------------------------------------------------------------------------------------------
// AVX2 hot loops
// ---------------------------------------------------------------------------------------------

#[cfg(target_arch = "x86_64")]
pub mod avx2;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::test_rng::rnd;

    /// `exp` as first written, with the saturating cast (scalar code in every copy).
    fn exp_saturating(x: f32) -> f32 {
        let (y, n) = exp_reduced(x);
        y * f32::from_bits(((n as i32 + 127) as u32) << 23)
    }

    #[test]
    fn exp_with_the_vectorizing_conversion_keeps_every_bit() {
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            -87.0,
            88.0,
            -0.0,
            0.0,
        ];
        let sweep = (0..=u32::MAX / 251).map(|i| f32::from_bits(i * 251));
        let xs: Vec<f32> = specials.into_iter().chain(sweep).collect();
        for x in &xs {
            assert_eq!(exp(*x).to_bits(), exp_saturating(*x).to_bits(), "exp({x})");
        }
        // The vector copies too (exp_sub at max 0 is exp of each element), over the range.
        let xs: Vec<f32> = xs.iter().step_by(16).copied().collect();
        let mut v = xs.clone();
        exp_sub(&mut v, 0.0);
        for (x, y) in xs.iter().zip(&v) {
            assert_eq!(y.to_bits(), exp_saturating(*x).to_bits(), "exp_sub at {x}");
        }
    }

    #[test]
    fn exp_sub_adds_element_j_into_lane_j_mod_8_in_order_on_every_copy() {
        // The recipe plainly: every `exp` first, then element j into lane j mod 8 in order,
        // then `reduce`. The kernel does both in one loop, 16 elements at a time; lengths
        // around multiples of 8 and 16 leave every kind of remainder.
        for n in (0..=48).chain([577, 2085]) {
            // Values of one order of magnitude, so that every addition rounds (an order
            // of the additions other than the recipe's shows in `z`).
            let x = rnd(n, 9);
            let max = 0.5;
            let want: Vec<f32> = x.iter().map(|v| exp(v - max)).collect();
            let mut lanes = [0f32; LANES];
            for (j, e) in want.iter().enumerate() {
                lanes[j % LANES] += e;
            }
            let want_z = reduce(&lanes);
            for copy in F32Copy::available() {
                let mut got = x.clone();
                // SAFETY: `available` lists only copies whose features were detected.
                let z = unsafe { exp_sub_in(copy, &mut got, max) };
                assert_eq!(z.to_bits(), want_z.to_bits(), "z, n = {n}, {copy:?}");
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "e, n = {n}, {copy:?}");
            }
        }
    }

    #[test]
    fn scale_max_in_16_lanes_is_the_sequential_maximum_and_exp_sub_cannot_tell_a_zero_sign() {
        // The plain recipe compares in element order; the kernel in 16 lanes. The maximum is
        // the same number (NaN never wins)...
        for n in [1, 7, 8, 15, 16, 17, 33, 577] {
            let mut x: Vec<f32> = rnd(n, 11).iter().map(|v| v * 9.0).collect();
            x[n / 2] = f32::NAN;
            let mut want = f32::NEG_INFINITY;
            for v in &x {
                let v = v * 0.125;
                want = if v > want { v } else { want };
            }
            for copy in F32Copy::available() {
                let mut got = x.clone();
                // SAFETY: `available` lists only copies whose features were detected.
                let max = unsafe { scale_max_in(copy, &mut got, 0.125) };
                assert_eq!(max, want, "n = {n}, {copy:?}");
            }
        }
        // ...but for the sign of a zero maximum: +0 and −0 both present, the lane order picks
        // one. `exp_sub` gives the same bits after either.
        let mut s = vec![-1.5f32; 37];
        s[3] = -0.0;
        s[20] = 0.0;
        assert_eq!(scale_max(&mut s.clone(), 1.0), 0.0);
        let (mut plus, mut minus) = (s.clone(), s.clone());
        let (zp, zm) = (exp_sub(&mut plus, 0.0), exp_sub(&mut minus, -0.0));
        assert_eq!(zp.to_bits(), zm.to_bits());
        let same = plus
            .iter()
            .zip(&minus)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "exp(±0 − ±0) and the rest");
    }

    /// The recipe of the module docs, written as plainly as possible.
    fn dot_ref(x: &[f32], w: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        for i in 0..x.len() {
            acc[i % LANES] = x[i].mul_add(w[i], acc[i % LANES]);
        }
        reduce(&acc)
    }

    /// Q4_1 weights of `n` rows of `k`: scale ≈ 0.1, a negative minimum, nibbles in a pattern.
    fn q4_1(n: usize, k: usize) -> PackedMatrix {
        let mut bytes = Vec::new();
        for b in 0..n * k / 32 {
            bytes.extend_from_slice(&[0x66, 0x2e, (b % 7) as u8, 0xa4]);
            bytes.extend((0..16).map(|j| ((b * 31 + j * 7) % 256) as u8));
        }
        PackedMatrix::from_q4_1(&bytes, n, k).unwrap()
    }

    #[test]
    fn every_compiled_copy_of_the_elementwise_kernels_gives_the_same_bits() {
        // Scalar, AVX2 and (where the CPU has it) AVX-512 copies of one body: odd lengths leave
        // remainders; NaN, infinities and huge values go through exp and the comparisons.
        let mut x = rnd(3 * 577, 5)
            .iter()
            .map(|v| v * 30.0)
            .collect::<Vec<f32>>();
        for (i, v) in [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e30,
            -1e30,
            0.0,
            -0.0,
        ]
        .into_iter()
        .enumerate()
        {
            x[100 * i + 3] = v;
        }
        let w = rnd(577, 6);
        let q = q4_1(24, 64);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
        let mut want_norm = vec![0f32; x.len()];
        rms_norm_impl(&x, &w, 1e-5, &mut want_norm);
        let mut want_silu = vec![0f32; 865];
        silu_mul_impl(&x[..2 * 865], 865, &mut want_silu);
        let mut want_scaled = x.clone();
        let want_max = scale_max_impl(&mut want_scaled, 0.125);
        let mut want_rows = vec![0f32; 5 * 64];
        dequant_rows_impl(&q, 3, 5, &mut want_rows);
        for copy in F32Copy::available() {
            // SAFETY: `available` lists only copies whose features were detected.
            unsafe {
                let mut got = vec![0f32; x.len()];
                rms_norm_in(copy, &x, &w, 1e-5, &mut got);
                assert_eq!(bits(&got), bits(&want_norm), "rms_norm {copy:?}");
                let mut got = vec![0f32; 865];
                silu_mul_in(copy, &x[..2 * 865], 865, &mut got);
                assert_eq!(bits(&got), bits(&want_silu), "silu_mul {copy:?}");
                let mut got = x.clone();
                let max = scale_max_in(copy, &mut got, 0.125);
                assert_eq!(max.to_bits(), want_max.to_bits(), "scale_max {copy:?}");
                assert_eq!(bits(&got), bits(&want_scaled), "scale_max {copy:?}");
                let mut got = vec![0f32; 5 * 64];
                dequant_rows_in(copy, &q, 3, 5, &mut got);
                assert_eq!(bits(&got), bits(&want_rows), "dequant_rows {copy:?}");
            }
        }
    }

    #[test]
    fn matmul_matches_reference_bit_for_bit_at_any_batch() {
        // Q4_1 weights: 40 outputs × 96 inputs.
        let (n, k) = (40, 96);
        let w = q4_1(n, k);
        let wf = w.to_f32();
        let x = rnd(9 * k, 1);
        let mut yt = Vec::new();
        let mut y_all = vec![0f32; 9 * n];
        matmul(&x, 9, &w, &mut y_all, &mut yt);
        for r in 0..9 {
            let mut y1 = vec![0f32; n];
            matmul(&x[r * k..(r + 1) * k], 1, &w, &mut y1, &mut yt);
            for c in 0..n {
                let want = dot_ref(&x[r * k..(r + 1) * k], &wf[c * k..(c + 1) * k]);
                assert_eq!(y_all[r * n + c].to_bits(), want.to_bits(), "r{r} c{c}");
                assert_eq!(y1[c].to_bits(), want.to_bits(), "b=1 r{r} c{c}");
            }
        }
        // Q8_0 too, through the fused (small m) and the dequantize-first (large m) paths.
        let mut b8 = Vec::new();
        for b in 0..n * k / 32 {
            b8.extend_from_slice(&[0x66, 0x2e]);
            b8.extend((0..32).map(|j| ((b * 13 + j * 5) % 256) as u8));
        }
        let w8 = PackedMatrix::from_q8_0(&b8, n, k).unwrap();
        let w8f = w8.to_f32();
        let x20 = rnd(20 * k, 9);
        for m in [1, 3, 8, 13, 20] {
            let mut y = vec![0f32; m * n];
            matmul(&x20[..m * k], m, &w8, &mut y, &mut yt);
            for r in 0..m {
                for c in 0..n {
                    let want = dot_ref(&x20[r * k..(r + 1) * k], &w8f[c * k..(c + 1) * k]);
                    assert_eq!(y[r * n + c].to_bits(), want.to_bits(), "q8 m{m} r{r} c{c}");
                }
            }
        }
        // The SIMD copy equals the scalar copy.
        for (m, nc) in [(4, 12), (8, 12), (1, 12), (5, 7), (9, 40)] {
            let mut a = vec![0f32; m * nc];
            let mut b = a.clone();
            matmul_block(&x[..m * k], m, k, &wf[..nc * k], nc, &mut a);
            matmul_block_impl(&x[..m * k], m, k, &wf[..nc * k], nc, &mut b);
            assert_eq!(a, b, "m={m} nc={nc}");
        }
    }

    #[test]
    fn exp_is_accurate_and_identical_to_scalar() {
        let xs: Vec<f32> = (0..4000).map(|i| -80.0 + i as f32 * 0.041).collect();
        let mut v = xs.clone();
        let mut r = xs.clone();
        let (mut a, mut b) = (xs.clone(), xs.clone());
        a[17] = f32::NAN;
        b[17] = f32::NAN;
        let (ma, mb) = (scale_max(&mut a, 0.125), scale_max_impl(&mut b, 0.125));
        assert_eq!(ma.to_bits(), mb.to_bits());
        assert_eq!(
            ma,
            xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max) * 0.125
        );
        assert_eq!(a[..17], b[..17]);
        let z = exp_sub(&mut v, 0.0);
        let zr = exp_sub_impl(&mut r, 0.0);
        assert_eq!(v, r);
        assert_eq!(z.to_bits(), zr.to_bits());
        // Each copy this CPU runs: scalar, AVX2 and, where AVX-512F is, AVX-512; odd lengths
        // leave a remainder for the vector ones.
        for n in [4000, 3999, 17, 1] {
            let mut want = xs[..n].to_vec();
            let zw = exp_sub_impl(&mut want, -3.0);
            for copy in F32Copy::available() {
                let mut got = xs[..n].to_vec();
                // SAFETY: `available` lists only copies whose features were detected.
                let z = unsafe { exp_sub_in(copy, &mut got, -3.0) };
                assert_eq!(z.to_bits(), zw.to_bits(), "{copy:?} n={n}");
                assert_eq!(got, want, "{copy:?} n={n}");
            }
        }
        for (x, y) in xs.iter().zip(&v) {
            let want = (*x as f64).exp();
            assert!(
                ((*y as f64) - want).abs() <= want * 4e-7,
                "exp({x}) = {y}, want {want}"
            );
        }
    }
}
