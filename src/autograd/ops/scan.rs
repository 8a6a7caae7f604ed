//! Running sums on [`Var`]: [`Var::cumsum`]. Input `i` of a lane counts in every output from `i`
//! on, so its gradient is the running sum of the output's gradient from the lane's end.

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result};

impl<'a, T: Element> Var<'a, T> {
    /// [`Tensor::cumsum`](crate::Tensor::cumsum): running sums along `axis`. The gradient is
    /// the reverse running sum of the output's gradient. Host only for now (a value on a GPU
    /// gives [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)).
    ///
    /// # Errors
    /// As [`Tensor::cumsum`](crate::Tensor::cumsum).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let x = Var::param(Tensor::<f64>::from_shape_vec(&[3], vec![1., 2., 3.])?);
    /// let y = x.cumsum(0)?;
    /// assert_eq!(y.value().as_slice(), &[1., 3., 6.]);
    /// y.sum().backward()?; // x[0] is in all three sums, x[2] in one
    /// assert_eq!(x.grad().unwrap().as_slice(), &[3., 2., 1.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn cumsum(&self, axis: usize) -> Result<Var<'a, T>> {
        let value = self.value.cumsum(axis)?;
        Ok(record(value, &[self], move |g, _| Ok(vec![Some(g.cumsum_from_end(axis)?)])))
    }
}
