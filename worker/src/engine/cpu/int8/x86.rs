//! The x86-64 copies of the integer recipe ([`super::dot_scalar`]) over [`Interleaved`]
//! weights: a register holds 16 (AVX-512) or 8 (AVX2) weight rows' next 4 bytes, the input
//! row's 4 bytes are broadcast, and one integer multiply-add advances every lane's exact block
//! sum. The block's float steps then run once per register, in the recipe's order.
//!
//! Products per instruction set (lane `l` sums `w·x` over 4 bytes, exact in 32 bits):
//! - AVX-512 VNNI: `vpdpbusd`; Q4_1 nibbles are unsigned already; for signed Q8_0 weights the
//!   input goes in as `x + 128` (unsigned) and the accumulator starts at `−128·Σw`;
//! - AVX-512BW and AVX2: `vpmaddubsw` + `vpmaddwd`; Q8_0 as `|w|` times `x` with `w`'s sign,
//!   which never saturates 16 bits (`2·128·127 < 2¹⁵`).

use std::arch::x86_64::*;

use super::super::isa::Isa;
use super::super::weights::{BlockKind, GROUP, Interleaved};
use super::{QuantizedRows, ROUND_MAGIC};

/// See [`super::dots`], for input rows `r0..` only (AMX runs here as AVX-512 VNNI).
///
/// # Safety
/// The CPU supports `isa` (at least AVX2+FMA); `out.len() >= ng·a.rows·16`,
/// `g0 + ng <= w.groups`, `w.cols == a.k`.
pub unsafe fn dots(
    isa: Isa,
    a: &QuantizedRows,
    w: &Interleaved,
    g0: usize,
    ng: usize,
    r0: usize,
    out: &mut [f32],
) {
    let m = a.rows;
    let isa = isa.min(Isa::Avx512Vnni);
    // Where every weight is read for a few rows (a decode step of one job), the weights
    // stream from memory and a prefetch hint keeps more of the bandwidth busy; with more rows
    // each group is read again per tile of rows, and the hint only evicted it (prefill).
    let prefetch = m <= PREFETCH_MAX_ROWS;
    for g in g0..g0 + ng {
        let mut r = r0;
        while r < m {
            let at = ((g - g0) * m + r) * GROUP;
            let o = &mut out[at..];
            // SAFETY: the caller's contract; each call handles rows r..r+R < m and writes
            // R·16 floats at `o` (in bounds: rows < m).
            r += unsafe {
                match (isa, m - r) {
                    (Isa::Avx512Vnni, 8..) => vnni::<8>(a, r, w, g, o, prefetch),
                    (Isa::Avx512Vnni, 4..) => vnni::<4>(a, r, w, g, o, prefetch),
                    (Isa::Avx512Vnni, _) => vnni::<1>(a, r, w, g, o, prefetch),
                    (Isa::Avx512Bw, 8..) => bw::<8>(a, r, w, g, o, prefetch),
                    (Isa::Avx512Bw, 4..) => bw::<4>(a, r, w, g, o, prefetch),
                    (Isa::Avx512Bw, _) => bw::<1>(a, r, w, g, o, prefetch),
                    (_, 4..) => avx2::<4>(a, r, w, g, o),
                    _ => avx2::<1>(a, r, w, g, o),
                }
            };
        }
    }
}

/// Blocks of weights ahead that the kernels prefetch: a one-row decode step streams every
/// weight once, and the hint kept more of the two cores' bandwidth busy (64-token context,
/// one row: 100 → 126 tokens/s with 16 blocks ahead; 4 and 8 gained less).
const PREFETCH_BLOCKS: usize = 16;
/// Input rows up to which the kernels prefetch (see [`dots`]).
const PREFETCH_MAX_ROWS: usize = 8;

