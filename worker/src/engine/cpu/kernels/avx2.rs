//! AVX2/FMA versions of [`super::matmul_block_impl`] and of the fused block-quantized
//! rows, computing the same operations in the same order (bit-identical; see the tests).

use std::arch::x86_64::*;

use super::LANES;
use crate::engine::cpu::weights::PackedMatrix;

/// [`super::reduce`] on one register: lanes `l + (l+4)`, then `+2`, then `+1`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// `R × C` dot products of length `k` over rows at offsets `xo` of `x` and `wo` of `w`.
///
/// # Safety
/// `x[xo[r]..xo[r]+k]` and `w[wo[c]..wo[c]+k]` must be in bounds, `k % 8 == 0`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize, const C: usize>(
    x: *const f32,
    xo: [usize; R],
    w: *const f32,
    wo: [usize; C],
    k: usize,
) -> [[f32; C]; R] {
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut i = 0;
    while i < k {
        let mut wv = [_mm256_setzero_ps(); C];
        for c in 0..C {
            // SAFETY: in bounds by the caller's contract.
            wv[c] = unsafe { _mm256_loadu_ps(w.add(wo[c] + i)) };
        }
        for r in 0..R {
            // SAFETY: in bounds by the caller's contract.
            let xv = unsafe { _mm256_loadu_ps(x.add(xo[r] + i)) };
            for c in 0..C {
                acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
        i += LANES;
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = hsum(acc[r][c]);
        }
    }
    out
}

/// See [`super::matmul_block_impl`].
///
/// # Safety
/// `x.len() >= m·k`, `w.len() >= nc·k`, `out.len() >= nc·m`, `k % 8 == 0`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn matmul_block(x: &[f32], m: usize, k: usize, w: &[f32], nc: usize, out: &mut [f32]) {
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    // Row tiles outside: a tile of 4 input rows stays in L1 while it meets every weight
    // row of the task (which stay in L2).
    let mut r = 0;
    while r < m {
        let rr = (m - r).min(4);
        let mut c = 0;
        while c < nc {
            let cc = (nc - c).min(3);
            if rr == 4 && cc == 3 {
                // SAFETY: rows r..r+4 < m and c..c+3 < nc: in bounds by the contract.
                let t = unsafe {
                    tile::<4, 3>(
                        xp,
                        [r * k, (r + 1) * k, (r + 2) * k, (r + 3) * k],
                        wp,
                        [c * k, (c + 1) * k, (c + 2) * k],
                        k,
                    )
                };
                for (i, row) in t.iter().enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        out[(c + j) * m + r + i] = *v;
                    }
                }
            } else if cc == 3 {
                for i in 0..rr {
                    // SAFETY: as above.
                    let t = unsafe {
                        tile::<1, 3>(xp, [(r + i) * k], wp, [c * k, (c + 1) * k, (c + 2) * k], k)
                    };
                    for (j, v) in t[0].iter().enumerate() {
                        out[(c + j) * m + r + i] = *v;
                    }
                }
            } else {
                for i in 0..rr {
                    for j in 0..cc {
                        // SAFETY: as above.
                        let t = unsafe { tile::<1, 1>(xp, [(r + i) * k], wp, [(c + j) * k], k) };
                        out[(c + j) * m + r + i] = t[0][0];
                    }
                }
            }
            c += cc;
        }
        r += rr;
    }
}

/// 8 floats from 8 small unsigned ints (low 8 bytes of `v`), dequantized `q·d + m` (two
/// roundings, as [`dequant_rows_impl`](crate::engine::cpu::weights::dequant_rows_impl)).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn q4_vec(v: __m128i, d: __m256, m: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d),
        m,
    )
}

