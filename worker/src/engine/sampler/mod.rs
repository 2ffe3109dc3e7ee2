//! Choosing the next token from one row of logits, deterministically.
//!
//! The order is fixed and part of every result's identity: repetition penalty (HF style: over
//! the prompt and the tokens generated so far, positive logits divided, negative multiplied) →
//! temperature (0 = greedy: highest logit, ties to the lowest id) → constraint mask → softmax in
//! f64 → order by probability descending, ties by token id → top-p cut (the smallest prefix whose
//! mass reaches `top_p`) → inverse CDF with the caller's uniform draw `u`.
//!
//! The uniform draw is `stageb_shared::seed::uniform_at(candidate seed, step)`, passed in by the
//! engine, so a token depends only on the candidate and the step, never on other rows.
//!
//! Three routes give the same token. [`sample_exhaustive`] is the sampler of record: partial
//! selection (top 64, doubling while the cut is not reached) instead of sorting the whole
//! vocabulary; since the comparator is a total order the result is exactly that of a full
//! sort. [`sample`] first tries the [`prefilter`] (peaked logits: only the tokens near the
//! maximum are weighed, and only when few are), then the [`radix`] path, which ranks the
//! tokens by a radix sort at a cost that does not depend on the logits' shape (flat logits,
//! where the doubling selection ends up sorting the whole vocabulary by comparisons).

mod common;
pub mod prefilter;
pub mod radix;

use crate::constraint::AllowedTokens;
use common::{FIRST_PREFIX, sorted_prefix};
pub use common::{SamplingParams, Scratch, SeenTokens};

/// Share of the vocabulary the prefilter may weigh: past `1/PREFILTER_SHARE` of the tokens
/// near the maximum, the radix path is the cheaper one (`examples/bench_sampler.rs`).
const PREFILTER_SHARE: usize = 4;

/// Picks the next token, or `None` when the mask leaves no token with a finite logit.
///
/// The same token as [`sample_exhaustive`] always: the prefilter answers when few tokens are
/// near the maximum and it can prove the exhaustive answer from them (see [`prefilter`]); the
/// radix path answers otherwise (see [`radix`]), and greedy decoding is the exhaustive
/// sampler's one pass.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    seen: Option<&SeenTokens>,
    allowed: Option<&AllowedTokens>,
    u: f64,
    scratch: &mut Scratch,
) -> Option<u32> {
    if !radix::handles(params) {
        return sample_exhaustive(logits, params, seen, allowed, u, scratch);
    }
    let most = (logits.len() / PREFILTER_SHARE).max(FIRST_PREFIX);
    prefilter::sample_within(logits, params, seen, allowed, u, most, scratch)
        .or_else(|| radix::sample(logits, params, seen, allowed, u, scratch))
}

/// The sampler of record: every allowed token's weight, summed over the whole vocabulary.
/// [`sample`] gives the same tokens faster.
pub fn sample_exhaustive(
    logits: &[f32],
    params: &SamplingParams,
    seen: Option<&SeenTokens>,
    allowed: Option<&AllowedTokens>,
    u: f64,
    scratch: &mut Scratch,
) -> Option<u32> {
    let penalty = params.repetition_penalty as f64;
    let greedy = params.temperature <= 0.0;
    let temp = params.temperature as f64;
    let cand = &mut scratch.cand;
    cand.clear();
    for (id, &l) in logits.iter().enumerate() {
        let id = id as u32;
        if let Some(a) = allowed
            && !a.is_allowed(id)
        {
            continue;
        }
        let mut l = l as f64;
        if !l.is_finite() {
            // -inf (or NaN from a broken model) can never be chosen.
            continue;
        }
        if penalty != 1.0
            && let Some(s) = seen
            && s.contains(id)
        {
            l = if l > 0.0 { l / penalty } else { l * penalty };
        }
        if !greedy {
            l /= temp;
        }
        cand.push((l, id));
    }
    if cand.is_empty() {
        return None;
    }
    if greedy {
        // Strictly greater keeps the lowest id among equal maxima (ids ascend in `cand`).
        let mut best = cand[0];
        for &c in cand.iter().skip(1) {
            if c.0 > best.0 {
                best = c;
            }
        }
        return Some(best.1);
    }
    let max = cand.iter().fold(f64::NEG_INFINITY, |m, c| m.max(c.0));
    let mut z = 0.0f64;
    for c in cand.iter_mut() {
        c.0 = (c.0 - max).exp();
        z += c.0; // summed in id order: deterministic
    }
    let n = cand.len();
    let top_p = params.top_p as f64;
    let cut_all = top_p >= 1.0;
    let mut k = FIRST_PREFIX.min(n);
    loop {
        sorted_prefix(cand, k, &mut scratch.cum);
        let cum = &scratch.cum;
        let pick = |kept: usize, mass: f64, cum: &[f64]| -> u32 {
            let r = u * mass;
            let i = cum[..kept].iter().position(|&c| c > r).unwrap_or(kept - 1);
            cand[i].1
        };
        if !cut_all {
            if let Some(c) = cum.iter().position(|&c| c >= top_p * z) {
                return Some(pick(c + 1, cum[c], cum));
            }
        } else if let Some(i) = cum.iter().position(|&c| c > u * z) {
            return Some(cand[i].1);
        }
        if k == n {
            // Rounding left the cut (or the draw) just past the end: keep everything.
            return Some(pick(n, cum[n - 1], cum));
        }
        k = (k * 2).min(n);
    }
}

