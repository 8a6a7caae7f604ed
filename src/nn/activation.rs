//! [`Activation`]: the elementwise nonlinearities of an MLP, with their derivatives.

use crate::Result;
use crate::tensor::{ActivationFn, Element, Tensor};

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
    /// The tensor layer's name for it (what `Tensor::bias_activation` takes).
    pub(crate) fn function(self) -> ActivationFn {
        match self {
            Activation::Gelu => ActivationFn::Gelu,
            Activation::GeluTanh => ActivationFn::GeluTanh,
            Activation::Silu => ActivationFn::Silu,
            Activation::Relu => ActivationFn::Relu,
        }
    }

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
        self.function().forward(x)
    }

    /// The gradient with respect to the input `x`, given the gradient `dy` with respect to the
    /// output: `dy * f'(x)`, each element computed in f64 and rounded once, on the host or on
    /// the GPU where both live ([`Tensor::gelu_backward`], [`Tensor::gelu_tanh_backward`],
    /// [`Tensor::silu_backward`], [`Tensor::relu_backward`]).
    ///
    /// # Errors
    /// [`Error::InvalidShape`](crate::Error::InvalidShape) when `dy` does not broadcast to `x`
    /// (on a GPU: when the shapes differ);
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when one is on the host and the
    /// other on a GPU.
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
        self.function().backward(x, dy)
    }
}
