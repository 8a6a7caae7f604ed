//! Matrix products on [`Var`]: `[m, k] @ [k, n]`, and batched with broadcast batch dimensions.
//! The gradients are `dA = dC @ B^T` and `dB = A^T @ dC`, each summed over the batch dimensions
//! its operand was broadcast along.

use super::arith::sum_to_shape;
use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result, Tensor};

/// The last two axes swapped.
fn t<T: Element>(x: &Tensor<T>) -> Result<Tensor<T>> {
    x.transpose(x.ndim() - 2, x.ndim() - 1)
}

/// `x` of `[..., k]` as a matrix `[rows, k]`.
fn rows<T: Element>(x: &Tensor<T>) -> Result<Tensor<T>> {
    let (k, lead) = x.shape().split_last().expect("at least 2-D");
    x.reshape(&[lead.iter().product(), *k])
}

impl<'a, T: Element> Var<'a, T> {
    /// `self @ rhs`, as [`Tensor::matmul`].
    ///
    /// # Errors
    /// As [`Tensor::matmul`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let x = Var::constant(Tensor::<f64>::random(&[3, 4], 1));
    /// let w = Var::param(Tensor::<f64>::random(&[4, 2], 2));
    /// x.matmul(&w)?.sum().backward()?;
    /// // d sum(x @ w) / dw[i][j] = sum over rows of x[r][i]
    /// let want = x.value().sum_axis(0)?;
    /// let g = w.grad().unwrap();
    /// assert!((0..4).all(|i| (g.as_slice()[2 * i] - want.as_slice()[i]).abs() < 1e-12));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn matmul(&self, rhs: &Var<'a, T>) -> Result<Var<'a, T>> {
        let value = self.value.matmul(&rhs.value)?;
        let (a, b) = (self.value.clone(), rhs.value.clone());
        Ok(record(value, &[self, rhs], move |g, need| {
            // A 2-D right operand is shared by every matrix of the left: fold the batch into rows
            // (one product instead of a product per matrix and a sum).
            if b.ndim() == 2 && a.ndim() > 2 {
                let g2 = rows(g)?;
                let ga = if need[0] { Some(g2.matmul(&t(&b)?)?.reshape(a.shape())?) } else { None };
                let gb = if need[1] { Some(t(&rows(&a)?)?.matmul(&g2)?) } else { None };
                return Ok(vec![ga, gb]);
            }
            let ga =
                if need[0] { Some(sum_to_shape(&g.matmul(&t(&b)?)?, a.shape())?) } else { None };
            let gb =
                if need[1] { Some(sum_to_shape(&t(&a)?.matmul(g)?, b.shape())?) } else { None };
            Ok(vec![ga, gb])
        }))
    }
}
