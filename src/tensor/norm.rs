//! Normalizations over the last axis, as transformer blocks use them: [`Tensor::rms_norm`]
//! (LLaMA, T5) and [`Tensor::layer_norm`] (GPT-2, BERT). Statistics, scale and shift run in the
//! accumulator type (f32 for f16 and bf16), and each output rounds once.

use num_traits::Float;

use super::reduce::pairwise_sum;
use super::{Element, Tensor};
use crate::{Error, Result};

/// A per-feature parameter (weight or bias), widened; `None` when left out.
type Param<A> = Option<Vec<A>>;

/// The last axis's length, and the per-feature parameters widened, after checking their shapes.
fn features<T: Element>(
    op: &'static str,
    x: &Tensor<T>,
    params: &[(&str, Option<&Tensor<T>>)],
) -> Result<(usize, Vec<Param<T::Acc>>)> {
    let Some(&n) = x.shape().last() else {
        return Err(Error::InvalidShape {
            op,
            reason: "a 0-D tensor has no last axis to normalize over".to_string(),
        });
    };
    let widened = params
        .iter()
        .map(|&(name, p)| match p {
            None => Ok(None),
            Some(p) if p.device() != x.device() => Err(Error::InvalidArgument {
                op,
                rank: 0,
                reason: format!(
                    "the input is on {} and {name} on {}: move one first",
                    x.device(),
                    p.device()
                ),
            }),
            // On a GPU the kernel reads the parameter there.
            Some(p) if p.shape() == [n] && !p.is_on_host() => Ok(None),
            Some(p) if p.shape() == [n] => {
                Ok(Some(p.as_slice().iter().map(|v| v.to_acc()).collect()))
            }
            Some(p) => Err(Error::InvalidShape {
                op,
                reason: format!(
                    "{name} has shape {:?}; it must be [{n}], one value per feature of the last \
                     axis of {:?}",
                    p.shape(),
                    x.shape()
                ),
            }),
        })
        .collect::<Result<_>>()?;
    Ok((n, widened))
}

impl<T: Element> Tensor<T> {
    /// RMS normalization over the last axis: `x / sqrt(mean(x^2) + eps) * weight`, with `weight`
    /// (shape `[last]`) left out meaning 1.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a 0-D tensor, or a weight whose shape is not `[last]`;
    /// [`Error::OutOfMemory`] when the output cannot be allocated.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let x = Tensor::<f64>::from_shape_vec(&[1, 2], vec![3.0, 4.0])?;
    /// let w = Tensor::<f64>::from_shape_vec(&[2], vec![1.0, 2.0])?;
    /// let y = x.rms_norm(Some(&w), 0.0)?; // rms = sqrt((9 + 16) / 2)
    /// let rms = 12.5f64.sqrt();
    /// assert!((y.as_slice()[0] - 3.0 / rms).abs() < 1e-15);
    /// assert!((y.as_slice()[1] - 8.0 / rms).abs() < 1e-15);
    /// assert!(x.rms_norm(Some(&x), 1e-6).is_err()); // weight must be [2]
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn rms_norm(&self, weight: Option<&Tensor<T>>, eps: f64) -> Result<Tensor<T>> {
        let (n, params) = features("Tensor::rms_norm", self, &[("weight", weight)])?;
        if !self.is_on_host() {
            return super::dispatch::norm("Tensor::rms_norm", self, weight, None, eps, false);
        }
        let (eps, count) = (T::Acc::from_f64(eps), T::Acc::from_f64(n as f64));
        let mut squares = Vec::with_capacity(n);
        self.per_row("Tensor::rms_norm", |x, out| {
            squares.clear();
            squares.extend(x.iter().map(|&v| v * v));
            let scale = (pairwise_sum(&squares) / count + eps).sqrt().recip();
            match &params[0] {
                Some(w) => {
                    for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
                        *o = T::from_acc(v * scale * w);
                    }
                }
                None => {
                    for (o, &v) in out.iter_mut().zip(x) {
                        *o = T::from_acc(v * scale);
                    }
                }
            }
        })
    }

    /// Layer normalization over the last axis: `(x - mean) / sqrt(var + eps) * weight + bias`,
    /// with the biased variance (as PyTorch's `layer_norm`); `weight` left out means 1, `bias`
    /// left out means 0, both of shape `[last]`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a 0-D tensor, or a weight or bias whose shape is not `[last]`;
    /// [`Error::OutOfMemory`] when the output cannot be allocated.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let x = Tensor::<f32>::from_shape_vec(&[2, 2], vec![1.0, 3.0, 10.0, 10.0])?;
    /// let b = Tensor::<f32>::from_shape_vec(&[2], vec![0.5, 0.5])?;
    /// let y = x.layer_norm(None, Some(&b), 0.0)?;
    /// assert_eq!(&y.as_slice()[..2], &[-0.5, 1.5]); // mean 2, standard deviation 1
    /// assert!(y.as_slice()[2].is_nan()); // a constant row with eps = 0: 0 / 0
    /// assert_eq!(x.layer_norm(None, Some(&b), 1e-5)?.as_slice()[2], 0.5);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn layer_norm(
        &self,
        weight: Option<&Tensor<T>>,
        bias: Option<&Tensor<T>>,
        eps: f64,
    ) -> Result<Tensor<T>> {
        let (n, params) =
            features("Tensor::layer_norm", self, &[("weight", weight), ("bias", bias)])?;
        if !self.is_on_host() {
            return super::dispatch::norm("Tensor::layer_norm", self, weight, bias, eps, true);
        }
        let (eps, count) = (T::Acc::from_f64(eps), T::Acc::from_f64(n as f64));
        let mut centered = Vec::with_capacity(n);
        self.per_row("Tensor::layer_norm", |x, out| {
            let mean = pairwise_sum(x) / count;
            centered.clear();
            centered.extend(x.iter().map(|&v| (v - mean) * (v - mean)));
            let scale = (pairwise_sum(&centered) / count + eps).sqrt().recip();
            let normalized = x.iter().map(|&v| (v - mean) * scale);
            match (&params[0], &params[1]) {
                (Some(w), Some(b)) => {
                    for (o, ((v, &w), &b)) in out.iter_mut().zip(normalized.zip(w).zip(b)) {
                        *o = T::from_acc(v * w + b);
                    }
                }
                (Some(w), None) => {
                    for (o, (v, &w)) in out.iter_mut().zip(normalized.zip(w)) {
                        *o = T::from_acc(v * w);
                    }
                }
                (None, Some(b)) => {
                    for (o, (v, &b)) in out.iter_mut().zip(normalized.zip(b)) {
                        *o = T::from_acc(v + b);
                    }
                }
                (None, None) => {
                    for (o, v) in out.iter_mut().zip(normalized) {
                        *o = T::from_acc(v);
                    }
                }
            }
        })
    }

    /// `f(row widened, output row)` for every row of the last axis.
    fn per_row(
        &self,
        op: &'static str,
        mut f: impl FnMut(&[T::Acc], &mut [T]),
    ) -> Result<Tensor<T>> {
        let n = *self.shape().last().expect("checked by features");
        let mut out = Tensor::<T>::scratch(op, self.shape())?;
        let mut row: Vec<T::Acc> = Vec::with_capacity(n);
        if n > 0 {
            let rows = self.as_slice().chunks_exact(n).zip(out.as_mut_slice().chunks_exact_mut(n));
            for (x, o) in rows {
                row.clear();
                row.extend(x.iter().map(|v| v.to_acc()));
                f(&row, o);
            }
        }
        Ok(out)
    }
}
