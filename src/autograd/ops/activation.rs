//! Activations on [`Var`]: GELU (exact and tanh forms), SiLU, ReLU, and softmax along an axis.
//! Derivatives are computed per element in f64 and rounded once.

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::device::cuda::Unary;
use crate::tensor::device_activation_grad;
use crate::{Element, Result, Tensor};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

fn gelu_grad(x: f64) -> f64 {
    let cdf = 0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2));
    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    cdf + x * pdf
}

fn gelu_tanh_grad(x: f64) -> f64 {
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    let th = u.tanh();
    0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
}

fn silu_grad(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

fn relu_grad(x: f64) -> f64 {
    if x > 0.0 { 1.0 } else { 0.0 }
}

impl<'a, T: Element> Var<'a, T> {
    /// `act` forward (`value`), its derivative `d` on the host or `act`'s backward kernel on a
    /// GPU.
    fn elementwise(&self, value: Tensor<T>, d: fn(f64) -> f64, act: Unary) -> Var<'a, T> {
        let x = self.value.clone();
        record(value, &[self], move |g, _| {
            if let Some(on_gpu) = device_activation_grad("Var activation backward", &x, g, act) {
                return Ok(vec![Some(on_gpu?)]);
            }
            Ok(vec![Some(g.zip_map(&x, |g, x| T::from_f64(g.to_f64() * d(x.to_f64())))?)])
        })
    }

    /// [`Tensor::gelu`].
    pub fn gelu(&self) -> Var<'a, T> {
        self.elementwise(self.value.gelu(), gelu_grad, Unary::Gelu)
    }

    /// [`Tensor::gelu_tanh`].
    pub fn gelu_tanh(&self) -> Var<'a, T> {
        self.elementwise(self.value.gelu_tanh(), gelu_tanh_grad, Unary::GeluTanh)
    }

    /// [`Tensor::silu`].
    pub fn silu(&self) -> Var<'a, T> {
        self.elementwise(self.value.silu(), silu_grad, Unary::Silu)
    }

    /// [`Tensor::relu`].
    pub fn relu(&self) -> Var<'a, T> {
        self.elementwise(self.value.relu(), relu_grad, Unary::Relu)
    }

    /// [`Tensor::softmax`]: `dx = y * (dy - sum(dy * y))` along `axis`.
    ///
    /// # Errors
    /// As [`Tensor::softmax`].
    pub fn softmax(&self, axis: usize) -> Result<Var<'a, T>> {
        let y = self.value.softmax(axis)?;
        let saved = y.clone();
        Ok(record(y, &[self], move |g, _| {
            let gy = g * &saved;
            let dot = gy.sum_axis(axis)?.insert_axis(axis)?;
            Ok(vec![Some(gy - &(&saved * &dot))])
        }))
    }
}
