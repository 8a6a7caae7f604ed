//! A backend that implements nothing of the contract but what it must (shape, device, `as_any`):
//! a tensor on it gives, for every op that returns a `Result`, the typed
//! [`Error::DeviceUnavailable`] naming the op and its device, never a panic.
//!
//! Operators (`+ - * /`, negation) and the methods that return a plain `Tensor` (`gelu`,
//! `relu`, `silu`, `gelu_tanh`, `cast`, `sum`, `mean`) cannot return a `Result`: on such a
//! tensor they panic, and the panic's message is that same error's text (checked with
//! `catch_unwind`), as they panic on a GPU's failure.
//!
//! The fake reports `Device::Ascend(0)`: what adding an NPU tensor backend that has no kernel yet
//! would look like.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use super::backend::DeviceTensor;
use super::{ActivationFn, Device, OptimRule, Tensor, scaled_dot_product_attention};
use crate::{Error, Result};

struct Fake {
    shape: Vec<usize>,
}

impl DeviceTensor<f32> for Fake {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn device(&self) -> Device {
        Device::Ascend(0)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn fake(shape: &[usize]) -> Tensor<f32> {
    Tensor::from_device(Arc::new(Fake { shape: shape.to_vec() }))
}

/// The text of the error a fake tensor gives for `op`.
fn message(op: &str) -> String {
    format!("{op}: device ascend:0 unavailable: this device's backend has no kernel for it")
}

/// That `got` is the typed error for `op` on the fake's device.
#[track_caller]
fn refused<R: std::fmt::Debug>(op: &str, got: Result<R>) {
    match got {
        Err(Error::DeviceUnavailable { op: o, device, reason }) => {
            assert_eq!((o, device.as_str()), (op, "ascend:0"), "{reason}");
        }
        other => panic!("{op}: expected DeviceUnavailable, got {other:?}"),
    }
}

/// That `f` panics with the text of the typed error for `op`.
#[track_caller]
fn panics_with<R>(op: &str, f: impl FnOnce() -> R) {
    let Err(payload) = catch_unwind(AssertUnwindSafe(f)) else {
        panic!("{op}: expected a panic");
    };
    let text = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(text.contains(&message(op)), "{op}: the panic says {text:?}");
}

#[test]
fn the_fake_tensor_reports_its_device_and_shape() {
    let x = fake(&[2, 3]);
    assert_eq!((x.device(), x.shape()), (Device::Ascend(0), &[2, 3][..]));
    assert!(!x.is_on_host());
    assert_eq!(x, x.clone()); // the same value (the contract's default `same_buffer`)
    assert_ne!(x, fake(&[2, 3]));
    assert!(format!("{x:?}").contains("Tensor on ascend:0 of shape [2, 3]"));
}

#[test]
fn every_fallible_op_returns_the_typed_error_naming_it() {
    let (x, y, dy) = (fake(&[2, 3]), fake(&[3, 2]), fake(&[2, 3]));
    let (w, b) = (fake(&[3]), fake(&[3]));
    let e = 1e-5;
    refused("Tensor::to_host", x.to_host());
    refused("Tensor::to_host", x.to_device(Device::Host));
    refused("Tensor::to_host", x.to_device(Device::Cuda(0)));
    refused("Tensor::zeros_like", x.zeros_like(&[4]));
    refused("Tensor::cast", x.zeros_beside::<f64>(&[4]));
    refused("Tensor::to_device", Tensor::<f64>::zeros(&[2]).into_place_of(&x));
    refused("Tensor::reshape", x.reshape(&[3, 2]));
    refused("Tensor::reshape", x.insert_axis(0));
    refused("Tensor::permute", x.permute(&[1, 0]));
    refused("Tensor::permute", x.transpose(0, 1));
    refused("Tensor::matmul", x.matmul(&y));
    refused("Tensor::matmul", fake(&[4, 2, 3]).matmul(&fake(&[4, 3, 2])));
    refused("Tensor::matmul_lhs_transposed", x.matmul_lhs_transposed(&dy, 1));
    refused("Tensor::softmax", x.softmax(1));
    refused("Tensor::rms_norm", x.rms_norm(Some(&w), e));
    refused("Tensor::layer_norm", x.layer_norm(Some(&w), Some(&b), e));
    refused("rms_norm backward", x.norm_grad(Some(&w), &dy, e, false, true));
    refused("layer_norm backward", x.norm_grad(None, &dy, e, true, false));
    refused("Tensor::sum", x.try_sum());
    refused("Tensor::mean", x.try_mean());
    refused("Tensor::sum", x.total_tensor(false));
    refused("Tensor::sum_axis", x.sum_axis(0));
    refused("Tensor::mean_axis", x.mean_axis(1));
    refused("Tensor::gelu_backward", x.gelu_backward(&dy));
    refused("Tensor::gelu_tanh_backward", x.gelu_tanh_backward(&dy));
    refused("Tensor::silu_backward", x.silu_backward(&dy));
    refused("Tensor::relu_backward", x.relu_backward(&dy));
    refused("bias and activation", x.bias_activation(&b, ActivationFn::Gelu));
    refused(
        "bias and activation backward",
        x.bias_activation_backward(&b, &dy, ActivationFn::Relu),
    );
    refused("mse_loss", x.mse_parts(&dy, 0.5));
    let sgd = OptimRule::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 };
    refused("optimizer step", x.clone().optim_step_(None, &dy, &mut [], sgd));
    // The host-only paths refuse with their own typed errors, as on a GPU.
    refused("Tensor::map", x.try_map(|v| v));
    refused("Tensor::zip_map", x.zip_map(&dy, |a, b| a + b));
    refused("example", x.view2("example"));
    let q = fake(&[2, 4]);
    refused("scaled_dot_product_attention", scaled_dot_product_attention(&q, &q, &q, false));
}

#[test]
fn the_host_only_indexing_ops_refuse_a_device_tensor_with_the_typed_error() {
    let (x, host) = (fake(&[2, 3]), Tensor::<f32>::zeros(&[2, 3]));
    refused("Tensor::cat", Tensor::cat(&[&host, &x], 0));
    refused("Tensor::stack", Tensor::stack(&[&x, &host], 0));
    refused("Tensor::index_select", x.index_select(1, &[0]));
    refused("Tensor::gather", x.gather(1, &ndarray::array![[0], [1]]));
    refused("Tensor::masked_fill", x.masked_fill(&ndarray::array![true, false, true], 0.0));
    refused("Tensor::select_where", Tensor::select_where(&ndarray::array![true], &host, &x));
    refused("Tensor::cumsum", x.cumsum(0));
    refused("Tensor::argmax", x.argmax(1));
    refused("Tensor::topk", x.topk(1, 1));
}

#[test]
fn operators_panic_with_the_typed_errors_text() {
    let (x, y) = (fake(&[2, 3]), fake(&[3]));
    panics_with("Tensor + Tensor", || &x + &y);
    panics_with("Tensor - Tensor", || x.clone() - &y);
    panics_with("Tensor * Tensor", || &x * y.clone());
    panics_with("Tensor / Tensor", || x.clone() / y.clone());
    panics_with("Tensor + Tensor", || {
        let mut z = x.clone();
        z += &y;
    });
    panics_with("Tensor + scalar", || &x + 1.0);
    panics_with("Tensor - scalar", || x.clone() - 1.0);
    panics_with("Tensor * scalar", || {
        let mut z = x.clone();
        z *= 2.0;
    });
    panics_with("Tensor / scalar", || &x / 2.0);
    panics_with("scalar - Tensor", || 1.0f32 - &x);
    panics_with("scalar / Tensor", || 1.0f32 / x.clone());
    panics_with("-Tensor", || -&x);
    panics_with("-Tensor", || -x.clone());
    panics_with("Tensor::gelu", || x.gelu());
    panics_with("Tensor::gelu_tanh", || x.gelu_tanh());
    panics_with("Tensor::silu", || x.silu());
    panics_with("Tensor::relu", || x.relu());
    panics_with("Tensor::cast", || x.cast::<f64>());
    panics_with("Tensor::sum", || x.sum());
    panics_with("Tensor::mean", || x.mean());
}
