//! Axis moves beside [`Tensor::reshape`] and [`Tensor::permute`]: [`Tensor::transpose`] of two
//! axes, and [`Tensor::insert_axis`] (a new axis of length 1, for broadcasting).

use super::{Element, Tensor};
use crate::{Error, Result};

impl<T: Element> Tensor<T> {
    /// Swaps axes `a` and `b` (a copy, contiguous again): `transpose(1, 2)` of `[H, S, D]` is
    /// `[H, D, S]`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] when either axis is not a dimension of the tensor.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let k = Tensor::<f32>::random(&[2, 5, 3], 1);
    /// let kt = k.transpose(1, 2)?;
    /// assert_eq!(kt.shape(), &[2, 3, 5]);
    /// assert_eq!(kt.view()[[1, 2, 4]], k.view()[[1, 4, 2]]);
    /// assert!(k.transpose(0, 3).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor<T>> {
        let ndim = self.ndim();
        if let Some(dim) = [a, b].into_iter().find(|&d| d >= ndim) {
            return Err(Error::DimOutOfRange { op: "Tensor::transpose", dim, ndim });
        }
        let mut axes: Vec<usize> = (0..ndim).collect();
        axes.swap(a, b);
        self.permute(&axes)
    }

    /// The same elements with a new axis of length 1 at `axis` (no copy): `[S, H]` with
    /// `insert_axis(1)` is `[S, 1, H]`, which broadcasts against `[S, S, H]`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] when `axis > ndim`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let x = Tensor::<f64>::random(&[4, 3], 1);
    /// let mean = x.mean_axis(1)?.insert_axis(1)?; // [4, 1]
    /// let centered = &x - &mean;
    /// assert!(centered.sum_axis(1)?.as_slice().iter().all(|s| s.abs() < 1e-15));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn insert_axis(&self, axis: usize) -> Result<Tensor<T>> {
        let ndim = self.ndim();
        if axis > ndim {
            return Err(Error::DimOutOfRange {
                op: "Tensor::insert_axis",
                dim: axis,
                ndim: ndim + 1,
            });
        }
        let mut shape = self.shape().to_vec();
        shape.insert(axis, 1);
        self.reshape(&shape)
    }
}
