//! Our transformer on candle tensors as a [`Backend`] (CPU or CUDA, safetensors, explicit
//! weight formats). A job's KV ([`CandleJob`]) is either a lockstep cache (`lockstep.rs`:
//! the prompt prefilled at b=1, expanded to one row per candidate, a finished row fed a pad
//! token) or, with the `paged`, `fused` or `flash_prefill` switch on, block tables of one pool
//! (`paged.rs`, `paged_step.rs`: rows step on their own, one attention launch per layer for
//! all rows). A prefill chunk always runs in a forward call of its own (its arithmetic depends
//! on its shape, so the fixed schedule keeps it the same in every prompt): into a one-row
//! cache, or with the flash prefill straight into the pool (`flash.rs`); the prompt stores
//! keep whole chunks only (`prefix.rs`).

mod flash;
#[cfg(test)]
mod flash_tests;
mod lockstep;
mod paged;
mod paged_step;
mod prefix;

use std::any::Any;

use candle_core::Device;

use super::{
    Backend, BackendKind, Blocks, Input, JobKv, PromptStores, Reuse, StepOut, kv_mut, kv_ref,
};
use crate::engine::cpu::kv_pool::PoolStats;
use crate::engine::model_config::TransformerConfig;
use crate::engine::switches::{EngineSwitches, Readback};
use crate::engine::transformer::{DecodeTile, KvCache, Transformer};
use crate::engine::{EngineError, kernels};
use paged::{PagedJob, Paging};
use prefix::Kept;

/// The candle release the engine is built against (`Cargo.toml` pins `0.11.1`); part of the
/// fingerprint because kernels change numerics between releases.
pub const CANDLE_VERSION: &str = "0.11.1";

pub(crate) fn me(e: impl std::fmt::Display) -> EngineError {
    EngineError::Model(e.to_string())
}

/// One job's KV on the candle backend.
enum CandleJob {
    /// Lockstep rows (`None` once the prompt cache was taken for rows that need none).
    Lockstep(Option<KvCache>),
    /// Block tables of the paged pool.
    Paged(PagedJob),
}

/// The candle transformer with its decode settings, paged pool and prompt stores.
pub struct CandleBackend {
    model: Transformer,
    /// The token a finished lockstep row is fed (its output is ignored).
    pad: u32,
    readback: Readback,
    /// The paged path (`paged`, `fused` or `flash_prefill` switch on), else `None`.
    paging: Option<Paging>,
    /// What the worker's jobs in hand may take; with the stores' budgets, the paged pool's size.
    kv_budget: u64,
    stores: PromptStores<Kept>,
    /// Test only: the decode tile instead of the device's.
    tile: Option<DecodeTile>,
}

impl CandleBackend {
    /// The backend of `model` with `switches`, finished rows fed `pad`. Turns the paged path
    /// on when the switches ask for it on this device (see [`Self::enable_paging`]); returns
    /// the kernels' fingerprint suffix then.
    pub fn new(
        model: Transformer,
        pad: u32,
        switches: &EngineSwitches,
    ) -> Result<(CandleBackend, Option<String>), EngineError> {
        let mut b = CandleBackend {
            model,
            pad,
            readback: switches.readback,
            paging: None,
            kv_budget: crate::engine::DEFAULT_KV_CACHE_BYTES,
            stores: PromptStores::new(0),
            tile: None,
        };
        let suffix = b.enable_paging(switches)?;
        Ok((b, suffix))
    }

    /// The model.
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// The decode tile in force: the device's unless a test set one.
    fn decode_tile(&self, device: &Device) -> DecodeTile {
        self.tile.unwrap_or_else(|| DecodeTile::for_device(device))
    }
}

