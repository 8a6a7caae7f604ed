//! Running sums: [`Tensor::cumsum`] along an axis, and the reverse running sum its gradient is.
//!
//! Host only for now: a tensor on a GPU gives [`Error::DeviceUnavailable`](crate::Error).

use ndarray::{Axis, Zip};

use super::map::require_host;
use super::select::check_axis;
use super::{Element, Tensor};
use crate::Result;

impl<T: Element> Tensor<T> {
    /// Running sums along `axis` (as `torch.cumsum`): element `i` of each lane is the sum of the
    /// lane's elements `0..=i`. The sums run in the accumulator type (f32 for the half types)
    /// and each is rounded once.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`](crate::Error::DimOutOfRange) for an axis the tensor does not
    /// have; [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) for a tensor on a
    /// GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?;
    /// assert_eq!(t.cumsum(1)?.as_slice(), &[1., 3., 6., 4., 9., 15.]);
    /// assert_eq!(t.cumsum(0)?.as_slice(), &[1., 2., 3., 5., 7., 9.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn cumsum(&self, axis: usize) -> Result<Tensor<T>> {
        self.scan("Tensor::cumsum", axis, false)
    }

    /// Running sums along `axis` from the end: element `i` of each lane is the sum of the lane's
    /// elements `i..` (the gradient of [`Tensor::cumsum`]: input `i` counts in every output from
    /// `i` on).
    pub(crate) fn cumsum_from_end(&self, axis: usize) -> Result<Tensor<T>> {
        self.scan("Var::cumsum backward", axis, true)
    }

    fn scan(&self, op: &'static str, axis: usize, from_end: bool) -> Result<Tensor<T>> {
        check_axis(op, axis, self.ndim())?;
        require_host(op, self)?;
        let mut out = Tensor::<T>::scratch(op, self.shape())?;
        let input = self.view();
        Zip::from(out.view_mut().lanes_mut(Axis(axis))).and(input.lanes(Axis(axis))).for_each(
            |mut o, x| {
                let mut sum = <T::Acc as Element>::zero();
                let mut step = |(o, x): (&mut T, &T)| {
                    sum += x.to_acc();
                    *o = T::from_acc(sum);
                };
                if from_end {
                    o.iter_mut().rev().zip(x.iter().rev()).for_each(&mut step);
                } else {
                    o.iter_mut().zip(x.iter()).for_each(&mut step);
                }
            },
        );
        Ok(out)
    }
}
