//! Integer dot products of the CPU fast path: activations quantized per block of 32 to 8 bits
//! (llama.cpp's Q8_1 scheme) and multiplied with the GGUF Q4_1 / Q8_0 weight blocks in integers,
//! with one kernel per instruction set picked once at run time ([`super::isa`]).
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
//! rows, results never depend on batch, tiling or threads. The AMX copy ([`amx`], batches of 16
//! rows or more) computes each block's exact integer sum with tiles and then runs the same float
//! steps per output in the same order, so it returns the same bits too.

// Kernels index lanes and rows explicitly: the order of operations is the contract.
#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
mod x86;

use rayon::prelude::*;

use super::isa::{Isa, int8_isa};
use super::weights::{BlockKind, GROUP, Interleaved, PackedMatrix};

/// A batch of activation rows quantized per block (see the module docs): `q` (`k` bytes per
/// row), the same plus 128 as unsigned bytes (`qu`, for the VNNI Q8_0 kernel), and per block
/// the scale `d` and `s = d·Σq`; `d_tiles` and `s_tiles` are `d` and `s` again per tile of 16
/// rows and block, the 16 rows side by side (what the AMX kernel broadcasts from).
#[derive(Debug, Default)]
pub struct QuantizedRows {
    rows: usize,
    k: usize,
    nb: usize,
    q: Lines<i8>,
    qu: Lines<u8>,
    d: Vec<f32>,
    s: Vec<f32>,
    d_tiles: Vec<f32>,
    s_tiles: Vec<f32>,
}

impl QuantizedRows {
    /// Quantizes `m` rows of `k` values (`k % 32 == 0`), reusing the buffers, the tiles' copy
    /// of the scales included.
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        self.quantize_for(true, x, m, k)
    }

    /// [`Self::quantize`], the tiles' copy of the scales only when `tiles` (a serial pass over
    /// every row and block that only the AMX kernel reads).
    fn quantize_for(&mut self, tiles: bool, x: &[f32], m: usize, k: usize) {
        assert!(k.is_multiple_of(32) && x.len() == m * k, "quantize shape");
        let nb = k / 32;
        (self.rows, self.k, self.nb) = (m, k, nb);
        self.q.resize(m * k);
        self.qu.resize(m * k);
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
        let full = if tiles { m - m % 16 } else { 0 };
        self.d_tiles.resize(full * nb, 0.0);
        self.s_tiles.resize(full * nb, 0.0);
        for r in 0..full {
            for b in 0..nb {
                let at = ((r / 16 * nb) + b) * 16 + r % 16;
                self.d_tiles[at] = self.d[r * nb + b];
                self.s_tiles[at] = self.s[r * nb + b];
            }
        }
    }
}

/// One cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
struct Line([u8; 64]);

/// Bytes (`i8` or `u8`) that start on a cache line, so that a tile row of 32 or 64 bytes at a
/// multiple of its size never straddles two lines (a split line halves a tile load's speed).
#[derive(Debug)]
struct Lines<T> {
    lines: Vec<Line>,
    len: usize,
    of: std::marker::PhantomData<T>,
}

impl<T: Byte> Default for Lines<T> {
    fn default() -> Self {
        Lines {
            lines: Vec::new(),
            len: 0,
            of: std::marker::PhantomData,
        }
    }
}

/// A one-byte type every bit pattern of which is a value.
trait Byte: Copy {}
impl Byte for i8 {}
impl Byte for u8 {}

impl<T: Byte> Lines<T> {
    /// `n` bytes (their values unspecified: the caller writes them); never shrinks the storage.
    fn resize(&mut self, n: usize) {
        if self.lines.len() >= n.div_ceil(64) {
            self.len = n;
            return;
        }
        self.lines.resize(n.div_ceil(64), Line([0; 64]));
        self.len = n;
    }
}

impl<T: Byte> std::ops::Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `T` is one byte with no invalid values (`Byte`); the lines hold `len` bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }
}

impl<T: Byte> std::ops::DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
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
    quantize_row_with(int8_isa(), x, q, qu, d, s)
}

/// [`quantize_row`] by the copy for `isa` (at most what the CPU has: the tests run each).
fn quantize_row_with(
    isa: Isa,
    x: &[f32],
    q: &mut [i8],
    qu: &mut [u8],
    d: &mut [f32],
    s: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `isa` is at most `detected()` (callers pass `int8_isa()` or, in tests, a
        // level the CPU has), and Avx2 and above mean avx2 and fma; the slices are one row (k
        // values, k bytes twice, k/32 blocks).
        if isa >= Isa::Avx2 {
            return unsafe { x86::quantize_row(x, q, qu, d, s) };
        }
    }
    let _ = isa;
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
        let mut r0 = 0;
        if isa == Isa::Amx && m >= amx::TILE_ROWS {
            // SAFETY: `Isa::Amx` is detected only after `amx::available()` (and AVX-512BW);
            // the shapes are asserted above.
            unsafe { amx::dots(a, w, g0, ng, out) };
            r0 = m - m % amx::TILE_ROWS;
        }
        // SAFETY: `isa` never exceeds what `detected()` found (callers pass `int8_isa()` or, in
        // tests, a level at most `detected()`), and the shapes the kernels rely on are
        // asserted just above.
        unsafe { x86::dots(isa, a, w, g0, ng, r0, out) };
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
    assert_eq!(y.len(), m * w.rows(), "matmul output shape");
    let n = sums(x, m, w, ws);
    let yt = &ws.yt[..m * n.div_ceil(GROUP) * GROUP];
    // Back to rows, 16 at a time: per group, the 16 rows' sums are one contiguous KiB of `yt`
    // (row by row, the reads jumped `m·64` bytes from group to group). Tasks own whole rows, so
    // no two share a cache line of `y`.
    y.par_chunks_mut(TRANSPOSE_ROWS * n)
        .enumerate()
        .for_each(|(rb, rows)| to_rows(yt, m, n, rb * TRANSPOSE_ROWS, rows));
}

