//! The paged path's forward call ([`CandleBackend::forward_paged`]): a prefill chunk (into the
//! pool by the flash prefill, `flash.rs`, else as on the unfused path), then one decode step of every fed row of every job in one
//! [`Transformer::forward_decode_paged`](crate::engine::transformer::Transformer::forward_decode_paged)
//! over the pool (`paged.rs`): each row's next slot taken first, the step's positions, slots
//! and row tables uploaded once, the fed rows' logits read back once.

use std::time::Instant;

use super::paged::lock;
use super::{CandleBackend, CandleJob, flash, me};
use crate::engine::EngineError;
use crate::engine::backend::{Input, StepOut};
use crate::engine::kernels::BLOCK;
use crate::engine::transformer::{PagedStep, ops};

impl CandleBackend {
    /// The paged path's forward call: the prefill chunk (if any), then one paged decode step of every fed row of every job (a finished row is not fed: rows
    /// do not step in lockstep here).
    pub(super) fn forward_paged(
        &self,
        mut jobs: Vec<Option<&mut CandleJob>>,
        inputs: &[Input],
        out: StepOut<'_>,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        let (model, Some(paging)) = (&self.model, &self.paging) else {
            return Err(me("not the paged candle backend"));
        };
        let mut chunk = None;
        let mut fed: Vec<(usize, usize, u32)> = Vec::new();
        for i in inputs {
            match &i.rows {
                None => {
                    let t = Instant::now();
                    let Some(Some(CandleJob::Paged(job))) = jobs.get_mut(i.job) else {
                        return Err(me("a prefill chunk of a job not on the paged path"));
                    };
                    chunk = Some(match job.prefill.as_mut() {
                        Some(cache) => super::lockstep::prefill_chunk(model, &i.tokens, cache)?,
                        None if paging.kernels.flash_prefill => {
                            flash::prefill_chunk(model, &paging.kernels, &i.tokens, job)?
                        }
                        None => return Err(me("a prefill chunk of a sealed prompt")),
                    });
                    out.split.prefill += t.elapsed();
                    out.split.prefill_steps += 1;
                }
                Some(rows) if rows.len() != i.tokens.len() => {
                    return Err(me("multi-token decode on the paged path"));
                }
                Some(rows) => fed.extend(rows.iter().zip(&i.tokens).map(|(r, t)| (i.job, *r, *t))),
            }
        }
        if !fed.is_empty() {
            self.decode_paged(&mut jobs, &fed, out)?;
        }
        Ok(chunk)
    }

    /// One paged decode step of the fed rows `(job, row, token)`, in order: their logits go
    /// to the step logits. Timed and counted.
    fn decode_paged(
        &self,
        jobs: &mut [Option<&mut CandleJob>],
        fed: &[(usize, usize, u32)],
        out: StepOut<'_>,
    ) -> Result<(), EngineError> {
        let (model, Some(paging)) = (&self.model, &self.paging) else {
            return Err(me("not the paged candle backend"));
        };
        let pool = paging.pool.clone().ok_or_else(|| me("no KV pool"))?;
        let tile = self.decode_tile(model.device());
        let (ops0, t0) = (ops::issued(), Instant::now());
        let mut pool = lock(&pool);
        let mut slots = Vec::with_capacity(fed.len());
        for &(j, r, _) in fed {
            let row = match jobs.get_mut(j) {
                Some(Some(CandleJob::Paged(p))) => p.rows.get_mut(r),
                _ => None,
            };
            let row = row.ok_or_else(|| me("a fed row without its table"))?;
            // A row's first write copies the prompt's shared partial block: a copy out and
            // a write back per layer.
            let t = &row.table;
            if !t.len().is_multiple_of(BLOCK)
                && t.blocks().last().is_some_and(|&b| pool.refcount(b) > 1)
            {
                ops::add(2 * pool.shape().n_layer);
            }
            slots.push(pool.append_slots(&mut row.table, 1).map_err(me)?[0]);
        }
        let mut rows = Vec::with_capacity(fed.len());
        for (&(j, r, token), &slot) in fed.iter().zip(&slots) {
            let Some(Some(CandleJob::Paged(p))) = jobs.get(j) else {
                return Err(me("a fed row without its table"));
            };
            rows.push((token, &p.rows[r].table, slot));
        }
        let step = PagedStep::new(&rows, tile, model.device()).map_err(me)?;
        let logits = model
            .forward_decode_paged(&step, &pool, &paging.kernels, tile)
            .map_err(me)?;
        drop(pool);
        let t1 = Instant::now();
        model.device().synchronize().map_err(me)?;
        let t2 = Instant::now();
        // The fed rows are the step's first rows: a view reads them.
        let first = logits.narrow(0, 0, fed.len()).map_err(me)?;
        ops::one(out.logits.read(&first)).map_err(me)?;
        let split = out.split;
        split.decode_steps += 1;
        split.forward_issued += t1 - t0;
        split.forward_done += t2 - t1;
        split.readback += t2.elapsed();
        split.add_ops(ops::issued() - ops0);
        Ok(())
    }
}
