//! `mse_loss`'s arithmetic on one tensor: the gradient `(p - t) * scale` in the accumulator type
//! rounded once, and the sum of squared errors in f64. One dispatch: the host loops below, or
//! one pass of a GPU kernel (`kernels/train.cu`) computing the same in the same types.

use super::{Element, Tensor};
use crate::{Error, Result};

const OP: &str = "mse_loss";

impl<T: Element> Tensor<T> {
    /// `((self - target) * scale, sum((self - target)^2))`: the gradient of a mean squared error
    /// (with `scale = 2 / len`) and this tensor's sum of squares, in one pass where a GPU holds
    /// both.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the shapes differ; [`Error::InvalidArgument`] when the two
    /// live on different devices; a GPU's launch or copy error.
    pub(crate) fn mse_parts(&self, target: &Tensor<T>, scale: f64) -> Result<(Tensor<T>, f64)> {
        if self.shape() != target.shape() {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!(
                    "a prediction of {:?} against a target of {:?}",
                    self.shape(),
                    target.shape()
                ),
            });
        }
        match (self.is_on_host(), target.is_on_host()) {
            (true, true) => {
                let s = <T::Acc as Element>::from_f64(scale);
                let grad =
                    self.zip_map(target, |p, t| T::from_acc((p.to_acc() - t.to_acc()) * s))?;
                let (p, t) = (self.as_slice(), target.as_slice());
                let sum = p.iter().zip(t).map(|(p, t)| (p.to_f64() - t.to_f64()).powi(2)).sum();
                Ok((grad, sum))
            }
            (false, false) => super::dispatch::mse_parts(self, target, scale),
            _ => Err(Error::InvalidArgument {
                op: OP,
                rank: 0,
                reason: format!(
                    "the prediction is on {}, the target on {}: both on one device",
                    self.device(),
                    target.device()
                ),
            }),
        }
    }
}
