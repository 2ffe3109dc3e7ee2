//! The candle backend on the paged KV pool (the `paged`, `fused` and `flash_prefill` engine
//! switches, [`crate::engine::switches`]): at load the kernels' self-check, the concatenated
//! weights and the fingerprint's kernel suffix ([`CandleBackend::enable_paging`]); a job's KV
//! as block tables of one pool ([`PagedJob`]); the decode step is in `paged_step.rs`.
//!
//! The prefill goes one of two ways. With the flash prefill kernel in use (`flash.rs`) each
//! chunk writes its keys and values straight into the job's prompt table and attends over the
//! pool. Otherwise a prompt is prefilled as on the unfused path into a one-row cache, whose
//! positions are then copied into the pool ([`seal_prompt`]). Either way the job's rows share
//! the prompt's blocks (copy-on-write of its partial last block) and write their own. Blocks
//! are counted by reference and go back to the pool when the last table holding them is
//! dropped ([`Held`]): a job that ends, fails or is cancelled, and a prefix the store evicts,
//! give theirs back without a call to forget.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::Tensor;

use super::{CandleBackend, me};
use crate::engine::EngineError;
use crate::engine::cpu::kv_pool::PoolStats;
use crate::engine::kernels::{
    AttnShape, BLOCK, BlockTable, KernelId, KernelUse, PagedKvPool, PoolError, PoolShape,
    SelfCheckReport, reference, self_check_for,
};
use crate::engine::switches::{EngineSwitches, KernelsOn};
use crate::engine::transformer::{KvCache, ops};

/// The pool a [`Held`] table belongs to.
pub(super) type SharedPool = Arc<Mutex<PagedKvPool>>;

pub(super) fn lock(pool: &SharedPool) -> MutexGuard<'_, PagedKvPool> {
    // A panic while the pool was locked leaves counts that are still consistent per call.
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

/// The paged path's state: the kernels in use and the pool (made at the first job, sized by
/// the KV budget and the prefix stores' budgets then; [`CandleBackend::drop_paged_pool`] drops it
/// to be remade when they change between runs).
pub(super) struct Paging {
    pub(super) kernels: KernelUse,
    pub(super) pool: Option<SharedPool>,
}

/// A block table of the pool; its blocks go back when it is dropped.
pub(super) struct Held {
    pub(super) table: BlockTable,
    pub(super) pool: SharedPool,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").field("table", &self.table).finish()
    }
}

impl Held {
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    /// A table of this one's first `len` positions, sharing its blocks.
    pub(super) fn share(&self, len: usize) -> Result<Held, PoolError> {
        let table = lock(&self.pool).share_prefix(&self.table, len)?;
        Ok(Held {
            table,
            pool: self.pool.clone(),
        })
    }

    /// Bytes of the blocks it holds.
    pub(super) fn bytes(&self) -> usize {
        self.table.blocks().len() * lock(&self.pool).stats().block_bytes
    }

    /// Whether `other` is a table of the same pool.
    pub(super) fn same_pool(&self, other: &Held) -> bool {
        Arc::ptr_eq(&self.pool, &other.pool)
    }

    /// Each layer's keys and values at this table's first `len` positions,
    /// `(len, n_kv_head, head_dim)`: one row gather each from the layer seen as rows of one
    /// position's heads (keys of slot `s` at row `(s/B)*2B + s%B`, values `B` rows further).
    pub(super) fn read(&self, len: usize) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
        let pool = lock(&self.pool);
        let shape = pool.shape();
        let (b, w) = (BLOCK as u32, shape.n_kv_head * shape.head_dim);
        let rows = |value: u32| -> candle_core::Result<Tensor> {
            let idx: Vec<u32> = (0..len)
                .map(|p| {
                    let s = self.table.slot(p).expect("a position the table holds");
                    (s / b) * 2 * b + s % b + value
                })
                .collect();
            Tensor::new(idx.as_slice(), pool.layer(0).device())
        };
        let (keys, values) = (rows(0)?, rows(b)?);
        let heads = (len, shape.n_kv_head, shape.head_dim);
        (0..shape.n_layer)
            .map(|li| {
                let flat = pool.layer(li).reshape((shape.num_blocks * 2 * BLOCK, w))?;
                let k = flat.index_select(&keys, 0)?.reshape(heads)?;
                let v = flat.index_select(&values, 0)?.reshape(heads)?;
                Ok((k, v))
            })
            .collect()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let table = std::mem::take(&mut self.table);
        lock(&self.pool).release(table);
    }
}

