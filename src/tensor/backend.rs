//! The contract between the tensor layer and a device backend: [`DeviceTensor`], what a tensor
//! that lives on a device is, and the local math and moves the tensor layer asks of it.
//!
//! Modelled on candle-core's `BackendStorage` (one trait that every device implements in its own
//! folder) and burn's `Backend`: a backend implements the trait for its storage type in
//! `src/device/<backend>/`, and a tensor holds it as `Storage::Device(Arc<dyn DeviceTensor<T>>)`.
//! The tensor's one dispatch file (`tensor/dispatch.rs`) is the only place that calls it.
//!
//! Every method that computes has a default body returning [`Error::DeviceUnavailable`] naming
//! the op ([`no_kernel`]): a backend that implements nothing yet still gives typed errors, never
//! a panic, and a backend grows op by op. Only what a tensor must always be able to answer has
//! no default: its shape, its device, and [`DeviceTensor::as_any`] (for the backend's own
//! downcasts of the other operands, which are `&dyn DeviceTensor<T>` here).
//!
//! The methods that change the element type (`cast`, `upload_like`) cannot be generic on a trait
//! object: they take and give the element type as a value ([`DType`], [`HostElements`],
//! [`AnyDeviceTensor`]).

use std::any::{Any, TypeId};
use std::sync::Arc;

use half::{bf16, f16};

use super::{DType, Device, Element, OptimRule};
use crate::{Error, Result};

/// A tensor on a device, shared (device tensors are immutable once written; ops make new ones).
pub(crate) type DeviceArc<T> = Arc<dyn DeviceTensor<T>>;

/// `dx`, and the weight and bias gradients `(dw, db)` where asked for, on the device.
pub(crate) type DeviceNormGrads<T> = (DeviceArc<T>, Option<(DeviceArc<T>, DeviceArc<T>)>);

/// An elementwise op of one tensor on a device; the scalar forms take the scalar beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unary {
    Neg,
    Relu,
    Silu,
    /// The exact GELU (f32 and f64 through erf; the half types in f32, rounded once).
    Gelu,
    GeluTanh,
    /// `x + s`.
    AddScalar,
    /// `x - s`.
    SubScalar,
    /// `x * s`.
    MulScalar,
    /// `x / s`.
    DivScalar,
    /// `s - x`.
    ScalarSub,
    /// `s / x`.
    ScalarDiv,
}

impl Unary {
    /// The op's name in errors: the tensor method or operator that runs it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Unary::Neg => "-Tensor",
            Unary::Relu => "Tensor::relu",
            Unary::Silu => "Tensor::silu",
            Unary::Gelu => "Tensor::gelu",
            Unary::GeluTanh => "Tensor::gelu_tanh",
            Unary::AddScalar => "Tensor + scalar",
            Unary::SubScalar => "Tensor - scalar",
            Unary::MulScalar => "Tensor * scalar",
            Unary::DivScalar => "Tensor / scalar",
            Unary::ScalarSub => "scalar - Tensor",
            Unary::ScalarDiv => "scalar / Tensor",
        }
    }

    /// The name in errors of the gradient through an activation (`Tensor::gelu_backward`, ...).
    pub(crate) fn backward_name(self) -> &'static str {
        match self {
            Unary::Relu => "Tensor::relu_backward",
            Unary::Silu => "Tensor::silu_backward",
            Unary::Gelu => "Tensor::gelu_backward",
            Unary::GeluTanh => "Tensor::gelu_tanh_backward",
            _ => "activation backward",
        }
    }
}

/// An elementwise op of two tensors on a device, broadcast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Binary {
    Add,
    Sub,
    Mul,
    Div,
}

impl Binary {
    /// The op's name in errors: the operator's, as the host's broadcast errors name it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Binary::Add => "Tensor + Tensor",
            Binary::Sub => "Tensor - Tensor",
            Binary::Mul => "Tensor * Tensor",
            Binary::Div => "Tensor / Tensor",
        }
    }
}

