//! `a^T @ b` for 2-D `a` and `b` with `a` read transposed in place: a weight's gradient (the
//! rows of a layer's input times the rows of its output's gradient). One dispatch: the host
//! product reads `a`'s reversed axes, a GPU's cuBLASLt call its transpose flag; neither copies.

use super::{Element, Tensor, matmul};
use crate::{Error, Result};

const OP: &str = "Tensor::matmul_lhs_transposed";

impl<T: Element> Tensor<T> {
    /// `self^T @ rhs` for `self: [k, m]` and `rhs: [k, n]`: `[m, n]`, on `threads` threads on the
    /// host.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless both are 2-D with as many rows; [`Error::InvalidArgument`]
    /// when they live on different devices; a GPU's launch error.
    pub(crate) fn matmul_lhs_transposed(
        &self,
        rhs: &Tensor<T>,
        threads: usize,
    ) -> Result<Tensor<T>> {
        if self.ndim() != 2 || rhs.ndim() != 2 || self.shape()[0] != rhs.shape()[0] {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!(
                    "{:?}^T @ {:?}: two matrices with as many rows",
                    self.shape(),
                    rhs.shape()
                ),
            });
        }
        match (self.is_on_host(), rhs.is_on_host()) {
            (true, true) => {
                let (a, b) = (self.view2(OP)?, rhs.view2(OP)?);
                Ok(Tensor::from(matmul(a.reversed_axes(), b, threads)?))
            }
            (false, false) => super::dispatch::matmul_lhs_transposed(self, rhs),
            _ => Err(Error::InvalidArgument {
                op: OP,
                rank: 0,
                reason: format!(
                    "the left operand is on {}, the right on {}: both on one device",
                    self.device(),
                    rhs.device()
                ),
            }),
        }
    }
}
