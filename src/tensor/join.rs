//! Joining tensors: [`Tensor::cat`] along an axis they have, [`Tensor::stack`] along a new one
//! (as `torch.cat` and `torch.stack`).
//!
//! Host only for now: a tensor on a GPU gives [`Error::DeviceUnavailable`].

use ndarray::{ArrayViewD, Axis};

use super::map::require_host;
use super::{Element, Tensor};
use crate::{Error, Result};

/// Checks what both joins need: at least one tensor, all on the host, and `axis` below `limit`
/// (`ndim` for `cat`, `ndim + 1` for `stack`, which may add an axis after the last).
fn check_join<T: Element>(
    op: &'static str,
    tensors: &[&Tensor<T>],
    axis: usize,
    limit: impl Fn(usize) -> usize,
) -> Result<()> {
    let Some(first) = tensors.first() else {
        return Err(Error::InvalidArgument {
            op,
            rank: 0,
            reason: "no tensors to join (the list is empty)".into(),
        });
    };
    for t in tensors {
        require_host(op, t)?;
    }
    let ndim = limit(first.ndim());
    if axis >= ndim {
        return Err(Error::DimOutOfRange { op, dim: axis, ndim });
    }
    Ok(())
}

/// The error for tensor `i` whose shape does not agree with the first's.
fn mismatch(op: &'static str, i: usize, shape: &[usize], first: &[usize], rule: &str) -> Error {
    Error::InvalidShape {
        op,
        reason: format!("tensor {i} has shape {shape:?}, tensor 0 {first:?}: {rule}"),
    }
}

impl<T: Element> Tensor<T> {
    /// The tensors joined along `axis`, which each of them has: they must have the same number
    /// of dimensions and the same lengths on every other axis. The result's length along
    /// `axis` is the sum of theirs.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list; [`Error::DimOutOfRange`] when `axis` is not
    /// below their number of dimensions (a 0-D tensor has no axis to join along);
    /// [`Error::InvalidShape`] when the shapes disagree off `axis`;
    /// [`Error::DeviceUnavailable`] for a tensor on a GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let a = Tensor::<f32>::from_shape_vec(&[2, 1], vec![1., 2.])?;
    /// let b = Tensor::<f32>::from_shape_vec(&[2, 2], vec![3., 4., 5., 6.])?;
    /// let c = Tensor::cat(&[&a, &b], 1)?;
    /// assert_eq!(c.shape(), &[2, 3]);
    /// assert_eq!(c.as_slice(), &[1., 3., 4., 2., 5., 6.]);
    /// assert!(Tensor::cat(&[&a, &b], 0).is_err()); // 1 and 2 columns
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn cat(tensors: &[&Tensor<T>], axis: usize) -> Result<Tensor<T>> {
        const OP: &str = "Tensor::cat";
        check_join(OP, tensors, axis, |ndim| ndim)?;
        let first = tensors[0].shape();
        for (i, t) in tensors.iter().enumerate().skip(1) {
            let agree = t.ndim() == first.len()
                && t.shape().iter().zip(first).enumerate().all(|(d, (a, b))| d == axis || a == b);
            if !agree {
                let rule = format!("they must agree on every axis but {axis}");
                return Err(mismatch(OP, i, t.shape(), first, &rule));
            }
        }
        let views: Vec<ArrayViewD<'_, T>> = tensors.iter().map(|t| t.view()).collect();
        let joined = ndarray::concatenate(Axis(axis), &views)
            .map_err(|e| Error::InvalidShape { op: OP, reason: e.to_string() })?;
        Ok(Tensor::from_array(joined))
    }

    /// The tensors, which must all have one shape, stacked along a new axis `axis` (at most
    /// their number of dimensions): `n` tensors of shape `[A, B]` stacked at axis 1 make
    /// `[A, n, B]`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list; [`Error::DimOutOfRange`] when `axis` is
    /// above their number of dimensions; [`Error::InvalidShape`] when the shapes differ;
    /// [`Error::DeviceUnavailable`] for a tensor on a GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let a = Tensor::<f64>::from_shape_vec(&[2], vec![1., 2.])?;
    /// let b = Tensor::<f64>::from_shape_vec(&[2], vec![3., 4.])?;
    /// assert_eq!(Tensor::stack(&[&a, &b], 0)?.as_slice(), &[1., 2., 3., 4.]);
    /// let s = Tensor::stack(&[&a, &b], 1)?;
    /// assert_eq!((s.shape(), s.as_slice()), (&[2, 2][..], &[1., 3., 2., 4.][..]));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn stack(tensors: &[&Tensor<T>], axis: usize) -> Result<Tensor<T>> {
        const OP: &str = "Tensor::stack";
        check_join(OP, tensors, axis, |ndim| ndim + 1)?;
        let first = tensors[0].shape();
        for (i, t) in tensors.iter().enumerate().skip(1) {
            if t.shape() != first {
                return Err(mismatch(OP, i, t.shape(), first, "stacked tensors have one shape"));
            }
        }
        let views: Vec<ArrayViewD<'_, T>> = tensors.iter().map(|t| t.view()).collect();
        let stacked = ndarray::stack(Axis(axis), &views)
            .map_err(|e| Error::InvalidShape { op: OP, reason: e.to_string() })?;
        Ok(Tensor::from_array(stacked))
    }
}
