//! The backward pass of [`Tensor::rms_norm`] and [`Tensor::layer_norm`] over the last axis, for
//! autograd: row by row in f64 on the host, or the kernels of `kernels/norm_grad.cu` (the same
//! formulas, statistics in f64 for f32 and f64, in f32 for the half types) where a GPU holds the
//! input, the output's gradient and the weight.
//!
//! - rms_norm: `x^ = x r`, `r = 1 / sqrt(mean(x^2) + eps)`, `y = x^ w`;
//!   `dx = r (dx^ - x^ mean(dx^ x^))` with `dx^ = dy w`; `dw = sum over rows of dy x^`.
//! - layer_norm: `x^ = (x - mean(x)) r`; `dx = r (dx^ - mean(dx^) - x^ mean(dx^ x^))`;
//!   `dw = sum dy x^`, `db = sum dy`.

use super::{Element, Tensor};
use crate::{Error, Result};

/// `dx`, and the weight and bias gradients `(dw, db)` where asked for.
pub(crate) type NormGrads<T> = (Tensor<T>, Option<(Tensor<T>, Tensor<T>)>);

impl<T: Element> Tensor<T> {
    /// The gradients of rms_norm (`centered` false) or layer_norm of `self` over its last axis
    /// for the output's gradient `dy`, with the weight `weight` (none meaning 1): `dx`, and with
    /// `params` the per-feature `(dw, db)`. All on the GPU where `self`, `dy` and the weight are
    /// on one; on the host otherwise, then placed beside `self`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a 0-D `self`, a `dy` of another shape or a weight that is not
    /// `[last]`; a GPU's launch, allocation or copy error.
    pub(crate) fn norm_grad(
        &self,
        weight: Option<&Tensor<T>>,
        dy: &Tensor<T>,
        eps: f64,
        centered: bool,
        params: bool,
    ) -> Result<NormGrads<T>> {
        let op = if centered { "layer_norm backward" } else { "rms_norm backward" };
        let Some(&n) = self.shape().last() else {
            return Err(Error::InvalidShape {
                op,
                reason: "a 0-D tensor has no last axis to normalize over".to_string(),
            });
        };
        if dy.shape() != self.shape() || weight.is_some_and(|w| w.shape() != [n]) {
            return Err(Error::InvalidShape {
                op,
                reason: format!(
                    "an input of {:?} with an output gradient of {:?} and a weight of {:?}",
                    self.shape(),
                    dy.shape(),
                    weight.map(|w| w.shape().to_vec())
                ),
            });
        }
        let on_device = |t: &Tensor<T>| !t.is_on_host();
        if on_device(self) && on_device(dy) && weight.is_none_or(on_device) {
            return super::dispatch::norm_backward(self, weight, dy, eps, centered, params);
        }
        // The host, and inputs split between the host and a GPU: in f64 on the host.
        let w = weight.map(Tensor::to_host).transpose()?;
        let (dx, dw, db) = host_grads(&self.to_host()?, w.as_ref(), &dy.to_host()?, eps, centered)?;
        let dx = dx.into_place_of(self)?;
        if !params {
            return Ok((dx, None));
        }
        Ok((dx, Some((vector(dw).into_place_of(self)?, vector(db).into_place_of(self)?))))
    }
}

/// The backward pass of both norms on host tensors, in f64: `(dx, dw, db)`.
fn host_grads<T: Element>(
    x: &Tensor<T>,
    w: Option<&Tensor<T>>,
    g: &Tensor<T>,
    eps: f64,
    centered: bool,
) -> Result<(Tensor<T>, Vec<f64>, Vec<f64>)> {
    let n = *x.shape().last().expect("checked by the caller");
    let mut dx = Tensor::<T>::try_zeros(x.shape())?;
    let (mut dw, mut db) = (vec![0.0; n], vec![0.0; n]);
    if n == 0 {
        return Ok((dx, dw, db));
    }
    let w: Vec<f64> = match w {
        Some(w) => w.as_slice().iter().map(|v| v.to_f64()).collect(),
        None => vec![1.0; n],
    };
    let (mut xh, mut gh) = (vec![0.0; n], vec![0.0; n]);
    let rows = x.as_slice().chunks_exact(n).zip(g.as_slice().chunks_exact(n));
    for ((xr, gr), out) in rows.zip(dx.as_mut_slice().chunks_exact_mut(n)) {
        let mean =
            if centered { xr.iter().map(|v| v.to_f64()).sum::<f64>() / n as f64 } else { 0.0 };
        let var = xr.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n as f64;
        let r = 1.0 / (var + eps).sqrt();
        let (mut mean_gh, mut mean_ghxh) = (0.0, 0.0);
        for i in 0..n {
            xh[i] = (xr[i].to_f64() - mean) * r;
            let gi = gr[i].to_f64();
            dw[i] += gi * xh[i];
            db[i] += gi;
            gh[i] = gi * w[i];
            mean_gh += gh[i];
            mean_ghxh += gh[i] * xh[i];
        }
        mean_gh /= n as f64;
        mean_ghxh /= n as f64;
        if !centered {
            mean_gh = 0.0;
        }
        for i in 0..n {
            out[i] = T::from_f64(r * (gh[i] - mean_gh - xh[i] * mean_ghxh));
        }
    }
    Ok((dx, dw, db))
}

fn vector<T: Element>(v: Vec<f64>) -> Tensor<T> {
    Tensor::from(v.into_iter().map(T::from_f64).collect::<Vec<_>>())
}
