//! Sums and means on [`Var`]: of every element (a 0-D result) and along an axis. The gradient
//! is the output's gradient broadcast back over what was summed (divided by the count for a
//! mean).

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result, Tensor};

/// `g` (0-D, or the shape with `axis` removed) broadcast to `shape`, times `k`.
fn spread<T: Element>(
    g: &Tensor<T>,
    shape: &[usize],
    axis: Option<usize>,
    k: f64,
) -> Result<Tensor<T>> {
    let g = match axis {
        Some(axis) => g.insert_axis(axis)?,
        None => g.clone(),
    };
    let k = T::from_f64(k);
    Tensor::<T>::try_zeros(shape)?.zip_map(&g, |_, g| T::from_f64(g.to_f64() * k.to_f64()))
}

impl<'a, T: Element> Var<'a, T> {
    /// The sum of every element, 0-D.
    pub fn sum(&self) -> Var<'a, T> {
        let v = Tensor::from_shape_vec(&[], vec![self.value.sum()]).expect("0-D");
        let shape = self.shape().to_vec();
        record(v, &[self], move |g, _| Ok(vec![Some(spread(g, &shape, None, 1.0)?)]))
    }

    /// The mean of every element, 0-D.
    pub fn mean(&self) -> Var<'a, T> {
        let v = Tensor::from_shape_vec(&[], vec![self.value.mean()]).expect("0-D");
        let shape = self.shape().to_vec();
        let k = 1.0 / self.value.len().max(1) as f64;
        record(v, &[self], move |g, _| Ok(vec![Some(spread(g, &shape, None, k)?)]))
    }

    /// [`Tensor::sum_axis`].
    ///
    /// # Errors
    /// As [`Tensor::sum_axis`].
    pub fn sum_axis(&self, axis: usize) -> Result<Var<'a, T>> {
        let shape = self.shape().to_vec();
        Ok(record(self.value.sum_axis(axis)?, &[self], move |g, _| {
            Ok(vec![Some(spread(g, &shape, Some(axis), 1.0)?)])
        }))
    }

    /// [`Tensor::mean_axis`].
    ///
    /// # Errors
    /// As [`Tensor::mean_axis`].
    pub fn mean_axis(&self, axis: usize) -> Result<Var<'a, T>> {
        let shape = self.shape().to_vec();
        let k = 1.0 / shape.get(axis).copied().unwrap_or(1).max(1) as f64;
        Ok(record(self.value.mean_axis(axis)?, &[self], move |g, _| {
            Ok(vec![Some(spread(g, &shape, Some(axis), k)?)])
        }))
    }
}
