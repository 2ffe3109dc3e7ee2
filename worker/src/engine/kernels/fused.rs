//! Fused kernels of a decode step, each a candle op with a CPU reference (`cpu_fwd`, run by
//! the candle backend on CPU and in CI) and a CUDA kernel (`worker/kernels/fused.cu`):
//!
//! - [`add_rms_norm`]: `s = x + residual` (rounded to the input dtype, as the residual stream
//!   is), then RMS norm of `s` with f32 statistics (sum of squares in f32, position order on
//!   the CPU, a fixed block tree on CUDA) and an f32 weight; returns `(s, norm(s))`.
//! - [`super::qkv_rope`]'s `q_norm_rope` and `kv_norm_rope_write`: from one concatenated `q|k|v` projection row,
//!   each head's RMS norm (Qwen3's per-head `q_norm`/`k_norm`, rounded to the dtype like the
//!   unfused path), RoPE at the row's position read from a device buffer, and the keys and
//!   values written into the row's slot of the paged pool. Two launches: candle's ops have
//!   one output each, and the pool is written in place.
//! - [`silu_mul`]: `silu(gate) * up` from a concatenated `gate|up` projection, in f32, rounded
//!   once.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor, WithDType};

use super::params::silu_mul_shape;
use super::{cpu_slice, shape_err};

/// Residual add then RMS norm: returns `(x + residual, rms_norm(x + residual) * w)`.
pub fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    w: &Tensor,
    eps: f32,
) -> candle_core::Result<(Tensor, Tensor)> {
    if x.dtype() != residual.dtype() || w.dtype() != DType::F32 || x.dims() != residual.dims() {
        candle_core::bail!("add_rms_norm: x and residual of one shape and dtype, an f32 weight")
    }
    let both = x.contiguous()?.apply_op3_no_bwd(
        &residual.contiguous()?,
        &w.contiguous()?,
        &AddRmsNorm { eps },
    )?;
    Ok((both.get(0)?, both.get(1)?))
}

/// The add + RMS norm op: output `(2, rows, hidden)`, the sum then the normed sum.
#[derive(Debug, Clone, Copy)]
pub struct AddRmsNorm {
    pub eps: f32,
}

fn cpu_add_rms_norm<T: WithDType>(x: &[T], r: &[T], w: &[f32], eps: f32) -> Vec<T> {
    let h = w.len();
    let n = x.len();
    let mut out = vec![T::from_f64(0.0); 2 * n];
    let (sum, normed) = out.split_at_mut(n);
    for (i, s) in sum.iter_mut().enumerate() {
        *s = T::from_f64((x[i].to_f64() as f32 + r[i].to_f64() as f32) as f64);
    }
    for (s, o) in sum.chunks(h).zip(normed.chunks_mut(h)) {
        let ss = s.iter().fold(0f32, |a, v| {
            let v = v.to_f64() as f32;
            a + v * v
        });
        let rms = (ss / h as f32 + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(s).zip(w) {
            *o = T::from_f64((v.to_f64() as f32 / rms * w) as f64);
        }
    }
    out
}

impl candle_core::CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "stageb-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let w = cpu_slice::<f32>(s3, l3)?;
        let h = *l1.dims().last().unwrap_or(&0);
        if w.len() != h || h == 0 {
            return Err(shape_err(format!(
                "add_rms_norm: weight of {} for {h}",
                w.len()
            )));
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(cpu_add_rms_norm(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                w,
                self.eps,
            )),
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => CpuStorage::BF16(cpu_add_rms_norm(
                cpu_slice(s1, l1)?,
                cpu_slice(s2, l2)?,
                w,
                self.eps,
            )),
            _ => candle_core::bail!("add_rms_norm: f32 or bf16 inputs of one dtype"),
        };
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((out, Shape::from(dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::add_rms_norm(self.eps, (s1, l1), (s2, l2), (s3, l3))?;
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((out, Shape::from(dims)))
    }
}

/// `silu(gate) * up` from `(rows, 2 * ff)` holding `gate | up`: returns `(rows, ff)`.
pub fn silu_mul(gate_up: &Tensor) -> candle_core::Result<Tensor> {
    gate_up.contiguous()?.apply_op1_no_bwd(&SiluMul)
}

/// The SiLU·mul op. See [`silu_mul`].
#[derive(Debug, Clone, Copy)]
pub struct SiluMul;

fn cpu_silu_mul<T: WithDType>(x: &[T], ff: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(x.len() / 2);
    for row in x.chunks(2 * ff) {
        let (g, u) = row.split_at(ff);
        out.extend(g.iter().zip(u).map(|(g, u)| {
            let g = g.to_f64() as f32;
            T::from_f64((g / (1.0 + (-g).exp()) * u.to_f64() as f32) as f64)
        }));
    }
    out
}

impl candle_core::CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "stageb-silu-mul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, ff) = silu_mul_shape(l)?;
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(cpu_silu_mul(cpu_slice(s, l)?, ff)),
            CpuStorage::BF16(_) => CpuStorage::BF16(cpu_silu_mul(cpu_slice(s, l)?, ff)),
            _ => candle_core::bail!("silu_mul: f32 or bf16"),
        };
        Ok((out, Shape::from((rows, ff))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, ff) = silu_mul_shape(l)?;
        Ok((super::cuda::silu_mul(s, l)?, Shape::from((rows, ff))))
    }
}
