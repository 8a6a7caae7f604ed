//! Sums and means on [`Var`]: of every element (a 0-D result) and along an axis. The gradient
//! is the output's gradient broadcast back over what was summed (divided by the count for a
//! mean). And the log-sum-exp along an axis, whose gradient is the softmax.

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result, Tensor};

/// `g` (0-D, or the shape with `axis` removed) broadcast to `shape`, times `k`, where `like`
/// lives (the op's output: on a GPU the gradient is made there, from a `g` on the host or the
/// GPU).
fn spread<T: Element>(
    g: &Tensor<T>,
    like: &Tensor<T>,
    shape: &[usize],
    axis: Option<usize>,
    k: f64,
) -> Result<Tensor<T>> {
    let g = match axis {
        Some(axis) => g.insert_axis(axis)?,
        None => g.clone(),
    };
    let k = T::from_f64(k);
    if !like.is_on_host() {
        // `k` rounded to `T` times `g` rounds once, as the host's f64 product does.
        let g = g.into_place_of(like)?;
        let g = if k.to_f64() == 1.0 { g } else { g * k };
        return Ok(&like.zeros_like(shape)? + &g);
    }
    Tensor::<T>::try_zeros(shape)?.zip_map(&g, |_, g| T::from_f64(g.to_f64() * k.to_f64()))
}

/// The 0-D total of `x` where it lives, panicking on a GPU's failure as the other infallible
/// GPU ops do ([`Tensor::try_sum`] is the fallible form).
#[track_caller]
fn total<T: Element>(x: &Tensor<T>, mean: bool) -> Tensor<T> {
    x.total_tensor(mean).unwrap_or_else(|e| panic!("{e}"))
}

impl<'a, T: Element> Var<'a, T> {
    /// The sum of every element, 0-D (on the GPU where the value lives).
    pub fn sum(&self) -> Var<'a, T> {
        let v = total(&self.value, false);
        let (shape, like) = (self.shape().to_vec(), v.clone());
        record(v, &[self], move |g, _| Ok(vec![Some(spread(g, &like, &shape, None, 1.0)?)]))
    }

    /// The mean of every element, 0-D (on the GPU where the value lives).
    pub fn mean(&self) -> Var<'a, T> {
        let v = total(&self.value, true);
        let (shape, like) = (self.shape().to_vec(), v.clone());
        let k = 1.0 / self.value.len().max(1) as f64;
        record(v, &[self], move |g, _| Ok(vec![Some(spread(g, &like, &shape, None, k)?)]))
    }

    /// [`Tensor::sum_axis`].
    ///
    /// # Errors
    /// As [`Tensor::sum_axis`].
    pub fn sum_axis(&self, axis: usize) -> Result<Var<'a, T>> {
        let (shape, v) = (self.shape().to_vec(), self.value.sum_axis(axis)?);
        let like = v.clone();
        Ok(record(v, &[self], move |g, _| {
            Ok(vec![Some(spread(g, &like, &shape, Some(axis), 1.0)?)])
        }))
    }

    /// [`Tensor::mean_axis`].
    ///
    /// # Errors
    /// As [`Tensor::mean_axis`].
    pub fn mean_axis(&self, axis: usize) -> Result<Var<'a, T>> {
        let shape = self.shape().to_vec();
        let k = 1.0 / shape.get(axis).copied().unwrap_or(1).max(1) as f64;
        let v = self.value.mean_axis(axis)?;
        let like = v.clone();
        Ok(record(v, &[self], move |g, _| Ok(vec![Some(spread(g, &like, &shape, Some(axis), k)?)])))
    }

    /// `log(sum(exp(x)))` along `axis` (the largest element taken out first, so nothing
    /// overflows; in the accumulator type, rounded once): the router z-loss's and a softmax's
    /// normaliser. The gradient is the output's times the softmax along `axis`. Host values.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`](crate::Error::DimOutOfRange) for an axis the value does not
    /// have; [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) on a device.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let x = Var::param(Tensor::<f64>::from_shape_vec(&[1, 2], vec![0.0, 0.0])?);
    /// let l = x.logsumexp(1)?;
    /// assert!((l.value().as_slice()[0] - 2f64.ln()).abs() < 1e-15);
    /// l.sum().backward()?;
    /// assert_eq!(x.grad().unwrap().as_slice(), &[0.5, 0.5]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn logsumexp(&self, axis: usize) -> Result<Var<'a, T>> {
        use num_traits::Float;
        let p = self.value.softmax(axis)?;
        crate::tensor::require_host("Var::logsumexp", &self.value)?;
        let x = self.value.view();
        let value = x.map_axis(ndarray::Axis(axis), |lane| {
            let acc = |v: &T| v.to_acc();
            let max = lane.iter().map(acc).fold(<T::Acc as Float>::neg_infinity(), Float::max);
            if max == <T::Acc as Float>::neg_infinity() {
                return T::from_acc(max);
            }
            let sum =
                lane.iter().fold(<T::Acc as Element>::zero(), |s, v| s + (acc(v) - max).exp());
            T::from_acc(max + sum.ln())
        });
        let value = Tensor::from_array(value);
        Ok(record(value, &[self], move |g, _| Ok(vec![Some(&p * &g.insert_axis(axis)?)])))
    }
}
