//! RMS and layer normalization on [`Var`], over the last axis, with optional learnable weight
//! (and bias). The backward pass works row by row in f64:
//!
//! - rms_norm: `x^ = x r`, `r = 1 / sqrt(mean(x^2) + eps)`, `y = x^ w`;
//!   `dx = r (dx^ - x^ mean(dx^ x^))` with `dx^ = dy w`; `dw = sum over rows of dy x^`.
//! - layer_norm: `x^ = (x - mean(x)) r`; `dx = r (dx^ - mean(dx^) - x^ mean(dx^ x^))`;
//!   `dw = sum dy x^`, `db = sum dy`.
//!
//! On a GPU the rows are brought to the host for this f64 pass and the gradients put back on
//! the GPU (there is no norm backward kernel yet): correct, with a copy each way.

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result, Tensor};

/// [`norm_backward`] wherever `x` lives: the gradients of a GPU `x` are computed on the host
/// and returned on its GPU (`dx`, `dw` and `db` beside `x`).
fn norm_backward_beside<T: Element>(
    x: &Tensor<T>,
    w: Option<&Tensor<T>>,
    g: &Tensor<T>,
    eps: f64,
    centered: bool,
) -> Result<(Tensor<T>, Tensor<T>, Tensor<T>)> {
    let w = w.map(Tensor::to_host).transpose()?;
    let (dx, dw, db) = norm_backward(&x.to_host()?, w.as_ref(), &g.to_host()?, eps, centered)?;
    Ok((dx.into_place_of(x)?, vector(dw).into_place_of(x)?, vector(db).into_place_of(x)?))
}

/// The backward pass of both norms: `centered` says whether the mean is subtracted.
fn norm_backward<T: Element>(
    x: &Tensor<T>,
    w: Option<&Tensor<T>>,
    g: &Tensor<T>,
    eps: f64,
    centered: bool,
) -> Result<(Tensor<T>, Vec<f64>, Vec<f64>)> {
    let n = *x.shape().last().expect("checked by the forward");
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

impl<'a, T: Element> Var<'a, T> {
    /// [`Tensor::rms_norm`] over the last axis, with an optional learnable weight of one value
    /// per feature.
    ///
    /// # Errors
    /// As [`Tensor::rms_norm`].
    pub fn rms_norm(&self, weight: Option<&Var<'a, T>>, eps: f64) -> Result<Var<'a, T>> {
        let value = self.value.rms_norm(weight.map(|w| &w.value), eps)?;
        let x = self.value.clone();
        let w = weight.map(|w| w.value.clone());
        let mut inputs = vec![self];
        inputs.extend(weight);
        Ok(record(value, &inputs, move |g, need| {
            let (dx, dw, _) = norm_backward_beside(&x, w.as_ref(), g, eps, false)?;
            let mut grads = vec![need[0].then_some(dx)];
            if w.is_some() {
                grads.push(need[1].then_some(dw));
            }
            Ok(grads)
        }))
    }

    /// [`Tensor::layer_norm`] over the last axis, with an optional learnable weight and bias.
    ///
    /// # Errors
    /// As [`Tensor::layer_norm`].
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
            let (dx, dw, db) = norm_backward_beside(&x, w.as_ref(), g, eps, true)?;
            let mut grads = vec![need[0].then_some(dx)];
            let mut next = 1;
            if w.is_some() {
                grads.push(need[next].then_some(dw));
                next += 1;
            }
            if has_bias {
                grads.push(need[next].then_some(db));
            }
            Ok(grads)
        }))
    }
}