/// Defines `$name::<R>`: `R` input rows from `r` against weight group `g`, 16 lanes per
/// register, the integer products by `$q4` (Q4_1: unsigned nibbles `w`, signed input `x`) and
/// `$q8` (Q8_0). Returns `R`.
macro_rules! kernel_512 {
    ($name:ident, $features:literal, q4: |$acc4:ident, $w4:ident, $x4:ident| $q4:expr,
     q8: |$acc8:ident, $w8:ident, $xs8:ident, $xu8:ident| $q8:expr, q8_init: |$bias:ident| $init:expr) => {
        /// See [`kernel_512!`].
        ///
        /// # Safety
        /// The CPU has the enabled features; rows `r..r+R` exist in `a`; group `g` exists in
        /// `w`; `out` holds `R·16` floats.
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize>(
            a: &QuantizedRows,
            r: usize,
            w: &Interleaved,
            g: usize,
            out: &mut [f32],
            prefetch: bool,
        ) -> usize {
            let nb = w.nb;
            let low = _mm512_set1_epi8(0x0f);
            let mut facc = [_mm512_setzero_ps(); R];
            // Rows `r..r+R`'s block scales and sums, `nb` a row, read without a bounds check
            // per block (the checks, and the registers they spilled, cost 5% of the kernel's
            // rate at m = 512 on a Zen 4 host).
            let dx: [*const f32; R] =
                core::array::from_fn(|i| unsafe { a.d.as_ptr().add((r + i) * nb) });
            let sx: [*const f32; R] =
                core::array::from_fn(|i| unsafe { a.s.as_ptr().add((r + i) * nb) });
            // SAFETY (all pointer reads below): block `gb` of group `g` holds 4 (Q4_1) or 8
            // (Q8_0) vectors of 64 bytes and 16 scales/mins/biases; row `r + i` of `a` holds
            // `k = 32·nb` bytes and `nb` scales, so block `b`'s 4-byte words are in bounds.
            for b in 0..nb {
                let gb = g * nb + b;
                let xq: [*const i32; R] = core::array::from_fn(|i| {
                    unsafe { a.q.as_ptr().add((r + i) * a.k + b * 32) }.cast()
                });
                let mut iacc = [_mm512_setzero_si512(); R];
                match w.kind {
                    BlockKind::Q4_1 => {
                        let base = unsafe { w.qs.as_ptr().add(gb * 4 * 64) };
                        // The weights stream once per step (decode): ask for the lines
                        // PREFETCH_BLOCKS ahead (a hint: addresses past the end are not read).
                        if prefetch {
                            for t in 0..4 {
                                let ahead = base.wrapping_add((PREFETCH_BLOCKS * 4 + t) * 64);
                                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                            }
                        }
                        for t in 0..4 {
                            let v = unsafe { _mm512_loadu_si512(base.add(t * 64).cast()) };
                            let lo = _mm512_and_si512(v, low);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                            for i in 0..R {
                                let (xl, xh) = unsafe {
                                    (
                                        xq[i].add(t).read_unaligned(),
                                        xq[i].add(t + 4).read_unaligned(),
                                    )
                                };
                                let ($acc4, $w4, $x4) = (iacc[i], lo, _mm512_set1_epi32(xl));
                                iacc[i] = $q4;
                                let ($acc4, $w4, $x4) = (iacc[i], hi, _mm512_set1_epi32(xh));
                                iacc[i] = $q4;
                            }
                        }
                    }
                    BlockKind::Q8_0 => {
                        let $bias =
                            unsafe { _mm512_loadu_si512(w.bias.as_ptr().add(gb * GROUP).cast()) };
                        for i in 0..R {
                            iacc[i] = $init;
                        }
                        let xu: [*const i32; R] = core::array::from_fn(|i| {
                            unsafe { a.qu.as_ptr().add((r + i) * a.k + b * 32) }.cast()
                        });
                        let base = unsafe { w.qs.as_ptr().add(gb * 8 * 64) };
                        if prefetch {
                            for t in 0..8 {
                                let ahead = base.wrapping_add((PREFETCH_BLOCKS * 8 + t) * 64);
                                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                            }
                        }
                        for t in 0..8 {
                            let $w8 = unsafe { _mm512_loadu_si512(base.add(t * 64).cast()) };
                            for i in 0..R {
                                let (xs, xu) = unsafe {
                                    (xq[i].add(t).read_unaligned(), xu[i].add(t).read_unaligned())
                                };
                                let ($acc8, $xs8, $xu8) =
                                    (iacc[i], _mm512_set1_epi32(xs), _mm512_set1_epi32(xu));
                                iacc[i] = $q8;
                            }
                        }
                    }
                }
                let dw = unsafe { _mm512_loadu_ps(w.d.as_ptr().add(gb * GROUP)) };
                for i in 0..R {
                    let dx = _mm512_set1_ps(unsafe { dx[i].add(b).read() });
                    let sumi = _mm512_cvtepi32_ps(iacc[i]);
                    facc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), sumi, facc[i]);
                }
                if w.kind == BlockKind::Q4_1 {
                    let mw = unsafe { _mm512_loadu_ps(w.m.as_ptr().add(gb * GROUP)) };
                    for i in 0..R {
                        let s = _mm512_set1_ps(unsafe { sx[i].add(b).read() });
                        facc[i] = _mm512_fmadd_ps(mw, s, facc[i]);
                    }
                }
            }
            for i in 0..R {
                // SAFETY: `out` holds R·16 floats.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i * GROUP), facc[i]) };
            }
            R
        }
    };
}

