//! A faster route to exactly the token [`sampler::sample_exhaustive`](super::sample_exhaustive)
//! draws: only the tokens near the maximum get an `exp`, a sort position and a place in the
//! cumulative sums; the rest are only counted, and the answer is given only when those counts
//! prove it.
//!
//! # Why the answer is the exhaustive one
//! The exhaustive sampler (temperature `T > 0`) gives every allowed finite token the weight
//! `x = exp(s − max)` (`s` its penalized logit over `T`, in f64), sums all weights in id order
//! into `z`, sorts by weight (ties by id), and takes the first sorted position `c` whose
//! cumulative sum `cum[c]` reaches `top_p·z` (for `top_p = 1`: the first exceeding `u·z`),
//! then draws with `u·cum[c]` inside `cum[..=c]`. Here:
//! 1. `max` is the same number: division by `T` is monotone, so the largest unpenalized
//!    `s` is the largest raw logit over `T`; penalized tokens are computed one by one.
//! 2. *Candidates* are the tokens estimated less than [`WINDOW`] below `max`; their weights are
//!    computed by the very same expressions, so each equals the exhaustive weight bit for bit.
//!    Every other token is only counted, in a bucket of its estimated distance below `max`
//!    (1/64 wide); the estimate is off by far less than [`SLACK`] (f64 rounding on magnitudes
//!    capped by [`MAX_MAGNITUDE`]), so a bucket's tokens weigh between known bounds, and the
//!    whole tail between `T_lo` and `T_hi`.
//! 3. `z` lies in `[(h+T_lo)·(1−δ), (h+T_hi)·(1+δ)]`, `h` the candidates' own sum: floating-point
//!    summation of `n` positive terms is within `γ_n ≈ n·2⁻⁵³` of the real sum, whatever the
//!    order, and `δ = 4n·2⁻⁵³ + 16·2⁻⁵³` covers both sums and the bound's own roundings.
//!    Multiplication by `top_p` (or `u`) rounds monotonically, so the exhaustive threshold
//!    lies between the thresholds computed from those two ends.
//! 4. The candidates sorted the same way give the exhaustive sorted prefix as long as its
//!    weights exceed every tail token's bound (checked at the chosen position), and with it
//!    the same cumulative sums. If the first position reaching the low threshold is also the
//!    first reaching the high one, it is the exhaustive `c`, and the draw is the same.
//!
//! Whenever a step cannot be proven (the thresholds straddle a cumulative sum, the cut or
//! draw falls past the candidates, logits beyond [`MAX_MAGNITUDE`], greedy decoding) the
//! prefilter answers `None` and the caller runs the exhaustive sampler.

use std::sync::OnceLock;

use super::common::{
    FIRST_PREFIX, SamplingParams, Scratch, SeenTokens, for_each_considered, sorted_prefix,
};
use crate::constraint::AllowedTokens;

/// Distance below the maximum (in logit / temperature units) within which tokens are
/// candidates: on SmolLM2's logits a few dozen tokens at temperature 0.3, a few thousand at 1.
const WINDOW: f64 = 16.0;

/// Tail buckets per unit of distance: a bucket's tokens weigh within a factor `e^{1/64}` of
/// each other, so the tail's mass is known within ~1.6% (coarser buckets left the top-p cut
/// undecided too often at temperature 1).
const PER_UNIT: f64 = 64.0;

/// Distance from which tail tokens are only counted together: each weighs at most `e^{−40}`,
/// 49,152 of them less than `10^{-12}` of the maximum's weight. (A single counter also keeps
/// the bulk of the vocabulary off the bucket array's store-to-load chain.)
const FAR: f64 = 40.0;

/// Tail buckets, for distances below [`FAR`].
const BUCKETS: usize = FAR as usize * PER_UNIT as usize;

/// Slack on every distance: far above the f64 rounding of the estimate (~1e-9 at
/// [`MAX_MAGNITUDE`]) and of `exp` (a few ulps).
const SLACK: f64 = 1e-6;

/// Largest `|max|` the rounding argument is made for (real logits are a few dozen).
const MAX_MAGNITUDE: f64 = 1e6;

/// Finite and within [`MAX_MAGNITUDE`] (false for NaN and the infinities).
fn within_magnitude(x: f64) -> bool {
    x.abs() <= MAX_MAGNITUDE
}

/// `(lower, upper)` weight bounds of a token in each tail bucket.
fn bucket_bounds() -> &'static [(f64, f64)] {
    static TABLE: OnceLock<Vec<(f64, f64)>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..BUCKETS)
            .map(|b| {
                let near = b as f64 / PER_UNIT - SLACK;
                let far = (b + 1) as f64 / PER_UNIT + SLACK;
                ((-far).exp(), (-near).exp())
            })
            .collect()
    })
}

