//! The CUDA backend's side of the tensor layer's contract: [`DeviceTensor`] for
//! [`DeviceStorage`], each method forwarding to this folder's kernels (`local`, `train`,
//! `norm_grad`, cuBLASLt through `api::matmul`); and the two ways the rest of the crate reaches a
//! tensor's GPU storage: [`storage_of`] (a downcast) and `Tensor::from_device_storage`.

use std::any::Any;
use std::sync::Arc;

use super::storage::DeviceStorage;
use super::{local, norm_grad, train};
use crate::tensor::backend::{
    AnyDeviceTensor, Binary, DeviceArc, DeviceNormGrads, DeviceTensor, HostElements, Unary,
};
use crate::tensor::{DType, Device, Element, OptimRule, Tensor};
use crate::{Error, Result};

fn arc<T: Element>(data: Result<DeviceStorage<T>>) -> Result<DeviceArc<T>> {
    Ok(Arc::new(data?))
}

fn any<U: Element>(data: Result<DeviceStorage<U>>) -> Result<AnyDeviceTensor> {
    Ok(AnyDeviceTensor::new::<U>(Arc::new(data?)))
}

/// An operand of an op on a GPU: its GPU storage, or an error naming `op` when it lives on
/// another backend's device.
fn gpu<'a, T: Element>(
    op: &'static str,
    t: &'a dyn DeviceTensor<T>,
) -> Result<&'a DeviceStorage<T>> {
    t.as_any().downcast_ref().ok_or_else(|| Error::InvalidArgument {
        op,
        rank: 0,
        reason: format!("an operand on {} beside one on a GPU: move it first", t.device()),
    })
}

/// The GPU storage of `t`, if it lives on a GPU.
pub(crate) fn storage_of<T: Element>(t: &Tensor<T>) -> Option<&DeviceStorage<T>> {
    t.device_storage()?.as_any().downcast_ref()
}

impl<T: Element> Tensor<T> {
    /// A tensor on a GPU, from its storage there.
    pub(crate) fn from_device_storage(data: DeviceStorage<T>) -> Tensor<T> {
        Tensor::from_device(Arc::new(data))
    }
}

impl<T: Element> DeviceTensor<T> for DeviceStorage<T> {
    fn shape(&self) -> &[usize] {
        DeviceStorage::shape(self)
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal() as u32)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn to_host(&self) -> Result<Vec<T>> {
        self.download()
    }

    fn reshaped(&self, shape: &[usize]) -> Result<DeviceArc<T>> {
        arc(DeviceStorage::reshaped(self, shape))
    }

    fn same_buffer(&self, other: &dyn DeviceTensor<T>) -> bool {
        other.as_any().downcast_ref().is_some_and(|o| DeviceStorage::same_buffer(self, o))
    }

    fn zeros_like(&self, shape: &[usize]) -> Result<DeviceArc<T>> {
        arc(local::zeros_like(self, shape))
    }

    fn upload_like(&self, host: HostElements<'_>, shape: &[usize]) -> Result<AnyDeviceTensor> {
        match host {
            HostElements::F32(h) => any(train::upload_like(self, h, shape)),
            HostElements::F64(h) => any(train::upload_like(self, h, shape)),
            HostElements::F16(h) => any(train::upload_like(self, h, shape)),
            HostElements::BF16(h) => any(train::upload_like(self, h, shape)),
        }
    }

    fn unary(&self, op: Unary, scalar: f64) -> Result<DeviceArc<T>> {
        arc(local::unary(self, op, scalar))
    }

    fn binary(
        &self,
        rhs: &dyn DeviceTensor<T>,
        op: Binary,
        out_shape: &[usize],
    ) -> Result<DeviceArc<T>> {
        arc(local::binary(self, gpu(op.name(), rhs)?, op, out_shape))
    }

    fn cast(&self, to: DType) -> Result<AnyDeviceTensor> {
        match to {
            DType::F32 => any(local::cast::<T, f32>(self)),
            DType::F64 => any(local::cast::<T, f64>(self)),
            DType::F16 => any(local::cast::<T, half::f16>(self)),
            DType::BF16 => any(local::cast::<T, half::bf16>(self)),
        }
    }

    fn permute(&self, axes: &[usize]) -> Result<DeviceArc<T>> {
        arc(local::permute(self, axes))
    }

