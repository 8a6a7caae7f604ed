//! The largest elements on [`Var`]: [`Var::argmax`] (indices only: not differentiable) and
//! [`Var::topk`] (values, differentiable as a gather of the elements chosen, and indices).

use ndarray::ArrayD;

use crate::autograd::Var;
use crate::{Element, Result};

impl<'a, T: Element> Var<'a, T> {
    /// [`Tensor::argmax`](crate::Tensor::argmax) of the value: the index of the largest element
    /// of every lane along `axis` (ties: the lowest index; NaN counts as the largest). Indices
    /// have no gradient, so this is a plain array and records nothing.
    ///
    /// # Errors
    /// As [`Tensor::argmax`](crate::Tensor::argmax).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let logits = Tensor::<f32>::from_shape_vec(&[2, 3], vec![0., 2., 1., 3., 3., 0.])?;
    /// let logits = Var::param(logits);
    /// let predicted = logits.argmax(1)?;
    /// assert_eq!(predicted.as_slice(), Some(&[1, 0][..])); // row 1 ties at 0 and 1: 0
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn argmax(&self, axis: usize) -> Result<ArrayD<usize>> {
        self.value.argmax(axis)
    }

    /// [`Tensor::topk`](crate::Tensor::topk): the `k` largest elements of every lane along
    /// `axis` in decreasing order, and their indices. Ties go to the lowest index first (NaN
    /// counts as the largest). The values are a [`Var::gather`] at the indices, so the gradient
    /// reaches exactly the elements chosen; where tied elements straddle the `k`-th place the
    /// lower index is chosen and gets the gradient (topk is not differentiable at a tie).
    ///
    /// # Errors
    /// As [`Tensor::topk`](crate::Tensor::topk).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let x = Var::param(Tensor::<f64>::from_shape_vec(&[4], vec![1., 3., 2., 3.])?);
    /// let (values, indices) = x.topk(2, 0)?;
    /// assert_eq!(values.value().as_slice(), &[3., 3.]);
    /// assert_eq!(indices.as_slice(), Some(&[1, 3][..]));
    /// values.sum().backward()?;
    /// assert_eq!(x.grad().unwrap().as_slice(), &[0., 1., 0., 1.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topk(&self, k: usize, axis: usize) -> Result<(Var<'a, T>, ArrayD<usize>)> {
        let indices = self.value.topk_indices(k, axis)?;
        Ok((self.gather(axis, &indices)?, indices))
    }
}