/// Bounds on the mass of the tokens left out of the candidates.
struct Tail {
    counts: [u32; BUCKETS],
    /// Tokens at least [`FAR`] below the maximum.
    far: u32,
}

impl Tail {
    fn new() -> Self {
        Tail {
            counts: [0; BUCKETS],
            far: 0,
        }
    }

    /// A token estimated `d` below the maximum, `WINDOW ≤ d < FAR`.
    #[inline(always)]
    fn add(&mut self, d: f64) {
        self.counts[((d * PER_UNIT) as usize).min(BUCKETS - 1)] += 1;
    }

    /// `(lower mass, upper mass, largest weight)` of the tail.
    fn bounds(&self) -> (f64, f64, f64) {
        let (mut lo, mut top) = (0.0, 0.0);
        let mut hi = if self.far > 0 {
            top = (-(FAR - SLACK)).exp();
            self.far as f64 * top
        } else {
            0.0
        };
        for (&c, &(l, h)) in self.counts.iter().zip(bucket_bounds()).rev() {
            if c > 0 {
                lo += c as f64 * l;
                hi += c as f64 * h;
                top = h;
            }
        }
        (lo, hi, top)
    }
}

/// The token [`sampler::sample_exhaustive`](super::sample_exhaustive) would draw, or `None`
/// when this cannot be proven from the tokens near the maximum (the caller then runs the
/// exhaustive sampler).
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    seen: Option<&SeenTokens>,
    allowed: Option<&AllowedTokens>,
    u: f64,
    scratch: &mut Scratch,
) -> Option<u32> {
    sample_within(logits, params, seen, allowed, u, usize::MAX, scratch)
}

/// [`sample`], giving up (`None`) as soon as more than `most` tokens lie in the window: with
/// that many the exact ranking of the radix path is cheaper than proving a cut.
pub(super) fn sample_within(
    logits: &[f32],
    params: &SamplingParams,
    seen: Option<&SeenTokens>,
    allowed: Option<&AllowedTokens>,
    u: f64,
    most: usize,
    scratch: &mut Scratch,
) -> Option<u32> {
    // Greedy is already one pass; a draw outside [0, 1) is left to the sampler of record.
    if params.temperature <= 0.0 || !(0.0..1.0).contains(&u) {
        return None;
    }
    let mut tail = Tail::new();
    let (max, n) = collect(logits, params, seen, allowed, most, &mut tail, scratch)?;
    let (tail_lo, tail_hi, tail_top) = tail.bounds();
    let cand = &mut scratch.cand;
    let mut h = 0.0f64;
    for c in cand.iter_mut() {
        c.0 = (c.0 - max).exp();
        h += c.0;
    }
    let ulp = f64::EPSILON / 2.0;
    let delta = 4.0 * n as f64 * ulp + 16.0 * ulp;
    let (z_lo, z_hi) = ((h + tail_lo) * (1.0 - delta), (h + tail_hi) * (1.0 + delta));
    let top_p = params.top_p as f64;
    let cut_all = top_p >= 1.0;
    let (lo, hi) = if cut_all {
        (u * z_lo, u * z_hi)
    } else {
        (top_p * z_lo, top_p * z_hi)
    };
    let reaches = |c: f64, t: f64| if cut_all { c > t } else { c >= t };

    let m = cand.len();
    let mut k = FIRST_PREFIX.min(m);
    while k > 0 {
        sorted_prefix(cand, k, &mut scratch.cum);
        let cum = &scratch.cum;
        if let Some(c) = cum.iter().position(|&x| reaches(x, hi)) {
            let first_lo = cum.iter().position(|&x| reaches(x, lo));
            // Undecided between two positions, or a tail token could sort before `c`.
            if first_lo != Some(c) || cand[c].0 <= tail_top {
                return None;
            }
            if cut_all {
                return Some(cand[c].1);
            }
            let r = u * cum[c];
            let i = cum[..=c].iter().position(|&x| x > r).unwrap_or(c);
            return Some(cand[i].1);
        }
        if k == m {
            return None;
        }
        k = (k * 2).min(m);
    }
    None
}

