//! The exhaustive sampler's draw at a cost linear in the vocabulary, whatever the logits'
//! shape: flat rows (every token near the maximum, as a random-weight model gives) cost about
//! what peaked ones do.
//!
//! # The order, and why the draw is the exhaustive one
//! [`sample_exhaustive`](super::sample_exhaustive) weighs every allowed finite token with
//! `w = exp(s − max)` in f64 (`s` the penalized logit over the temperature), sums the weights
//! in id order into `z`, ranks the tokens by weight descending, ties by lower id, and searches
//! the running sums of the ranked weights for the top-p cut (at `top_p ≥ 1`, for the draw
//! itself). Its answer depends on that ranking and those running sums only: its doubling
//! selection searches a prefix of the ranking, and the first position meeting the condition
//! in a prefix is the first in the whole ranking.
//!
//! Here every weight and `z` come from the same expressions, summed in the same order, so they
//! are the same numbers bit for bit. The ranking comes from a stable LSD radix sort:
//! - With a positive temperature and a finite positive penalty ([`handles`]) a scaled logit is
//!   finite, so every weight is a number in `[0, 1]`, never NaN. For non-negative doubles the
//!   order of the bit patterns is the order of the values, so the key `bits(w_max) − bits(w)`
//!   ascends exactly as the weight descends, and two keys are equal exactly when the weights
//!   are.
//! - Tokens enter the sort in id order and every pass is stable, so tokens of equal weight
//!   keep the lower id first: the exhaustive sampler's tie rule.
//!
//! Only the key digits below the largest key are sorted (on flat logits the keys span ~44
//! bits, four 11-bit passes), a digit every token shares is skipped, and key and id travel
//! packed in one `u64` when they fit (else in a `u128`).
//!
//! # Sorting less than the vocabulary
//! A histogram of the keys' top bits, with each bucket's approximate mass, picks the fewest
//! leading buckets whose mass passes the cut's target. The tokens in them are exactly a prefix
//! of the ranking (every key in a bucket is below every key of a later bucket), so their
//! running sums and the search over them are the exhaustive sampler's. Should rounding leave
//! the cut past that prefix, the whole vocabulary is sorted: the histogram decides how much
//! work is done, never the answer.

use super::common::{SamplingParams, Scratch, SeenTokens, for_each_considered};
use crate::constraint::AllowedTokens;

/// Most bits of one radix digit: 4,096 counters a pass, which stay in the L1 cache.
const DIGIT_BITS: u32 = 12;

/// Top key bits sorted first (two passes): 16 million slots, far more than a vocabulary's
/// tokens, so tokens sharing them are few unless the keys cluster.
const TOP_BITS: u32 = 24;

/// Runs of tokens up to this long are sorted by insertion.
const SHORT_RUN: usize = 32;

/// Bits of the key's top that choose which tokens get sorted (2,048 buckets).
const BUCKET_BITS: u32 = 11;

/// Relative excess of the chosen buckets' approximate mass over the cut's target: far above
/// the error of summing 152k positive doubles (~2e-11), so the cut almost never falls past
/// the chosen prefix (when it does, everything is sorted and the answer is the same).
const MARGIN: f64 = 1e-9;

/// Whether [`sample`] ranks the tokens itself for these settings: a positive temperature
/// (greedy decoding is one pass already) and a finite positive repetition penalty, for which
/// every weight is a number. Other settings are handed to the exhaustive sampler.
pub fn handles(params: &SamplingParams) -> bool {
    params.temperature > 0.0
        && params.repetition_penalty > 0.0
        && params.repetition_penalty.is_finite()
}

/// The token [`sample_exhaustive`](super::sample_exhaustive) draws, always; `None` when the
/// mask leaves no token with a finite logit.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    seen: Option<&SeenTokens>,
    allowed: Option<&AllowedTokens>,
    u: f64,
    scratch: &mut Scratch,
) -> Option<u32> {
    if !handles(params) {
        return super::sample_exhaustive(logits, params, seen, allowed, u, scratch);
    }
    let weighed = weigh(logits, params, seen, allowed, scratch)?;
    let top_p = params.top_p as f64;
    let target = if top_p >= 1.0 {
        u * weighed.z
    } else {
        top_p * weighed.z
    };
    let prefix = chosen_buckets(&weighed, &scratch.weights, target);
    Some(draw(&weighed, params, u, prefix, scratch))
}

