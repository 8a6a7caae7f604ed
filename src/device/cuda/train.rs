//! Training on one GPU tensor: the device arms of the activations' backward pass, of
//! `mse_loss`, of weight gradients and of the optimizers' steps (`kernels/train.cu`, cuBLASLt). Each launches on the first input's stream, after the
//! streams that wrote the others, and returns without waiting.

use super::Unary;
use super::blas;
use super::kernels::{self, Source};
use super::local::{after, bias_fits, chunk_grid, launch_words, output, same_gpu, vec_len};
use super::storage::DeviceStorage;
use crate::tensor::{Element, OptimRule};
use crate::{Error, Result};

/// `dy * f'(x)` for the activation `f` (`Unary::Gelu`, `GeluTanh`, `Silu` or `Relu`), elementwise;
/// `x` and `dy` have one shape (checked by the caller).
pub(crate) fn activation_grad<T: Element>(
    x: &DeviceStorage<T>,
    dy: &DeviceStorage<T>,
    act: Unary,
) -> Result<DeviceStorage<T>> {
    same_gpu("activation backward", x, dy)?;
    let name = match act {
        Unary::Gelu => "dt_gelu_grad",
        Unary::GeluTanh => "dt_gelu_tanh_grad",
        Unary::Silu => "dt_silu_grad",
        Unary::Relu => "dt_relu_grad",
        other => {
            return Err(Error::InvalidArgument {
                op: "activation backward",
                rank: 0,
                reason: format!("{other:?} is not an activation"),
            });
        }
    };
    let out = output::<T, T>(x, x.shape())?;
    let n = x.len();
    if n == 0 {
        return Ok(out);
    }
    after(x, dy)?;
    x.gpu().bind()?;
    let f = kernels::function(x.gpu(), Source::Train, T::DTYPE, name)?;
    // A block per chunk of DT_UNROLL (4) vectors a thread, as local.rs's `chunk_grid`.
    let grid = chunk_grid(n / vec_len::<T>());
    launch_words(x, f, grid, &[out.ptr(), x.ptr(), dy.ptr(), n as u64])?;
    Ok(out)
}

/// The gradient through [`bias_activation`](super::local::bias_activation): `dy * act'(x +
/// bias)`, the sum rounded as the forward rounded it (recomputed, not stored): the bits of
/// [`activation_grad`] at that sum, in one pass where the bias kernels take the shapes.
pub(crate) fn bias_activation_grad<T: Element>(
    x: &DeviceStorage<T>,
    bias: &DeviceStorage<T>,
    dy: &DeviceStorage<T>,
    act: Unary,
) -> Result<DeviceStorage<T>> {
    same_gpu("bias and activation backward", x, bias)?;
    same_gpu("bias and activation backward", x, dy)?;
    let name = match act {
        Unary::Gelu => "dt_bias_gelu_grad",
        Unary::GeluTanh => "dt_bias_gelu_tanh_grad",
        Unary::Silu => "dt_bias_silu_grad",
        Unary::Relu => "dt_bias_relu_grad",
        other => {
            return Err(Error::InvalidArgument {
                op: "bias and activation backward",
                rank: 0,
                reason: format!("{other:?} is not an activation"),
            });
        }
    };
    if dy.shape() != x.shape() {
        return Err(Error::InvalidShape {
            op: "bias and activation backward",
            reason: format!("the gradient is {:?}, the input {:?}", dy.shape(), x.shape()),
        });
    }
    if !bias_fits(x, bias) {
        let sum = super::local::binary(x, bias, super::Binary::Add, x.shape())?;
        return activation_grad(&sum, dy, act);
    }
    let out = output::<T, T>(x, x.shape())?;
    let n = x.len();
    after(x, bias)?;
    after(x, dy)?;
    x.gpu().bind()?;
    let f = kernels::function(x.gpu(), Source::Train, T::DTYPE, name)?;
    let cols = x.shape().last().copied().unwrap_or(0) as u64;
    let words = [out.ptr(), x.ptr(), bias.ptr(), dy.ptr(), n as u64, cols];
    launch_words(x, f, chunk_grid(n / vec_len::<T>()), &words)?;
    Ok(out)
}

/// `MseArgs` in train.cu./// `MseArgs` in train.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MseArgs {
    grad: u64,
    p: u64,
    t: u64,
    partial: u64,
    n: u64,
    chunk: u64,
    scale: f64,
}

/// Elements of `dt_mse`'s chunks (a block's each): a whole number of 16-byte vectors.
const MSE_CHUNK: usize = 16 << 10;

