//! The lockstep forward call of the candle backend, from the step's inputs (at most one
//! prefill chunk and every fed row) to logits: the prefill chunk's last logits come back to
//! the caller, the decoded rows' land in the step logits
//! ([`StepLogits`](crate::engine::backend::readback::StepLogits)), input by input and row by
//! row; and the step's phases are timed into the [`StepSplit`](crate::engine::step_split).
//!
//! The decoded rows' logits reach the host as the `readback` switch says ([`Readback`]): `once` gathers the fed rows on the device (pad rows and finished
//! rows dropped, one `index_select`, or a view when they are the first rows) and copies them
//! to the host in one go, in the dtype the output head computed; `per-job` is the path before
//! it (each job's logits cast to f32 and copied whole, then its fed rows picked on the host),
//! kept to A/B the two on a GPU. Both give the same f32 values.

use std::time::Instant;

use candle_core::Tensor;

use super::{CandleBackend, CandleJob, me};
use crate::engine::EngineError;
use crate::engine::backend::{Input, StepOut};
use crate::engine::switches::Readback;
use crate::engine::transformer::{DecodePart, KvCache, Transformer, ops};

/// One prefill chunk of `tokens` into the one-row `cache`: the logits of its last token.
pub(super) fn prefill_chunk(
    model: &Transformer,
    tokens: &[u32],
    cache: &mut KvCache,
) -> Result<Vec<f32>, EngineError> {
    let input = Tensor::new(tokens, model.device())
        .and_then(|t| t.unsqueeze(0))
        .map_err(me)?;
    let logits = model.forward(&input, cache).map_err(me)?;
    logits.squeeze(0).and_then(|t| t.to_vec1()).map_err(me)
}

impl CandleBackend {
    /// The candle backend's step: the prefill chunk (if any) in a forward call of its own
    /// (the one-row prompt cache, the fixed chunk schedule), then one
    /// [`Transformer::forward_decode_logits`](crate::engine::transformer::Transformer::forward_decode_logits)
    /// over every decoding job's rows (a finished row of a job still decoding is fed a pad
    /// token: the cache is lockstep), read back as the `readback` switch says.
    pub(super) fn forward_lockstep(
        &self,
        jobs: Vec<Option<&mut CandleJob>>,
        inputs: &[Input],
        out: StepOut<'_>,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        let model = &self.model;
        let pad = self.pad;
        let mut chunk = None;
        let mut caches: Vec<Option<&mut KvCache>> = jobs
            .into_iter()
            .map(|j| match j {
                Some(CandleJob::Lockstep(c)) => c.as_mut(),
                Some(CandleJob::Paged(_)) | None => None,
            })
            .collect();
        // The decoded parts, and each fed row's place among the parts' rows (`at`, from 0).
        let (mut parts, mut fed, mut at) = (Vec::new(), Vec::new(), 0);
        for i in inputs {
            let cache = caches
                .get_mut(i.job)
                .and_then(Option::take)
                .ok_or_else(|| {
                    EngineError::Model("a job without its cache in a forward call".into())
                })?;
            match &i.rows {
                None => {
                    let t = Instant::now();
                    chunk = Some(prefill_chunk(model, &i.tokens, cache)?);
                    out.split.prefill += t.elapsed();
                    out.split.prefill_steps += 1;
                }
                Some(rows) if rows.len() != i.tokens.len() => {
                    return Err(EngineError::Model(
                        "multi-token decode on the lockstep path".into(),
                    ));
                }
                Some(rows) => {
                    let mut tokens = vec![pad; cache.batch()];
                    for (r, t) in rows.iter().zip(&i.tokens) {
                        tokens[*r] = *t;
                        fed.push((at + r) as u32);
                    }
                    at += cache.batch();
                    parts.push(DecodePart { tokens, cache });
                }
            }
        }
        if !parts.is_empty() {
            self.decode_lockstep(&mut parts, fed, out)?;
        }
        Ok(chunk)
    }

    /// One decode step of `parts`; `fed` are the fed rows' places among the parts' rows, in
    /// order: their logits go to the step logits. Timed and counted.
    fn decode_lockstep(
        &self,
        parts: &mut [DecodePart<'_>],
        fed: Vec<u32>,
        out: StepOut<'_>,
    ) -> Result<(), EngineError> {
        let model = &self.model;
        let tile = self.decode_tile(model.device());
        let (ops0, t0) = (ops::issued(), Instant::now());
        let split = match self.readback {
            Readback::Once => {
                let logits = model.forward_decode_logits(parts, tile).map_err(me)?;
                let t1 = Instant::now();
                model.device().synchronize().map_err(me)?;
                let t2 = Instant::now();
                if let Some(logits) = logits {
                    let n = fed.len();
                    // Fed rows that are the first `n` rows need no gather: a view reads them
                    // (candle's index_select allocates and zero-fills a fresh tensor).
                    let live = if fed.iter().enumerate().all(|(i, &f)| f as usize == i) {
                        logits.narrow(0, 0, n).map_err(me)?
                    } else {
                        let idx = ops::one(Tensor::from_vec(fed, n, model.device())).map_err(me)?;
                        ops::one(logits.index_select(&idx, 0)).map_err(me)?
                    };
                    ops::one(out.logits.read(&live)).map_err(me)?;
                }
                (t1, t2)
            }
            Readback::PerJob => {
                let logits = model.forward_decode(parts, tile).map_err(me)?;
                let t1 = Instant::now();
                model.device().synchronize().map_err(me)?;
                let t2 = Instant::now();
                out.logits.begin(fed.len());
                let (mut k, mut base) = (0, 0);
                for (l, part) in logits.iter().zip(parts.iter()) {
                    let all = ops::one(l.to_vec2::<f32>()).map_err(me)?;
                    let end = base + part.tokens.len();
                    for &f in fed.iter().filter(|&&f| (base..end).contains(&(f as usize))) {
                        let row = &all[f as usize - base];
                        out.logits.row_mut(k).copy_from_slice(row);
                        k += 1;
                    }
                    base = end;
                }
                (t1, t2)
            }
        };
        let (t1, t2) = split;
        let split = out.split;
        split.decode_steps += 1;
        split.forward_issued += t1 - t0;
        split.forward_done += t2 - t1;
        split.readback += t2.elapsed();
        split.add_ops(ops::issued() - ops0);
        Ok(())
    }
}
