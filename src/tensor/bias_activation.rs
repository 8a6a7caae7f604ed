//! A bias along the last dimension, then an activation, as one op: what an MLP's hidden layer
//! computes between its two products, and its backward pass. On a GPU each is one pass over the
//! elements with the sum never stored (the backward pass recomputes it); elsewhere, and for
//! shapes the kernels do not take, the add and the activation run apart. Both ways give the same
//! bits: the sum is rounded to the element type before the activation sees it.

use super::backend::Unary;
use super::dispatch;
use super::map::broadcast_shape;
use super::{Element, Tensor};
use crate::{Error, Result};

/// The activations [`Tensor::bias_activation`] applies after the bias: named here, in the
/// tensor layer, so that the layers above it (autograd, `nn`) name no backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ActivationFn {
    /// The exact GELU, [`Tensor::gelu`].
    Gelu,
    /// [`Tensor::gelu_tanh`].
    GeluTanh,
    /// [`Tensor::silu`].
    Silu,
    /// [`Tensor::relu`].
    Relu,
}

impl ActivationFn {
    /// The GPU kernels' name for it.
    fn unary(self) -> Unary {
        match self {
            ActivationFn::Gelu => Unary::Gelu,
            ActivationFn::GeluTanh => Unary::GeluTanh,
            ActivationFn::Silu => Unary::Silu,
            ActivationFn::Relu => Unary::Relu,
        }
    }

    /// The activation of `x`, elementwise.
    pub(crate) fn forward<T: Element>(self, x: &Tensor<T>) -> Tensor<T> {
        match self {
            ActivationFn::Gelu => x.gelu(),
            ActivationFn::GeluTanh => x.gelu_tanh(),
            ActivationFn::Silu => x.silu(),
            ActivationFn::Relu => x.relu(),
        }
    }

    /// The gradient through it at `x`, given its output's gradient `dy`.
    pub(crate) fn backward<T: Element>(self, x: &Tensor<T>, dy: &Tensor<T>) -> Result<Tensor<T>> {
        match self {
            ActivationFn::Gelu => x.gelu_backward(dy),
            ActivationFn::GeluTanh => x.gelu_tanh_backward(dy),
            ActivationFn::Silu => x.silu_backward(dy),
            ActivationFn::Relu => x.relu_backward(dy),
        }
    }
}

impl<T: Element> Tensor<T> {
    /// `act(self + bias)`, with `bias` broadcast as the operator broadcasts it (on a GPU in one
    /// pass where it is `[last dimension]`): the bits of `&self + bias` and then `act`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the shapes do not broadcast to `self`'s; as the ops on a
    /// GPU.
    pub(crate) fn bias_activation(&self, bias: &Tensor<T>, act: ActivationFn) -> Result<Tensor<T>> {
        check_bias("bias and activation", self, bias)?;
        if !self.is_on_host() && !bias.is_on_host() {
            return dispatch::bias_activation(self, bias, act.unary());
        }
        Ok(act.forward(&(self + bias)))
    }

    /// The gradient through [`Tensor::bias_activation`] at `self` and `bias`, given the
    /// gradient `dy` of its output: `dy * act'(self + bias)`, the sum rounded as the forward
    /// rounded it (the bits of the activation's `*_backward` at that sum). The bias's gradient
    /// is this summed over the rows.
    ///
    /// # Errors
    /// As [`Tensor::bias_activation`]; [`Error::InvalidShape`] when `dy` is not of `self`'s
    /// shape.
    pub(crate) fn bias_activation_backward(
        &self,
        bias: &Tensor<T>,
        dy: &Tensor<T>,
        act: ActivationFn,
    ) -> Result<Tensor<T>> {
        const OP: &str = "bias and activation backward";
        check_bias(OP, self, bias)?;
        if dy.shape() != self.shape() {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!("the gradient is {:?}, the input {:?}", dy.shape(), self.shape()),
            });
        }
        if !self.is_on_host() && !bias.is_on_host() && !dy.is_on_host() {
            return dispatch::bias_activation_grad(self, bias, dy, act.unary());
        }
        act.backward(&(self + bias), dy)
    }
}

/// That `bias` broadcasts to `x`'s shape.
fn check_bias<T: Element>(op: &'static str, x: &Tensor<T>, bias: &Tensor<T>) -> Result<()> {
    if broadcast_shape(x.shape(), bias.shape()).as_deref() != Some(x.shape()) {
        return Err(Error::InvalidShape {
            op,
            reason: format!(
                "a bias of {:?} does not broadcast to the input's {:?}",
                bias.shape(),
                x.shape()
            ),
        });
    }
    Ok(())
}
