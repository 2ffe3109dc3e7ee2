//! Attention of the CPU fast path ([`super::model`]) over the transposed KV cache: many
//! queries of one KV head per call, each with its own visible keys.
//!
//! # Numerics: one recipe per query
//! A query sees the `common` runs of keys (the shared prompt), then its `own` runs (its candidate
//! row's suffix), up to its limit. Its scores are `Σ_d q[d]·k[d]` by sequential fused
//! multiply-add over `d`, times `scale`; then `e_j = exp(s_j − max)` ([`kernels::exp`]) and
//! `z = Σ e_j` ([`kernels::exp_sub`]: 8 lanes, a fixed tree); the output is `Σ_j e_j·v_j` by
//! fused multiply-add in key order, divided by `z`. Which queries share a call, how keys are
//! tiled, and whether the AVX-512 (16 keys or dimensions a register), the AVX2 or the scalar copy
//! runs never changes a bit (tests): each lane is one key's score or one dimension's sum, and the
//! softmax between them is the one 8-lane `exp_sub` on every copy. (A one-pass online softmax
//! would rescale partial sums and change bits, so the two passes stay.)
//!
//! # Why many queries at once
//! Attention reads every visible key and value; per query, that is a stream from L2/L3 (1 MiB
//! of keys per KV head at 4k tokens). A call takes every query that shares the `common` runs:
//! the heads of a GQA group of a block of prompt positions (prefill), or of every candidate row
//! (decode: all rows attend to the same prompt). Keys go in tiles of 16 that every group of 4
//! queries meets while they are in L1, values in tiles of [`VALUE_TILE`] likewise, so the cache
//! is read once per call rather than once per query. A run is one 32-position block of the KV
//! pool (8 KiB of keys, 8 KiB of values per head at d = 64): too short for the hardware
//! prefetcher to ramp up on, so the vector copies ask for the next run's lines themselves while
//! they compute one (the `prefetch` engine switch).

// Kernels index lanes and rows explicitly: the order of operations is the contract.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use std::sync::atomic::{AtomicBool, Ordering};

use super::kernels::{self, F32Copy, LANES};

#[cfg(target_arch = "x86_64")]
mod avx512;

/// Whether the vector copies prefetch the next run's keys and values (the `prefetch` engine
/// switch; on unless turned off). A cache hint only: the bits are the same either way.
static PREFETCH: AtomicBool = AtomicBool::new(true);

/// Sets [`PREFETCH`] for the process (from the engine switches at load).
pub fn set_prefetch(on: bool) {
    PREFETCH.store(on, Ordering::Relaxed);
}

/// The run a kernel's loop prefetches along (the next run's keys or values): with its own row
/// `i` (a dimension of the keys, a key of the values), the loop asks for row `i` of `at`, `row`
/// bytes long. A run is one block of the KV pool, too short for the hardware prefetcher to ramp
/// up on. A hint: it reads nothing and changes no bit; [`Ahead::NONE`] asks for nothing.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Ahead {
    at: *const u8,
    row: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ahead {
    const NONE: Ahead = Ahead {
        at: std::ptr::null(),
        row: 0,
    };

    /// The keys of `run` (`d × cap`: a row is `cap` floats).
    fn keys(run: &KvRun) -> Ahead {
        Ahead {
            at: run.kt.as_ptr().cast(),
            row: run.cap * 4,
        }
    }

    /// The values of `run` (`cap × d`: a row is `d` floats).
    fn values(run: &KvRun, d: usize) -> Ahead {
        Ahead {
            at: run.v.as_ptr().cast(),
            row: d * 4,
        }
    }

    /// Asks for the cache lines of row `i` to be fetched into L1.
    #[inline(always)]
    fn fetch(self, i: usize) {
        if self.at.is_null() {
            return;
        }
        let p = self.at.wrapping_add(i * self.row);
        let mut o = 0;
        while o < self.row {
            // SAFETY: a prefetch is a hint that never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    p.wrapping_add(o).cast(),
                )
            };
            o += 64;
        }
    }
}

