//! The KV cache of one job on the CPU fast path ([`CpuCache`]), paged: a table of
//! [`Block`]s for the prompt, read by every candidate row, then one table per row for its own
//! positions after the prompt; keys stored transposed (`d × B` per KV head and block) so 16
//! keys load as one vector. Also where a forward call's positions go ([`Slot`]).
//!
//! Blocks come from the model's [`KvPool`] when a forward call first writes into them
//! ([`CpuCache::make_room`]), so a job holds what it has computed, not its worst case. The
//! prompt's blocks are `Arc`s: a finished prefill's prompt goes to the engine's prefix store
//! as the same blocks ([`CpuCache::prompt_part`]), and a later job with the same head starts
//! from them ([`CpuCache::on_prefix`]): shared, never copied, except the one block a job
//! writes into while another holds it (copy-on-write, its first positions copied). Rows never
//! write into the prompt's blocks (their positions go to blocks of their own), so they share
//! even the prompt's last, partial block without a copy. Split from `model.rs`, which reads and
//! writes the fields.

use std::sync::Arc;

use super::attention::KvRun;
use super::kv_pool::{BLOCK_POSITIONS as B, Block, KvPool};

/// Where a position of a forward call goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The next prompt position (shared by every row).
    Shared,
    /// The next position of candidate row `r`.
    Row(usize),
}

/// The attention state of one ticket: the prompt once, then one suffix per candidate row.
/// `shared_len` and `shared_cap` count prompt positions, `row_len[r]` and `row_cap` row `r`'s
/// own positions after the prompt.
#[derive(Debug)]
pub struct CpuCache {
    pool: Arc<KvPool>,
    /// Block `i` holds prompt positions `i·B..(i+1)·B`.
    pub(super) prompt: Vec<Arc<Block>>,
    pub(super) shared_len: usize,
    pub(super) shared_cap: usize,
    /// Row `r`'s block `i` holds its own positions `i·B..(i+1)·B`.
    pub(super) rows: Vec<Vec<Block>>,
    pub(super) row_len: Vec<usize>,
    pub(super) row_cap: usize,
}

/// Layer `li`, KV head `g`'s run of the first `len` positions of `block`.
fn run<'a>(block: &'a Block, li: usize, g: usize, d: usize, len: usize) -> KvRun<'a> {
    let (kt, v) = block.layer(li);
    KvRun {
        kt: &kt[g * d * B..(g + 1) * d * B],
        v: &v[g * B * d..(g + 1) * B * d],
        cap: B,
        len,
    }
}

/// Pushes the runs of the first `upto` positions of a table of blocks onto `out`.
fn runs_of<'a, T: AsRef<Block> + 'a>(
    table: &'a [T],
    li: usize,
    g: usize,
    d: usize,
    upto: usize,
    out: &mut Vec<KvRun<'a>>,
) {
    debug_assert!(table.len() >= upto.div_ceil(B), "positions without a block");
    for (i, b) in table.iter().enumerate().take(upto.div_ceil(B)) {
        out.push(run(b.as_ref(), li, g, d, (upto - i * B).min(B)));
    }
}

impl AsRef<Block> for Block {
    fn as_ref(&self) -> &Block {
        self
    }
}

impl CpuCache {
    /// An empty cache with room for `prompt_cap` prompt positions, its blocks from `pool`.
    pub fn new(pool: &Arc<KvPool>, prompt_cap: usize) -> CpuCache {
        CpuCache {
            pool: pool.clone(),
            prompt: Vec::new(),
            shared_len: 0,
            shared_cap: prompt_cap,
            rows: Vec::new(),
            row_len: Vec::new(),
            row_cap: 0,
        }
    }

    /// Prompt positions cached.
    pub fn shared_len(&self) -> usize {
        self.shared_len
    }

    /// Adds `n` candidate rows with room for `cap` positions each (after the prompt); their
    /// blocks come as they fill.
    pub fn add_rows(&mut self, n: usize, cap: usize) {
        self.row_cap = cap;
        self.rows = (0..n).map(|_| Vec::new()).collect();
        self.row_len = vec![0; n];
    }

    /// Blocks this cache holds (some perhaps shared with others).
    pub fn blocks(&self) -> usize {
        self.prompt.len() + self.rows.iter().map(Vec::len).sum::<usize>()
    }

    /// Bytes of the prompt's blocks (what a stored prefix holds).
    pub fn shared_bytes(&self) -> usize {
        self.prompt.len() * self.pool.block_bytes()
    }

