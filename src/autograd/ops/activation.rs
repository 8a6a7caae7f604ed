//! Activations on [`Var`]: GELU (exact and tanh forms), SiLU, ReLU, and softmax along an axis.
//! Derivatives are computed per element in f64 and rounded once (the tensors' `*_backward`).

use crate::autograd::Var;
use crate::autograd::ops::arith::sum_to_shape;
use crate::autograd::var::record;
use crate::tensor::ActivationFn;
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

    /// `act(self + bias)` as one op, as an MLP's hidden layer computes it: the values and
    /// gradients of `&self + bias` and then the activation (`Tensor::bias_activation`: one pass
    /// each way on a GPU, the sum not kept, its backward pass recomputing it); the bias's
    /// gradient is summed down to its shape as the operator's is.
    ///
    /// # Errors
    /// As `Tensor::bias_activation`.
    pub(crate) fn bias_activation(
        &self,
        bias: &Var<'a, T>,
        act: ActivationFn,
    ) -> Result<Var<'a, T>> {
        let value = self.value.bias_activation(&bias.value, act)?;
        let (x, b) = (self.value.clone(), bias.value.clone());
        Ok(record(value, &[self, bias], move |g, need| {
            let pre = x.bias_activation_backward(&b, g, act)?;
            let db = if need[1] { Some(sum_to_shape(&pre, b.shape())?) } else { None };
            Ok(vec![need[0].then_some(pre), db])
        }))
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
