//! The q/k RMS norm + RoPE + K/V write op behind [`q_norm_rope`] and
//! [`kv_norm_rope_write`]: as a [`candle_core::CustomOp1`] on the `q|k|v` rows it
//! returns the rotated queries; as a [`candle_core::InplaceOp1`] on a pool layer it writes the
//! rotated keys and the values into the rows' slots. One head vector's recipe (shared by both):
//! RMS norm in f32 (sum of squares in index order on the CPU, a fixed block tree on CUDA),
//! rounded to the dtype, then each pair rotated in f32 by the row's `cos`/`sin` and rounded.

use candle_core::{CpuStorage, Layout, Shape, Tensor, WithDType};

use super::params::{QkvRope, QkvSpec, Rope, RopePairs};
use super::pool::{BLOCK, PAD_SLOT};
use super::{cpu_slice, cpu_vec, shape_err};

/// Each query head of `qkv` `(rows, width)` normed and rotated at its row's position
/// (`positions`, `(rows,)` u32 on the device): `(rows, n_head, head_dim)`.
pub fn q_norm_rope(
    qkv: &Tensor,
    spec: &QkvSpec,
    rope: &Rope,
    positions: &Tensor,
) -> candle_core::Result<Tensor> {
    let op = QkvRope::new(spec, rope, positions, None)?;
    qkv.contiguous()?.apply_op1_no_bwd(&op)
}

/// Each key head of `qkv` normed and rotated at its row's position, and each value head, written
/// into the row's slot (`slots`, `(rows,)` u32; see [`super::pool`]) of `pool_layer`.
pub fn kv_norm_rope_write(
    pool_layer: &Tensor,
    qkv: &Tensor,
    spec: &QkvSpec,
    rope: &Rope,
    positions: &Tensor,
    slots: &Tensor,
) -> candle_core::Result<()> {
    let qkv = qkv.contiguous()?;
    let op = QkvRope::new(spec, rope, positions, Some((&qkv, slots)))?;
    pool_layer.inplace_op1(&op)
}

/// Norms (when `w` is given) and rotates one head vector in place, `cs` = (cos, sin) rows.
fn head<T: WithDType>(
    x: &mut [T],
    w: Option<&[f32]>,
    eps: f32,
    cs: (&[T], &[T]),
    pairs: RopePairs,
) {
    let d = x.len();
    let mut f: Vec<f32> = x.iter().map(|v| v.to_f64() as f32).collect();
    if let Some(w) = w {
        let ss = f.iter().fold(0f32, |a, v| a + v * v);
        let rms = (ss / d as f32 + eps).sqrt();
        for (v, w) in f.iter_mut().zip(w) {
            // Rounded to the dtype between the norm and RoPE, like the unfused path.
            *v = T::from_f64((*v / rms * w) as f64).to_f64() as f32;
        }
    }
    let half = d / 2;
    for i in 0..half {
        let (a, b) = match pairs {
            RopePairs::Interleaved => (2 * i, 2 * i + 1),
            RopePairs::Halves => (i, i + half),
        };
        let (c, s) = (cs.0[i].to_f64() as f32, cs.1[i].to_f64() as f32);
        let (xa, xb) = (f[a], f[b]);
        x[a] = T::from_f64((xa * c - xb * s) as f64);
        x[b] = T::from_f64((xa * s + xb * c) as f64);
    }
}

