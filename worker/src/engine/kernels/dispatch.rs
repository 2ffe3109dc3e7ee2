//! Which kernels a decode step runs ([`KernelUse`]): each one the switches select and the
//! device's [`self_check`](super::self_check) passed, the others their reference composition
//! ([`super::reference`], the same signatures). So a kernel found wrong on a device costs
//! speed, never results.

use candle_core::Tensor;

use super::params::{QkvSpec, Rope};
use super::self_check::{KernelId, SelfCheckReport};
use super::{flash_prefill, fused, paged_attention, qkv_rope, reference};
use crate::engine::switches::KernelsOn;

/// The kernels in use (see the module header); all off runs every composition.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelUse {
    pub paged_attention: bool,
    pub add_rms_norm: bool,
    pub qk_rope_kv: bool,
    pub silu_mul: bool,
    pub flash_prefill: bool,
}

impl KernelUse {
    /// The kernels `report` found usable that the switches in `on` select.
    pub fn new(report: &SelfCheckReport, on: KernelsOn) -> KernelUse {
        let on = report.in_use(on);
        KernelUse {
            paged_attention: on.contains(&KernelId::PagedAttention),
            add_rms_norm: on.contains(&KernelId::AddRmsNorm),
            qk_rope_kv: on.contains(&KernelId::QkNormRopeKv),
            silu_mul: on.contains(&KernelId::SiluMul),
            flash_prefill: on.contains(&KernelId::FlashPrefill),
        }
    }

    fn on(&self, k: KernelId) -> bool {
        match k {
            KernelId::PagedAttention => self.paged_attention,
            KernelId::AddRmsNorm => self.add_rms_norm,
            KernelId::QkNormRopeKv => self.qk_rope_kv,
            KernelId::SiluMul => self.silu_mul,
            KernelId::FlashPrefill => self.flash_prefill,
        }
    }

    /// Device operations one call of `k` issues over `rows` rows (for the q/k norm + RoPE,
    /// the queries' and the K/V write's together): 1 per kernel launch, the composition's
    /// count otherwise (its matmuls, elementwise ops, copies and uploads, as the transformer's
    /// op counter counts them).
    pub fn launches(&self, k: KernelId, rows: usize) -> usize {
        if self.on(k) {
            return if k == KernelId::QkNormRopeKv { 2 } else { 1 };
        }
        match k {
            KernelId::AddRmsNorm | KernelId::SiluMul => 2,
            // Queries: copy out, norm, transpose, two table lookups, RoPE, transpose; then the
            // same for keys and a copy of the values, an index upload, a cat and the scatter.
            KernelId::QkNormRopeKv => 7 + 7 + 1 + 4,
            // The table read back, then per row a gather, casts, matmuls and a softmax.
            KernelId::PagedAttention => 1 + 12 * rows,
            // An upload, the gather, casts, matmuls, the mask and a softmax.
            KernelId::FlashPrefill => 14,
        }
    }

    pub fn add_rms_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        w: &Tensor,
        eps: f32,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        match self.add_rms_norm {
            true => fused::add_rms_norm(x, residual, w, eps),
            false => reference::add_rms_norm(x, residual, w, eps),
        }
    }

    pub fn silu_mul(&self, gate_up: &Tensor) -> candle_core::Result<Tensor> {
        match self.silu_mul {
            true => fused::silu_mul(gate_up),
            false => reference::silu_mul(gate_up),
        }
    }

    pub fn q_norm_rope(
        &self,
        qkv: &Tensor,
        spec: &QkvSpec,
        rope: &Rope,
        positions: &Tensor,
    ) -> candle_core::Result<Tensor> {
        match self.qk_rope_kv {
            true => qkv_rope::q_norm_rope(qkv, spec, rope, positions),
            false => reference::q_norm_rope(qkv, spec, rope, positions),
        }
    }

    /// The K/V write at `slots` (on the device) or, by the composition, at `host_slots` (the
    /// same slots on the host).
    pub fn kv_norm_rope_write(
        &self,
        pool_layer: &Tensor,
        qkv: &Tensor,
        (spec, rope): (&QkvSpec, &Rope),
        positions: &Tensor,
        (slots, host_slots): (&Tensor, &[u32]),
    ) -> candle_core::Result<()> {
        if self.qk_rope_kv {
            return qkv_rope::kv_norm_rope_write(pool_layer, qkv, spec, rope, positions, slots);
        }
        let (k, v) = reference::kv_norm_rope(qkv, spec, rope, positions)?;
        reference::write_slots(pool_layer, &k, &v, host_slots)
    }

    pub fn paged_decode_attention(
        &self,
        q: &Tensor,
        pool_layer: &Tensor,
        table: &Tensor,
        scale: f32,
    ) -> candle_core::Result<Tensor> {
        match self.paged_attention {
            true => paged_attention::paged_decode_attention(q, pool_layer, table, scale),
            false => reference::paged_decode_attention(q, pool_layer, table, scale),
        }
    }

    /// The prefill attention of one job's chunk over the pool (the flash prefill kernel, or
    /// its composition: the yardstick, which holds the chunk's scores).
    pub fn flash_prefill_attention(
        &self,
        q: &Tensor,
        pool_layer: &Tensor,
        table: &Tensor,
        scale: f32,
    ) -> candle_core::Result<Tensor> {
        match self.flash_prefill {
            true => flash_prefill::flash_prefill_attention(q, pool_layer, table, scale),
            false => reference::flash_prefill_attention(q, pool_layer, table, scale),
        }
    }
}