    fn matmul(&self, rhs: &dyn DeviceTensor<T>) -> Result<DeviceArc<T>> {
        arc(super::api::matmul(self, gpu("Tensor::matmul", rhs)?))
    }

    fn batched_matmul(&self, rhs: &dyn DeviceTensor<T>, batch: &[usize]) -> Result<DeviceArc<T>> {
        arc(local::batched_matmul(self, gpu("Tensor::matmul", rhs)?, batch))
    }

    fn matmul_lhs_transposed(&self, rhs: &dyn DeviceTensor<T>) -> Result<DeviceArc<T>> {
        let rhs = gpu("Tensor::matmul_lhs_transposed", rhs)?;
        arc(train::matmul_lhs_transposed(self, rhs))
    }

    fn softmax(&self, axis: usize) -> Result<DeviceArc<T>> {
        arc(local::softmax(self, axis))
    }

    fn norm(
        &self,
        weight: Option<&dyn DeviceTensor<T>>,
        bias: Option<&dyn DeviceTensor<T>>,
        eps: f64,
        layer: bool,
    ) -> Result<DeviceArc<T>> {
        let op = if layer { "Tensor::layer_norm" } else { "Tensor::rms_norm" };
        let weight = weight.map(|w| gpu(op, w)).transpose()?;
        let bias = bias.map(|b| gpu(op, b)).transpose()?;
        arc(local::norm(self, weight, bias, eps, layer))
    }

    fn norm_backward(
        &self,
        weight: Option<&dyn DeviceTensor<T>>,
        dy: &dyn DeviceTensor<T>,
        eps: f64,
        centered: bool,
        params: bool,
    ) -> Result<DeviceNormGrads<T>> {
        let op = if centered { "layer_norm backward" } else { "rms_norm backward" };
        let weight = weight.map(|w| gpu(op, w)).transpose()?;
        let (dx, grads) =
            norm_grad::norm_backward(self, weight, gpu(op, dy)?, eps, centered, params)?;
        let wrap = |d: DeviceStorage<T>| -> DeviceArc<T> { Arc::new(d) };
        Ok((wrap(dx), grads.map(|(dw, db)| (wrap(dw), wrap(db)))))
    }

    fn total(&self, mean: bool) -> Result<DeviceArc<T>> {
        arc(local::total(self, mean))
    }

    fn sum_axis(&self, axis: usize, mean: bool) -> Result<DeviceArc<T>> {
        arc(local::sum_axis(self, axis, mean))
    }

    fn activation_grad(&self, dy: &dyn DeviceTensor<T>, act: Unary) -> Result<DeviceArc<T>> {
        arc(train::activation_grad(self, gpu(act.backward_name(), dy)?, act))
    }

    fn bias_activation(&self, bias: &dyn DeviceTensor<T>, act: Unary) -> Result<DeviceArc<T>> {
        arc(local::bias_activation(self, gpu("bias and activation", bias)?, act))
    }

    fn bias_activation_grad(
        &self,
        bias: &dyn DeviceTensor<T>,
        dy: &dyn DeviceTensor<T>,
        act: Unary,
    ) -> Result<DeviceArc<T>> {
        const OP: &str = "bias and activation backward";
        arc(train::bias_activation_grad(self, gpu(OP, bias)?, gpu(OP, dy)?, act))
    }

    fn mse_parts(
        &self,
        target: &dyn DeviceTensor<T>,
        scale: f64,
    ) -> Result<(DeviceArc<T>, DeviceArc<f64>)> {
        let (grad, sum) = train::mse_parts(self, gpu("mse_loss", target)?, scale)?;
        Ok((Arc::new(grad), Arc::new(sum)))
    }

    fn optimizer_step(
        &self,
        master: Option<&dyn DeviceTensor<T::Acc>>,
        grad: &dyn DeviceTensor<T>,
        state: &[&dyn DeviceTensor<T::Acc>],
        rule: OptimRule,
    ) -> Result<DeviceArc<T>> {
        const OP: &str = "optimizer step";
        let master = master.map(|m| gpu(OP, m)).transpose()?;
        let state = state.iter().map(|s| gpu(OP, *s)).collect::<Result<Vec<_>>>()?;
        arc(train::optimizer_step(self, master, gpu(OP, grad)?, &state, rule))
    }
}
