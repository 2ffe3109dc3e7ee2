//! Paged KV memory of the CPU fast path: fixed-size [`Block`]s of [`BLOCK_POSITIONS`]
//! positions (keys and values of every layer), handed out by one [`KvPool`] per model and
//! returned to it when dropped. A job's cache ([`super::cache::CpuCache`]) is a table of
//! blocks; blocks of a prompt are shared (`Arc`) by the prompt's rows, by the prefix store and
//! by later jobs with the same prompt head, and copied only when a job writes into one it
//! shares ([`super::cache`]: copy-on-write).
//!
//! The pool counts the blocks in use and its capacity (the worker's KV budget plus the prefix
//! stores'); it never refuses a block: the bound is kept by admission, the worker leasing a
//! job only while the worst case of every job in hand fits the budget (one job is taken
//! whatever its size when none is in hand), so a full pool makes new jobs wait and never
//! fails or evicts a running one. Returned blocks are
//! kept for reuse up to the capacity; a block's stale positions are never read (attention
//! reads a block's first `len` positions, all written by its owner).

use std::sync::{Arc, Mutex, MutexGuard};

use crate::engine::transformer::TransformerConfig;

/// Positions per block: two tiles of 16 keys for the attention kernel, one value tile.
pub const BLOCK_POSITIONS: usize = 32;

/// What the pool holds now ([`KvPool::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks held by caches and the prefix store.
    pub used: usize,
    /// Blocks the budget leaves (`capacity - used`, never below 0).
    pub free: usize,
    /// Blocks the budget allows.
    pub capacity: usize,
    /// Most blocks held at once since the pool was made.
    pub peak: usize,
    /// Bytes of one block.
    pub block_bytes: usize,
}

#[derive(Debug, Default)]
struct PoolState {
    spare: Vec<Box<[f32]>>,
    used: usize,
    peak: usize,
    capacity: usize,
}

/// The blocks of one model's caches. See the module header.
#[derive(Debug)]
pub struct KvPool {
    /// Floats of one layer's part of a block: keys (`n_kv × d × B`, transposed) then values
    /// (`n_kv × B × d`).
    layer_floats: usize,
    n_layer: usize,
    state: Mutex<PoolState>,
}

impl KvPool {
    /// A pool for `cfg`'s caches with room for `capacity_bytes`.
    pub fn new(cfg: &TransformerConfig, capacity_bytes: u64) -> Arc<KvPool> {
        Self::with_shape(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, capacity_bytes)
    }

    /// A pool for caches of `n_layer` layers of `n_kv` KV heads of `d` with room for
    /// `capacity_bytes`.
    pub fn with_shape(n_layer: usize, n_kv: usize, d: usize, capacity_bytes: u64) -> Arc<KvPool> {
        let pool = KvPool {
            layer_floats: 2 * n_kv * d * BLOCK_POSITIONS,
            n_layer,
            state: Mutex::default(),
        };
        pool.set_capacity_bytes(capacity_bytes);
        Arc::new(pool)
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.layer_floats * self.n_layer * std::mem::size_of::<f32>()
    }

    /// Sets the capacity to the blocks `bytes` hold (the worker's KV budget).
    pub fn set_capacity_bytes(&self, bytes: u64) {
        let blocks = bytes / self.block_bytes().max(1) as u64;
        let mut s = self.state();
        s.capacity = usize::try_from(blocks).unwrap_or(usize::MAX);
        let keep = s.capacity.saturating_sub(s.used);
        s.spare.truncate(keep);
    }

    /// What the pool holds now.
    pub fn stats(&self) -> PoolStats {
        let s = self.state();
        PoolStats {
            used: s.used,
            free: s.capacity.saturating_sub(s.used),
            capacity: s.capacity,
            peak: s.peak,
            block_bytes: self.block_bytes(),
        }
    }

    /// A block for the caller alone (a spare one, or a new one).
    pub fn alloc(self: &Arc<Self>) -> Block {
        let spare = {
            let mut s = self.state();
            s.used += 1;
            s.peak = s.peak.max(s.used);
            s.spare.pop()
        };
        let data =
            spare.unwrap_or_else(|| vec![0.0; self.layer_floats * self.n_layer].into_boxed_slice());
        Block {
            data,
            pool: self.clone(),
        }
    }

    fn give_back(&self, data: Box<[f32]>) {
        let mut s = self.state();
        s.used = s.used.saturating_sub(1);
        if s.used + s.spare.len() < s.capacity {
            s.spare.push(data);
        }
    }
}

/// [`BLOCK_POSITIONS`] positions of keys and values of every layer; back to its pool when
/// dropped.
#[derive(Debug)]
pub struct Block {
    data: Box<[f32]>,
    pool: Arc<KvPool>,
}

impl Block {
    /// Layer `li`'s keys (`n_kv × d × B`, transposed) and values (`n_kv × B × d`).
    pub fn layer(&self, li: usize) -> (&[f32], &[f32]) {
        let lf = self.pool.layer_floats;
        self.data[li * lf..(li + 1) * lf].split_at(lf / 2)
    }

    /// Layer `li`'s keys and values, to write.
    pub fn layer_mut(&mut self, li: usize) -> (&mut [f32], &mut [f32]) {
        let lf = self.pool.layer_floats;
        self.data[li * lf..(li + 1) * lf].split_at_mut(lf / 2)
    }

    /// A new block of the same pool holding this one's positions (copy-on-write).
    pub fn copy(&self) -> Block {
        let mut b = self.pool.alloc();
        b.data.copy_from_slice(&self.data);
        b
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.data));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_count_while_held_and_return_to_the_pool_when_dropped() {
        let pool = KvPool::with_shape(2, 1, 4, 3 * 2 * 2 * 4 * 32 * 4);
        assert_eq!(pool.stats().capacity, 3);
        let a = pool.alloc();
        let b = Arc::new(pool.alloc());
        let shared = b.clone();
        assert_eq!((pool.stats().used, pool.stats().free), (2, 1));
        drop(b);
        assert_eq!(
            pool.stats().used,
            2,
            "a block shared is held until its last user ends"
        );
        drop(shared);
        drop(a);
        let s = pool.stats();
        assert_eq!((s.used, s.free, s.peak), (0, 3, 2));
    }

    #[test]
    fn a_copy_holds_the_same_positions_and_is_a_block_of_its_own() {
        let pool = KvPool::with_shape(2, 1, 4, 1 << 20);
        let mut a = pool.alloc();
        a.layer_mut(1).1[5] = 7.0;
        let mut b = a.copy();
        assert_eq!(b.layer(1).1[5], 7.0);
        b.layer_mut(1).1[5] = 1.0;
        assert_eq!(a.layer(1).1[5], 7.0);
        assert_eq!(pool.stats().used, 2);
    }
}