kernel_512!(vnni, "avx2,fma,avx512f,avx512bw,avx512vnni",
    q4: |acc, w, x| _mm512_dpbusd_epi32(acc, w, x),
    q8: |acc, w, _xs, xu| _mm512_dpbusd_epi32(acc, xu, w),
    q8_init: |bias| bias);
kernel_512!(bw, "avx2,fma,avx512f,avx512bw",
    q4: |acc, w, x| _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1))),
    q8: |acc, w, xs, _xu| {
        let neg = _mm512_movepi8_mask(w);
        let signed = _mm512_mask_sub_epi8(xs, neg, _mm512_setzero_si512(), xs);
        let p = _mm512_maddubs_epi16(_mm512_abs_epi8(w), signed);
        _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))
    },
    q8_init: |_bias| _mm512_setzero_si512());

/// The AVX2 copy: each group as two halves of 8 lanes (weight rows `16g..16g+8`, then
/// `16g+8..16g+16`), `R` input rows from `r`. Returns `R`.
///
/// # Safety
/// AVX2+FMA available; otherwise as the AVX-512 kernels.
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<const R: usize>(
    a: &QuantizedRows,
    r: usize,
    w: &Interleaved,
    g: usize,
    out: &mut [f32],
) -> usize {
    let nb = w.nb;
    let low = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    for h in 0..2 {
        let mut facc = [_mm256_setzero_ps(); R];
        // SAFETY (pointer reads): as in the AVX-512 kernels; half `h` is bytes 32h..32h+32 of
        // each 64-byte vector and lanes 8h..8h+8 of the scales.
        for b in 0..nb {
            let gb = g * nb + b;
            let xq: [*const i32; R] = core::array::from_fn(|i| {
                unsafe { a.q.as_ptr().add((r + i) * a.k + b * 32) }.cast()
            });
            let mut iacc = [_mm256_setzero_si256(); R];
            match w.kind {
                BlockKind::Q4_1 => {
                    let base = unsafe { w.qs.as_ptr().add(gb * 4 * 64 + h * 32) };
                    for t in 0..4 {
                        let v = unsafe { _mm256_loadu_si256(base.add(t * 64).cast()) };
                        let lo = _mm256_and_si256(v, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        for i in 0..R {
                            let (xl, xh) = unsafe {
                                (
                                    xq[i].add(t).read_unaligned(),
                                    xq[i].add(t + 4).read_unaligned(),
                                )
                            };
                            let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl));
                            let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh));
                            let p = _mm256_add_epi32(
                                _mm256_madd_epi16(pl, ones),
                                _mm256_madd_epi16(ph, ones),
                            );
                            iacc[i] = _mm256_add_epi32(iacc[i], p);
                        }
                    }
                }
                BlockKind::Q8_0 => {
                    let base = unsafe { w.qs.as_ptr().add(gb * 8 * 64 + h * 32) };
                    for t in 0..8 {
                        let v = unsafe { _mm256_loadu_si256(base.add(t * 64).cast()) };
                        let av = _mm256_abs_epi8(v);
                        for i in 0..R {
                            let x = _mm256_set1_epi32(unsafe { xq[i].add(t).read_unaligned() });
                            let p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(x, v));
                            iacc[i] = _mm256_add_epi32(iacc[i], _mm256_madd_epi16(p, ones));
                        }
                    }
                }
            }
            let dw = unsafe { _mm256_loadu_ps(w.d.as_ptr().add(gb * GROUP + h * 8)) };
            for i in 0..R {
                let dx = _mm256_set1_ps(a.d[(r + i) * nb + b]);
                let sumi = _mm256_cvtepi32_ps(iacc[i]);
                facc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), sumi, facc[i]);
            }
            if w.kind == BlockKind::Q4_1 {
                let mw = unsafe { _mm256_loadu_ps(w.m.as_ptr().add(gb * GROUP + h * 8)) };
                for i in 0..R {
                    let s = _mm256_set1_ps(a.s[(r + i) * nb + b]);
                    facc[i] = _mm256_fmadd_ps(mw, s, facc[i]);
                }
            }
        }
        for i in 0..R {
            // SAFETY: `out` holds R·16 floats.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i * GROUP + h * 8), facc[i]) };
        }
    }
    R
}

