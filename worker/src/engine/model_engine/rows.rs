//! One candidate row of a decode batch and how it advances: sampling a token under its
//! constraint (with the finishing mask of its last tokens), accepting it, forced-token
//! fast-forward, checking the draft tokens it was fed ([`super::draft`]) and guessing the
//! next, and its text. Split from `model_engine.rs`, whose fields it uses.
//!
//! The rows of a step are sampled in parallel ([`ModelEngine::sample_rows_of`]; in a running
//! batch every row of every job at once): a row's token
//! depends only on its own logits, seed and state, so the threads change no result. On a GPU the
//! host-side sampling is otherwise serial work that grows with the rows of a step (measured on
//! an H100, docs/PERFORMANCE.md: 8 rows of a flat 151,936-token distribution took ~120 ms of a
//! 156 ms step).

use rayon::prelude::*;
use stageb_shared::seed::uniform_at;

use super::ModelEngine;
use super::draft;
use super::{FINISH_LOOKAHEAD, FINISH_MARGIN};
use crate::constraint::{AllowedTokens, TokenConstraint};
use crate::engine::sampler::{self, SamplingParams, Scratch, SeenTokens};
use crate::engine::{EngineError, FinishReason};

/// One row of a lockstep decode batch.
pub(super) struct Row {
    pub(super) params: SamplingParams,
    pub(super) seed: u64,
    pub(super) max_new: usize,
    pub(super) constraint: Option<Box<dyn TokenConstraint>>,
    pub(super) seen: Option<SeenTokens>,
    pub(super) tokens: Vec<u32>,
    pub(super) finish: Option<FinishReason>,
    /// The constraint's allowed set for the next token, computed ahead by [`forced_run`]
    /// (`ModelEngine::forced_run`) and used by the next sampling step.
    pub(super) next_allowed: Option<AllowedTokens>,
    /// The draft tokens fed at the end of the row's last feed, not yet confirmed: the last
    /// forward call computed logits after each of them too.
    pub(super) drafts: Vec<u32>,
    /// The sampler's buffers, one set per row so rows sample in parallel.
    scratch: Scratch,
}

/// What one step's sampling did to a row: its feed for the next forward call (its sampled
/// token, its forced run, then its new draft tokens, [`Row::drafts`]), the tokens its forced
/// run took, and its positions to forget (drafts fed last step that it did not take).
#[derive(Debug, Default)]
pub(super) struct RowStep {
    pub(super) feed: Vec<u32>,
    pub(super) forced: u64,
    pub(super) rewind: usize,
    /// Draft tokens the row was fed last step (all of them, those after the first it
    /// rejected or after it ended included), and how many of them it took.
    pub(super) drafts_fed: u64,
    pub(super) taken: u64,
}

/// How a step samples its rows: forced runs fed at once, and up to `drafts` draft tokens
/// guessed per row.
#[derive(Debug, Clone, Copy)]
pub(super) struct Feeding {
    pub(super) fast_forward: bool,
    pub(super) drafts: usize,
}

impl Row {
    /// A row that has produced nothing yet.
    pub(super) fn new(
        params: SamplingParams,
        seed: u64,
        max_new: usize,
        constraint: Option<Box<dyn TokenConstraint>>,
    ) -> Row {
        Row {
            params,
            seed,
            max_new,
            constraint,
            seen: None,
            tokens: Vec::new(),
            finish: None,
            next_allowed: None,
            drafts: Vec::new(),
            scratch: Scratch::default(),
        }
    }
}

impl ModelEngine {
    /// One step's sampling for every unfinished row, in parallel: each row's [`RowStep`]
    /// (an empty feed for a row that is or just became finished). `logits[i]` are row `i`'s:
    /// after its last fed token, then after each of its drafts, `vocab` each. `prompt` is the
    /// job's (drafts are looked up in it). On failure the error of the first failing row (in
    /// row order) is returned, whichever thread met it first. Reads the engine only, so many
    /// jobs' rows can be sampled at once.
    pub(super) fn sample_rows_of(
        &self,
        rows: &mut [Row],
        logits: &[&[f32]],
        prompt: &[u32],
        feeding: Feeding,
    ) -> Result<Vec<RowStep>, EngineError> {
        let sample =
            |(row, logits): (&mut Row, &&[f32])| self.sample_one(row, logits, prompt, feeding);
        let live = rows.iter().filter(|r| r.finish.is_none()).count();
        let results: Vec<Result<RowStep, EngineError>> = if live > 1 {
            rows.par_iter_mut()
                .zip(logits.par_iter())
                .map(sample)
                .collect()
        } else {
            rows.iter_mut().zip(logits.iter()).map(sample).collect()
        };
        results.into_iter().collect()
    }