/// Ranks the tokens of `prefix` and draws among them, ranking everything when the draw falls
/// past them.
fn draw(
    weighed: &Weighed,
    params: &SamplingParams,
    u: f64,
    mut prefix: Prefix,
    scratch: &mut Scratch,
) -> u32 {
    let top_p = params.top_p as f64;
    let cut_all = top_p >= 1.0;
    loop {
        let ranked = rank(weighed, prefix, scratch);
        if let Some(t) = search(weighed, cut_all, top_p, u, ranked, scratch) {
            return t;
        }
        // Rounding left the cut past the prefix: rank everything.
        prefix = Prefix::all(weighed);
    }
}

/// What one pass of weighing learned about the row.
struct Weighed {
    /// Tokens weighed (allowed, finite logit).
    n: usize,
    /// The exhaustive sampler's normalizer: every weight summed in id order.
    z: f64,
    /// Bit pattern of the heaviest weight (that of 1.0: the maximum's own weight).
    top_bits: u64,
    /// `top_bits` minus the lightest weight's bit pattern: the largest key.
    span: u64,
    /// Right shift of a key to its histogram bucket.
    shift: u32,
    /// Bits an id needs.
    id_bits: u32,
}

/// Every considered token's weight and id into `scratch` (in id order), with the sums and
/// bounds the ranking needs; `None` when no token is considered.
fn weigh(
    logits: &[f32],
    params: &SamplingParams,
    seen: Option<&SeenTokens>,
    allowed: Option<&AllowedTokens>,
    scratch: &mut Scratch,
) -> Option<Weighed> {
    let temp = params.temperature as f64;
    let penalty = params.repetition_penalty as f64;
    let seen = seen.filter(|_| penalty != 1.0);
    let penalized = |id: u32| seen.is_some_and(|s| s.contains(id));
    // The exhaustive sampler's transform, operation for operation.
    let scaled = |id: u32, l: f32| {
        let l = l as f64;
        if penalized(id) {
            (if l > 0.0 { l / penalty } else { l * penalty }) / temp
        } else {
            l / temp
        }
    };
    // Division by `temp` is monotone: the largest unpenalized scaled logit is the largest
    // raw logit's, the same number the exhaustive sampler's fold finds.
    let (mut raw_max, mut pen_max, mut n) = (f32::NEG_INFINITY, f64::NEG_INFINITY, 0usize);
    for_each_considered(logits, allowed, |id, l| {
        n += 1;
        if penalized(id) {
            pen_max = pen_max.max(scaled(id, l));
        } else if l > raw_max {
            raw_max = l;
        }
    });
    if n == 0 {
        return None;
    }
    // `max` ignores the NaN of an infinite temperature over no unpenalized token.
    let max = (raw_max as f64 / temp).max(pen_max);
    let (weights, ids) = (&mut scratch.weights, &mut scratch.ids);
    weights.clear();
    ids.clear();
    let (mut z, mut hi, mut lo) = (0.0f64, 0u64, u64::MAX);
    for_each_considered(logits, allowed, |id, l| {
        let w = (scaled(id, l) - max).exp();
        z += w; // in id order, as the exhaustive sampler sums
        let b = w.to_bits();
        hi = hi.max(b);
        lo = lo.min(b);
        weights.push(w);
        ids.push(id);
    });
    let span = hi - lo;
    let last_id = ids.last().copied().unwrap_or(0);
    Some(Weighed {
        n,
        z,
        top_bits: hi,
        span,
        shift: bit_len(span).saturating_sub(BUCKET_BITS),
        id_bits: bit_len(u64::from(last_id)).max(1),
    })
}

/// Number of bits of `x` (0 for 0).
fn bit_len(x: u64) -> u32 {
    64 - x.leading_zeros()
}

/// Which tokens to rank: those whose key is at most `limit`; no key of theirs exceeds
/// `top_key` (it bounds the key bits to sort).
#[derive(Debug, Clone, Copy)]
struct Prefix {
    limit: u64,
    top_key: u64,
}

impl Prefix {
    /// Every token.
    fn all(w: &Weighed) -> Prefix {
        Prefix {
            limit: w.span,
            top_key: w.span,
        }
    }
}