impl QkvRope<'_> {
    /// The rotated queries of `qkv` on the CPU.
    fn cpu_queries<T: WithDType>(&self, qkv: &[T]) -> candle_core::Result<Vec<T>> {
        let QkvSpec {
            n_head,
            head_dim: d,
            ..
        } = self.spec;
        let (width, half) = (self.spec.width(), d / 2);
        let positions = cpu_vec::<u32>(self.positions)?;
        let (cos, sin) = (cpu_vec::<T>(self.rope.cos)?, cpu_vec::<T>(self.rope.sin)?);
        let norm = self.spec.q_norm.map(cpu_vec::<f32>).transpose()?;
        let mut out = Vec::with_capacity(positions.len() * n_head * d);
        for (r, &p) in positions.iter().enumerate() {
            let p = p as usize;
            if (p + 1) * half > cos.len() {
                candle_core::bail!("q/k rope: position {p} past the RoPE tables")
            }
            let cs = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            for h in 0..n_head {
                let start = out.len();
                out.extend_from_slice(&qkv[r * width + h * d..r * width + (h + 1) * d]);
                let (eps, pairs) = (self.spec.eps, self.rope.pairs);
                head(&mut out[start..], norm.as_deref(), eps, cs, pairs);
            }
        }
        Ok(out)
    }

    /// Writes the rotated keys and the values of `qkv` into `pool` (a layer, on the CPU).
    fn cpu_write<T: WithDType>(&self, pool: &mut [T], qkv: &[T]) -> candle_core::Result<()> {
        let QkvSpec {
            n_head,
            n_kv,
            head_dim: d,
            ..
        } = self.spec;
        let (width, half) = (self.spec.width(), d / 2);
        let positions = cpu_vec::<u32>(self.positions)?;
        let slots = cpu_vec::<u32>(self.write.map(|w| w.1).expect("a write has slots"))?;
        let (cos, sin) = (cpu_vec::<T>(self.rope.cos)?, cpu_vec::<T>(self.rope.sin)?);
        let norm = self.spec.k_norm.map(cpu_vec::<f32>).transpose()?;
        let block_len = 2 * BLOCK * n_kv * d;
        for (r, (&p, &slot)) in positions.iter().zip(&slots).enumerate() {
            if slot == PAD_SLOT {
                continue;
            }
            let (p, slot) = (p as usize, slot as usize);
            let (b, off) = (slot / BLOCK, slot % BLOCK);
            if (p + 1) * half > cos.len() || (b + 1) * block_len > pool.len() {
                candle_core::bail!("q/k rope: position {p} or slot {slot} out of range")
            }
            let cs = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            for h in 0..n_kv {
                let kq = r * width + (n_head + h) * d;
                let vq = r * width + (n_head + n_kv + h) * d;
                let kp = ((b * 2) * BLOCK + off) * n_kv * d + h * d;
                let vp = ((b * 2 + 1) * BLOCK + off) * n_kv * d + h * d;
                pool[kp..kp + d].copy_from_slice(&qkv[kq..kq + d]);
                let (eps, pairs) = (self.spec.eps, self.rope.pairs);
                head(&mut pool[kp..kp + d], norm.as_deref(), eps, cs, pairs);
                pool[vp..vp + d].copy_from_slice(&qkv[vq..vq + d]);
            }
        }
        Ok(())
    }
}

impl candle_core::CustomOp1 for QkvRope<'_> {
    fn name(&self) -> &'static str {
        "stageb-q-norm-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let rows = self.rows(l.shape())?;
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(self.cpu_queries(cpu_slice(s, l)?)?),
            CpuStorage::BF16(_) => CpuStorage::BF16(self.cpu_queries(cpu_slice(s, l)?)?),
            _ => candle_core::bail!("q/k rope: f32 or bf16"),
        };
        Ok((
            out,
            Shape::from((rows, self.spec.n_head, self.spec.head_dim)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let rows = self.rows(l.shape())?;
        let out = super::cuda::q_norm_rope(self, rows, s, l)?;
        Ok((
            out,
            Shape::from((rows, self.spec.n_head, self.spec.head_dim)),
        ))
    }
}

impl candle_core::InplaceOp1 for QkvRope<'_> {
    fn name(&self) -> &'static str {
        "stageb-kv-norm-rope-write"
    }

    fn cpu_fwd(&self, pool: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (qkv, _) = self.write.expect("the write op holds its q|k|v rows");
        let (rows, d) = (self.rows(qkv.shape())?, self.spec.head_dim);
        if self.write.is_some_and(|(_, s)| s.dims() != [rows]) {
            candle_core::bail!("q/k rope: one slot per row")
        }
        let (_, two, block, n_kv, d2) = l.shape().dims5()?;
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| shape_err("the pool layer must be contiguous".into()))?;
        if two != 2 || block != BLOCK || n_kv != self.spec.n_kv || d2 != d || end - start == 0 {
            return Err(shape_err(format!("q/k rope: a pool layer {:?}", l.dims())));
        }
        match pool {
            CpuStorage::F32(p) => self.cpu_write(&mut p[start..end], &cpu_vec::<f32>(qkv)?),
            CpuStorage::BF16(p) => self.cpu_write(&mut p[start..end], &cpu_vec(qkv)?),
            _ => candle_core::bail!("q/k rope: f32 or bf16"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, pool: &mut candle_core::CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let (qkv, _) = self.write.expect("the write op holds its q|k|v rows");
        let rows = self.rows(qkv.shape())?;
        super::cuda::kv_norm_rope_write(self, rows, pool, l)
    }
}
