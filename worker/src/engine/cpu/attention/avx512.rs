//! The 16-lane (AVX-512) pieces of the attention recipe: scores of 16 keys a register and the
//! weighted sum over 16 dimensions a register. Each lane is one key's (or one dimension's)
//! sequential chain of fused multiply-adds, exactly as in the scalar recipe and the 8-lane copy,
//! so only the speed changes; the softmax between them stays the shared 8-lane
//! [`crate::engine::cpu::kernels::exp_sub`], which fixes `z`'s order.

use std::arch::x86_64::*;

use super::{Ahead, KvRun};

/// Keys per register.
pub const WIDE: usize = 16;

/// Scores of `Q` queries (rows of `q`, each `d`) against 16·`V` keys from `j` of `run`, stored at
/// `s[i·stride + 16t ..]` for query `i` and register `t`; row `dd` of `ahead` is prefetched
/// with row `dd` of these keys.
///
/// # Safety
/// AVX-512F available; `q` holds `Q·d`; keys `j..j+16V` are below `run.cap`; `run.kt` holds
/// `d × cap`; `s` is valid for `(Q−1)·stride + 16V` writes.
#[target_feature(enable = "avx2,fma,avx512f")]
pub unsafe fn score_tile<const Q: usize, const V: usize>(
    q: *const f32,
    run: &KvRun,
    j: usize,
    d: usize,
    s: *mut f32,
    stride: usize,
    ahead: Ahead,
) {
    let mut acc = [[_mm512_setzero_ps(); V]; Q];
    let kt = run.kt.as_ptr();
    for dd in 0..d {
        ahead.fetch(dd);
        let mut kv = [_mm512_setzero_ps(); V];
        for (t, k) in kv.iter_mut().enumerate() {
            // SAFETY: dd < d and j + 16t + 16 <= cap: in bounds of `kt` (d × cap).
            *k = unsafe { _mm512_loadu_ps(kt.add(dd * run.cap + j + t * WIDE)) };
        }
        for i in 0..Q {
            // SAFETY: i < Q, dd < d: in bounds of `q`.
            let qv = _mm512_set1_ps(unsafe { *q.add(i * d + dd) });
            for t in 0..V {
                acc[i][t] = _mm512_fmadd_ps(qv, kv[t], acc[i][t]);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (t, a) in row.iter().enumerate() {
            // SAFETY: the contract on `s`.
            unsafe { _mm512_storeu_ps(s.add(i * stride + t * WIDE), *a) };
        }
    }
}

/// `o += Σ_t e[t]·v_t` for keys `t0..t1` of `run`, in key order (`D16·16 = d` floats); with
/// key `t`, row `t` of `ahead` is prefetched.
///
/// # Safety
/// AVX-512F available; `t1 <= run.len`, `e` holds `t1` weights, `o` holds `d`; the run holds
/// `cap × d` values.
#[target_feature(enable = "avx2,fma,avx512f")]
pub unsafe fn accumulate<const D16: usize>(
    e: &[f32],
    run: &KvRun,
    t0: usize,
    t1: usize,
    o: &mut [f32],
    ahead: Ahead,
) {
    let d = D16 * WIDE;
    let v = run.v.as_ptr();
    let mut acc = [_mm512_setzero_ps(); D16];
    for (u, a) in acc.iter_mut().enumerate() {
        // SAFETY: u·16 + 16 <= d = o.len().
        *a = unsafe { _mm512_loadu_ps(o.as_ptr().add(u * WIDE)) };
    }
    for t in t0..t1 {
        ahead.fetch(t);
        let ev = _mm512_set1_ps(e[t]);
        for (u, a) in acc.iter_mut().enumerate() {
            // SAFETY: t < len <= cap, u·16 + 16 <= d: in bounds of `v` (cap × d).
            let vv = unsafe { _mm512_loadu_ps(v.add(t * d + u * WIDE)) };
            *a = _mm512_fmadd_ps(ev, vv, *a);
        }
    }
    for (u, a) in acc.iter().enumerate() {
        // SAFETY: u·16 + 16 <= d = o.len().
        unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(u * WIDE), *a) };
    }
}

/// [`accumulate`] for `G` queries at once over the same keys `t0..t1` of `run`: query `g`'s
/// weights are `e[g·e_stride ..]`, its sums `o[g·d .. (g+1)·d]`. Each (query, dimension) lane is
/// the same chain of fused multiply-adds in key order as in `G` separate calls, so the bits do
/// not change; the `G·D16` independent chains (and each value loaded once for all `G`) keep both
/// FMA ports busy where one query's `D16 = 4` chains wait on the FMA latency.
///
/// With key `t`, row `t` of `ahead` is prefetched.
///
/// # Safety
/// AVX-512F available; `t1 <= run.len`; `e` is valid for `(G−1)·e_stride + t1` reads; `o` holds
/// `G·d`; the run holds `cap × d` values.
#[target_feature(enable = "avx2,fma,avx512f")]
pub unsafe fn accumulate_many<const D16: usize, const G: usize>(
    e: *const f32,
    e_stride: usize,
    run: &KvRun,
    t0: usize,
    t1: usize,
    o: &mut [f32],
    ahead: Ahead,
) {
    let d = D16 * WIDE;
    assert!(o.len() >= G * d);
    let v = run.v.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); D16]; G];
    for (g, row) in acc.iter_mut().enumerate() {
        for (u, a) in row.iter_mut().enumerate() {
            // SAFETY: g·d + u·16 + 16 <= G·d <= o.len().
            *a = unsafe { _mm512_loadu_ps(o.as_ptr().add(g * d + u * WIDE)) };
        }
    }
    for t in t0..t1 {
        ahead.fetch(t);
        let mut vv = [_mm512_setzero_ps(); D16];
        for (u, x) in vv.iter_mut().enumerate() {
            // SAFETY: t < len <= cap, u·16 + 16 <= d: in bounds of `v` (cap × d).
            *x = unsafe { _mm512_loadu_ps(v.add(t * d + u * WIDE)) };
        }
        for (g, row) in acc.iter_mut().enumerate() {
            // SAFETY: g < G, t < t1: within the reads the contract allows.
            let ev = _mm512_set1_ps(unsafe { *e.add(g * e_stride + t) });
            for (a, x) in row.iter_mut().zip(&vv) {
                *a = _mm512_fmadd_ps(ev, *x, *a);
            }
        }
    }
    for (g, row) in acc.iter().enumerate() {
        for (u, a) in row.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(g * d + u * WIDE), *a) };
        }
    }
}