/// The copy of the recipe this process runs for head size `d`: the elementwise kernels' copy
/// ([`F32Copy::in_use`]: 16 keys or dimensions a register with AVX-512, 8 with AVX2) where the
/// vector copies take `d`, else the scalar one. Every copy gives the same bits.
fn copy_in_use(d: usize) -> F32Copy {
    if d == 64 || d == 128 {
        F32Copy::in_use()
    } else {
        F32Copy::Scalar
    }
}

/// Keys per tile of the weighted sum: 32 values of d = 64 are 8 KiB, in L1 while every query of
/// the call uses them.
const VALUE_TILE: usize = 32;

/// One run of cached positions of one KV head: `kt` is `d × cap` (keys transposed, so 8 keys
/// load as one vector), `v` is `cap × d`; positions `0..len` are valid.
#[derive(Clone, Copy)]
pub struct KvRun<'a> {
    pub kt: &'a [f32],
    pub v: &'a [f32],
    pub cap: usize,
    pub len: usize,
}

impl KvRun<'_> {
    pub const EMPTY: KvRun<'static> = KvRun {
        kt: &[],
        v: &[],
        cap: 0,
        len: 0,
    };
}

/// Each query's own runs, read after the common ones (a candidate row's blocks): query `i`'s
/// are `runs[ends[i - 1]..ends[i]]` (from 0 for the first); no query has any when `ends` is
/// empty.
#[derive(Clone, Copy)]
pub struct Own<'r, 'a> {
    pub runs: &'r [KvRun<'a>],
    pub ends: &'r [usize],
}

impl<'r, 'a> Own<'r, 'a> {
    pub const NONE: Own<'static, 'static> = Own {
        runs: &[],
        ends: &[],
    };

    /// Query `i`'s own runs.
    pub fn of(&self, i: usize) -> &'r [KvRun<'a>] {
        match self.ends.get(i) {
            Some(&end) => &self.runs[if i == 0 { 0 } else { self.ends[i - 1] }..end],
            None => &[],
        }
    }

    /// Positions in query `i`'s own runs.
    fn len_of(&self, i: usize) -> usize {
        self.of(i).iter().map(|r| r.len).sum()
    }
}

#[inline(always)]
fn score_one(q: &[f32], run: &KvRun, j: usize, d: usize) -> f32 {
    let mut s = 0f32;
    for dd in 0..d {
        s = q[dd].mul_add(run.kt[dd * run.cap + j], s);
    }
    s
}

/// The recipe, one query at a time: the scalar fallback and the reference of the tests.
fn attend_impl(
    q: &[f32],
    nq: usize,
    limits: &[usize],
    common: &[KvRun],
    own: Own,
    d: usize,
    scale: f32,
    s: &mut Vec<f32>,
    out: &mut [f32],
) {
    for i in 0..nq {
        let qi = &q[i * d..(i + 1) * d];
        let runs: Vec<&KvRun> = common.iter().chain(own.of(i)).collect();
        let total: usize = runs.iter().map(|r| r.len).sum();
        let lim = limits[i].min(total);
        s.clear();
        for run in &runs {
            for t in 0..run.len {
                if s.len() == lim {
                    break;
                }
                s.push(score_one(qi, run, t, d));
            }
        }
        let max = kernels::scale_max(s, scale);
        let z = kernels::exp_sub(s, max);
        let o = &mut out[i * d..(i + 1) * d];
        o.fill(0.0);
        let mut j = 0;
        for run in &runs {
            let n = run.len.min(lim - j);
            for t in 0..n {
                let e = s[j + t];
                for dd in 0..d {
                    o[dd] = e.mul_add(run.v[t * d + dd], o[dd]);
                }
            }
            j += n;
        }
        for v in o.iter_mut() {
            *v /= z;
        }
    }
}

/// Attention of `nq` queries (`q`, each `d`) sharing one KV head. Query `i` sees the `common`
/// runs, then its `own` runs, up to its first `limits[i]` keys. Writes `nq × d` into `out`;
/// `s` is scratch.
pub fn attend(
    q: &[f32],
    nq: usize,
    limits: &[usize],
    common: &[KvRun],
    own: Own,
    d: usize,
    scale: f32,
    s: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_with(copy_in_use(d), q, nq, limits, common, own, d, scale, s, out)
}

