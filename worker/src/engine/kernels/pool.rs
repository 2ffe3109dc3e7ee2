//! The paged KV pool of the candle backend: one device tensor per layer holding every block's
//! keys and values, `(num_blocks, 2, BLOCK, n_kv, head_dim)` (keys at index 0 of the second
//! dimension, values at 1), and the bookkeeping of which block holds what.
//!
//! A job's cache is a [`BlockTable`]: the block ids holding its positions in order and how
//! many positions it holds. Blocks are counted by reference: a prompt prefilled once is
//! shared by the job's rows ([`PagedKvPool::fork`]) and by the prefix store and later jobs
//! ([`PagedKvPool::share_prefix`]) without a copy. A table writes only into a block it holds
//! alone: [`PagedKvPool::append_slots`] copies a shared, partly filled last block first
//! (copy-on-write) and takes a fresh block only when the last one is full, so a job holds what
//! it wrote, never its worst case. Positions are written through a slot mapping
//! (`slot = block * BLOCK + offset`), which the fused K/V write kernel reads.
//!
//! The blocks are allocated once, when the pool is made (device memory is not grown during a
//! run); a table asking for a block when none is free gets [`PoolError::Full`]: the worker's
//! admission keeps the jobs in hand within the pool, so this is a bug guard, never eviction.

use candle_core::{DType, Device, Tensor};

use crate::engine::cpu::kv_pool::PoolStats;

/// Positions per block.
pub const BLOCK: usize = 16;

/// The slot of a pad row (a decode tile's filler): the K/V write skips it. A pad row's entry
/// in the row table has length 0, so attention gives it zeros and reads nothing.
pub const PAD_SLOT: u32 = u32::MAX;

/// Why the pool could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("the KV pool has no free block (all {0} in use)")]
    Full(usize),
    #[error("block table error: {0}")]
    Table(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The blocks of one sequence (a prompt, a row, a stored prefix), in position order. The
/// default is an empty table (a pad row's).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    len: usize,
}

impl BlockTable {
    /// Positions written.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Block ids, in position order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The slot (`block * BLOCK + offset`) of position `pos`.
    pub fn slot(&self, pos: usize) -> Option<u32> {
        let b = *self.blocks.get(pos / BLOCK)?;
        Some(b * BLOCK as u32 + (pos % BLOCK) as u32)
    }
}

/// Shape of the pool's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    pub n_layer: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
}

/// Every layer's KV blocks and their reference counts. See the module header.
#[derive(Debug)]
pub struct PagedKvPool {
    shape: PoolShape,
    dtype: DType,
    layers: Vec<Tensor>,
    refs: Vec<u32>,
    /// Free block ids; popped from the end, so the lowest ids go first.
    free: Vec<u32>,
    peak: usize,
}

