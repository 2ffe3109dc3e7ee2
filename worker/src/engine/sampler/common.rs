//! What both samplers build on: a candidate's sampling settings, the tokens it has seen (for
//! the repetition penalty), the scratch buffers a step reuses, and the order every draw ranks
//! tokens in (weight descending, ties by id) with its partially sorted prefix.

use std::cmp::Ordering;

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
