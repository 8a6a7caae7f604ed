//! RMS and layer normalization on [`Var`], over the last axis, with optional learnable weight
//! (and bias). The backward pass is `Tensor::norm_grad`'s (crate-internal): row by row in f64
//! on the host, or the norm backward kernels where the values live on a GPU:
//!
//! - rms_norm: `x^ = x r`, `r = 1 / sqrt(mean(x^2) + eps)`, `y = x^ w`;
//!   `dx = r (dx^ - x^ mean(dx^ x^))` with `dx^ = dy w`; `dw = sum over rows of dy x^`.
//! - layer_norm: `x^ = (x - mean(x)) r`; `dx = r (dx^ - mean(dx^) - x^ mean(dx^ x^))`;
//!   `dw = sum dy x^`, `db = sum dy`.

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result};

impl<'a, T: Element> Var<'a, T> {
    /// [`Tensor::rms_norm`](crate::Tensor::rms_norm) over the last axis, with an optional learnable weight of one value
    /// per feature.
    ///
    /// # Errors
    /// As [`Tensor::rms_norm`](crate::Tensor::rms_norm).
    pub fn rms_norm(&self, weight: Option<&Var<'a, T>>, eps: f64) -> Result<Var<'a, T>> {
        let value = self.value.rms_norm(weight.map(|w| &w.value), eps)?;
        let x = self.value.clone();
        let w = weight.map(|w| w.value.clone());
        let mut inputs = vec![self];
        inputs.extend(weight);
        Ok(record(value, &inputs, move |g, need| {
            let want_w = w.is_some() && need[1];
            let (dx, params) = x.norm_grad(w.as_ref(), g, eps, false, want_w)?;
            let mut grads = vec![need[0].then_some(dx)];
            if w.is_some() {
                grads.push(params.map(|(dw, _)| dw));
            }
            Ok(grads)
        }))
    }

    /// [`Tensor::layer_norm`](crate::Tensor::layer_norm) over the last axis, with an optional learnable weight and bias.
    ///
    /// # Errors
    /// As [`Tensor::layer_norm`](crate::Tensor::layer_norm).
    pub fn layer_norm(
        &self,
        weight: Option<&Var<'a, T>>,
        bias: Option<&Var<'a, T>>,
        eps: f64,
    ) -> Result<Var<'a, T>> {
        let value = self.value.layer_norm(weight.map(|w| &w.value), bias.map(|b| &b.value), eps)?;
        let x = self.value.clone();
        let w = weight.map(|w| w.value.clone());
        let has_bias = bias.is_some();
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        Ok(record(value, &inputs, move |g, need| {
            // need[1..] follows the inputs: the weight (if any), then the bias (if any).
            let (want_w, want_b) = match (w.is_some(), has_bias) {
                (true, true) => (need[1], need[2]),
                (true, false) => (need[1], false),
                (false, true) => (false, need[1]),
                (false, false) => (false, false),
            };
            let (dx, params) = x.norm_grad(w.as_ref(), g, eps, true, want_w || want_b)?;
            let (dw, db) = params.unzip();
            let mut grads = vec![need[0].then_some(dx)];
            if w.is_some() {
                grads.push(dw.filter(|_| want_w));
            }
            if has_bias {
                grads.push(db.filter(|_| want_b));
            }
            Ok(grads)
        }))
    }
}
