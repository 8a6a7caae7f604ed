//! `Display` for [`Tensor`]: the elements as ndarray prints them, then the shape and type.

use std::fmt;

use super::{Element, Tensor};

/// The elements as ndarray prints them (large tensors abbreviated with `...`; `{:#}` prints
/// every element, a precision such as `{:.2}` applies to each), then the shape and element type.
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// let t = Tensor::<f32>::from_shape_vec(&[2, 2], vec![1.0, 2.5, -3.0, 4.0])?;
/// assert_eq!(t.to_string(), "[[1, 2.5],\n [-3, 4]], shape=[2, 2], dtype=f32");
/// assert_eq!(format!("{t:.1}"), "[[1.0, 2.5],\n [-3.0, 4.0]], shape=[2, 2], dtype=f32");
/// # Ok::<(), dist_tensor::Error>(())
/// ```
impl<T: Element> fmt::Display for Tensor<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.view(), f)?;
        write!(f, ", shape={:?}, dtype={}", self.shape(), T::DTYPE)
    }
}