/// [`super::quantize_row_impl`] with AVX2: the same operations on 8 lanes; the block's `amax` is
/// a maximum (exact in any order), its sum of integers exact.
///
/// # Safety
/// AVX2+FMA available; `x.len() == q.len() == qu.len() == 32·d.len() == 32·s.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_row(x: &[f32], q: &mut [i8], qu: &mut [u8], d: &mut [f32], s: &mut [f32]) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let magic = _mm256_set1_ps(ROUND_MAGIC);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let flip = _mm256_set1_epi8(-128);
    for b in 0..d.len() {
        // SAFETY: block b's 32 floats are in bounds of `x` (the contract).
        let v: [__m256; 4] =
            core::array::from_fn(|t| unsafe { _mm256_loadu_ps(x.as_ptr().add(b * 32 + t * 8)) });
        // max(a, m) is `a > m ? a : m`: a NaN never wins, as in the scalar recipe.
        let mut m = _mm256_setzero_ps();
        for t in 0..4 {
            m = _mm256_max_ps(_mm256_and_ps(v[t], abs_mask), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
        let db = amax / 127.0;
        let id = _mm256_set1_ps(if db == 0.0 { 0.0 } else { 1.0 / db });
        let ints: [__m256i; 4] = core::array::from_fn(|t| {
            let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[t], id), magic), magic);
            let r = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(r, r), r);
            _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        let sum = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256::<1>(sum),
        );
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b01_00_11_10>(s4));
        let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32::<0b10_11_00_01>(s2));
        // Packing works within 128-bit halves: dwords come out as i0[0..4], i1[0..4], i2[0..4],
        // i3[0..4], i0[4..8], …; `order` puts them back in element order.
        let p16a = _mm256_packs_epi32(ints[0], ints[1]);
        let p16b = _mm256_packs_epi32(ints[2], ints[3]);
        let p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
        // SAFETY: block b's 32 bytes are in bounds of `q` and `qu` (the contract).
        unsafe {
            _mm256_storeu_si256(q.as_mut_ptr().add(b * 32).cast(), p8);
            _mm256_storeu_si256(
                qu.as_mut_ptr().add(b * 32).cast(),
                _mm256_xor_si256(p8, flip),
            );
        }
        d[b] = db;
        s[b] = db * _mm_cvtsi128_si32(s1) as f32;
    }
}