/// The tokens of the leading histogram buckets up to the first whose running approximate mass
/// passes `target` (all tokens when none does, or `target` is not a number).
fn chosen_buckets(w: &Weighed, weights: &[f64], target: f64) -> Prefix {
    let mut mass = [0.0f64; 1 << BUCKET_BITS];
    let mut top = [0u64; 1 << BUCKET_BITS];
    for &x in weights {
        let key = w.top_bits - x.to_bits();
        let b = (key >> w.shift) as usize;
        mass[b] += x;
        top[b] = top[b].max(key);
    }
    let goal = target * (1.0 + MARGIN);
    let mut acc = 0.0;
    for (b, &m) in mass.iter().enumerate() {
        acc += m;
        // The first bucket passing the goal adds mass, so it holds a token: `top[b]` is the
        // largest key ranked.
        if acc >= goal && b + 1 < mass.len() {
            return Prefix {
                limit: (((b as u64) + 1) << w.shift) - 1,
                top_key: top[b],
            };
        }
    }
    Prefix::all(w)
}

/// Ranks the tokens of `prefix` (a prefix of the exhaustive ranking) into `scratch.narrow` or
/// `scratch.wide`; returns how many there are and whether they are wide.
fn rank(w: &Weighed, prefix: Prefix, scratch: &mut Scratch) -> (usize, bool) {
    let key_bits = bit_len(prefix.top_key);
    let keep = |x: f64| (w.top_bits - x.to_bits()) <= prefix.limit;
    let Scratch {
        weights,
        ids,
        narrow,
        narrow_tmp,
        wide,
        wide_tmp,
        ..
    } = scratch;
    if key_bits + w.id_bits <= 64 {
        narrow.clear();
        for (&x, &id) in weights.iter().zip(ids.iter()) {
            if keep(x) {
                narrow.push(((w.top_bits - x.to_bits()) << w.id_bits) | u64::from(id));
            }
        }
        wide.clear();
        sort_packed(narrow, narrow_tmp, w.id_bits, key_bits);
        (narrow.len(), false)
    } else {
        wide.clear();
        for (&x, &id) in weights.iter().zip(ids.iter()) {
            if keep(x) {
                wide.push((u128::from(w.top_bits - x.to_bits()) << 32) | u128::from(id));
            }
        }
        narrow.clear();
        sort_packed(wide, wide_tmp, 32, key_bits);
        (wide.len(), true)
    }
}

/// The exhaustive sampler's search over the ranked prefix: the first running sum reaching
/// the top-p cut, then the draw inside it (at `top_p ≥ 1`, the first exceeding `u·z`).
/// `None` when the condition is not met inside a prefix shorter than all tokens.
fn search(
    w: &Weighed,
    cut_all: bool,
    top_p: f64,
    u: f64,
    (ranked, wide): (usize, bool),
    scratch: &mut Scratch,
) -> Option<u32> {
    let at = Ranked {
        narrow: &scratch.narrow,
        wide: wide.then_some(&scratch.wide[..]),
        top_bits: w.top_bits,
        id_bits: w.id_bits,
    };
    let cum = &mut scratch.cum;
    cum.clear();
    let mut acc = 0.0f64;
    let mut cut = None;
    for i in 0..ranked {
        acc += at.weight(i);
        cum.push(acc);
        if cut_all {
            if acc > u * w.z {
                return Some(at.id(i));
            }
        } else if acc >= top_p * w.z {
            cut = Some(i);
            break;
        }
    }
    let (kept, mass) = match cut {
        Some(c) => (c + 1, cum[c]),
        None if ranked < w.n => return None,
        // Rounding left the cut (or the draw) just past the end: keep everything.
        None => (ranked, cum[ranked - 1]),
    };
    let r = u * mass;
    let i = cum[..kept].iter().position(|&c| c > r).unwrap_or(kept - 1);
    Some(at.id(i))
}

/// Reads the ranked tokens back from whichever packing [`rank`] used.
struct Ranked<'a> {
    narrow: &'a [u64],
    /// The wide packing, when `rank` used it.
    wide: Option<&'a [u128]>,
    top_bits: u64,
    id_bits: u32,
}

