//! The KV cache of one job on the CPU fast path ([`CpuCache`]): the prompt's keys and values
//! once (`shared`), then one short suffix per candidate row; keys stored transposed (`d × cap`
//! per KV head) so 16 keys load as one vector. Also where a forward call's positions go
//! ([`Slot`]). A finished job's prompt part can seed the next job's cache
//! ([`CpuCache::load_prefix`], the engine's prefix store). Split from `model.rs`, which reads
//! and writes the fields.

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
#[derive(Debug)]
pub struct CpuCache {
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

    /// Bytes of the prompt's keys and values (what a stored prefix holds).
    pub fn shared_bytes(&self) -> usize {
        let floats: usize = self.shared.iter().map(|s| s.kt.len() + s.v.len()).sum();
        floats * std::mem::size_of::<f32>()
    }

    /// The prompt part alone: the candidate rows are dropped (a finished job's cache kept for
    /// prefix reuse needs only the prompt's positions).
    pub fn into_prompt(mut self) -> CpuCache {
        self.rows = Vec::new();
        self.row_len = Vec::new();
        self.row_cap = 0;
        self
    }

    /// Starts this empty cache with the first `len` prompt positions of `src`, so the next
    /// forward call continues at position `len`. The copied keys and values are the bits a
    /// prefill of the same tokens computes (a position's KV depends only on the tokens up to
    /// it), so what follows is computed exactly as without the copy. Keys are stored
    /// transposed: the first `len` columns of every `d`-row of `kt`, the first `len` rows of
    /// every KV head's `v`.
    pub fn load_prefix(
        &mut self,
        cfg: &TransformerConfig,
        src: &CpuCache,
        len: usize,
    ) -> Result<(), String> {
        let (d, nkv) = (cfg.head_dim, cfg.n_kv_head);
        let (dc, sc) = (self.shared_cap, src.shared_cap);
        if self.shared_len != 0 || !self.rows.is_empty() {
            return Err("load_prefix: the cache is not empty".into());
        }
        if len > src.shared_len || len > dc || src.shared.len() != self.shared.len() {
            return Err("load_prefix: the prefix does not fit".into());
        }
        let shape_ok = |c: &CpuCache| {
            c.shared
                .iter()
                .all(|s| s.kt.len() == nkv * d * c.shared_cap)
        };
        if !shape_ok(self) || !shape_ok(src) {
            return Err("load_prefix: caches of another model".into());
        }
        for (dst, from) in self.shared.iter_mut().zip(&src.shared) {
            for r in 0..nkv * d {
                dst.kt[r * dc..r * dc + len].copy_from_slice(&from.kt[r * sc..r * sc + len]);
            }
            for g in 0..nkv {
                dst.v[g * dc * d..(g * dc + len) * d]
                    .copy_from_slice(&from.v[g * sc * d..(g * sc + len) * d]);
            }
        }
        self.shared_len = len;
        Ok(())
    }
}