    /// One row's step: its fed drafts checked in order (each kept while the token sampled
    /// before it is the draft itself; the first token that differs is the row's new token,
    /// its drafts after it forgotten), then its feed for the next forward.
    fn sample_one(
        &self,
        row: &mut Row,
        logits: &[f32],
        prompt: &[u32],
        feeding: Feeding,
    ) -> Result<RowStep, EngineError> {
        let mut step = RowStep::default();
        let drafts = std::mem::take(&mut row.drafts);
        if row.finish.is_some() {
            return Ok(step);
        }
        let vocab = self.backend.config().vocab_size;
        let at = |i: usize| logits.get(i * vocab..(i + 1) * vocab).unwrap_or(&[]);
        let mut taken = 0;
        let next = loop {
            // A row that just finished needs no more forward passes.
            match self.step_row(row, at(taken))? {
                Some(tok) if row.finish.is_none() => {
                    if drafts.get(taken) != Some(&tok) {
                        break Some(tok);
                    }
                    taken += 1;
                }
                _ => break None,
            }
        };
        step.drafts_fed = drafts.len() as u64;
        step.taken = taken as u64;
        let Some(tok) = next else {
            return Ok(step);
        };
        step.rewind = drafts.len() - taken;
        step.feed.push(tok);
        if feeding.fast_forward {
            self.forced_run(row, &mut step.feed, &mut step.forced)?;
        }
        if feeding.drafts > 0 && row.finish.is_none() {
            // A draft's logits give the token after it: the last useful one gives the row's
            // `max_new`-th token.
            let room = row.max_new.saturating_sub(row.tokens.len() + 1);
            let mut guesses = drafts;
            draft::propose(prompt, &row.tokens, feeding.drafts.min(room), &mut guesses);
            step.feed.extend_from_slice(&guesses);
            row.drafts = guesses;
        }
        Ok(step)
    }

    /// Samples one token for `row` and advances its state. `None` when the row ended without
    /// producing a token. The draw is `uniform_at(seed, token index)`.
    fn step_row(&self, row: &mut Row, logits: &[f32]) -> Result<Option<u32>, EngineError> {
        let step = row.tokens.len() as u64;
        let ahead = row.next_allowed.take();
        let allowed = match row.constraint.as_mut() {
            Some(c) => {
                if c.is_finished() {
                    row.finish = Some(FinishReason::Stop);
                    return Ok(None);
                }
                let a = match ahead {
                    Some(a) => a,
                    None => c.allowed()?,
                };
                if a.is_empty() {
                    row.finish = Some(FinishReason::Stop);
                    return Ok(None);
                }
                Some(a)
            }
            None => None,
        };
        let allowed = match allowed {
            Some(a) if row.max_new.saturating_sub(row.tokens.len()) <= FINISH_MARGIN => {
                Some(self.finishing_mask(row, a, logits)?)
            }
            other => other,
        };
        let u = uniform_at(row.seed, step);
        let tok = sampler::sample(
            logits,
            &row.params,
            row.seen.as_ref(),
            allowed.as_ref(),
            u,
            &mut row.scratch,
        )
        .ok_or_else(|| {
            EngineError::Model(format!(
                "no token can be sampled at step {step} (all logits masked)"
            ))
        })?;
        self.accept(row, tok)?;
        Ok(Some(tok))
    }

    /// Advances `row` by `tok`: constraint, repetition memory, output, and whether it ends.
    fn accept(&self, row: &mut Row, tok: u32) -> Result<(), EngineError> {
        if let Some(c) = row.constraint.as_mut() {
            c.consume(tok)?;
        }
        if let Some(s) = row.seen.as_mut() {
            s.insert(tok);
        }
        row.tokens.push(tok);
        let stops = self.stop_ids.contains(&tok) && !(self.ignore_eos && row.constraint.is_none());
        if stops || row.constraint.as_ref().is_some_and(|c| c.is_finished()) {
            row.finish = Some(FinishReason::Stop);
        } else if row.tokens.len() >= row.max_new {
            row.finish = Some(FinishReason::Length);
        }
        Ok(())
    }