impl PagedKvPool {
    /// A pool of `shape.num_blocks` blocks of `dtype` on `device`, zeroed.
    pub fn new(shape: PoolShape, dtype: DType, device: &Device) -> Result<Self, PoolError> {
        let dims = (shape.num_blocks, 2, BLOCK, shape.n_kv_head, shape.head_dim);
        let layers = (0..shape.n_layer)
            .map(|_| Tensor::zeros(dims, dtype, device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(PagedKvPool {
            shape,
            dtype,
            layers,
            refs: vec![0; shape.num_blocks],
            free: (0..shape.num_blocks as u32).rev().collect(),
            peak: 0,
        })
    }

    /// The blocks `bytes` hold for `shape` (every layer's keys and values) in `dtype`.
    pub fn blocks_for_bytes(shape: PoolShape, dtype: DType, bytes: u64) -> usize {
        let one = Self::bytes_per_block(shape, dtype).max(1) as u64;
        usize::try_from(bytes / one).unwrap_or(usize::MAX)
    }

    fn bytes_per_block(shape: PoolShape, dtype: DType) -> usize {
        shape.n_layer * 2 * BLOCK * shape.n_kv_head * shape.head_dim * dtype.size_in_bytes()
    }

    pub fn shape(&self) -> PoolShape {
        self.shape
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Layer `li`'s blocks, `(num_blocks, 2, BLOCK, n_kv, head_dim)`: what the paged attention
    /// and the K/V write kernels take.
    pub fn layer(&self, li: usize) -> &Tensor {
        &self.layers[li]
    }

    /// Used and free blocks now (a worker metric).
    pub fn stats(&self) -> PoolStats {
        let used = self.shape.num_blocks - self.free.len();
        PoolStats {
            used,
            free: self.free.len(),
            capacity: self.shape.num_blocks,
            peak: self.peak,
            block_bytes: Self::bytes_per_block(self.shape, self.dtype),
        }
    }

    /// How many tables hold block `b` (0 when free).
    pub fn refcount(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    fn take_block(&mut self) -> Result<u32, PoolError> {
        let b = self
            .free
            .pop()
            .ok_or(PoolError::Full(self.shape.num_blocks))?;
        self.refs[b as usize] = 1;
        self.peak = self.peak.max(self.shape.num_blocks - self.free.len());
        Ok(b)
    }

    fn unref(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push(b);
        }
    }

    /// An empty table (holds no block until written).
    pub fn empty_table(&self) -> BlockTable {
        BlockTable {
            blocks: Vec::new(),
            len: 0,
        }
    }

    /// A table of the same positions sharing every block of `t` (a job's rows after its
    /// prompt): nothing is copied until one of them writes.
    pub fn fork(&mut self, t: &BlockTable) -> BlockTable {
        self.share_prefix(t, t.len)
            .expect("a table's own length is always a valid prefix")
    }

    /// A table of the first `len` positions of `t`, sharing its blocks (a prefix store entry,
    /// or a later job starting from one).
    pub fn share_prefix(&mut self, t: &BlockTable, len: usize) -> Result<BlockTable, PoolError> {
        if len > t.len {
            return Err(PoolError::Table(format!(
                "a prefix of {len} positions of a table holding {}",
                t.len
            )));
        }
        let blocks = t.blocks[..len.div_ceil(BLOCK)].to_vec();
        for &b in &blocks {
            self.refs[b as usize] += 1;
        }
        Ok(BlockTable { blocks, len })
    }

    /// Gives back every block of `t` (a job ended, a prefix was evicted).
    pub fn release(&mut self, t: BlockTable) {
        for b in t.blocks {
            self.unref(b);
        }
    }

    /// Makes room for `n` more positions in `t` and returns their slots, in order. A shared,
    /// partly filled last block is first copied into a block of `t`'s own (every layer).
    pub fn append_slots(&mut self, t: &mut BlockTable, n: usize) -> Result<Vec<u32>, PoolError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        if !t.len.is_multiple_of(BLOCK) {
            let last = *t
                .blocks
                .last()
                .expect("a partly filled table holds a block");
            if self.refs[last as usize] > 1 {
                let own = self.take_block()?;
                self.copy_block(last, own)?;
                self.unref(last);
                *t.blocks.last_mut().expect("checked above") = own;
            }
        }
        let need = (t.len + n).div_ceil(BLOCK);
        while t.blocks.len() < need {
            let b = self.take_block()?;
            t.blocks.push(b);
        }
        let slots = (t.len..t.len + n)
            .map(|p| t.slot(p).expect("the blocks were just taken"))
            .collect();
        t.len += n;
        Ok(slots)
    }

    /// Copies block `src` into block `dst` in every layer.
    fn copy_block(&mut self, src: u32, dst: u32) -> candle_core::Result<()> {
        for layer in &self.layers {
            // Only the block: `copy` of a view would clone the whole layer's storage.
            let block = layer.narrow(0, src as usize, 1)?.force_contiguous()?;
            layer.slice_set(&block, 0, dst as usize)?;
        }
        Ok(())
    }
}

/// The per-row table the paged attention reads, `(rows, 1 + max_blocks)` u32: column 0 is the
/// number of positions the row attends (its length after this step's write), then its block
/// ids, padded with 0 past its last block (never read: the length bounds every read).
pub fn row_table_tensor(rows: &[&BlockTable], device: &Device) -> candle_core::Result<Tensor> {
    let width = 1 + rows.iter().map(|t| t.blocks.len()).max().unwrap_or(0);
    let mut data = vec![0u32; rows.len() * width];
    for (r, t) in rows.iter().enumerate() {
        let row = &mut data[r * width..(r + 1) * width];
        row[0] = t.len as u32;
        row[1..=t.blocks.len()].copy_from_slice(&t.blocks);
    }
    Tensor::from_vec(data, (rows.len(), width), device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(blocks: usize) -> PagedKvPool {
        let shape = PoolShape {
            n_layer: 2,
            n_kv_head: 1,
            head_dim: 4,
            num_blocks: blocks,
        };
        PagedKvPool::new(shape, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_table_takes_blocks_only_as_it_writes() {
        let mut p = pool(8);
        let mut t = p.empty_table();
        let s = p.append_slots(&mut t, 3).unwrap();
        assert_eq!(s, vec![0, 1, 2]);
        assert_eq!(p.stats().used, 1);
        let s = p.append_slots(&mut t, BLOCK).unwrap();
        assert_eq!(s.first(), Some(&3));
        assert_eq!(s.last(), Some(&(BLOCK as u32 + 2)));
        assert_eq!((t.len(), p.stats().used, p.stats().free), (BLOCK + 3, 2, 6));
        p.release(t);
        assert_eq!((p.stats().used, p.stats().free, p.stats().peak), (0, 8, 2));
    }

    #[test]
    fn rows_share_the_prompt_and_copy_its_partial_last_block_on_write() {
        let mut p = pool(8);
        let mut prompt = p.empty_table();
        p.append_slots(&mut prompt, BLOCK + 5).unwrap();
        // Mark the partial block's contents so the copy can be seen.
        let marker = Tensor::ones((1, 2, BLOCK, 1, 4), DType::F32, &Device::Cpu).unwrap();
        p.layer(1).slice_set(&marker, 0, 1).unwrap();
        let mut rows: Vec<_> = (0..3).map(|_| p.fork(&prompt)).collect();
        assert_eq!((p.refcount(0), p.refcount(1)), (4, 4));
        assert_eq!(p.stats().used, 2, "forks copy nothing");
        let slot = p.append_slots(&mut rows[0], 1).unwrap()[0];
        let own = rows[0].blocks()[1];
        assert_ne!(own, 1, "the shared partial block is not written");
        assert_eq!(slot, own * BLOCK as u32 + 5);
        assert_eq!((p.refcount(0), p.refcount(1), p.refcount(own)), (4, 3, 1));
        let copied = p.layer(1).narrow(0, own as usize, 1).unwrap();
        let sum = copied.sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(
            sum,
            (2 * BLOCK * 4) as f32,
            "the copy holds the block's positions"
        );
        p.release(prompt);
        for r in rows {
            p.release(r);
        }
        assert_eq!((p.stats().used, p.stats().free), (0, 8));
    }

    #[test]
    fn a_full_block_is_shared_without_a_copy_and_prefixes_outlive_their_job() {
        let mut p = pool(8);
        let mut prompt = p.empty_table();
        p.append_slots(&mut prompt, 2 * BLOCK).unwrap();
        let stored = p.share_prefix(&prompt, BLOCK + 1).unwrap();
        assert_eq!(stored.blocks(), &prompt.blocks()[..2]);
        let mut row = p.fork(&prompt);
        p.append_slots(&mut row, 1).unwrap();
        assert_eq!(
            &row.blocks()[..2],
            prompt.blocks(),
            "full blocks stay shared"
        );
        p.release(prompt);
        p.release(row);
        assert_eq!(p.stats().used, 2, "the stored prefix keeps its blocks");
        let mut later = p.share_prefix(&stored, BLOCK + 1).unwrap();
        p.append_slots(&mut later, 1).unwrap();
        assert_ne!(later.blocks()[1], stored.blocks()[1], "copy-on-write");
        p.release(stored);
        p.release(later);
        assert_eq!(p.stats().used, 0);
        assert!(p.share_prefix(&p.empty_table(), 1).is_err());
    }

    #[test]
    fn a_full_pool_refuses_and_keeps_its_counts() {
        let mut p = pool(1);
        let mut t = p.empty_table();
        p.append_slots(&mut t, BLOCK).unwrap();
        assert!(matches!(p.append_slots(&mut t, 1), Err(PoolError::Full(1))));
        p.release(t);
        assert_eq!(p.stats().free, 1);
    }

    #[test]
    fn the_row_table_holds_lengths_then_blocks() {
        let mut p = pool(8);
        let mut a = p.empty_table();
        let mut b = p.empty_table();
        p.append_slots(&mut a, 2 * BLOCK + 1).unwrap();
        p.append_slots(&mut b, 1).unwrap();
        let t = row_table_tensor(&[&a, &b], &Device::Cpu).unwrap();
        let v = t.to_vec2::<u32>().unwrap();
        assert_eq!(v[0], vec![2 * BLOCK as u32 + 1, 0, 1, 2]);
        assert_eq!(v[1], vec![1, 3, 0, 0]);
    }
}
