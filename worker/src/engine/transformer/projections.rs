//! Projections of one layer that read the same input (`q`, `k`, `v`; `gate`, `up`), held once:
//! apart as loaded, or concatenated into one matrix ([`Projections::Fused`]) when the `fused`
//! switch is on and every one of them is dense. Every caller, the prefill and both decode
//! steps, reads them through [`Projections::outputs`] or [`Projections::joined`], so a model
//! never keeps both forms.
//!
//! The concatenation is along the output dimension (dense weights are stored `(in, out)`, see
//! [`Linear::dense`]): each output column is the same dot product over the same input as
//! before, only in a wider matrix, and the outputs are its column ranges
//! ([`weights::split_outputs`]).

use candle_core::Tensor;

use super::{Linear, LinearWeight, ops};
use crate::engine::kernels::weights::{self, concat_bias, concat_dense};

/// `N` projections of one input (see the module docs).
#[derive(Debug, Clone)]
pub enum Projections<const N: usize> {
    /// As loaded: one matrix each.
    Separate([Linear; N]),
    /// One matrix of the `N` side by side; `widths` are their output widths, in order.
    Fused { linear: Linear, widths: [usize; N] },
}

impl<const N: usize> Projections<N> {
    /// The matrices held: the `N` apart, or the one concatenated.
    pub fn linears(&self) -> &[Linear] {
        match self {
            Projections::Separate(l) => l,
            Projections::Fused { linear, .. } => std::slice::from_ref(linear),
        }
    }

    /// Each projection's output `(rows, out_i)` of `x`, every matrix applied by `apply` (the
    /// plain forward, or its decode tiles): views of the one output when fused.
    pub fn outputs(
        &self,
        x: &Tensor,
        apply: impl Fn(&Linear, &Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<[Tensor; N]> {
        let outs = match self {
            Projections::Separate(l) => l.iter().map(|l| apply(l, x)).collect::<Result<_, _>>()?,
            Projections::Fused { linear, widths } => {
                weights::split_outputs(&apply(linear, x)?, widths)?
            }
        };
        let outs: Vec<Tensor> = outs;
        outs.try_into()
            .map_err(|_| candle_core::Error::Msg("a projection's output is missing".into()))
    }

    /// The outputs side by side, `(rows, sum of out_i)`: the one output when fused, else the
    /// outputs joined.
    pub fn joined(
        &self,
        x: &Tensor,
        apply: impl Fn(&Linear, &Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        match self {
            Projections::Separate(l) => {
                let outs = l
                    .iter()
                    .map(|l| apply(l, x))
                    .collect::<Result<Vec<_>, _>>()?;
                ops::cat(&outs, 1)
            }
            Projections::Fused { linear, .. } => apply(linear, x),
        }
    }

    /// Whether every matrix is dense (only dense ones are concatenated).
    pub fn all_dense(&self) -> bool {
        self.linears()
            .iter()
            .all(|l| matches!(l.weight, LinearWeight::Dense(_)))
    }

    /// Concatenates the separate matrices (and their biases) into one, which is then the only
    /// one held; fused or not dense: unchanged.
    pub fn fuse(&mut self) -> candle_core::Result<()> {
        let Projections::Separate(parts) = self else {
            return Ok(());
        };
        let mut dense = Vec::with_capacity(N);
        for l in parts.iter() {
            match &l.weight {
                LinearWeight::Dense(w) => dense.push(w),
                LinearWeight::Quantized(_) => return Ok(()),
            }
        }
        let mut widths = [0; N];
        for (w, d) in widths.iter_mut().zip(&dense) {
            *w = d.dim(1)?;
        }
        let bias: Vec<Option<&Tensor>> = parts.iter().map(|l| l.bias.as_ref()).collect();
        let linear = Linear {
            weight: LinearWeight::Dense(concat_dense(&dense)?),
            bias: concat_bias(&bias)?,
        };
        *self = Projections::Fused { linear, widths };
        Ok(())
    }
}
