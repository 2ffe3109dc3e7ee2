//! A count of the device operations our transformer code asks candle for, per thread: what a
//! decode step costs the host in calls, whatever the device (`stageb probe rollout` reports it
//! per step as `host_ops_per_step`).
//!
//! What counts one: each candle call that launches work on the device, namely a matmul, an
//! elementwise or broadcast op, an RMS norm, a softmax, a RoPE, an `index_select`, a
//! `slice_set`, a dtype cast that changes the dtype, a `contiguous` or `reshape` of data that
//! is not contiguous (a copy), a tensor made on the device (`zeros`, an upload of host data),
//! and a readback to the host; a `cat` of `n` parts counts `n` (one copy each). Views
//! (`narrow`, `transpose`, `squeeze`, a reshape of contiguous data) and casts to the same dtype
//! count nothing. It counts the calls our code makes, not what candle launches inside one (a
//! quantized matmul or a cuBLAS call may launch more than one kernel): a lower bound of the
//! launches. A thread-local counter, so concurrent engines (tests) do not mix their counts.

use std::cell::Cell;

use candle_core::{DType, Result, Shape, Tensor};

thread_local! {
    static ISSUED: Cell<u64> = const { Cell::new(0) };
}

/// Device operations counted on this thread so far (see the module docs); a step's count is
/// the difference across it.
pub fn issued() -> u64 {
    ISSUED.with(Cell::get)
}

/// Counts `n` operations.
pub(crate) fn add(n: usize) {
    ISSUED.with(|c| c.set(c.get() + n as u64));
}

/// `r`, the result of one call that launches one operation, counted.
pub(crate) fn one<T>(r: Result<T>) -> Result<T> {
    add(1);
    r
}

/// `t` contiguous: a copy (counted) when it is a strided view.
pub(crate) fn contiguous(t: &Tensor) -> Result<Tensor> {
    if !t.is_contiguous() {
        add(1);
    }
    t.contiguous()
}

/// `t` reshaped: a copy (counted) when it is a strided view.
pub(crate) fn reshape<S: Into<Shape>>(t: &Tensor, shape: S) -> Result<Tensor> {
    if !t.is_contiguous() {
        add(1);
    }
    t.reshape(shape)
}

/// `t` in `dtype`: a cast (counted) when it is in another dtype.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() != dtype {
        add(1);
    }
    t.to_dtype(dtype)
}

/// `parts` joined along `dim`: one copy per part.
pub(crate) fn cat<A: AsRef<Tensor>>(parts: &[A], dim: usize) -> Result<Tensor> {
    add(parts.len());
    Tensor::cat(parts, dim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn copies_and_casts_count_views_do_not() {
        let t = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let before = issued();
        let same = cast(&t, DType::F32).unwrap();
        let _ = contiguous(&same).unwrap();
        let _ = reshape(&t, (3, 2)).unwrap();
        assert_eq!(issued(), before, "no copy, no cast, no count");
        let strided = t.t().unwrap();
        let _ = contiguous(&strided).unwrap();
        let _ = reshape(&strided, 6).unwrap();
        let _ = cast(&t, DType::BF16).unwrap();
        let _ = cat(&[&t, &t, &t], 0).unwrap();
        let _ = one(t.exp()).unwrap();
        assert_eq!(issued() - before, 1 + 1 + 1 + 3 + 1);
    }
}
