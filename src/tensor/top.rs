//! The largest elements along an axis: [`Tensor::argmax`] (where the largest is) and
//! [`Tensor::topk`] (the `k` largest, in decreasing order, and where they are).
//!
//! Order: larger first; NaN counts as larger than every number (as in `torch.argmax` and
//! `torch.topk`, so a NaN is never silently skipped); ties (equal values, `-0.0` and `0.0`, two
//! NaNs) go to the lowest index first. Host only for now: a tensor on a GPU gives
//! [`Error::DeviceUnavailable`].

use std::cmp::Ordering;

use ndarray::{ArrayD, Axis, IxDyn, Zip};

use super::map::require_host;
use super::select::check_axis;
use super::{Element, Tensor};
use crate::{Error, Result};

/// How `a` ranks against `b` (`Less`: `a` comes first): larger first, NaN before every number,
/// `Equal` for ties (the caller breaks them by index).
fn rank<T: Element>(a: T, b: T) -> Ordering {
    #[allow(clippy::eq_op)] // `x != x` is how a generic element says NaN
    let (a_nan, b_nan) = (a != a, b != b);
    match (a_nan, b_nan) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => b.partial_cmp(&a).unwrap_or(Ordering::Equal),
    }
}

impl<T: Element> Tensor<T> {
    /// The index of the largest element of every lane along `axis`, in an array of `self`'s
    /// shape without `axis` (as `torch.argmax(dim=axis)`; not differentiable, so a plain index
    /// array). Ties go to the lowest index; a NaN counts as the largest.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] for an axis the tensor does not have; [`Error::InvalidShape`]
    /// when `axis` has length 0 (no largest element); [`Error::DeviceUnavailable`] for a tensor
    /// on a GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 5., 5., 7., 2., 3.])?;
    /// assert_eq!(t.argmax(1)?.as_slice(), Some(&[1, 0][..])); // 5 at 1 and 2: 1
    /// assert_eq!(t.argmax(0)?.as_slice(), Some(&[1, 0, 0][..]));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn argmax(&self, axis: usize) -> Result<ArrayD<usize>> {
        const OP: &str = "Tensor::argmax";
        if self.lane_len(OP, axis)? == 0 {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!("axis {axis} of {:?} is empty: no largest element", self.shape()),
            });
        }
        let mut shape = self.shape().to_vec();
        shape.remove(axis);
        let mut out = ArrayD::<usize>::zeros(IxDyn(&shape));
        Zip::from(&mut out).and(self.view().lanes(Axis(axis))).for_each(|o, lane| {
            // Strictly before the best so far: a tie keeps the earlier index.
            for (i, &x) in lane.iter().enumerate() {
                if rank(x, lane[*o]) == Ordering::Less {
                    *o = i;
                }
            }
        });
        Ok(out)
    }

    /// The `k` largest elements of every lane along `axis`, in decreasing order, and their
    /// indices (as `torch.topk(k, dim=axis)`, sorted): both have `self`'s shape with `k` along
    /// `axis`. Ties go to the lowest index first; a NaN counts as the largest.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] for an axis the tensor does not have;
    /// [`Error::InvalidArgument`] when `k` is above the axis' length;
    /// [`Error::DeviceUnavailable`] for a tensor on a GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f64>::from_shape_vec(&[2, 4], vec![1., 4., 2., 4., 0., -1., 3., 2.])?;
    /// let (values, indices) = t.topk(2, 1)?;
    /// assert_eq!(values.as_slice(), &[4., 4., 3., 2.]);
    /// assert_eq!(indices.as_slice(), Some(&[1, 3, 2, 3][..])); // the tie: 1 first
    /// assert!(t.topk(5, 1).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topk(&self, k: usize, axis: usize) -> Result<(Tensor<T>, ArrayD<usize>)> {
        let indices = self.topk_indices(k, axis)?;
        Ok((self.gather(axis, &indices)?, indices))
    }

    /// The indices of [`Tensor::topk`] (the values are a [`Tensor::gather`] of them).
    pub(crate) fn topk_indices(&self, k: usize, axis: usize) -> Result<ArrayD<usize>> {
        const OP: &str = "Tensor::topk";
        let len = self.lane_len(OP, axis)?;
        if k > len {
            return Err(Error::InvalidArgument {
                op: OP,
                rank: 0,
                reason: format!("k = {k} is above the length {len} of axis {axis}"),
            });
        }
        let mut shape = self.shape().to_vec();
        shape[axis] = k;
        let mut out = ArrayD::<usize>::zeros(IxDyn(&shape));
        let mut order: Vec<usize> = Vec::new();
        Zip::from(out.lanes_mut(Axis(axis))).and(self.view().lanes(Axis(axis))).for_each(
            |mut o, lane| {
                if k == 0 {
                    return;
                }
                // A total order (rank, then index), so the k first are well defined: put them
                // in front (linear time), then sort only those.
                let by = |&i: &usize, &j: &usize| rank(lane[i], lane[j]).then(i.cmp(&j));
                order.clear();
                order.extend(0..lane.len());
                order.select_nth_unstable_by(k - 1, by);
                order[..k].sort_unstable_by(by);
                o.iter_mut().zip(&order).for_each(|(o, &i)| *o = i);
            },
        );
        Ok(out)
    }

    /// Checks `axis` and the place for `op`; the length of the lanes along `axis`.
    fn lane_len(&self, op: &'static str, axis: usize) -> Result<usize> {
        check_axis(op, axis, self.ndim())?;
        require_host(op, self)?;
        Ok(self.shape()[axis])
    }
}