    /// Forced-token fast-forward: while the row's constraint allows exactly one token, accepts
    /// it and appends it to `feed`, so the whole run goes through the model in one forward.
    /// Identical to sampling each step: a one-token allowed set stays one token through
    /// [`finishing_mask`](Self::finishing_mask), and the sampler returns it whatever the draw
    /// (its logit is not consulted; a model whose logit there is not finite would have failed
    /// the step instead). A token that ends the row is accepted but not fed. The first
    /// non-forced allowed set is kept for the next sampling step.
    fn forced_run(
        &self,
        row: &mut Row,
        feed: &mut Vec<u32>,
        forced: &mut u64,
    ) -> Result<(), EngineError> {
        while row.finish.is_none() {
            let Some(c) = row.constraint.as_mut() else {
                return Ok(());
            };
            if c.is_finished() {
                return Ok(());
            }
            let allowed = c.allowed()?;
            let Some(tok) = allowed.only() else {
                row.next_allowed = Some(allowed);
                return Ok(());
            };
            self.accept(row, tok)?;
            if row.finish.is_none() {
                feed.push(tok);
            }
            *forced += 1;
        }
        Ok(())
    }

    /// The allowed set of a constrained row in its last [`FINISH_MARGIN`] tokens, narrowed so
    /// the output ends complete (never cut mid-character by `max_new_tokens`):
    /// 1. EOS allowed now → EOS only;
    /// 2. else the highest-logit allowed tokens (at most [`FINISH_LOOKAHEAD`]) after which the
    ///    constraint allows EOS (checked on a fork);
    /// 3. else the allowed tokens made only of UTF-8 continuation bytes (each one brings a
    ///    split character closer to complete);
    /// 4. else unchanged.
    ///
    /// A character is at most 4 bytes, so from a split character EOS becomes reachable within
    /// 3 tokens: a margin of 4 ends every row by `max_new_tokens` as long as the reason already
    /// has content (the minimum `max_new_tokens` of a constrained rollout leaves room for it).
    /// Depends only on the row's own logits and state: deterministic.
    fn finishing_mask(
        &self,
        row: &mut Row,
        allowed: AllowedTokens,
        logits: &[f32],
    ) -> Result<AllowedTokens, EngineError> {
        let Some(c) = row.constraint.as_mut() else {
            return Ok(allowed);
        };
        let eos: Vec<u32> = self
            .stop_ids
            .iter()
            .copied()
            .filter(|&t| allowed.is_allowed(t))
            .collect();
        if !eos.is_empty() {
            let mut only = AllowedTokens::none(allowed.len());
            for t in eos {
                only.allow(t);
            }
            return Ok(only);
        }
        // Top allowed tokens by logit (ties to the lower id), so the narrowed set stays likely.
        let mut cand: Vec<(f32, u32)> = (0..allowed.len() as u32)
            .filter(|&t| allowed.is_allowed(t))
            .map(|t| {
                (
                    logits.get(t as usize).copied().unwrap_or(f32::NEG_INFINITY),
                    t,
                )
            })
            .filter(|(l, _)| l.is_finite())
            .collect();
        cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        cand.truncate(FINISH_LOOKAHEAD);
        let mut ends = AllowedTokens::none(allowed.len());
        let mut any = false;
        for &(_, t) in &cand {
            let mut f = c.fork();
            if f.consume(t).is_err() {
                continue;
            }
            let next = f.allowed()?;
            if f.is_finished() || self.stop_ids.iter().any(|&e| next.is_allowed(e)) {
                ends.allow(t);
                any = true;
            }
        }
        if any {
            return Ok(ends);
        }
        let vocab = self.constraint_factory()?.vocabulary();
        let mut cont = AllowedTokens::none(allowed.len());
        let mut any = false;
        for t in 0..allowed.len() as u32 {
            if allowed.is_allowed(t)
                && vocab
                    .token_bytes(t)
                    .is_some_and(|b| !b.is_empty() && b.iter().all(|&x| (0x80..0xC0).contains(&x)))
            {
                cont.allow(t);
                any = true;
            }
        }
        Ok(if any { cont } else { allowed })
    }

    /// The text of a row: the raw decoded output, special tokens the model emitted included
    /// (the contract parser judges them; hiding them would make a malformed answer look
    /// clean). Only the stop token that ended the row is left out.
    pub(super) fn row_text(&self, row: &Row) -> Result<String, EngineError> {
        self.tokenizer
            .decode(without_terminator(&row.tokens, &self.stop_ids), false)
            .map_err(|e| EngineError::Model(format!("detokenize: {e}")))
    }
}

/// `tokens` without the trailing stop token that ended generation (if it ended on one).
pub(super) fn without_terminator<'a>(tokens: &'a [u32], stop_ids: &[u32]) -> &'a [u32] {
    match tokens.split_last() {
        Some((last, rest)) if stop_ids.contains(last) => rest,
        _ => tokens,
    }
}