/// One job's KV on the paged path.
pub(super) struct PagedJob {
    /// The one-row cache the prompt is prefilled in; `None` once its positions are in the
    /// pool ([`seal_prompt`]), and from the start with the flash prefill (each chunk goes
    /// straight into the pool).
    pub(super) prefill: Option<KvCache>,
    /// The prompt's positions in the pool (the leading ones shared from the prefix store).
    pub(super) prompt: Held,
    /// Each row's table after the prompt (empty until the rows start).
    pub(super) rows: Vec<Held>,
}

/// Whether the paged KV pool is worth running with the kernels `on` selects and `report`
/// passed: on CUDA only with the paged attention kernel, since its composition (a few
/// operations a row and layer, and a host round trip a layer) took over a second a decode
/// step on an H200 (the GPU check of 2026-11-29, `unpaged@8`: it did not finish 63 steps in 88
/// s), several times the plain path's 265 ms. On the CPU every combination stays available
/// (the compositions are the kernels' references there).
pub(super) fn paging_pays(cuda: bool, on: KernelsOn, report: &SelfCheckReport) -> bool {
    !cuda || (on.paged && report.usable(KernelId::PagedAttention))
}

impl CandleBackend {
    /// Turns the paged path on when the switches ask for it on this device (`auto`: on CUDA):
    /// runs the kernels' self-check (at the model's attention shape too), concatenates the
    /// projections for `fused`, and returns the kernels in use for the fingerprint's dtype
    /// (`cuda-bf16;kernels=paged-attn+...`). With every kernel switch off nothing changes, the
    /// fingerprint included (`None`).
    pub(super) fn enable_paging(
        &mut self,
        switches: &EngineSwitches,
    ) -> Result<Option<String>, EngineError> {
        let on = switches.kernels_on(self.model.device().is_cuda());
        if !on.any() {
            return Ok(None);
        }
        crate::engine::kernels::params::set_decode_attn_v1(switches.decode_attn_v1);
        let c = &self.model.config;
        let shape = AttnShape {
            head_dim: c.head_dim,
            n_head: c.n_head,
            n_kv: c.n_kv_head,
            hidden: c.hidden,
        };
        let report = self_check_for(self.model.device(), shape);
        if !paging_pays(self.model.device().is_cuda(), on, &report) {
            tracing::error!(
                paged_attention_passed = report.usable(KernelId::PagedAttention),
                "on CUDA the paged KV pool needs the paged attention kernel (switched off or \
                 failed its self-check): the candle backend decodes on its plain path, as with \
                 every kernel switch off"
            );
            return Ok(None);
        }
        self.enable_paging_checked(on, &report).map(Some)
    }

    /// The paged path with the kernels `report` passed that `on` selects; the fingerprint
    /// suffix naming them.
    ///
    /// (On CUDA, [`paging_pays`] decides first whether the pool is worth it.)
    pub(super) fn enable_paging_checked(
        &mut self,
        on: KernelsOn,
        report: &SelfCheckReport,
    ) -> Result<String, EngineError> {
        if on.fused {
            self.model.fuse_weights().map_err(me)?;
        }
        let suffix = report.fingerprint_suffix(on);
        let kernels = KernelUse::new(report, on);
        if on.flash_prefill && !kernels.flash_prefill {
            tracing::error!(
                "the flash prefill kernel failed its self-check: the prefill runs as without it"
            );
        }
        tracing::info!(?on, %suffix, "the candle backend runs on the paged KV pool");
        self.paging = Some(Paging {
            kernels,
            pool: None,
        });
        Ok(suffix)
    }