impl Backend for CandleBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Candle
    }

    fn config(&self) -> &TransformerConfig {
        &self.model.config
    }

    fn max_context(&self) -> usize {
        self.model.max_context()
    }

    fn kv_bytes_per_position(&self) -> u64 {
        let c = &self.model.config;
        let dtype_bytes = self.model.dtype().size_in_bytes();
        (c.n_layer * 2 * c.n_kv_head * c.head_dim * dtype_bytes) as u64
    }

    fn block_positions(&self) -> u64 {
        match self.paging {
            Some(_) => kernels::BLOCK as u64,
            None => 1,
        }
    }

    /// Per row, the paged path may copy the prompt's partial last block.
    fn blocks(&self) -> Option<Blocks> {
        self.paged_stats().map(|stats| Blocks {
            positions: kernels::BLOCK,
            bytes: stats.block_bytes,
            per_row: 1,
        })
    }

    fn kv_stats(&self) -> Option<PoolStats> {
        self.paged_stats()
    }

    #[cfg(feature = "cuda")]
    fn device_free_bytes(&self) -> Option<u64> {
        match self.model.device() {
            Device::Cuda(dev) => {
                let info = dev.cuda_stream().context().mem_get_info();
                info.ok().map(|(free, _total)| free as u64)
            }
            _ => None,
        }
    }

    fn multi_token_rows(&self) -> bool {
        false
    }

    fn set_prefix_budget(&mut self, bytes: usize) {
        self.stores = PromptStores::new(bytes);
    }

    fn prefix_budget(&self) -> u64 {
        self.stores.budget()
    }

    fn prefix_bytes(&self) -> Option<u64> {
        self.stores.bytes()
    }

    /// The paged pool is made again at the next job when it should have another size.
    fn size_kv(&mut self, kv_budget: u64, idle: bool) {
        self.kv_budget = kv_budget;
        self.drop_paged_pool(idle);
    }

    /// A one-row cache for the prompt's prefill (on the paged path with an empty table, and
    /// with the flash prefill that table only).
    fn new_job(&mut self, prompt_len: usize) -> Result<JobKv, EngineError> {
        let job = match self.paging {
            Some(_) => CandleJob::Paged(self.new_paged_job(prompt_len)?),
            None => CandleJob::Lockstep(Some(self.model.new_cache(1, prompt_len).map_err(me)?)),
        };
        Ok(Box::new(job))
    }

    /// Whole chunks only (see `prefix.rs`).
    fn look_up(
        &mut self,
        reuse: Reuse,
        prompt: &[u32],
        kv: &mut JobKv,
    ) -> Result<usize, EngineError> {
        let store = self.stores.of(reuse);
        Ok(match kv_mut::<CandleJob>(kv)? {
            CandleJob::Lockstep(Some(cache)) => prefix::lockstep_lookup(store, prompt, cache),
            CandleJob::Paged(p) => prefix::paged_lookup(store, prompt, p),
            CandleJob::Lockstep(None) => 0,
        })
    }

    fn forward(
        &mut self,
        jobs: Vec<&mut JobKv>,
        inputs: &[Input],
        out: StepOut<'_>,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        let jobs: Vec<Option<&mut CandleJob>> = jobs
            .into_iter()
            .map(|kv| kv.downcast_mut::<CandleJob>())
            .collect();
        match self.paging {
            Some(_) => self.forward_paged(jobs, inputs, out),
            None => self.forward_lockstep(jobs, inputs, out),
        }
    }

    /// A paged job's prompt goes into the pool.
    fn prompt_prefilled(&mut self, kv: &mut JobKv) -> Result<(), EngineError> {
        if let CandleJob::Paged(p) = kv_mut::<CandleJob>(kv)? {
            paged::seal_prompt(p)?;
        }
        Ok(())
    }

    /// The store gets a copy of the prompt's whole chunks (lockstep) or a table sharing
    /// their blocks (paged).
    fn publish(&mut self, reuse: Reuse, prompt: &[u32], kv: &JobKv) -> bool {
        let paging = self.paging.is_some();
        let (Some(store), Ok(job)) = (self.stores.of(reuse), kv_ref::<CandleJob>(kv)) else {
            return false;
        };
        match job {
            // The paged path's store holds tables of its pool only.
            CandleJob::Lockstep(Some(_)) if paging => return false,
            CandleJob::Lockstep(Some(cache)) => {
                // The store only saves work: a prompt it cannot copy is not kept.
                if let Err(e) = prefix::keep_lockstep(store, prompt, cache) {
                    tracing::debug!("prompt not kept for reuse: {e}");
                }
            }
            CandleJob::Paged(p) => prefix::keep_paged(store, prompt, p),
            CandleJob::Lockstep(None) => return false,
        }
        true
    }

    fn add_rows(
        &mut self,
        kv: &mut JobKv,
        n: usize,
        max_new: usize,
        prompt_len: usize,
    ) -> Result<(), EngineError> {
        match kv_mut::<CandleJob>(kv)? {
            CandleJob::Lockstep(c) => {
                let b1 = c.take();
                if max_new > 1
                    && let Some(b1) = b1
                {
                    *c = Some(b1.expand(n, prompt_len + max_new).map_err(me)?);
                }
            }
            CandleJob::Paged(p) => paged::fork_rows(p, n),
        }
        Ok(())
    }

    fn set_decode_tile(&mut self, rows: usize) {
        self.tile = Some(DecodeTile(rows.max(1)));
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
