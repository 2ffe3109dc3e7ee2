//! What a layer does per position of its projections before attention: the bias, the query
//! and key norms and RoPE ([`CpuModel::project_row`]), then the key (transposed) and the value
//! into the job's KV cache ([`CpuModel::store_kv`]), block by block in parallel for a prefill
//! chunk. Each position's numbers are computed alone, so the split changes no bit.

use rayon::prelude::*;

use super::{B, Block, CpuCache, CpuLayer, CpuModel, PAR_MIN_ROWS, Placement, Slot, add, rows_mut};
use crate::engine::cpu::kernels;
use crate::engine::transformer::RopeStyle;

impl CpuModel {
    fn rope(&self, x: &mut [f32], pos: usize) {
        let d = self.config.head_dim;
        let half = d / 2;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        for head in x.chunks_exact_mut(d) {
            for i in 0..half {
                let (a, b) = match self.config.rope_style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }

    /// Per position of layer `li`'s projections `qkv` (`m × (n_head + 2·n_kv)·d`): the bias,
    /// the query and key norms and RoPE, in place; then its key (transposed) and value stored
    /// at its slot of `cache`.
    pub(super) fn store_kv(
        &self,
        li: usize,
        layer: &CpuLayer,
        slots: &[Slot],
        place: &Placement,
        qkv: &mut [f32],
        cache: &mut CpuCache,
    ) {
        let cfg = &self.config;
        let (d, nh, nkv) = (cfg.head_dim, cfg.n_head, cfg.n_kv_head);
        let qkv_n = (nh + 2 * nkv) * d;
        let eps = cfg.rms_eps as f32;
        rows_mut(qkv, qkv_n, &place.positions, 1, |rows, pos| {
            for (row, &p) in rows.chunks_exact_mut(qkv_n).zip(pos) {
                self.project_row(layer, row, p, eps);
            }
        });
        // Store each position's k (transposed) and v at its slot (`make_room` made its block
        // present and this cache's alone: `forward_parts` calls it before any layer).
        let put = |block: &mut Block, at: usize, row: &[f32]| {
            let (k, v) = row[nh * d..].split_at(nkv * d);
            let (kt, vs) = block.layer_mut(li);
            for g in 0..nkv {
                for dd in 0..d {
                    kt[(g * d + dd) * B + at] = k[g * d + dd];
                }
                vs[(g * B + at) * d..(g * B + at + 1) * d].copy_from_slice(&v[g * d..(g + 1) * d]);
            }
        };
        let qkv = &*qkv;
        let m = slots.len();
        if m >= PAR_MIN_ROWS && slots.iter().all(|s| *s == Slot::Shared) {
            // A prefill chunk: block by block in parallel (each block's positions alone).
            let from = cache.shared_len;
            let Some(blocks) = cache.prompt_blocks_mut(from, from + m) else {
                unreachable!("make_room gives every written position a block of its own");
            };
            blocks.into_par_iter().for_each(|(p0, block)| {
                for p in p0..((p0 / B + 1) * B).min(from + m) {
                    put(
                        block,
                        p % B,
                        &qkv[(p - from) * qkv_n..(p - from + 1) * qkv_n],
                    );
                }
            });
            return;
        }
        for (i, row) in qkv.chunks_exact(qkv_n).enumerate() {
            let slot = match slots[i] {
                Slot::Shared => cache.prompt_slot(cache.shared_len + i),
                Slot::Row(r) => cache.row_slot(r, place.row_pos[i]),
            };
            let Some((block, at)) = slot else {
                unreachable!("make_room gives every written position a block of its own");
            };
            put(block, at, row);
        }
    }

    /// One position's projections `row` (`(n_head + 2·n_kv)·d`) at position `pos`: the bias,
    /// the query and key norms and RoPE, in place.
    fn project_row(&self, layer: &CpuLayer, row: &mut [f32], pos: usize, eps: f32) {
        let cfg = &self.config;
        let (d, nh, nkv) = (cfg.head_dim, cfg.n_head, cfg.n_kv_head);
        if let Some(b) = &layer.qkv_bias {
            add(row, b);
        }
        let (q, kv) = row.split_at_mut(nh * d);
        let k = &mut kv[..nkv * d];
        if let Some(w) = &layer.q_norm {
            let src = q.to_vec();
            kernels::rms_norm(&src, w, eps, q);
        }
        if let Some(w) = &layer.k_norm {
            let src = k.to_vec();
            kernels::rms_norm(&src, w, eps, k);
        }
        self.rope(q, pos);
        self.rope(k, pos);
    }
}
