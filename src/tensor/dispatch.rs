//! The tensor's one dispatch to its device's backend: one function per op that takes the
//! operands (found on a device by the op's own file, which computes on the host otherwise),
//! calls the backend contract ([`DeviceTensor`]) on their device storage, and wraps what it
//! returns. With `storage.rs`, the only place of the tensor layer that looks into a device
//! tensor; what the backend has no kernel for comes back as its typed error.

use super::backend::{Binary, DeviceTensor, Unary};
use super::{Element, OptimRule, Tensor};
use crate::{Error, Result};

/// The device storage of `t`, an operand of `op`; an error when it is on the host (the op's file
/// calls here once it has found its operands on a device, so only a mixed call meets it).
fn dev<'a, T: Element>(op: &'static str, t: &'a Tensor<T>) -> Result<&'a dyn DeviceTensor<T>> {
    t.device_storage().ok_or_else(|| Error::InvalidArgument {
        op,
        rank: 0,
        reason: "an operand on the host beside one on a device: move it first".into(),
    })
}

/// `op` on every element of `t` (with `scalar` for the scalar forms).
pub(super) fn unary<T: Element>(t: &Tensor<T>, op: Unary, scalar: f64) -> Result<Tensor<T>> {
    Ok(Tensor::from_device(dev(op.name(), t)?.unary(op, scalar)?))
}

/// `a op b`, broadcast to `out_shape`.
pub(super) fn binary<T: Element>(
    a: &Tensor<T>,
    b: &Tensor<T>,
    op: Binary,
    out_shape: &[usize],
) -> Result<Tensor<T>> {
    let name = op.name();
    Ok(Tensor::from_device(dev(name, a)?.binary(dev(name, b)?, op, out_shape)?))
}

/// Every element of `t` converted to `U`.
pub(super) fn cast<T: Element, U: Element>(t: &Tensor<T>) -> Result<Tensor<U>> {
    const OP: &str = "Tensor::cast";
    Ok(Tensor::from_device(dev(OP, t)?.cast(U::DTYPE)?.typed(OP)?))
}

/// `t`'s axes reordered (`axes` checked).
pub(super) fn permute<T: Element>(t: &Tensor<T>, axes: &[usize]) -> Result<Tensor<T>> {
    Ok(Tensor::from_device(dev("Tensor::permute", t)?.permute(axes)?))
}

/// `a @ b` of two matrices.
pub(super) fn matmul<T: Element>(a: &Tensor<T>, b: &Tensor<T>) -> Result<Tensor<T>> {
    const OP: &str = "Tensor::matmul";
    Ok(Tensor::from_device(dev(OP, a)?.matmul(dev(OP, b)?)?))
}

/// `a @ b` per matrix, over the (checked, broadcast) batch dimensions `batch`.
pub(super) fn batched_matmul<T: Element>(
    a: &Tensor<T>,
    b: &Tensor<T>,
    batch: &[usize],
) -> Result<Tensor<T>> {
    const OP: &str = "Tensor::matmul";
    Ok(Tensor::from_device(dev(OP, a)?.batched_matmul(dev(OP, b)?, batch)?))
}

/// `a^T @ b`.
pub(super) fn matmul_lhs_transposed<T: Element>(a: &Tensor<T>, b: &Tensor<T>) -> Result<Tensor<T>> {
    const OP: &str = "Tensor::matmul_lhs_transposed";
    Ok(Tensor::from_device(dev(OP, a)?.matmul_lhs_transposed(dev(OP, b)?)?))
}

/// The softmax of `t` along `axis`.
pub(super) fn softmax<T: Element>(t: &Tensor<T>, axis: usize) -> Result<Tensor<T>> {
    Ok(Tensor::from_device(dev("Tensor::softmax", t)?.softmax(axis)?))
}

/// A parameter `p` of a normalization of `x`, which lives on a device: on that device too.
fn param<'a, T: Element>(
    op: &'static str,
    x: &Tensor<T>,
    p: Option<&'a Tensor<T>>,
) -> Result<Option<&'a dyn DeviceTensor<T>>> {
    match p {
        None => Ok(None),
        Some(p) => match p.device_storage() {
            Some(d) => Ok(Some(d)),
            None => Err(Error::InvalidArgument {
                op,
                rank: 0,
                reason: format!(
                    "the input is on {} and a parameter on {}: move it first",
                    x.device(),
                    p.device()
                ),
            }),
        },
    }
}