    /// Pushes the runs of layer `li`, KV head `g` of the prompt's first `upto` positions onto
    /// `out`, in position order (as attention reads them).
    pub(super) fn prompt_runs<'a>(
        &'a self,
        li: usize,
        g: usize,
        d: usize,
        upto: usize,
        out: &mut Vec<KvRun<'a>>,
    ) {
        runs_of(&self.prompt, li, g, d, upto, out)
    }

    /// Pushes the runs of row `r`'s first `upto` own positions onto `out`.
    pub(super) fn row_runs<'a>(
        &'a self,
        r: usize,
        li: usize,
        g: usize,
        d: usize,
        upto: usize,
        out: &mut Vec<KvRun<'a>>,
    ) {
        runs_of(&self.rows[r], li, g, d, upto, out)
    }

    /// Makes every block that prompt positions `shared_len..prompt_to` and row positions
    /// `row_len[r]..row_to[r]` go to present and this cache's alone: new blocks from the pool,
    /// a copy of a prompt block another cache or the prefix store also holds.
    pub(super) fn make_room(&mut self, prompt_to: usize, row_to: &[usize]) {
        if prompt_to > self.shared_len {
            for bi in self.shared_len / B..prompt_to.div_ceil(B) {
                if bi == self.prompt.len() {
                    self.prompt.push(Arc::new(self.pool.alloc()));
                } else if Arc::get_mut(&mut self.prompt[bi]).is_none() {
                    self.prompt[bi] = Arc::new(self.prompt[bi].copy());
                }
            }
        }
        for ((table, &len), &to) in self.rows.iter_mut().zip(&self.row_len).zip(row_to) {
            while to > len && table.len() < to.div_ceil(B) {
                table.push(self.pool.alloc());
            }
        }
    }

    /// Forgets row `r`'s last `n` positions (draft tokens the row did not take): the next
    /// forward call writes from there, and blocks left without a position go back to the
    /// pool. A position's keys and values depend only on the tokens up to it, so what is
    /// written next is what it would have been had those positions never been fed.
    pub fn rewind_row(&mut self, r: usize, n: usize) -> Result<(), String> {
        let len = self
            .row_len
            .get(r)
            .and_then(|l| l.checked_sub(n))
            .ok_or_else(|| format!("rewind: row {r} has fewer than {n} positions"))?;
        self.row_len[r] = len;
        self.rows[r].truncate(len.div_ceil(B));
        Ok(())
    }

    /// The block and offset prompt position `p` is written to: `None` unless
    /// [`Self::make_room`] made it this cache's alone.
    pub(super) fn prompt_slot(&mut self, p: usize) -> Option<(&mut Block, usize)> {
        let b = Arc::get_mut(self.prompt.get_mut(p / B)?)?;
        Some((b, p % B))
    }

    /// The blocks prompt positions `from..to` are written to, each with the first of those
    /// positions it holds: `None` unless [`Self::make_room`] made every one this cache's alone.
    pub(super) fn prompt_blocks_mut(
        &mut self,
        from: usize,
        to: usize,
    ) -> Option<Vec<(usize, &mut Block)>> {
        let b0 = from / B;
        let blocks = self.prompt.get_mut(b0..to.div_ceil(B))?.iter_mut();
        blocks
            .enumerate()
            .map(|(j, a)| Arc::get_mut(a).map(|b| (((b0 + j) * B).max(from), b)))
            .collect()
    }

    /// The block and offset row `r`'s own position `p` is written to.
    pub(super) fn row_slot(&mut self, r: usize, p: usize) -> Option<(&mut Block, usize)> {
        Some((self.rows.get_mut(r)?.get_mut(p / B)?, p % B))
    }

    /// The prompt part alone (what the prefix store keeps): the same blocks, shared, and no
    /// rows.
    pub fn prompt_part(&self) -> CpuCache {
        CpuCache {
            pool: self.pool.clone(),
            prompt: self.prompt.clone(),
            shared_len: self.shared_len,
            shared_cap: self.shared_len,
            rows: Vec::new(),
            row_len: Vec::new(),
            row_cap: 0,
        }
    }

    /// A cache for a prompt of `prompt_cap` positions whose first `len` are those of `src` (a
    /// stored prompt): its blocks are shared, and the next forward call continues at position
    /// `len` (into a copy of the block holding it, if `len` ends inside one). A position's keys
    /// and values depend only on the tokens up to it, so what follows is computed exactly as
    /// after a prefill of the same tokens.
    pub fn on_prefix(src: &CpuCache, len: usize, prompt_cap: usize) -> Result<CpuCache, String> {
        if len > src.shared_len || len > prompt_cap {
            return Err("on_prefix: the prefix does not fit".into());
        }
        let mut cache = CpuCache::new(&src.pool, prompt_cap);
        cache.prompt = src.prompt[..len.div_ceil(B)].to_vec();
        cache.shared_len = len;
        Ok(cache)
    }
}