/// [`attend`] by a given copy (`copy` runs on this CPU and, unless scalar, `d` is 64 or 128).
fn attend_with(
    copy: F32Copy,
    q: &[f32],
    nq: usize,
    limits: &[usize],
    common: &[KvRun],
    own: Own,
    d: usize,
    scale: f32,
    s: &mut Vec<f32>,
    out: &mut [f32],
) {
    assert!(q.len() >= nq * d && out.len() >= nq * d && limits.len() >= nq);
    assert!(
        (own.ends.is_empty() || own.ends.len() == nq)
            && own.ends.windows(2).all(|w| w[0] <= w[1])
            && own.ends.last().is_none_or(|&e| e <= own.runs.len()),
        "own runs for every query, or none"
    );
    for r in common.iter().chain(own.runs) {
        assert!(r.kt.len() >= d * r.cap && r.v.len() >= r.cap * d && r.len <= r.cap);
    }
    #[cfg(target_arch = "x86_64")]
    if copy != F32Copy::Scalar {
        assert!(d == 64 || d == 128, "the vector copies take d = 64 or 128");
        let wide = copy == F32Copy::Avx512;
        // SAFETY: AVX2 and FMA (and AVX-512F when `wide`) were detected at run time
        // (`F32Copy::in_use`, or the tests' `copies`); every run holds `d × cap` keys and `cap × d`
        // values with `len ≤ cap`, `q`/`out` hold `nq × d` and `own` has runs for every query
        // or none (asserted above): the bounds the kernel relies on.
        unsafe { avx2::attend(wide, q, nq, limits, common, own, d, scale, s, out) };
        return;
    }
    let _ = copy;
    attend_impl(q, nq, limits, common, own, d, scale, s, out)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2/FMA copy of [`super::attend_impl`]: the same operations in the same order per
    //! query, many queries per pass over the keys and values.

    use std::arch::x86_64::*;

    use super::{Ahead, KvRun, LANES, Own, VALUE_TILE, avx512};

    /// `o += Σ_t e[t]·v_t` for keys `t0..t1` (see [`accumulate`]), 16 or 8 lanes a register.
    ///
    /// # Safety
    /// As [`accumulate`]; AVX-512F available when `wide`; `d = o.len()` is 64 or 128.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate_any(
        wide: bool,
        e: &[f32],
        run: &KvRun,
        t0: usize,
        t1: usize,
        o: &mut [f32],
        ahead: Ahead,
    ) {
        // SAFETY: the contract.
        unsafe {
            match (wide, o.len()) {
                (true, 64) => avx512::accumulate::<4>(e, run, t0, t1, o, ahead),
                (true, _) => avx512::accumulate::<8>(e, run, t0, t1, o, ahead),
                (false, 64) => accumulate::<8>(e, run, t0, t1, o, ahead),
                (false, _) => accumulate::<16>(e, run, t0, t1, o, ahead),
            }
        }
    }

    /// [`accumulate_any`] for `g` consecutive queries over the same keys `t0..t1`: query `k`'s
    /// weights are `e[k·stride ..]`, its sums `o[k·d ..]` (`d = o.len() / g`); `ahead` is
    /// prefetched along.
    ///
    /// # Safety
    /// As [`accumulate_any`] per query; `g` is 1, or 2 to 4 with `wide` (2 at most for d = 128);
    /// `e` holds `(g−1)·stride + t1` weights.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate_group(
        wide: bool,
        g: usize,
        e: &[f32],
        stride: usize,
        run: &KvRun,
        t0: usize,
        t1: usize,
        o: &mut [f32],
        ahead: Ahead,
    ) {
        let d = o.len() / g;
        assert!(g == 1 || (e.len() >= (g - 1) * stride + t1));
        let ep = e.as_ptr();
        // SAFETY: the contract; `accumulate_many` is the AVX-512 copy (`wide`).
        unsafe {
            match (g, d) {
                (1, _) => accumulate_any(wide, e, run, t0, t1, o, ahead),
                (2, 64) => avx512::accumulate_many::<4, 2>(ep, stride, run, t0, t1, o, ahead),
                (3, 64) => avx512::accumulate_many::<4, 3>(ep, stride, run, t0, t1, o, ahead),
                (4, 64) => avx512::accumulate_many::<4, 4>(ep, stride, run, t0, t1, o, ahead),
                (2, _) => avx512::accumulate_many::<8, 2>(ep, stride, run, t0, t1, o, ahead),
                _ => unreachable!("groups of {g} queries at d = {d}"),
            }
        }
    }

    /// Scores of `Q` queries (rows of `q`, each `d`) against 8·`V` keys from `j` of `run`.
    ///
    /// # Safety
    /// `q` holds `Q·d`; keys `j..j+8V` are below `run.cap`; `run.kt` holds `d × cap`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores<const Q: usize, const V: usize>(
        q: *const f32,
        run: &KvRun,
        j: usize,
        d: usize,
        ahead: Ahead,
    ) -> [[__m256; V]; Q] {
        let mut acc = [[_mm256_setzero_ps(); V]; Q];
        let kt = run.kt.as_ptr();
        for dd in 0..d {
            ahead.fetch(dd);
            let mut kv = [_mm256_setzero_ps(); V];
            for (t, k) in kv.iter_mut().enumerate() {
                // SAFETY: dd < d and j + 8t + 8 <= cap: in bounds of `kt` (d × cap).
                *k = unsafe { _mm256_loadu_ps(kt.add(dd * run.cap + j + t * LANES)) };
            }
            for i in 0..Q {
                // SAFETY: i < Q, dd < d: in bounds of `q`.
                let qv = _mm256_set1_ps(unsafe { *q.add(i * d + dd) });
                for t in 0..V {
                    acc[i][t] = _mm256_fmadd_ps(qv, kv[t], acc[i][t]);
                }
            }
        }
        acc
    }

    /// Scores of queries `q0..q0+nq` for every key of `run`, into `s[i·stride + at + j]`: keys
    /// in tiles of 16 (then 8, then one by one), each tile met by every group of up to 4
    /// queries while it is in L1. The first group's pass over the first tile prefetches
    /// `ahead` (the keys of the run read next).
    ///
    /// # Safety
    /// `q` holds the queries (`d` each); `s` holds `(q0+nq)·stride` with `at + run.len <=
    /// stride`; the run is valid (`len <= cap`, `kt` holds `d × cap`).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn score_run(
        wide: bool,
        q: &[f32],
        q0: usize,
        nq: usize,
        run: &KvRun,
        ahead: Ahead,
        d: usize,
        s: &mut [f32],
        stride: usize,
        at: usize,
    ) {
        let first = |qg: usize, j: usize| {
            if qg == 0 && j == 0 {
                ahead
            } else {
                Ahead::NONE
            }
        };
        let mut j = 0;
        macro_rules! tile {
            ($v:expr) => {
                let mut qg = 0;
                while qg < nq {
                    // SAFETY: queries q0+qg.. hold d floats each (the contract).
                    let qp = unsafe { q.as_ptr().add((q0 + qg) * d) };
                    macro_rules! put {
                        ($g:expr) => {{
                            // SAFETY: keys j..j+8·$v <= len <= cap; queries in bounds.
                            let a = unsafe { scores::<$g, $v>(qp, run, j, d, first(qg, j)) };
                            for (i, row) in a.iter().enumerate() {
                                for t in 0..$v {
                                    let o = (q0 + qg + i) * stride + at + j + t * LANES;
                                    // SAFETY: o + 8 <= (q0+nq)·stride (the contract).
                                    unsafe { _mm256_storeu_ps(s.as_mut_ptr().add(o), row[t]) };
                                }
                            }
                            qg += $g;
                        }};
                    }
                    match nq - qg {
                        4.. => put!(4),
                        3 => put!(3),
                        2 => put!(2),
                        _ => put!(1),
                    }
                }
            };
        }
        if wide {
            // 16 keys a register: tiles of 32, then 16, each met by groups of up to 4 queries.
            macro_rules! wide_tile {
                ($v:literal) => {
                    let mut qg = 0;
                    while qg < nq {
                        let g = (nq - qg).min(8);
                        let pf = first(qg, j);
                        // SAFETY: queries q0+qg..q0+qg+g hold d floats each; keys
                        // j..j+16·$v <= len <= cap; `s` row q0+qg+i holds at + len <= stride.
                        unsafe {
                            let qp = q.as_ptr().add((q0 + qg) * d);
                            let sp = s.as_mut_ptr().add((q0 + qg) * stride + at + j);
                            match g {
                                8 => avx512::score_tile::<8, $v>(qp, run, j, d, sp, stride, pf),
                                7 => avx512::score_tile::<7, $v>(qp, run, j, d, sp, stride, pf),
                                6 => avx512::score_tile::<6, $v>(qp, run, j, d, sp, stride, pf),
                                5 => avx512::score_tile::<5, $v>(qp, run, j, d, sp, stride, pf),
                                4 => avx512::score_tile::<4, $v>(qp, run, j, d, sp, stride, pf),
                                3 => avx512::score_tile::<3, $v>(qp, run, j, d, sp, stride, pf),
                                2 => avx512::score_tile::<2, $v>(qp, run, j, d, sp, stride, pf),
                                _ => avx512::score_tile::<1, $v>(qp, run, j, d, sp, stride, pf),
                            }
                        }
                        qg += g;
                    }
                };
            }
            while j + 2 * avx512::WIDE <= run.len {
                wide_tile!(2);
                j += 2 * avx512::WIDE;
            }
            while j + avx512::WIDE <= run.len {
                wide_tile!(1);
                j += avx512::WIDE;
            }
        }
        while j + 2 * LANES <= run.len {
            tile!(2);
            j += 2 * LANES;
        }
        while j + LANES <= run.len {
            tile!(1);
            j += LANES;
        }
        for jj in j..run.len {
            for i in q0..q0 + nq {
                s[i * stride + at + jj] = super::score_one(&q[i * d..(i + 1) * d], run, jj, d);
            }
        }
    }

    /// `o += Σ_t e[t]·v_t` for keys `t0..t1` of `run`, in key order (`D8·8 = d` floats); with
    /// key `t`, row `t` of `ahead` (the next run's values, or null) is prefetched.
    ///
    /// # Safety
    /// `t1 <= run.len`, `e` holds `t1` weights, `o` holds `d`; the run holds `cap × d` values.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate<const D8: usize>(
        e: &[f32],
        run: &KvRun,
        t0: usize,
        t1: usize,
        o: &mut [f32],
        ahead: Ahead,
    ) {
        let d = D8 * LANES;
        let v = run.v.as_ptr();
        let mut acc = [_mm256_setzero_ps(); D8];
        for (u, a) in acc.iter_mut().enumerate() {
            // SAFETY: u·8 + 8 <= d = o.len().
            *a = unsafe { _mm256_loadu_ps(o.as_ptr().add(u * LANES)) };
        }
        for t in t0..t1 {
            ahead.fetch(t);
            let ev = _mm256_set1_ps(e[t]);
            for (u, a) in acc.iter_mut().enumerate() {
                // SAFETY: t < len <= cap, u·8 + 8 <= d: in bounds of `v` (cap × d).
                let vv = unsafe { _mm256_loadu_ps(v.add(t * d + u * LANES)) };
                *a = _mm256_fmadd_ps(ev, vv, *a);
            }
        }
        for (u, a) in acc.iter().enumerate() {
            // SAFETY: u·8 + 8 <= d = o.len().
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(u * LANES), *a) };
        }
    }

    /// The weighted sums of every query into `out` (zeroed first): the common runs in tiles of
    /// [`VALUE_TILE`] values met by every query, then each query's own runs.
    ///
    /// # Safety
    /// As [`attend`]; `lims[i] <= common_len + own.len_of(i)`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weighted_sums(
        wide: bool,
        d: usize,
        s: &[f32],
        stride: usize,
        lims: &[usize],
        common: &[KvRun],
        own: Own,
        out: &mut [f32],
    ) {
        let nq = lims.len();
        out[..nq * d].fill(0.0);
        let mut base = 0;
        // In 16 lanes, consecutive queries whose tile ends at the same key go together (up to
        // 4 at d = 64, 2 at d = 128: what the registers hold).
        let max_group = match (wide, d) {
            (false, _) => 1,
            (true, 64) => 4,
            (true, _) => 2,
        };
        let prefetch = super::PREFETCH.load(super::Ordering::Relaxed);
        for (k, run) in common.iter().enumerate() {
            // The first call over a run's first tile prefetches the next run's values.
            let mut ahead = match common.get(k + 1) {
                Some(next) if prefetch => Ahead::values(next, d),
                _ => Ahead::NONE,
            };
            let mut t0 = 0;
            while t0 < run.len {
                let t1 = (t0 + VALUE_TILE).min(run.len);
                let mut i = 0;
                while i < nq {
                    if base + t0 >= lims[i] {
                        i += 1;
                        continue;
                    }
                    let end = t1.min(lims[i] - base);
                    let mut g = 1;
                    while g < max_group
                        && i + g < nq
                        && base + t0 < lims[i + g]
                        && t1.min(lims[i + g] - base) == end
                    {
                        g += 1;
                    }
                    // SAFETY: end <= run.len; rows i..i+g of `s` hold base + end weights (row
                    // length `stride`); out rows i..i+g hold g·d.
                    let o = &mut out[i * d..(i + g) * d];
                    let e = &s[i * stride + base..];
                    unsafe { accumulate_group(wide, g, e, stride, run, t0, end, o, ahead) };
                    ahead = Ahead::NONE;
                    i += g;
                }
                t0 = t1;
            }
            base += run.len;
        }
        for i in 0..own.ends.len() {
            let mut at = base;
            for run in own.of(i) {
                let end = run.len.min(lims[i].saturating_sub(at));
                let e = &s[i * stride + at..];
                // SAFETY: as above.
                let o = &mut out[i * d..(i + 1) * d];
                unsafe { accumulate_any(wide, e, run, 0, end, o, Ahead::NONE) };
                at += run.len;
            }
        }
    }

    /// See [`super::attend`].
    ///
    /// # Safety
    /// AVX2+FMA available (and AVX-512F when `wide`); `d` is 64 or 128; the bounds
    /// [`super::attend`] asserts.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn attend(
        wide: bool,
        q: &[f32],
        nq: usize,
        limits: &[usize],
        common: &[KvRun],
        own: Own,
        d: usize,
        scale: f32,
        s: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let common_len: usize = common.iter().map(|r| r.len).sum();
        let own_max = (0..own.ends.len()).map(|i| own.len_of(i)).max();
        let stride = common_len + own_max.unwrap_or(0);
        s.resize(nq * stride, 0.0);
        let mut base = 0;
        let prefetch = super::PREFETCH.load(super::Ordering::Relaxed);
        for (k, run) in common.iter().enumerate() {
            let ahead = match common.get(k + 1) {
                Some(next) if prefetch => Ahead::keys(next),
                _ => Ahead::NONE,
            };
            // SAFETY: `s` holds nq·stride, base + len <= common_len <= stride.
            unsafe { score_run(wide, q, 0, nq, run, ahead, d, s, stride, base) };
            base += run.len;
        }
        for i in 0..own.ends.len() {
            let mut at = common_len;
            for run in own.of(i) {
                // SAFETY: as above for query i alone; at + len <= common_len + own.len_of(i)
                // <= stride.
                unsafe { score_run(wide, q, i, 1, run, Ahead::NONE, d, s, stride, at) };
                at += run.len;
            }
        }
        let mut lims = Vec::with_capacity(nq);
        let mut zs = Vec::with_capacity(nq);
        for i in 0..nq {
            let total = common_len + own.len_of(i);
            let lim = limits[i].min(total);
            let si = &mut s[i * stride..i * stride + lim];
            let max = crate::engine::cpu::kernels::scale_max(si, scale);
            zs.push(crate::engine::cpu::kernels::exp_sub(si, max));
            lims.push(lim);
        }
        // SAFETY: d is 64 or 128; the bounds of the contract.
        unsafe { weighted_sums(wide, d, s, stride, &lims, common, own, out) };
        for (i, z) in zs.iter().enumerate() {
            for v in out[i * d..(i + 1) * d].iter_mut() {
                *v /= *z;
            }
        }
    }
}

#[cfg(test)]
mod tests;