/// Host elements of any element type, borrowed: what [`DeviceTensor::upload_like`] copies.
// Read by the backends; a build without `cuda` has none (the tests' fake reads nothing).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, Copy)]
pub(crate) enum HostElements<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl<'a> HostElements<'a> {
    /// `elements` tagged with their type.
    pub(crate) fn of<U: Element>(elements: &'a [U]) -> Self {
        fn as_slice<U: 'static, V: 'static>(s: &[U]) -> Option<&[V]> {
            // SAFETY: the type ids are equal, so `U` is `V`.
            (TypeId::of::<U>() == TypeId::of::<V>())
                .then(|| unsafe { &*(s as *const [U] as *const [V]) })
        }
        if let Some(s) = as_slice(elements) {
            HostElements::F32(s)
        } else if let Some(s) = as_slice(elements) {
            HostElements::F64(s)
        } else if let Some(s) = as_slice(elements) {
            HostElements::F16(s)
        } else if let Some(s) = as_slice(elements) {
            HostElements::BF16(s)
        } else {
            unreachable!("Element is sealed: f32, f64, f16 and bf16")
        }
    }
}

/// A device tensor whose element type is a value: what [`DeviceTensor::cast`] and
/// [`DeviceTensor::upload_like`] return ([`AnyDeviceTensor::new`] on the backend's side,
/// [`AnyDeviceTensor::typed`] on the tensor's).
pub(crate) struct AnyDeviceTensor(Box<dyn Any + Send + Sync>);

impl AnyDeviceTensor {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // called by the backends
    pub(crate) fn new<U: Element>(t: DeviceArc<U>) -> Self {
        AnyDeviceTensor(Box::new(t))
    }

    /// The tensor as one of `U`; an error naming `op` when the backend made another type.
    pub(crate) fn typed<U: Element>(self, op: &'static str) -> Result<DeviceArc<U>> {
        self.0.downcast::<DeviceArc<U>>().map(|t| *t).map_err(|_| Error::InvalidArgument {
            op,
            rank: 0,
            reason: format!("the backend returned a tensor of another type than {}", U::DTYPE),
        })
    }
}

/// The error of an op that `t`'s backend has no kernel for: [`Error::DeviceUnavailable`]
/// naming the op and the device.
pub(crate) fn no_kernel<T: Element>(
    t: &(impl DeviceTensor<T> + ?Sized),
    op: &'static str,
) -> Error {
    Error::DeviceUnavailable {
        op,
        device: t.device().to_string(),
        reason: "this device's backend has no kernel for it".into(),
    }
}

