//! The KV cache of one job on the CPU fast path ([`CpuCache`]): the prompt's keys and values
//! once (`shared`), then one short suffix per candidate row; keys stored transposed (`d × cap`
//! per KV head) so 16 keys load as one vector. Also where a forward call's positions go
//! ([`Slot`]). A finished job's prompt part can seed later jobs' caches
//! ([`CpuCache::on_prefix`], the engine's prefix store): they share its positions read-only
//! (an `Arc`, never a copy) and hold only their own prompt positions after them. Split from
//! `model.rs`, which reads and writes the fields.

use std::sync::Arc;

use super::attention::KvRun;
use crate::engine::transformer::TransformerConfig;

/// Per-layer keys/values of one run of positions.
#[derive(Debug)]
pub(super) struct Seg {
    /// `n_kv × d × cap`.
    pub(super) kt: Vec<f32>,
    /// `n_kv × cap × d`.
    pub(super) v: Vec<f32>,
}

/// Where a position of a forward call goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The next prompt position (shared by every row).
    Shared,
    /// The next position of candidate row `r`.
    Row(usize),
}

/// The attention state of one ticket: the prompt once, then one suffix per candidate row.
///
/// The prompt's first `base` positions may live in a `parent` prompt cache shared with other
/// jobs (a stored prefix, read-only); `shared` holds positions `base..shared_cap` (so its
/// segments have room for `shared_cap - base`). `shared_len` and `shared_cap` count from
/// position 0.
#[derive(Debug)]
pub struct CpuCache {
    pub(super) parent: Option<Arc<CpuCache>>,
    pub(super) base: usize,
    pub(super) shared: Vec<Seg>,
    pub(super) shared_len: usize,
    pub(super) shared_cap: usize,
    pub(super) rows: Vec<Vec<Seg>>,
    pub(super) row_len: Vec<usize>,
    pub(super) row_cap: usize,
}

impl CpuCache {
    /// An empty cache with room for `prompt_cap` prompt positions.
    pub fn new(c: &TransformerConfig, prompt_cap: usize) -> CpuCache {
        let sz = c.n_kv_head * c.head_dim * prompt_cap;
        CpuCache {
            parent: None,
            base: 0,
            shared: (0..c.n_layer)
                .map(|_| Seg {
                    kt: vec![0.0; sz],
                    v: vec![0.0; sz],
                })
                .collect(),
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

    /// Adds `n` candidate rows with room for `cap` positions each (after the prompt).
    pub fn add_rows(&mut self, cfg: &TransformerConfig, n: usize, cap: usize) {
        self.row_cap = cap;
        let sz = cfg.n_kv_head * cfg.head_dim * cap;
        self.rows = (0..n)
            .map(|_| {
                (0..cfg.n_layer)
                    .map(|_| Seg {
                        kt: vec![0.0; sz],
                        v: vec![0.0; sz],
                    })
                    .collect()
            })
            .collect();
        self.row_len = vec![0; n];
    }

    /// Whether the prompt's first positions are shared from a stored prompt.
    pub fn has_parent(&self) -> bool {
        self.parent.is_some()
    }

    /// Room in the own prompt segments (positions `base..shared_cap`).
    pub(super) fn own_cap(&self) -> usize {
        self.shared_cap - self.base
    }

    /// The prompt's keys and values of layer `li`, KV head `g`, for its first `upto`
    /// positions (at most `shared_cap`; positions a forward call is writing count): the
    /// parent's part, then the own part (in position order, as attention reads them).
    pub(super) fn prompt_runs(&self, li: usize, g: usize, d: usize, upto: usize) -> [KvRun<'_>; 2] {
        fn run(seg: &Seg, g: usize, d: usize, cap: usize, len: usize) -> KvRun<'_> {
            KvRun {
                kt: &seg.kt[g * d * cap..(g + 1) * d * cap],
                v: &seg.v[g * cap * d..(g + 1) * cap * d],
                cap,
                len,
            }
        }
        let inherited = match &self.parent {
            Some(p) => run(&p.shared[li], g, d, p.shared_cap, upto.min(self.base)),
            None => KvRun::EMPTY,
        };
        let own = run(
            &self.shared[li],
            g,
            d,
            self.own_cap(),
            upto.saturating_sub(self.base),
        );
        [inherited, own]
    }

    /// Bytes of the prompt's own keys and values (what a stored prefix holds: a stored
    /// prompt has no parent, see [`Self::into_prompt`]).
    pub fn shared_bytes(&self) -> usize {
        let floats: usize = self.shared.iter().map(|s| s.kt.len() + s.v.len()).sum();
        floats * std::mem::size_of::<f32>()
    }

    /// The prompt part alone, in one piece: the candidate rows are dropped (a finished job's
    /// cache kept for prefix reuse needs only the prompt's positions), and positions shared
    /// from a parent are copied in, so a stored prompt never keeps another alive.
    pub fn into_prompt(mut self, cfg: &TransformerConfig) -> CpuCache {
        self.rows = Vec::new();
        self.row_len = Vec::new();
        self.row_cap = 0;
        let Some(parent) = self.parent.take() else {
            return self;
        };
        let (d, nkv) = (cfg.head_dim, cfg.n_kv_head);
        let (len, base, own, pc) = (
            self.shared_len,
            self.base,
            self.own_cap(),
            parent.shared_cap,
        );
        let mut flat = CpuCache::new(cfg, len);
        for ((dst, from), mine) in flat.shared.iter_mut().zip(&parent.shared).zip(&self.shared) {
            // Keys: `n_kv·d` rows of `cap` positions.
            for r in 0..nkv * d {
                dst.kt[r * len..r * len + base].copy_from_slice(&from.kt[r * pc..r * pc + base]);
                dst.kt[r * len + base..(r + 1) * len]
                    .copy_from_slice(&mine.kt[r * own..r * own + len - base]);
            }
            // Values: per KV head, `cap` positions of `d`.
            for g in 0..nkv {
                dst.v[g * len * d..(g * len + base) * d]
                    .copy_from_slice(&from.v[g * pc * d..(g * pc + base) * d]);
                dst.v[(g * len + base) * d..(g + 1) * len * d]
                    .copy_from_slice(&mine.v[g * own * d..(g * own + len - base) * d]);
            }
        }
        flat.shared_len = len;
        flat
    }

    /// A cache for a prompt of `prompt_cap` positions whose first `len` are those of `src` (a
    /// stored prompt, which has no parent): they are shared, not copied, and the next forward
    /// call continues at position `len`, writing its positions into this cache's own part. A
    /// position's keys and values depend only on the tokens up to it, so what follows is
    /// computed exactly as after a prefill of the same tokens.
    pub fn on_prefix(
        cfg: &TransformerConfig,
        src: &Arc<CpuCache>,
        len: usize,
        prompt_cap: usize,
    ) -> Result<CpuCache, String> {
        let (d, nkv) = (cfg.head_dim, cfg.n_kv_head);
        if src.parent.is_some() {
            return Err("on_prefix: the prefix is not a stored prompt".into());
        }
        if len > src.shared_len || len > prompt_cap || src.shared.len() != cfg.n_layer {
            return Err("on_prefix: the prefix does not fit".into());
        }
        if !src
            .shared
            .iter()
            .all(|s| s.kt.len() == nkv * d * src.shared_cap)
        {
            return Err("on_prefix: caches of another model".into());
        }
        let mut cache = CpuCache::new(cfg, prompt_cap - len);
        cache.parent = Some(src.clone());
        cache.base = len;
        cache.shared_len = len;
        cache.shared_cap = prompt_cap;
        Ok(cache)
    }
}