#[cfg(test)]
mod tests {
    use super::common::by_weight_then_id;
    use super::*;

    fn params(t: f32, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_p: p,
            repetition_penalty: 1.0,
        }
    }

    /// Reference: full sort, same order and arithmetic.
    fn full_sort(logits: &[f32], t: f32, p: f64, u: f64) -> u32 {
        let max = logits
            .iter()
            .fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64 / t as f64));
        let mut c: Vec<(f64, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| ((l as f64 / t as f64 - max).exp(), i as u32))
            .collect();
        let z: f64 = c.iter().map(|x| x.0).sum();
        c.sort_by(by_weight_then_id);
        let mut acc = 0.0;
        let mut cums = vec![];
        for x in &c {
            acc += x.0;
            cums.push(acc);
        }
        let kept = if p >= 1.0 {
            c.len()
        } else {
            cums.iter()
                .position(|&x| x >= p * z)
                .map_or(c.len(), |i| i + 1)
        };
        let mass = if p >= 1.0 { z } else { cums[kept - 1] };
        let i = cums[..kept]
            .iter()
            .position(|&x| x > u * mass)
            .unwrap_or(kept - 1);
        c[i].1
    }

    #[test]
    fn greedy_takes_max_and_lowest_id_on_ties() {
        let mut s = Scratch::default();
        let l = [0.0, 3.0, 1.0, 3.0];
        assert_eq!(
            sample(&l, &params(0.0, 0.9), None, None, 0.99, &mut s),
            Some(1)
        );
    }

    #[test]
    fn mask_excludes_tokens_and_empty_mask_is_none() {
        let mut s = Scratch::default();
        let l = [5.0, 1.0, 0.5];
        let mut a = AllowedTokens::none(3);
        a.allow(2);
        assert_eq!(
            sample(&l, &params(0.7, 0.9), None, Some(&a), 0.3, &mut s),
            Some(2)
        );
        let none = AllowedTokens::none(3);
        assert_eq!(
            sample(&l, &params(0.7, 0.9), None, Some(&none), 0.3, &mut s),
            None
        );
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Scratch::default();
        let l = [2.0, 1.9];
        let mut seen = SeenTokens::new(2);
        seen.insert(0);
        let p = SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            repetition_penalty: 1.1,
        };
        assert_eq!(sample(&l, &p, Some(&seen), None, 0.0, &mut s), Some(1));
    }

    #[test]
    fn partial_selection_matches_full_sort() {
        let mut s = Scratch::default();
        // A wide, deterministic pseudo-random vocabulary with ties.
        let logits: Vec<f32> = (0..5000u64)
            .map(|i| ((stageb_shared::seed::splitmix64(i) % 2000) as f32) / 200.0)
            .collect();
        for (t, p) in [
            (0.7f32, 0.9f32),
            (1.0, 1.0),
            (0.3, 0.5),
            (2.0, 0.99),
            (1.5, 0.0),
        ] {
            for step in 0..40 {
                let u = stageb_shared::seed::uniform_at(7, step);
                let got = sample(&logits, &params(t, p), None, None, u, &mut s);
                assert_eq!(
                    got,
                    Some(full_sort(&logits, t, p as f64, u)),
                    "t={t} p={p} step={step}"
                );
            }
        }
    }
}
