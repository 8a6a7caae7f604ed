//! The activations' backward pass: `dy * f'(x)` for GELU (exact and tanh), SiLU and ReLU, as
//! the nn layers' and autograd's backward use it. One dispatch: the host computes each element
//! in f64 and rounds once; a GPU tensor runs the derivative kernel of the same name
//! (`kernels/train.cu`), which computes the same f64 formula.

use super::backend::Unary;
use super::dispatch;
use super::{Element, Tensor};
use crate::{Error, Result};

/// `sqrt(2 / pi)`, for the tanh form of GELU.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// `1 / sqrt(2 pi)`, the standard normal density at 0.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

fn d_gelu(x: f64) -> f64 {
    let cdf = 0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2));
    let pdf = INV_SQRT_2PI * (-0.5 * x * x).exp();
    cdf + x * pdf
}

fn d_gelu_tanh(x: f64) -> f64 {
    let (c, k) = (SQRT_2_OVER_PI, 0.044715);
    let t = (c * (x + k * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * k * x * x)
}

fn d_silu(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

fn d_relu(x: f64) -> f64 {
    if x > 0.0 { 1.0 } else { 0.0 }
}

impl<T: Element> Tensor<T> {
    /// The gradient through [`Tensor::gelu`] at `self`, given the gradient `dy` of its output:
    /// `dy * (Phi(x) + x * phi(x))`, computed in f64 and rounded once (on the host or on the GPU
    /// where both live).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `dy` does not broadcast to `self` (on a GPU: when the shapes
    /// differ); [`Error::InvalidArgument`] when one lives on the host and the other on a GPU, or
    /// they live on different GPUs.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// // Against a central difference of the forward.
    /// let x = Tensor::<f64>::from(vec![-1.3, 0.2, 1.7]);
    /// let grad = x.gelu_backward(&Tensor::from(vec![1.0; 3]))?;
    /// let h = 1e-6;
    /// let (up, down) = ((&x + h).gelu(), (&x - h).gelu());
    /// for i in 0..3 {
    ///     let numeric = (up.as_slice()[i] - down.as_slice()[i]) / (2.0 * h);
    ///     assert!((grad.as_slice()[i] - numeric).abs() < 1e-8);
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gelu_backward(&self, dy: &Tensor<T>) -> Result<Tensor<T>> {
        self.activation_backward("Tensor::gelu_backward", dy, Unary::Gelu, d_gelu)
    }

    /// The gradient through [`Tensor::gelu_tanh`] at `self`, given `dy`: computed in f64,
    /// rounded once.
    ///
    /// # Errors
    /// As [`Tensor::gelu_backward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let x = Tensor::<f64>::from(vec![-0.7, 0.0, 2.5]);
    /// let grad = x.gelu_tanh_backward(&Tensor::from(vec![2.0; 3]))?;
    /// let h = 1e-6;
    /// let (up, down) = ((&x + h).gelu_tanh(), (&x - h).gelu_tanh());
    /// for i in 0..3 {
    ///     let numeric = 2.0 * (up.as_slice()[i] - down.as_slice()[i]) / (2.0 * h);
    ///     assert!((grad.as_slice()[i] - numeric).abs() < 1e-8);
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gelu_tanh_backward(&self, dy: &Tensor<T>) -> Result<Tensor<T>> {
        self.activation_backward("Tensor::gelu_tanh_backward", dy, Unary::GeluTanh, d_gelu_tanh)
    }

    /// The gradient through [`Tensor::silu`] at `self`, given `dy`:
    /// `dy * s * (1 + x * (1 - s))` with `s = sigmoid(x)`, computed in f64, rounded once.
    ///
    /// # Errors
    /// As [`Tensor::gelu_backward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let x = Tensor::<f32>::from(vec![0.0]);
    /// // sigmoid(0) = 1/2.
    /// assert_eq!(x.silu_backward(&Tensor::from(vec![3.0]))?.as_slice(), &[1.5]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn silu_backward(&self, dy: &Tensor<T>) -> Result<Tensor<T>> {
        self.activation_backward("Tensor::silu_backward", dy, Unary::Silu, d_silu)
    }

    /// The gradient through [`Tensor::relu`] at `self`, given `dy`: `dy` where `x > 0`, else
    /// `dy * 0` (0, or NaN where `dy` is not finite, as on the GPU).
    ///
    /// # Errors
    /// As [`Tensor::gelu_backward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let x = Tensor::<f64>::from(vec![-1.0, 0.0, 2.0]);
    /// let dy = Tensor::from(vec![3.0, 3.0, 3.0]);
    /// assert_eq!(x.relu_backward(&dy)?.as_slice(), &[0.0, 0.0, 3.0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn relu_backward(&self, dy: &Tensor<T>) -> Result<Tensor<T>> {
        self.activation_backward("Tensor::relu_backward", dy, Unary::Relu, d_relu)
    }

    /// `dy * d(x)` elementwise: the host loop in f64, or `act`'s derivative kernel where both
    /// tensors live on a GPU (it computes the same `d` in f64).
    fn activation_backward(
        &self,
        op: &'static str,
        dy: &Tensor<T>,
        act: Unary,
        d: fn(f64) -> f64,
    ) -> Result<Tensor<T>> {
        match (self.is_on_host(), dy.is_on_host()) {
            (true, true) => self.zip_map(dy, |x, dy| T::from_f64(dy.to_f64() * d(x.to_f64()))),
            (false, false) => {
                if self.shape() != dy.shape() {
                    return Err(Error::InvalidShape {
                        op,
                        reason: format!(
                            "the input is {:?}, its gradient {:?}: one shape on a GPU",
                            self.shape(),
                            dy.shape()
                        ),
                    });
                }
                dispatch::activation_grad(self, dy, act)
            }
            _ => Err(Error::InvalidArgument {
                op,
                rank: 0,
                reason: format!(
                    "the input is on {}, its gradient on {}: both on one device",
                    self.device(),
                    dy.device()
                ),
            }),
        }
    }
}
