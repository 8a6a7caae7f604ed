//! [`Activation`]: the elementwise nonlinearities of an MLP, with their derivatives.

use num_traits::Float;

use crate::Result;
use crate::device::cuda::Unary;
use crate::tensor::{Element, Tensor, device_activation_grad};

/// `sqrt(2 / pi)`, for the tanh form of GELU.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// `1 / sqrt(2 pi)`, the standard normal density at 0.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// An elementwise activation: its value ([`Activation::forward`], the same as
/// [`Tensor::gelu`], [`Tensor::gelu_tanh`], [`Tensor::silu`] or [`Tensor::relu`]) and the
/// gradient through it ([`Activation::backward`]).
///
/// # Examples
/// ```
/// use dist_tensor::nn::Activation;
/// use dist_tensor::Tensor;
///
/// let x = Tensor::<f64>::from(vec![-1.0, 0.5, 2.0]);
/// assert_eq!(Activation::Gelu.forward(&x), x.gelu());
/// // d/dx relu(x) is 0 below 0 and 1 above.
/// let dy = Tensor::from(vec![3.0, 3.0, 3.0]);
/// assert_eq!(Activation::Relu.backward(&x, &dy)?.as_slice(), &[0.0, 3.0, 3.0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Activation {
    /// GELU, exact (`x * Phi(x)`), as [`Tensor::gelu`].
    #[default]
    Gelu,
    /// GELU's tanh approximation, as [`Tensor::gelu_tanh`].
    GeluTanh,
    /// SiLU, `x * sigmoid(x)`, as [`Tensor::silu`].
    Silu,
    /// ReLU, `max(x, 0)`, as [`Tensor::relu`].
    Relu,
}

impl Activation {
    /// The activation of `x`, elementwise.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Activation;
    /// use dist_tensor::Tensor;
    /// let x = Tensor::<f32>::random(&[4, 3], 1);
    /// assert_eq!(Activation::Silu.forward(&x), x.silu());
    /// ```
    pub fn forward<T: Element>(self, x: &Tensor<T>) -> Tensor<T> {
        match self {
            Activation::Gelu => x.gelu(),
            Activation::GeluTanh => x.gelu_tanh(),
            Activation::Silu => x.silu(),
            Activation::Relu => x.relu(),
        }
    }

    /// The gradient with respect to the input `x`, given the gradient `dy` with respect to the
    /// output: `dy * f'(x)`, each element computed in the accumulator type (the exact GELU in
    /// f64) and rounded once.
    ///
    /// # Errors
    /// [`Error::InvalidShape`](crate::Error::InvalidShape) when `dy` does not broadcast to `x`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Activation;
    /// use dist_tensor::Tensor;
    /// // Against a central difference.
    /// let x = Tensor::<f64>::from(vec![-1.3, 0.2, 1.7]);
    /// let ones = Tensor::from(vec![1.0; 3]);
    /// for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
    ///     let grad = act.backward(&x, &ones)?;
    ///     let h = 1e-6;
    ///     let (up, down) = (act.forward(&(&x + h)), act.forward(&(&x - h)));
    ///     for i in 0..3 {
    ///         let numeric = (up.as_slice()[i] - down.as_slice()[i]) / (2.0 * h);
    ///         assert!((grad.as_slice()[i] - numeric).abs() < 1e-8, "{act:?}");
    ///     }
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn backward<T: Element>(self, x: &Tensor<T>, dy: &Tensor<T>) -> Result<Tensor<T>> {
        if let Some(on_gpu) =
            device_activation_grad("Activation::backward", x, dy, self.device_op())
        {
            return on_gpu;
        }
        match self {
            Activation::Gelu => x.zip_map(dy, |x, dy| {
                let v = x.to_f64();
                let cdf = 0.5 * (1.0 + libm::erf(v * std::f64::consts::FRAC_1_SQRT_2));
                let pdf = INV_SQRT_2PI * (-0.5 * v * v).exp();
                T::from_f64(dy.to_f64() * (cdf + v * pdf))
            }),
            Activation::GeluTanh => {
                let [half, one, c, k, k3] =
                    [0.5, 1.0, SQRT_2_OVER_PI, 0.044715, 3.0 * 0.044715].map(acc::<T>);
                x.zip_map(dy, move |x, dy| {
                    let (x, dy) = (x.to_acc(), dy.to_acc());
                    let t = (c * (x + k * x * x * x)).tanh();
                    let d = half * (one + t) + half * x * (one - t * t) * c * (one + k3 * x * x);
                    T::from_acc(dy * d)
                })
            }
            Activation::Silu => {
                let one = acc::<T>(1.0);
                x.zip_map(dy, move |x, dy| {
                    let x = x.to_acc();
                    let s = one / (one + (-x).exp());
                    T::from_acc(dy.to_acc() * s * (one + x * (one - s)))
                })
            }
            Activation::Relu => x.zip_map(dy, |x, dy| if x > T::zero() { dy } else { T::zero() }),
        }
    }
}

impl Activation {
    /// The GPU kernel family of this activation (its forward op; the backward kernel of the
    /// same name computes the derivative).
    pub(crate) fn device_op(self) -> Unary {
        match self {
            Activation::Gelu => Unary::Gelu,
            Activation::GeluTanh => Unary::GeluTanh,
            Activation::Silu => Unary::Silu,
            Activation::Relu => Unary::Relu,
        }
    }
}

fn acc<T: Element>(v: f64) -> T::Acc {
    <T::Acc as Element>::from_f64(v)
}
