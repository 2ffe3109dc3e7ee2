//! A decode step's logits on the host ([`StepLogits`]): the live rows of the step (every fed
//! row of every job, in the step's order), `vocab` f32 logits each, in one buffer the engine
//! keeps and reuses from step to step (grown to the largest step, never shrunk), which each
//! row's sampler reads its slice of. No per-job or per-row allocation.
//!
//! On the candle backend ([`StepLogits::read`]) the rows arrive gathered on the device (pad
//! rows and finished rows dropped) in the dtype the output head computed them in, and are
//! copied to the host once: on the CPU straight from the tensor's storage; on CUDA into a
//! page-locked host buffer (not write-combined, so the host reads it at full speed), also kept
//! and reused, then into the f32 buffer. bf16 logits are widened on the host, which is exact
//! (every bf16 value is an f32), so a row's f32 logits are those the device would have cast.
//! The CPU fast path writes its rows in with [`StepLogits::begin`] and [`StepLogits::row_mut`].

use candle_core::{CpuStorage, Storage, Tensor};

/// The host copy of a step's logits (see the module docs).
pub struct StepLogits {
    vocab: usize,
    rows: usize,
    host: Vec<f32>,
    #[cfg(feature = "cuda")]
    pinned: pinned::Pinned,
}

impl StepLogits {
    pub(crate) fn new(vocab: usize) -> StepLogits {
        StepLogits {
            vocab,
            rows: 0,
            host: Vec::new(),
            #[cfg(feature = "cuda")]
            pinned: pinned::Pinned::default(),
        }
    }

    /// Rows `i..i + n` of the last step, one after another (empty past its rows).
    pub(crate) fn rows(&self, i: usize, n: usize) -> &[f32] {
        if i + n > self.rows {
            return &[];
        }
        &self.host[i * self.vocab..(i + n) * self.vocab]
    }

    /// Starts a step of `rows` rows, to be written with [`Self::row_mut`].
    pub(crate) fn begin(&mut self, rows: usize) {
        let need = rows * self.vocab;
        if self.host.len() < need {
            self.host.resize(need, 0.0);
        }
        self.rows = rows;
    }

    /// Row `i` of the step [`Self::begin`] started.
    pub(crate) fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.host[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The step's rows from `logits` (`(rows, vocab)`, f32 or bf16, on any device), copied to
    /// the host once.
    pub(crate) fn read(&mut self, logits: &Tensor) -> candle_core::Result<()> {
        let (rows, vocab) = logits.dims2()?;
        if vocab != self.vocab {
            candle_core::bail!("logits of {vocab} tokens, expected {}", self.vocab)
        }
        self.begin(rows);
        let n = rows * vocab;
        let (storage, layout) = logits.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("the gathered logits are not contiguous")
        };
        let dst = &mut self.host[..n];
        match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => dst.copy_from_slice(&v[start..end]),
            Storage::Cpu(CpuStorage::BF16(v)) => {
                for (d, s) in dst.iter_mut().zip(&v[start..end]) {
                    *d = s.to_f32();
                }
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => self.pinned.read(c, (start, end), dst)?,
            _ => candle_core::bail!("logits in {:?} cannot be read back", logits.dtype()),
        }
        Ok(())
    }
}

/// The page-locked staging buffers of the CUDA readback, one per dtype the output head may
/// compute in, each grown to the largest step and reused.
#[cfg(feature = "cuda")]
mod pinned {
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
    };
    use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};

    #[derive(Default)]
    pub(super) struct Pinned {
        f32: Option<PinnedHostSlice<f32>>,
        bf16: Option<PinnedHostSlice<half::bf16>>,
    }

    fn err(e: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::Msg(format!("logits readback: {e}"))
    }

    /// Elements `start..end` of `src` in `buf` (allocated or grown first), after the copy
    /// completed.
    fn copy<'a, T: DeviceRepr + ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        src: &CudaSlice<T>,
        (start, end): (usize, usize),
        buf: &'a mut Option<PinnedHostSlice<T>>,
    ) -> candle_core::Result<&'a [T]> {
        let n = end - start;
        if buf.as_ref().is_none_or(|b| b.len() < n) {
            // The old buffer is freed before the larger one is taken.
            *buf = None;
            // SAFETY: the memory starts unset; only the `n` elements the copy below writes
            // are ever read. Flags 0: page-locked, not write-combined (the host reads it).
            let fresh = unsafe { stream.context().alloc_pinned_with_flags::<T>(n, 0) };
            *buf = Some(fresh.map_err(err)?);
        }
        let Some(b) = buf.as_mut() else {
            return Err(err("no staging buffer"));
        };
        stream.memcpy_dtoh(&src.slice(start..end), b).map_err(err)?;
        stream.synchronize().map_err(err)?;
        Ok(&b.as_slice().map_err(err)?[..n])
    }

    impl Pinned {
        /// Elements `range` of `c` (f32 or bf16) into `dst` as f32, through the staging
        /// buffer of their dtype.
        pub(super) fn read(
            &mut self,
            c: &CudaStorage,
            range: (usize, usize),
            dst: &mut [f32],
        ) -> candle_core::Result<()> {
            let stream = c.device.cuda_stream();
            match &c.slice {
                CudaStorageSlice::F32(s) => {
                    dst.copy_from_slice(copy(&stream, s, range, &mut self.f32)?);
                }
                CudaStorageSlice::BF16(s) => {
                    let src = copy(&stream, s, range, &mut self.bf16)?;
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = s.to_f32();
                    }
                }
                _ => return Err(err("logits are neither f32 nor bf16")),
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn rows_read_once_are_the_tensors_rows_and_bf16_widens_exactly() {
        let v: Vec<f32> = (0..12).map(|i| i as f32 * 0.37 - 2.0).collect();
        let t = Tensor::from_vec(v.clone(), (3, 4), &Device::Cpu).unwrap();
        let mut s = StepLogits::new(4);
        s.read(&t.narrow(0, 1, 2).unwrap()).unwrap();
        assert_eq!(s.rows, 2);
        assert_eq!(s.rows(0, 1), &v[4..8]);
        assert_eq!(s.rows(1, 1), &v[8..12]);
        assert_eq!(s.rows(0, 2), &v[4..12]);
        assert!(s.rows(2, 1).is_empty(), "past the step's rows");
        assert!(s.rows(1, 2).is_empty(), "past the step's rows");

        let b = t.to_dtype(DType::BF16).unwrap();
        let want: Vec<Vec<f32>> = b.to_dtype(DType::F32).unwrap().to_vec2().unwrap();
        s.read(&b).unwrap();
        for (i, w) in want.iter().enumerate() {
            assert_eq!(
                s.rows(i, 1),
                w.as_slice(),
                "row {i}: the device cast's values"
            );
        }
        assert!(
            s.read(&t.t().unwrap()).is_err(),
            "the vocabulary must match"
        );
    }
}
