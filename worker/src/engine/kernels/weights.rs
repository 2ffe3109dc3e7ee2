//! Projections concatenated at load so one GEMM computes several: Q, K and V (and their
//! biases) into one `q|k|v` projection, gate and up into one `gate|up` projection, which the
//! fused kernels read ([`super::fused::q_norm_rope`], [`super::fused::silu_mul`]).
//!
//! Dense weights are stored transposed, `(in, out)` contiguous (see the transformer's
//! `Linear::dense`), so the concatenation is along the output dimension: each output column
//! is the same dot product over the same input as before, only in a wider matrix. Quantized
//! (GGUF) projections are not concatenated here: they keep their separate GEMMs.

use candle_core::Tensor;

/// `(in, out_1 + out_2 + ...)` from transposed dense weights `(in, out_i)` of one dtype.
pub fn concat_dense(parts: &[&Tensor]) -> candle_core::Result<Tensor> {
    let rows = parts.first().map(|p| p.dim(0)).transpose()?;
    for p in parts {
        if Some(p.dim(0)?) != rows || p.rank() != 2 || p.dtype() != parts[0].dtype() {
            candle_core::bail!("concatenated weights need one input width and dtype")
        }
    }
    Tensor::cat(parts, 1)?.contiguous()
}

/// The biases `(out_i,)` of concatenated projections: all or none.
pub fn concat_bias(parts: &[Option<&Tensor>]) -> candle_core::Result<Option<Tensor>> {
    if parts.iter().all(Option::is_none) {
        return Ok(None);
    }
    let all: Option<Vec<&Tensor>> = parts.iter().copied().collect();
    match all {
        Some(b) => Ok(Some(Tensor::cat(&b, 0)?)),
        None => candle_core::bail!("concatenated projections with and without a bias"),
    }
}

/// The outputs `(rows, out_i)` of each projection from the concatenated output.
pub fn split_outputs(y: &Tensor, widths: &[usize]) -> candle_core::Result<Vec<Tensor>> {
    let mut at = 0;
    widths
        .iter()
        .map(|&w| {
            let part = y.narrow(1, at, w);
            at += w;
            part
        })
        .collect()
}