impl Ranked<'_> {
    #[inline(always)]
    fn key(&self, i: usize) -> u64 {
        match self.wide {
            None => self.narrow[i] >> self.id_bits,
            Some(wide) => (wide[i] >> 32) as u64,
        }
    }

    #[inline(always)]
    fn weight(&self, i: usize) -> f64 {
        f64::from_bits(self.top_bits - self.key(i))
    }

    #[inline(always)]
    fn id(&self, i: usize) -> u32 {
        match self.wide {
            None => (self.narrow[i] & ((1u64 << self.id_bits) - 1)) as u32,
            Some(wide) => wide[i] as u32,
        }
    }
}

/// A key and id packed in one unsigned integer, the id in the low bits: ordering the integers
/// orders by key, then id.
trait Packed: Copy + Default + Ord {
    /// The bits from bit `shift` up, as far as 64 of them.
    fn bits_from(self, shift: u32) -> u64;
}

impl Packed for u64 {
    #[inline(always)]
    fn bits_from(self, shift: u32) -> u64 {
        self >> shift
    }
}

impl Packed for u128 {
    #[inline(always)]
    fn bits_from(self, shift: u32) -> u64 {
        (self >> shift) as u64
    }
}

/// Sorts packed tokens (ids ascending on entry, keys in bits `low..low + bits`) by key, then
/// id. The top [`TOP_BITS`] of the key are radix sorted (two passes), which leaves few tokens
/// sharing them when keys are spread; each run of tokens that share them is then sorted
/// whole: by insertion when short, else by radix sorting the remaining bits (stable, so ids
/// stay ascending). Either way no key bit is sorted by more than one pass.
fn sort_packed<T: Packed>(v: &mut [T], tmp: &mut Vec<T>, low: u32, bits: u32) {
    let n = v.len();
    if n <= SHORT_RUN {
        v.sort_unstable();
        return;
    }
    tmp.clear();
    tmp.resize(n, T::default());
    let top = bits.min(TOP_BITS);
    let rest = bits - top;
    radix_sort(v, tmp, low + rest, top);
    if rest == 0 {
        return;
    }
    let mut a = 0;
    while a < n {
        let head = v[a].bits_from(low + rest);
        let mut b = a + 1;
        while b < n && v[b].bits_from(low + rest) == head {
            b += 1;
        }
        if b - a > SHORT_RUN {
            radix_sort(&mut v[a..b], &mut tmp[a..b], low, rest);
        } else if b - a > 1 {
            insertion_sort(&mut v[a..b]);
        }
        a = b;
    }
}

fn insertion_sort<T: Packed>(v: &mut [T]) {
    for i in 1..v.len() {
        let x = v[i];
        let mut j = i;
        while j > 0 && v[j - 1] > x {
            v[j] = v[j - 1];
            j -= 1;
        }
        v[j] = x;
    }
}

/// Stable LSD radix sort of `v` by bits `low..low + bits`, in passes of at most
/// [`DIGIT_BITS`]; `tmp` is scratch of the same length.
fn radix_sort<T: Packed>(v: &mut [T], tmp: &mut [T], low: u32, bits: u32) {
    let n = v.len();
    if n < 2 || bits == 0 {
        return;
    }
    let passes = bits.div_ceil(DIGIT_BITS);
    let width = bits.div_ceil(passes);
    let mask = (1u64 << width) - 1;
    let digit = |x: T, p: u32| (x.bits_from(low + p * width) & mask) as usize;
    // Every pass's counts in one read of the input.
    let mut counts = vec![[0u32; 1 << DIGIT_BITS]; passes as usize];
    for &x in v.iter() {
        for (p, c) in counts.iter_mut().enumerate() {
            c[digit(x, p as u32)] += 1;
        }
    }
    let (mut src, mut dst) = (v, tmp);
    let mut moved = false;
    for (p, c) in counts.iter_mut().enumerate() {
        // A digit every element shares moves nothing.
        if c[digit(src[0], p as u32)] as usize == n {
            continue;
        }
        let mut at = 0u32;
        for slot in c.iter_mut() {
            let k = *slot;
            *slot = at;
            at += k;
        }
        for &x in src.iter() {
            let d = digit(x, p as u32);
            dst[c[d] as usize] = x;
            c[d] += 1;
        }
        std::mem::swap(&mut src, &mut dst);
        moved = !moved;
    }
    if moved {
        // The sorted elements are in `tmp`; `dst` is the caller's `v`.
        dst.copy_from_slice(src);
    }
}

#[cfg(test)]
#[path = "radix_tests.rs"]
mod tests;