/// Rows of `x · wᵀ` each call of [`matmul_into`]'s function gets (fewer in the last call).
pub const ROWS_PER_CALL: usize = TRANSPOSE_ROWS;

/// [`matmul`] whose rows go straight to `f` instead of into a `y`: `f(rows, out)` for each
/// [`ROWS_PER_CALL`] rows of `x · wᵀ` (`n` floats each, in a thread's own buffer), in
/// parallel, with the matching item of `outs` (one per [`ROWS_PER_CALL`] rows: chunks of the
/// buffers the rows go on to). What a layer does next to the matmul's rows (SiLU·up, the
/// residual add and the norm after it) then reads them from the core's cache, where a `y` of a
/// prefill chunk (6 MB for SmolLM2's gate/up) went out to memory and came back. Each row's
/// values are those [`matmul`] writes, so `f` sees the same numbers.
pub fn matmul_into<T, O, F>(
    x: &[f32],
    m: usize,
    w: &PackedMatrix,
    ws: &mut Int8Workspace,
    outs: O,
    f: F,
) where
    T: Send,
    O: IndexedParallelIterator<Item = T>,
    F: Fn(&[f32], T) + Sync,
{
    let n = sums(x, m, w, ws);
    assert_eq!(
        outs.len(),
        m.div_ceil(ROWS_PER_CALL),
        "matmul_into: one output per 16 rows"
    );
    let yt = &ws.yt[..m * n.div_ceil(GROUP) * GROUP];
    outs.enumerate().for_each(|(rb, out)| {
        ROWS.with_borrow_mut(|rows| {
            let nr = ROWS_PER_CALL.min(m - rb * ROWS_PER_CALL);
            rows.resize(nr * n, 0.0);
            to_rows(yt, m, n, rb * ROWS_PER_CALL, &mut rows[..nr * n]);
            f(&rows[..nr * n], out);
        })
    });
}

thread_local! {
    /// A task's rows of [`matmul_into`], reused call after call.
    static ROWS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows `r0..` of the group-major sums `yt` (`m` rows, `n` outputs) into `rows` (`n` floats
/// each, as many rows as it holds).
fn to_rows(yt: &[f32], m: usize, n: usize, r0: usize, rows: &mut [f32]) {
    for g in 0..n.div_ceil(GROUP) {
        let width = GROUP.min(n - g * GROUP);
        for (i, row) in rows.chunks_mut(n).enumerate() {
            let at = (g * m + r0 + i) * GROUP;
            let dst = &mut row[g * GROUP..g * GROUP + width];
            // A whole group as a fixed-size copy (inlined, where a `memcpy` call per
            // 64 bytes was 3% of a prefill), a last partial group by slice.
            match <&mut [f32; GROUP]>::try_from(&mut *dst) {
                Ok(d) => *d = yt[at..at + GROUP].try_into().expect("a whole group"),
                Err(_) => dst.copy_from_slice(&yt[at..at + width]),
            }
        }
    }
}

/// Quantizes `x` (`m × k`) and leaves every dot product with `w`'s rows in `ws.yt`, group-major
/// (see [`dots`]); returns `n`, `w`'s rows.
fn sums(x: &[f32], m: usize, w: &PackedMatrix, ws: &mut Int8Workspace) -> usize {
    let PackedMatrix::Interleaved(w) = w else {
        panic!("integer matmul of weights that are not interleaved");
    };
    let k = w.cols;
    assert_eq!(x.len(), m * k, "matmul input shape");
    let isa = int8_isa();
    ws.acts.quantize_for(isa == Isa::Amx, x, m, k);
    // Decode steps and tiles: about 8 tasks per thread (a tile task's weights are laid out once
    // for all its rows); prefill on vectors: one group per task (its weights stay in L1 while
    // every input row passes).
    let per_task = if m > 16 && !(isa == Isa::Amx && m >= 16) {
        1
    } else {
        (w.groups / (8 * rayon::current_num_threads().max(1))).max(1)
    };
    // The kernels write every float of `yt[..need]`; the buffer only grows, since zeroing what
    // a resize adds back after a smaller matrix (the model's matrices take turns) was 1.4% of
    // a 2k-token prefill.
    let need = w.groups * m * GROUP;
    if ws.yt.len() < need {
        ws.yt.resize(need, 0.0);
    }
    let acts = &ws.acts;
    ws.yt[..need]
        .par_chunks_mut(per_task * m * GROUP)
        .enumerate()
        .for_each(|(ci, out)| dots(isa, acts, w, ci * per_task, out.len() / (m * GROUP), out));
    w.rows
}

/// Output rows per task of [`matmul`]'s transposition back to rows.
const TRANSPOSE_ROWS: usize = 16;

#[cfg(test)]
mod tests;