/// The RMS norm (`layer` false) or layer norm of `x`, named `op`, its parameters on its device.
pub(super) fn norm<T: Element>(
    op: &'static str,
    x: &Tensor<T>,
    weight: Option<&Tensor<T>>,
    bias: Option<&Tensor<T>>,
    eps: f64,
    layer: bool,
) -> Result<Tensor<T>> {
    let d = dev(op, x)?;
    let (w, b) = (param(op, x, weight)?, param(op, x, bias)?);
    Ok(Tensor::from_device(d.norm(w, b, eps, layer)?))
}

/// `dx`, and the weight and bias gradients where asked for.
pub(super) type NormGrads<T> = (Tensor<T>, Option<(Tensor<T>, Tensor<T>)>);

/// The gradients of a norm at `x` given `dy` (and `weight`), all on one device.
pub(super) fn norm_backward<T: Element>(
    x: &Tensor<T>,
    weight: Option<&Tensor<T>>,
    dy: &Tensor<T>,
    eps: f64,
    centered: bool,
    params: bool,
) -> Result<NormGrads<T>> {
    let op = if centered { "layer_norm backward" } else { "rms_norm backward" };
    let w = weight.map(|w| dev(op, w)).transpose()?;
    let (dx, grads) = dev(op, x)?.norm_backward(w, dev(op, dy)?, eps, centered, params)?;
    let wrap = Tensor::from_device;
    Ok((wrap(dx), grads.map(|(dw, db)| (wrap(dw), wrap(db)))))
}

/// The sum (or mean) of every element of `t`, a 0-D tensor on its device.
pub(super) fn total<T: Element>(t: &Tensor<T>, mean: bool) -> Result<Tensor<T>> {
    let op = if mean { "Tensor::mean" } else { "Tensor::sum" };
    Ok(Tensor::from_device(dev(op, t)?.total(mean)?))
}

/// The sum (or mean) of `t` along `axis`.
pub(super) fn sum_axis<T: Element>(t: &Tensor<T>, axis: usize, mean: bool) -> Result<Tensor<T>> {
    let op = if mean { "Tensor::mean_axis" } else { "Tensor::sum_axis" };
    Ok(Tensor::from_device(dev(op, t)?.sum_axis(axis, mean)?))
}

/// `dy * act'(x)`.
pub(super) fn activation_grad<T: Element>(
    x: &Tensor<T>,
    dy: &Tensor<T>,
    act: Unary,
) -> Result<Tensor<T>> {
    let op = act.backward_name();
    Ok(Tensor::from_device(dev(op, x)?.activation_grad(dev(op, dy)?, act)?))
}

/// `act(x + bias)`.
pub(super) fn bias_activation<T: Element>(
    x: &Tensor<T>,
    bias: &Tensor<T>,
    act: Unary,
) -> Result<Tensor<T>> {
    const OP: &str = "bias and activation";
    Ok(Tensor::from_device(dev(OP, x)?.bias_activation(dev(OP, bias)?, act)?))
}

/// `dy * act'(x + bias)`.
pub(super) fn bias_activation_grad<T: Element>(
    x: &Tensor<T>,
    bias: &Tensor<T>,
    dy: &Tensor<T>,
    act: Unary,
) -> Result<Tensor<T>> {
    const OP: &str = "bias and activation backward";
    let grad = dev(OP, x)?.bias_activation_grad(dev(OP, bias)?, dev(OP, dy)?, act)?;
    Ok(Tensor::from_device(grad))
}

/// The mean squared error's gradient `(p - t) * scale` (on the device) and sum of squared
/// differences (brought to the host).
pub(super) fn mse_parts<T: Element>(
    p: &Tensor<T>,
    t: &Tensor<T>,
    scale: f64,
) -> Result<(Tensor<T>, f64)> {
    const OP: &str = "mse_loss";
    let (grad, sum) = dev(OP, p)?.mse_parts(dev(OP, t)?, scale)?;
    let sum = Tensor::from_device(sum).to_host()?.as_slice()[0];
    Ok((Tensor::from_device(grad), sum))
}

/// One optimizer step of `value` (see `Tensor::optim_step_`): the new value.
pub(super) fn optimizer_step<T: Element>(
    value: &Tensor<T>,
    master: Option<&Tensor<T::Acc>>,
    grad: &Tensor<T>,
    state: &[Tensor<T::Acc>],
    rule: OptimRule,
) -> Result<Tensor<T>> {
    const OP: &str = "optimizer step";
    let master = master.map(|m| dev(OP, m)).transpose()?;
    let state = state.iter().map(|s| dev(OP, s)).collect::<Result<Vec<_>>>()?;
    let stepped = dev(OP, value)?.optimizer_step(master, dev(OP, grad)?, &state, rule)?;
    Ok(Tensor::from_device(stepped))
}