/// Dot products of `R` input rows (offsets `xo` of `x`, starting at element 0 of the weight
/// row) with one weight row given as Q4_1 blocks, dequantized in registers. Same lanes and
/// order as dequantizing to f32 first and calling [`tile`].
///
/// # Safety
/// `x[xo[r]..xo[r] + 32·dm.len()]` in bounds; `qs.len() == dm.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q4_1_row<const R: usize>(
    x: *const f32,
    xo: [usize; R],
    dm: &[[f32; 2]],
    qs: &[[u8; 16]],
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mask = _mm_set1_epi8(0x0f);
    for (b, (s, q)) in dm.iter().zip(qs).enumerate() {
        let (d, m) = (_mm256_set1_ps(s[0]), _mm256_set1_ps(s[1]));
        // SAFETY: `q` is 16 bytes.
        let raw = unsafe { _mm_loadu_si128(q.as_ptr().cast()) };
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
        // Elements 0..8, 8..16 (low nibbles), 16..24, 24..32 (high nibbles).
        let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
        for (t, part) in parts.into_iter().enumerate() {
            let w = q4_vec(part, d, m);
            for r in 0..R {
                // SAFETY: in bounds by the caller's contract.
                let xv = unsafe { _mm256_loadu_ps(x.add(xo[r] + b * 32 + t * LANES)) };
                acc[r] = _mm256_fmadd_ps(xv, w, acc[r]);
            }
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(acc[r]);
    }
    out
}

/// As [`q4_1_row`] for Q8_0 blocks (`q·d`).
///
/// # Safety
/// `x[xo[r]..xo[r] + 32·d.len()]` in bounds; `qs.len() == d.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8_0_row<const R: usize>(
    x: *const f32,
    xo: [usize; R],
    d: &[f32],
    qs: &[[i8; 32]],
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    for (b, (s, q)) in d.iter().zip(qs).enumerate() {
        let dv = _mm256_set1_ps(*s);
        for t in 0..4 {
            // SAFETY: bytes t·8..t·8+8 of the 32-byte block.
            let raw = unsafe { _mm_loadl_epi64(q.as_ptr().add(t * 8).cast()) };
            let w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), dv);
            for r in 0..R {
                // SAFETY: in bounds by the caller's contract.
                let xv = unsafe { _mm256_loadu_ps(x.add(xo[r] + b * 32 + t * LANES)) };
                acc[r] = _mm256_fmadd_ps(xv, w, acc[r]);
            }
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(acc[r]);
    }
    out
}

/// `out[c·m + r] = dot(x[r], w[r0 + c])` for `nc` block-quantized weight rows, dequantized
/// in registers (small `m`: decode steps). Returns false for a format without a fused
/// kernel (f32).
///
/// # Safety
/// `x.len() >= m·k`, `out.len() >= nc·m`, rows `r0..r0+nc` exist in `w`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn matmul_fused(
    x: &[f32],
    m: usize,
    w: &PackedMatrix,
    r0: usize,
    nc: usize,
    out: &mut [f32],
) -> bool {
    let xp = x.as_ptr();
    let k = w.cols();
    let nb = k / 32;
    macro_rules! rows {
        ($f:ident, $a:expr, $b:expr) => {{
            for c in 0..nc {
                let blocks = (r0 + c) * nb..(r0 + c + 1) * nb;
                let (a, b) = (&$a[blocks.clone()], &$b[blocks]);
                let mut r = 0;
                while r < m {
                    // SAFETY: rows r.. < m of `x` (m·k floats); `a`/`b` are one row of
                    // blocks, 32 elements each, k in all.
                    if m - r >= 8 {
                        let t = unsafe { $f::<8>(xp, core::array::from_fn(|i| (r + i) * k), a, b) };
                        out[c * m + r..c * m + r + 8].copy_from_slice(&t);
                        r += 8;
                    } else if m - r >= 4 {
                        let t = unsafe { $f::<4>(xp, core::array::from_fn(|i| (r + i) * k), a, b) };
                        out[c * m + r..c * m + r + 4].copy_from_slice(&t);
                        r += 4;
                    } else {
                        let t = unsafe { $f::<1>(xp, [r * k], a, b) };
                        out[c * m + r] = t[0];
                        r += 1;
                    }
                }
            }
            true
        }};
    }
    match w {
        PackedMatrix::Q4_1 { dm, qs, .. } => rows!(q4_1_row, dm, qs),
        PackedMatrix::Q8_0 { d, qs, .. } => rows!(q8_0_row, d, qs),
        PackedMatrix::F32 { .. } | PackedMatrix::Interleaved(_) => false,
    }
}