    /// The pool's shape for the budgets now: every block the KV budget and the prefix stores'
    /// budgets hold (at least one).
    fn pool_shape(&self) -> Option<PoolShape> {
        self.paging.as_ref()?;
        let model = &self.model;
        let bytes = self.kv_budget.saturating_add(self.stores.budget());
        let c = &model.config;
        let mut shape = PoolShape {
            n_layer: c.n_layer,
            n_kv_head: c.n_kv_head,
            head_dim: c.head_dim,
            num_blocks: 0,
        };
        shape.num_blocks = PagedKvPool::blocks_for_bytes(shape, model.dtype(), bytes).max(1);
        Some(shape)
    }

    /// The pool, made now (of [`Self::pool_shape`]) if it is not yet.
    fn paged_pool(&mut self) -> Result<SharedPool, EngineError> {
        let shape = self.pool_shape();
        let (model, Some(paging), Some(shape)) = (&self.model, &mut self.paging, shape) else {
            return Err(me("not the paged candle backend"));
        };
        if let Some(p) = &paging.pool {
            return Ok(p.clone());
        }
        let pool = PagedKvPool::new(shape, model.dtype(), model.device()).map_err(me)?;
        let pool = Arc::new(Mutex::new(pool));
        paging.pool = Some(pool.clone());
        Ok(pool)
    }

    /// The paged pool's blocks now (`None` off the paged path or before the first job).
    pub(super) fn paged_stats(&self) -> Option<PoolStats> {
        let pool = self.paging.as_ref()?.pool.as_ref()?;
        Some(lock(pool).stats())
    }

    /// Drops the pool (remade at the next job with the budgets then) and the prefix stores'
    /// entries in it when the budgets ask for another size and no job holds blocks (`idle`);
    /// else keeps it as it is.
    pub(super) fn drop_paged_pool(&mut self, idle: bool) {
        let blocks = self.pool_shape().map(|s| s.num_blocks);
        let Some(paging) = &mut self.paging else {
            return;
        };
        let same = match &paging.pool {
            Some(p) => Some(lock(p).stats().capacity) == blocks,
            None => true,
        };
        if !same && idle {
            self.stores.clear();
            paging.pool = None;
        }
    }

    /// A joining job's KV on the paged path: an empty prompt table, and a one-row cache for
    /// its prefill unless the flash prefill writes it into the pool.
    pub(super) fn new_paged_job(&mut self, prompt_len: usize) -> Result<PagedJob, EngineError> {
        let pool = self.paged_pool()?;
        let flash = self
            .paging
            .as_ref()
            .is_some_and(|p| p.kernels.flash_prefill);
        let prefill = match flash {
            true => None,
            false => Some(self.model.new_cache(1, prompt_len).map_err(me)?),
        };
        Ok(PagedJob {
            prefill,
            prompt: Held {
                table: BlockTable::default(),
                pool,
            },
            rows: Vec::new(),
        })
    }
}

/// A prefilled prompt's positions not yet in the pool (those after a shared prefix) are
/// copied there from its one-row cache, which is then dropped (nothing to do after the flash
/// prefill).
pub(super) fn seal_prompt(job: &mut PagedJob) -> Result<(), EngineError> {
    let Some(cache) = job.prefill.take() else {
        return Ok(());
    };
    let from = job.prompt.len();
    let n = cache.len() - from;
    let mut pool = lock(&job.prompt.pool);
    let slots = pool.append_slots(&mut job.prompt.table, n).map_err(me)?;
    for li in 0..pool.shape().n_layer {
        let (k, v) = cache.positions(li, from, n).map_err(me)?;
        // The scatter: an index upload, the keys and values joined, the write.
        ops::add(4);
        reference::write_slots(pool.layer(li), &k, &v, &slots).map_err(me)?;
    }
    Ok(())
}

/// `n` rows after the sealed prompt, each sharing its blocks.
pub(super) fn fork_rows(job: &mut PagedJob, n: usize) {
    let mut pool = lock(&job.prompt.pool);
    let rows: Vec<BlockTable> = (0..n).map(|_| pool.fork(&job.prompt.table)).collect();
    drop(pool);
    job.rows = rows
        .into_iter()
        .map(|table| Held {
            table,
            pool: job.prompt.pool.clone(),
        })
        .collect();
}
