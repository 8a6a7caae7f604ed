//! A bias along the last dimension, then an activation, as one op: what an MLP's hidden layer
//! computes between its two products, and its backward pass. On a GPU each is one pass over the
//! elements with the sum never stored (the backward pass recomputes it); elsewhere, and for
//! shapes the kernels do not take, the add and the activation run apart. Both ways give the same
//! bits: the sum is rounded to the element type before the activation sees it.

use super::map::broadcast_shape;
use super::{Element, Tensor};
use crate::device::cuda::{self, Unary};
use crate::{Error, Result};

impl<T: Element> Tensor<T> {
    /// `act(self + bias)`, with `bias` broadcast as the operator broadcasts it (on a GPU in one
    /// pass where it is `[last dimension]`): the bits of `&self + bias` and then `act`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the shapes do not broadcast to `self`'s;
    /// [`Error::InvalidArgument`] when `act` is not an activation (GELU, its tanh form, SiLU,
    /// ReLU); as the ops on a GPU.
    pub(crate) fn bias_activation(&self, bias: &Tensor<T>, act: Unary) -> Result<Tensor<T>> {
        const OP: &str = "bias and activation";
        check(OP, self, bias, act)?;
        if let (Some(x), Some(b)) = (self.device_storage(), bias.device_storage()) {
            return Ok(Tensor::from_device_storage(cuda::bias_activation(x, b, act)?));
        }
        let sum = self + bias;
        Ok(match act {
            Unary::Gelu => sum.gelu(),
            Unary::GeluTanh => sum.gelu_tanh(),
            Unary::Silu => sum.silu(),
            _ => sum.relu(),
        })
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
        act: Unary,
    ) -> Result<Tensor<T>> {
        const OP: &str = "bias and activation backward";
        check(OP, self, bias, act)?;
        if dy.shape() != self.shape() {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!("the gradient is {:?}, the input {:?}", dy.shape(), self.shape()),
            });
        }
        if let (Some(x), Some(b), Some(d)) =
            (self.device_storage(), bias.device_storage(), dy.device_storage())
        {
            return Ok(Tensor::from_device_storage(cuda::bias_activation_grad(x, b, d, act)?));
        }
        let sum = self + bias;
        match act {
            Unary::Gelu => sum.gelu_backward(dy),
            Unary::GeluTanh => sum.gelu_tanh_backward(dy),
            Unary::Silu => sum.silu_backward(dy),
            _ => sum.relu_backward(dy),
        }
    }
}

/// That `bias` broadcasts to `x`'s shape and `act` is an activation.
fn check<T: Element>(op: &'static str, x: &Tensor<T>, bias: &Tensor<T>, act: Unary) -> Result<()> {
    if !matches!(act, Unary::Gelu | Unary::GeluTanh | Unary::Silu | Unary::Relu) {
        return Err(Error::InvalidArgument {
            op,
            rank: 0,
            reason: format!("{act:?} is not an activation"),
        });
    }
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