/// A tensor that lives on a device: what a backend implements for its storage (see the module's
/// docs). Shapes are row-major and contiguous; a device tensor is never written after the op
/// that made it (except the optimizer's state in [`DeviceTensor::optimizer_step`]).
///
/// The tensor layer checks shapes, axes and element counts before it calls a method, as the host
/// code does; a backend checks what only it knows (that operands share its device, its limits).
/// Operands of other backends are the backend's to refuse (`as_any` downcasts fail on them).
#[allow(unused_variables)] // the default bodies name their arguments for the implementations
pub(crate) trait DeviceTensor<T: Element>: Send + Sync + 'static {
    /// The shape.
    fn shape(&self) -> &[usize];

    /// Where it lives (never [`Device::Host`]).
    fn device(&self) -> Device;

    /// The value itself, for the backend's downcasts of its operands.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // called by the backends
    fn as_any(&self) -> &dyn Any;

    /// The elements, copied to the host once the work that writes them is done.
    fn to_host(&self) -> Result<Vec<T>> {
        Err(no_kernel(self, "Tensor::to_host"))
    }

    /// The same elements under another shape of equal size (checked by the caller).
    fn reshaped(&self, shape: &[usize]) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "Tensor::reshape"))
    }

    /// Whether both are the same elements (by default: the same value).
    fn same_buffer(&self, other: &dyn DeviceTensor<T>) -> bool {
        std::ptr::addr_eq(self as *const Self, other as *const dyn DeviceTensor<T>)
    }

    /// Zeros of `shape` where this tensor lives.
    fn zeros_like(&self, shape: &[usize]) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "Tensor::zeros_like"))
    }

    /// `host` (of `shape`) copied to where this tensor lives (the same device and stream).
    fn upload_like(&self, host: HostElements<'_>, shape: &[usize]) -> Result<AnyDeviceTensor> {
        Err(no_kernel(self, "Tensor::to_device"))
    }

    /// `op` on every element (with `scalar` for the scalar forms).
    fn unary(&self, op: Unary, scalar: f64) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, op.name()))
    }

    /// `self op rhs`, broadcast to `out_shape`.
    fn binary(
        &self,
        rhs: &dyn DeviceTensor<T>,
        op: Binary,
        out_shape: &[usize],
    ) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, op.name()))
    }

    /// Every element converted to `to` (through f64, so exactly where it fits).
    fn cast(&self, to: DType) -> Result<AnyDeviceTensor> {
        Err(no_kernel(self, "Tensor::cast"))
    }

    /// The axes reordered: axis `i` of the result is axis `axes[i]` (a permutation, checked).
    fn permute(&self, axes: &[usize]) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "Tensor::permute"))
    }

    /// `self @ rhs` of two matrices.
    fn matmul(&self, rhs: &dyn DeviceTensor<T>) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "Tensor::matmul"))
    }

    /// `self @ rhs` per matrix, the batch dimensions (`batch`, checked) broadcast.
    fn batched_matmul(&self, rhs: &dyn DeviceTensor<T>, batch: &[usize]) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "Tensor::matmul"))
    }

    /// `self^T @ rhs` of two matrices with as many rows.
    fn matmul_lhs_transposed(&self, rhs: &dyn DeviceTensor<T>) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "Tensor::matmul_lhs_transposed"))
    }

    /// The softmax along `axis`.
    fn softmax(&self, axis: usize) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "Tensor::softmax"))
    }

    /// The RMS norm (`layer` false) or layer norm over the last axis, with the optional
    /// per-feature weight and bias (on this device, shapes checked).
    fn norm(
        &self,
        weight: Option<&dyn DeviceTensor<T>>,
        bias: Option<&dyn DeviceTensor<T>>,
        eps: f64,
        layer: bool,
    ) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, if layer { "Tensor::layer_norm" } else { "Tensor::rms_norm" }))
    }

    /// The gradients of a norm at `self` given the output's gradient `dy`: `dx`, and the
    /// weight's and bias's where `params`.
    fn norm_backward(
        &self,
        weight: Option<&dyn DeviceTensor<T>>,
        dy: &dyn DeviceTensor<T>,
        eps: f64,
        centered: bool,
        params: bool,
    ) -> Result<DeviceNormGrads<T>> {
        Err(no_kernel(self, if centered { "layer_norm backward" } else { "rms_norm backward" }))
    }

    /// The sum (or mean) of every element, a 0-D tensor on this device.
    fn total(&self, mean: bool) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, if mean { "Tensor::mean" } else { "Tensor::sum" }))
    }

    /// The sum (or mean) along `axis`, which is removed.
    fn sum_axis(&self, axis: usize, mean: bool) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, if mean { "Tensor::mean_axis" } else { "Tensor::sum_axis" }))
    }

    /// `dy * act'(self)`, elementwise (one shape, checked).
    fn activation_grad(&self, dy: &dyn DeviceTensor<T>, act: Unary) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, act.backward_name()))
    }

    /// `act(self + bias)`, `bias` broadcast.
    fn bias_activation(&self, bias: &dyn DeviceTensor<T>, act: Unary) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "bias and activation"))
    }

    /// `dy * act'(self + bias)`.
    fn bias_activation_grad(
        &self,
        bias: &dyn DeviceTensor<T>,
        dy: &dyn DeviceTensor<T>,
        act: Unary,
    ) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "bias and activation backward"))
    }

    /// The mean squared error's parts for a prediction `self` against `target`: the gradient
    /// `(self - target) * scale` and the sum of squared differences (a 0-D f64 tensor).
    fn mse_parts(
        &self,
        target: &dyn DeviceTensor<T>,
        scale: f64,
    ) -> Result<(DeviceArc<T>, DeviceArc<f64>)> {
        Err(no_kernel(self, "mse_loss"))
    }

    /// One optimizer step of the parameter `self`: the new value; `master` and `state` (in the
    /// accumulator type) are updated in place.
    fn optimizer_step(
        &self,
        master: Option<&dyn DeviceTensor<T::Acc>>,
        grad: &dyn DeviceTensor<T>,
        state: &[&dyn DeviceTensor<T::Acc>],
        rule: OptimRule,
    ) -> Result<DeviceArc<T>> {
        Err(no_kernel(self, "optimizer step"))
    }
}