/// The exhaustive sampler's `max`, and the number of tokens it weighs; the candidates (their
/// scaled logits, in id order) into `scratch.cand`, every other token into `tail`. `None` when
/// no token counts, the logits are beyond [`MAX_MAGNITUDE`], or more than `most` tokens are
/// candidates.
fn collect(
    logits: &[f32],
    params: &SamplingParams,
    seen: Option<&SeenTokens>,
    allowed: Option<&AllowedTokens>,
    most: usize,
    tail: &mut Tail,
    scratch: &mut Scratch,
) -> Option<(f64, usize)> {
    let temp = params.temperature as f64;
    let penalty = params.repetition_penalty as f64;
    let seen = seen.filter(|_| penalty != 1.0);
    let cand = &mut scratch.cand;
    cand.clear();
    if seen.is_none() && allowed.is_none() {
        // The common unconstrained, unpenalized row: two plain passes.
        let raw_max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| {
            if l.is_finite() && l > m { l } else { m }
        });
        let max = raw_max as f64 / temp;
        if !within_magnitude(max) {
            return None;
        }
        let (inv_t, mut n, mut far) = (1.0 / temp, 0, 0);
        for (id, &l) in logits.iter().enumerate() {
            if l.is_finite() {
                n += 1;
                let d = max - l as f64 * inv_t;
                if d >= FAR {
                    far += 1;
                } else if d >= WINDOW {
                    tail.add(d);
                } else {
                    if cand.len() == most {
                        return None;
                    }
                    cand.push((l as f64 / temp, id as u32));
                }
            }
        }
        tail.far = far;
        return Some((max, n));
    }
    let penalized = |id: u32| seen.is_some_and(|s| s.contains(id));
    // The exhaustive sampler's transform of a seen token, operation for operation.
    let scaled = |l: f32| {
        let l = l as f64;
        (if l > 0.0 { l / penalty } else { l * penalty }) / temp
    };
    // Division by `temp` is monotone: the largest unpenalized weight is the largest raw logit's.
    let (mut raw_max, mut pen_max, mut n) = (f32::NEG_INFINITY, f64::NEG_INFINITY, 0usize);
    for_each_considered(logits, allowed, |id, l| {
        n += 1;
        if penalized(id) {
            pen_max = pen_max.max(scaled(l));
        } else if l > raw_max {
            raw_max = l;
        }
    });
    let max = (raw_max as f64 / temp).max(pen_max);
    if n == 0 || !within_magnitude(max) {
        return None;
    }
    let (inv_t, mut far, mut over) = (1.0 / temp, 0, false);
    for_each_considered(logits, allowed, |id, l| {
        let s = penalized(id).then(|| scaled(l));
        let d = max - s.unwrap_or(l as f64 * inv_t);
        if d >= FAR {
            far += 1;
        } else if d >= WINDOW {
            tail.add(d);
        } else if cand.len() < most {
            cand.push((s.unwrap_or(l as f64 / temp), id));
        } else {
            over = true;
        }
    });
    tail.far = far;
    (!over).then_some((max, n))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use stageb_shared::seed::{splitmix64, uniform_at};

    use super::super::sample_exhaustive;
    use super::*;

    fn params(temperature: f32, top_p: f32, repetition_penalty: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            repetition_penalty,
        }
    }

    /// Logits shaped like a language model's: a bulk spread `spread` wide, a few tokens far
    /// above it, some exact ties; deterministic in `seed`.
    fn model_like(vocab: usize, spread: f32, seed: u64) -> Vec<f32> {
        (0..vocab as u64)
            .map(|i| {
                let r = splitmix64(seed ^ i.wrapping_mul(0x9E37_79B9));
                let bulk = ((r % 10_000) as f32 / 10_000.0 - 0.5) * spread;
                match r % 997 {
                    0 => bulk + 3.0 * spread,
                    1 => (bulk * 4.0).round() / 4.0,
                    _ => bulk,
                }
            })
            .collect()
    }

    /// Every answer the prefilter gives is the exhaustive sampler's, and `sample` always is.
    fn same_draw(
        logits: &[f32],
        p: &SamplingParams,
        seen: Option<&SeenTokens>,
        allowed: Option<&AllowedTokens>,
        u: f64,
    ) -> bool {
        let mut s = Scratch::default();
        let want = sample_exhaustive(logits, p, seen, allowed, u, &mut s);
        let fast = sample(logits, p, seen, allowed, u, &mut s);
        let combined = super::super::sample(logits, p, seen, allowed, u, &mut s);
        assert_eq!(combined, want, "sampler::sample");
        if let Some(t) = fast {
            assert_eq!(Some(t), want, "prefilter");
        }
        fast.is_some()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn the_prefilter_draws_exactly_what_the_exhaustive_sampler_draws(
            vocab in 1usize..3000,
            spread in 0.0f32..60.0,
            seed: u64,
            temperature in 0.01f32..3.0,
            top_p in prop_oneof![Just(1.0f32), Just(0.9f32), 0.01f32..1.0],
            penalty in prop_oneof![Just(1.0f32), 0.5f32..2.0],
            seen_every in 1u64..50,
            mask_every in prop_oneof![Just(0u64), 1u64..5, Just(1000u64)],
            specials in 0usize..4,
            step in 0u64..1_000_000,
        ) {
            let mut logits = model_like(vocab, spread, seed);
            // Non-finite logits are never drawn; the prefilter must skip them the same way.
            for k in 0..specials.min(vocab) {
                logits[(splitmix64(seed + k as u64) as usize) % vocab] =
                    [f32::NEG_INFINITY, f32::NAN, f32::INFINITY][k % 3];
            }
            let mut seen = SeenTokens::new(vocab);
            for id in (0..vocab as u64).filter(|i| splitmix64(seed ^ i).is_multiple_of(seen_every)) {
                seen.insert(id as u32);
            }
            let allowed = (mask_every > 0).then(|| {
                let mut a = AllowedTokens::none(vocab);
                for id in (0..vocab as u64).filter(|i| splitmix64(i ^ !seed).is_multiple_of(mask_every)) {
                    a.allow(id as u32);
                }
                a
            });
            let p = params(temperature, top_p, penalty);
            same_draw(&logits, &p, Some(&seen), allowed.as_ref(), uniform_at(seed, step));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Tens of thousands of tokens just past the window carry a mass that moves the top-p
        /// cut: the prefilter must account for it (or decline), never ignore it.
        #[test]
        fn a_heavy_tail_just_past_the_window_is_accounted_for(
            // Below the maximum, steps of a size the tail's mass (up to ~0.5%) can shift.
            head in prop::collection::vec(2.0f64..9.0, 1..40),
            tail in 10_000usize..50_000,
            tail_at in WINDOW..WINDOW + 2.0,
            temperature in 0.2f32..1.5,
            top_p in prop_oneof![Just(1.0f32), 0.9f32..1.0],
            u in 0.0f64..1.0,
        ) {
            let t = temperature as f64;
            // The maximum at 0, so the tail sits `tail_at` below it.
            let head: Vec<f64> = std::iter::once(0.0).chain(head).collect();
            let mut logits = vec![(-tail_at * t) as f32; tail + head.len()];
            for (i, d) in head.iter().enumerate() {
                logits[i * (tail / head.len())] = (-d * t) as f32;
            }
            same_draw(&logits, &params(temperature, top_p, 1.0), None, None, u);
        }
    }

    #[test]
    fn on_a_full_vocabulary_the_prefilter_decides_nearly_every_draw() {
        // 49,152 tokens as SmolLM2's; the exhaustive sampler is the fallback, not the rule.
        let mut seen = SeenTokens::new(49_152);
        for id in (0..49_152).step_by(97) {
            seen.insert(id);
        }
        let mut decided = 0;
        let mut draws = 0;
        for (t, top_p, penalty) in [
            (0.3, 0.9, 1.05),
            (0.7, 0.9, 1.05),
            (0.7, 1.0, 1.0),
            (1.0, 0.95, 1.0),
        ] {
            for row in 0..4 {
                let logits = model_like(49_152, 24.0, row);
                for step in 0..25 {
                    let u = uniform_at(row, step);
                    decided += same_draw(&logits, &params(t, top_p, penalty), Some(&seen), None, u)
                        as usize;
                    draws += 1;
                }
            }
        }
        assert!(decided * 100 >= draws * 95, "{decided} of {draws} decided");
    }

    #[test]
    fn greedy_huge_logits_and_empty_masks_are_left_to_the_exhaustive_sampler() {
        let mut s = Scratch::default();
        let l = [1.0, 2.0, 3.0];
        assert_eq!(
            sample(&l, &params(0.0, 0.9, 1.0), None, None, 0.5, &mut s),
            None
        );
        let huge = [1e30, -1e30, 0.0];
        assert!(!same_draw(&huge, &params(1e-3, 0.9, 1.0), None, None, 0.5));
        let none = AllowedTokens::none(3);
        assert_eq!(
            sample(&l, &params(0.7, 0.9, 1.0), None, Some(&none), 0.5, &mut s),
            None
        );
        assert!(same_draw(
            &l,
            &params(0.7, 0.9, 1.0),
            None,
            None,
            0.999_999_9
        ));
    }
}