/// `mse_loss`'s parts for a prediction `p` and a target `t` of one shape (checked by the caller),
/// in one pass: the gradient `(p - t) * scale` in the accumulator type rounded once, and the sum
/// of `(p - t)^2` in f64, a 0-D tensor on the GPU.
pub(crate) fn mse_parts<T: Element>(
    p: &DeviceStorage<T>,
    t: &DeviceStorage<T>,
    scale: f64,
) -> Result<(DeviceStorage<T>, DeviceStorage<f64>)> {
    same_gpu("mse_loss", p, t)?;
    after(p, t)?;
    let n = p.len();
    let grad = output::<T, T>(p, p.shape())?;
    let sum = output::<T, f64>(p, &[])?;
    let chunks = n.div_ceil(MSE_CHUNK).max(1);
    let partials = output::<T, f64>(p, &[chunks])?;
    let args = MseArgs {
        grad: grad.ptr(),
        p: p.ptr(),
        t: t.ptr(),
        partial: partials.ptr(),
        n: n as u64,
        chunk: MSE_CHUNK as u64,
        scale,
    };
    p.gpu().bind()?;
    let f = kernels::function(p.gpu(), Source::Train, T::DTYPE, "dt_mse")?;
    let blocks = (chunks as u64).min(p.gpu().sm_count as u64 * f.blocks_per_sm as u64) as u32;
    kernels::launch(f, blocks, kernels::BLOCK, p.stream(), &args)?;
    let f = kernels::function(p.gpu(), Source::Train, T::DTYPE, "dt_mse_total")?;
    launch_words(p, f, 1, &[sum.ptr(), partials.ptr(), chunks as u64])?;
    // The partials go back to the cache behind the second pass, queued on the same stream.
    drop(partials);
    Ok((grad, sum))
}

/// `a^T @ b` for `a: [k, m]` and `b: [k, n]` on one GPU, `a` read transposed in place by
/// cuBLASLt (a weight's gradient: the rows of a layer's input times the rows of its output's
/// gradient).
pub(crate) fn matmul_lhs_transposed<T: Element>(
    a: &DeviceStorage<T>,
    b: &DeviceStorage<T>,
) -> Result<DeviceStorage<T>> {
    same_gpu("Tensor::matmul_lhs_transposed", a, b)?;
    after(a, b)?;
    let (k, m, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let out = output::<T, T>(a, &[m, n])?;
    a.gpu().bind()?;
    blas::matmul(
        a.gpu(),
        a.stream(),
        (a.ptr(), b.ptr(), out.ptr()),
        (m, n, k),
        blas::Transposed { a: true, b: false },
        T::DTYPE,
        T::DTYPE,
    )?;
    Ok(out)
}

/// `OptArgs` in train.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct OptArgs {
    out: u64,
    p: u64,
    master: u64,
    g: u64,
    s0: u64,
    s1: u64,
    n: u64,
    lr: f64,
    a: f64,
    b: f64,
    eps: f64,
    shrink: f64,
    root: f64,
    mode: u32,
}

/// One optimizer step of the parameter `value` with gradient `grad`: returns the new value (a
/// new buffer, since the old one may be shared with saved activations or a caller's clone). The
/// optimizer's own buffers are updated in place: `master` (the f32 copy of a half-type
/// parameter, `None` for f32 and f64) and `state` (`[velocity]` for SGD with momentum, `[m, v]`
/// for Adam, `[]` for plain SGD), in the parameter's accumulator type. The caller
/// (`Tensor::optim_step_`) has checked the lengths and the number of buffers.
pub(crate) fn optimizer_step<T: Element>(
    value: &DeviceStorage<T>,
    master: Option<&DeviceStorage<T::Acc>>,
    grad: &DeviceStorage<T>,
    state: &[&DeviceStorage<T::Acc>],
    rule: OptimRule,
) -> Result<DeviceStorage<T>> {
    const OP: &str = "optimizer step";
    let n = value.len();
    same_gpu(OP, value, grad)?;
    after(value, grad)?;
    for s in master.iter().chain(state) {
        same_gpu(OP, value, *s)?;
        after(value, *s)?;
    }
    let out = output::<T, T>(value, value.shape())?;
    if n == 0 {
        return Ok(out);
    }
    let mut args = OptArgs {
        out: out.ptr(),
        p: value.ptr(),
        master: master.map_or(0, |m| m.ptr()),
        g: grad.ptr(),
        s0: state.first().map_or(0, |s| s.ptr()),
        s1: state.get(1).map_or(0, |s| s.ptr()),
        n: n as u64,
        ..Default::default()
    };
    match rule {
        OptimRule::Sgd { lr, momentum, weight_decay } => {
            (args.lr, args.a, args.b) = (lr, momentum, weight_decay);
            args.mode = u32::from(momentum != 0.0);
        }
        OptimRule::Adam { step, beta1, beta2, eps, shrink, root } => {
            (args.lr, args.a, args.b, args.eps) = (step, beta1, beta2, eps);
            (args.shrink, args.root, args.mode) = (shrink, root, 2);
        }
    }
    value.gpu().bind()?;
    let f = kernels::function(value.gpu(), Source::Train, T::DTYPE, "dt_optim")?;
    // Four elements a thread, one pass (dt_optim walks grid-stride past the cap).
    let grid = n.div_ceil(4 * kernels::BLOCK as usize).clamp(1, 1 << 24) as u32;
    kernels::launch(f, grid, kernels::BLOCK, value.stream(), &args)?;
    Ok(out)
}

/// `host` (of `shape`) copied to the GPU where `like` lives, in its world (its streams): the
/// optimizers' state loaded from a checkpoint, for parameters on that GPU.
pub(crate) fn upload_like<T: Element, U: Element>(
    like: &DeviceStorage<T>,
    host: &[U],
    shape: &[usize],
) -> Result<DeviceStorage<U>> {
    DeviceStorage::upload(like.gpu(), host, shape, like.home())
}
