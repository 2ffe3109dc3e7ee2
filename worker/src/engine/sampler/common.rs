//! What the samplers build on: a candidate's sampling settings, the tokens it has seen (for
//! the repetition penalty), the scratch buffers a step reuses, the tokens a draw considers, and
//! the order every draw ranks tokens in (weight descending, ties by id) with its partially
//! sorted prefix.

use std::cmp::Ordering;

use crate::constraint::AllowedTokens;

/// One candidate's sampling settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub repetition_penalty: f32,
}

/// Tokens seen in a candidate's context (for the repetition penalty).
#[derive(Debug, Clone)]
pub struct SeenTokens {
    bits: Vec<u64>,
}

impl SeenTokens {
    pub fn new(vocab: usize) -> Self {
        SeenTokens {
            bits: vec![0; vocab.div_ceil(64)],
        }
    }

    pub fn insert(&mut self, id: u32) {
        let i = id as usize;
        if let Some(w) = self.bits.get_mut(i / 64) {
            *w |= 1 << (i % 64);
        }
    }

    pub fn contains(&self, id: u32) -> bool {
        let i = id as usize;
        self.bits
            .get(i / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
}

/// Reusable buffers (one per engine), so a step allocates nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    pub(super) cand: Vec<(f64, u32)>,
    pub(super) cum: Vec<f64>,
    /// The radix path's weights and ids, in id order.
    pub(super) weights: Vec<f64>,
    pub(super) ids: Vec<u32>,
    /// The radix path's keys with ids packed below them, and its sorting buffer.
    pub(super) narrow: Vec<u64>,
    pub(super) narrow_tmp: Vec<u64>,
    /// The same, when key and id do not fit in 64 bits.
    pub(super) wide: Vec<u128>,
    pub(super) wide_tmp: Vec<u128>,
}

/// First size of the partially sorted prefix; doubled until the top-p cut (or the draw) lies in it.
pub(super) const FIRST_PREFIX: usize = 64;

/// Desc by weight, then asc by id: a total order, so selection and sorting are deterministic.
pub(super) fn by_weight_then_id(a: &(f64, u32), b: &(f64, u32)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

/// Puts the `k` heaviest candidates first, in [`by_weight_then_id`] order, and their running
/// sums of weight into `cum` (the top-p cut is searched there).
pub(super) fn sorted_prefix(cand: &mut [(f64, u32)], k: usize, cum: &mut Vec<f64>) {
    if k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_weight_then_id);
    }
    cand[..k].sort_unstable_by(by_weight_then_id);
    cum.clear();
    let mut acc = 0.0;
    for c in &cand[..k] {
        acc += c.0;
        cum.push(acc);
    }
}

/// Calls `f(id, logit)` for every token the exhaustive sampler weighs (finite logit, allowed),
/// in id order; a mask is read a word (32 tokens) at a time, so a narrow mask costs little.
#[inline(always)]
pub(super) fn for_each_considered(
    logits: &[f32],
    allowed: Option<&AllowedTokens>,
    mut f: impl FnMut(u32, f32),
) {
    let Some(a) = allowed else {
        for (id, &l) in logits.iter().enumerate() {
            if l.is_finite() {
                f(id as u32, l);
            }
        }
        return;
    };
    for (wi, &word) in a.words().iter().enumerate() {
        let mut w = word;
        while w != 0 {
            let id = wi * 32 + w.trailing_zeros() as usize;
            w &= w - 1;
            match logits.get(id) {
                Some(&l) if l.is_finite() && id < a.len() => f(id as u32, l),
                _ => {}
            }
        }
    }
}
