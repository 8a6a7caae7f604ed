//! Activations on [`Var`]: GELU (exact and tanh forms), SiLU, ReLU, and softmax along an axis.
//! Derivatives are computed per element in f64 and rounded once (the tensors' `*_backward`).

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result, Tensor};

/// The gradient through an activation at `x` given its output's gradient: one of
/// [`Tensor::gelu_backward`], [`Tensor::gelu_tanh_backward`], [`Tensor::silu_backward`],
/// [`Tensor::relu_backward`] (on the host or the GPU, wherever `x` lives).
type Backward<T> = fn(&Tensor<T>, &Tensor<T>) -> Result<Tensor<T>>;

impl<'a, T: Element> Var<'a, T> {
    /// `act` forward (`value`), and `backward` at the saved input.
    fn elementwise(&self, value: Tensor<T>, backward: Backward<T>) -> Var<'a, T> {
        let x = self.value.clone();
        record(value, &[self], move |g, _| Ok(vec![Some(backward(&x, g)?)]))
    }

    /// [`Tensor::gelu`].
    pub fn gelu(&self) -> Var<'a, T> {
        self.elementwise(self.value.gelu(), Tensor::gelu_backward)
    }

    /// [`Tensor::gelu_tanh`].
    pub fn gelu_tanh(&self) -> Var<'a, T> {
        self.elementwise(self.value.gelu_tanh(), Tensor::gelu_tanh_backward)
    }

    /// [`Tensor::silu`].
    pub fn silu(&self) -> Var<'a, T> {
        self.elementwise(self.value.silu(), Tensor::silu_backward)
    }

    /// [`Tensor::relu`].
    pub fn relu(&self) -> Var<'a, T> {
        self.elementwise(self.value.relu(), Tensor::relu_backward)
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
