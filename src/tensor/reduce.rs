//! Reductions: [`Tensor::sum`], [`Tensor::mean`] over every element, and their forms along one
//! axis. Sums run in the accumulator type (f32 for f16 and bf16), pairwise, and round once.

use ndarray::{Axis, Zip};

use super::{Accumulator, Element, Tensor};
use crate::{Error, Result};

/// Lanes this short or shorter are summed in order; longer ones split in halves.
const PAIRWISE_BLOCK: usize = 64;

/// The sum of `xs`, pairwise: the rounding error grows with `log n` rather than `n`.
pub(crate) fn pairwise_sum<A: Accumulator>(xs: &[A]) -> A {
    if xs.len() <= PAIRWISE_BLOCK {
        let mut sum = <A as Element>::zero();
        for &x in xs {
            sum += x;
        }
        return sum;
    }
    let (lo, hi) = xs.split_at(xs.len() / 2);
    pairwise_sum(lo) + pairwise_sum(hi)
}

impl<T: Element> Tensor<T> {
    /// The sum of every element (0 for an empty tensor).
    ///
    /// # Panics
    /// On a GPU tensor whose sum fails there (its world failed, the GPU is out of memory), as
    /// the other infallible ops on a GPU do: [`Tensor::try_sum`] returns the error instead.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// use half::bf16;
    /// let t = Tensor::<f32>::from_shape_vec(&[2, 2], vec![1., 2., 3., 4.])?;
    /// assert_eq!(t.sum(), 10.0);
    /// // bf16 sums in f32: 256 + 1 + 1 is 258, where bf16 steps would stay at 256.
    /// let b = Tensor::<bf16>::from_shape_vec(&[3], vec![bf16::from_f32(256.), bf16::ONE, bf16::ONE])?;
    /// assert_eq!(b.sum().to_f32(), 258.0);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    #[track_caller]
    pub fn sum(&self) -> T {
        self.try_sum().unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Tensor::sum`], or the error of a GPU that could not compute it.
    ///
    /// # Errors
    /// On a GPU tensor: the GPU's error (a failed world, [`Error::OutOfMemory`], a launch or
    /// copy error). Never on the host.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f64>::from_shape_vec(&[3], vec![1., 2., 4.])?;
    /// assert_eq!(t.try_sum()?, 7.0);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn try_sum(&self) -> Result<T> {
        self.total(false)
    }

    /// The mean of every element (NaN for an empty tensor).
    ///
    /// # Panics
    /// As [`Tensor::sum`]: [`Tensor::try_mean`] returns a GPU's error instead.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f64>::from_shape_vec(&[4], vec![1., 2., 3., 6.])?;
    /// assert_eq!(t.mean(), 3.0);
    /// assert!(Tensor::<f64>::zeros(&[0]).mean().is_nan());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    #[track_caller]
    pub fn mean(&self) -> T {
        self.try_mean().unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Tensor::mean`], or the error of a GPU that could not compute it.
    ///
    /// # Errors
    /// As [`Tensor::try_sum`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[2], vec![1., 2.])?;
    /// assert_eq!(t.try_mean()?, 1.5);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn try_mean(&self) -> Result<T> {
        self.total(true)
    }

    /// The sum (or mean) of every element as a 0-D tensor where `self` lives: computed on its
    /// GPU and left there (no wait), or on the host.
    pub(crate) fn total_tensor(&self, mean: bool) -> Result<Tensor<T>> {
        if !self.is_on_host() {
            return super::dispatch::total(self, mean);
        }
        let sum = self.acc_sum();
        let total = if mean { sum / T::Acc::from_f64(self.len() as f64) } else { sum };
        Tensor::from_shape_vec(&[], vec![T::from_acc(total)])
    }

    /// The sum (or mean) of every element, brought to the host.
    fn total(&self, mean: bool) -> Result<T> {
        if !self.is_on_host() {
            let total = self.total_tensor(mean)?.to_host()?;
            return Ok(total.as_slice()[0]);
        }
        let sum = self.acc_sum();
        Ok(T::from_acc(if mean { sum / T::Acc::from_f64(self.len() as f64) } else { sum }))
    }

    /// The sum in the accumulator type: pairwise within chunks widened one at a time, then
    /// pairwise over the chunks' sums (no copy of the whole tensor).
    fn acc_sum(&self) -> T::Acc {
        const CHUNK: usize = 1024;
        let mut widened = [<T::Acc as Element>::zero(); CHUNK];
        let sums: Vec<T::Acc> = self
            .as_slice()
            .chunks(CHUNK)
            .map(|chunk| {
                for (w, x) in widened.iter_mut().zip(chunk) {
                    *w = x.to_acc();
                }
                pairwise_sum(&widened[..chunk.len()])
            })
            .collect();
        pairwise_sum(&sums)
    }

    /// Sums along `axis`, which the result drops (as ndarray's `sum_axis` and numpy's `sum` do).
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] when `axis` is not a dimension of the tensor;
    /// [`Error::OutOfMemory`] when the output cannot be allocated.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?;
    /// assert_eq!(t.sum_axis(0)?.as_slice(), &[5., 7., 9.]);
    /// assert_eq!(t.sum_axis(1)?.shape(), &[2]);
    /// assert!(t.sum_axis(2).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn sum_axis(&self, axis: usize) -> Result<Tensor<T>> {
        self.reduce_axis("Tensor::sum_axis", axis, |sum, _| sum)
    }

    /// Means along `axis`, which the result drops.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] when `axis` is not a dimension of the tensor;
    /// [`Error::OutOfMemory`] when the output cannot be allocated.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?;
    /// assert_eq!(t.mean_axis(1)?.as_slice(), &[2., 5.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn mean_axis(&self, axis: usize) -> Result<Tensor<T>> {
        self.reduce_axis("Tensor::mean_axis", axis, |sum, n| sum / T::Acc::from_f64(n as f64))
    }

    /// `finish(sum of the lane, lane length)` for every lane along `axis`.
    fn reduce_axis(
        &self,
        op: &'static str,
        axis: usize,
        finish: impl Fn(T::Acc, usize) -> T::Acc,
    ) -> Result<Tensor<T>> {
        if axis >= self.ndim() {
            return Err(Error::DimOutOfRange { op, dim: axis, ndim: self.ndim() });
        }
        if !self.is_on_host() {
            return super::dispatch::sum_axis(self, axis, op == "Tensor::mean_axis");
        }
        let mut shape = self.shape().to_vec();
        let len = shape.remove(axis);
        let mut out = Tensor::<T>::scratch(op, &shape)?;
        let mut lane: Vec<T::Acc> = Vec::with_capacity(len);
        let input = self.view();
        Zip::from(out.view_mut()).and(input.lanes(Axis(axis))).for_each(|o, x| {
            lane.clear();
            lane.extend(x.iter().map(|v| v.to_acc()));
            *o = T::from_acc(finish(pairwise_sum(&lane), len));
        });
        Ok(out)
    }
}
