//! Picking elements on [`Var`]: [`Var::index_select`] and [`Var::gather`] (the gradient is
//! scatter-added back where the forward pass read, so a repeated index accumulates), and
//! [`Var::masked_fill`] and [`Var::select_where`] (the gradient flows only where the value was
//! taken from the input).

use ndarray::{Array, ArrayD, Dimension};

use super::arith::sum_to_shape;
use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result, Tensor};

impl<'a, T: Element> Var<'a, T> {
    /// [`Tensor::index_select`]: the slices at `indices` along `axis`. The gradient is the
    /// output's gradient scatter-added back: a slice selected `n` times gets the sum of its `n`
    /// gradients. Host only for now (a value on a GPU gives
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)).
    ///
    /// # Errors
    /// As [`Tensor::index_select`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let x = Var::param(Tensor::<f64>::from_shape_vec(&[3, 2], vec![1., 2., 3., 4., 5., 6.])?);
    /// let y = x.index_select(0, &[2, 0, 2])?;
    /// assert_eq!(y.value().as_slice(), &[5., 6., 1., 2., 5., 6.]);
    /// y.sum().backward()?;
    /// assert_eq!(x.grad().unwrap().as_slice(), &[1., 1., 0., 0., 2., 2.]); // row 2 twice
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn index_select(&self, axis: usize, indices: &[usize]) -> Result<Var<'a, T>> {
        let value = self.value.index_select(axis, indices)?;
        let (shape, indices) = (self.shape().to_vec(), indices.to_vec());
        Ok(record(value, &[self], move |g, _| {
            Ok(vec![Some(g.index_select_backward(&shape, axis, &indices)?)])
        }))
    }

    /// [`Tensor::gather`] (as `torch.gather`): the result has `index`'s shape, and its element
    /// at `p` is `self`'s at `p` with coordinate `axis` replaced by `index[p]`. The gradient is
    /// scatter-added back: an element read `n` times gets the sum of its `n` gradients. Host
    /// only for now (a value on a GPU gives
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)).
    ///
    /// # Errors
    /// As [`Tensor::gather`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// use ndarray::array;
    /// let x = Var::param(Tensor::<f64>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?);
    /// // The probability of each row's label: out[i][0] = x[i][label[i]].
    /// let picked = x.gather(1, &array![[2], [2]])?;
    /// assert_eq!(picked.value().as_slice(), &[3., 6.]);
    /// picked.sum().backward()?;
    /// assert_eq!(x.grad().unwrap().as_slice(), &[0., 0., 1., 0., 0., 1.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gather<D: Dimension>(&self, axis: usize, index: &Array<usize, D>) -> Result<Var<'a, T>> {
        let value = self.value.gather(axis, index)?;
        let (shape, index) = (self.shape().to_vec(), index.view().into_dyn().to_owned());
        Ok(record(value, &[self], move |g, _| {
            Ok(vec![Some(g.gather_backward(&shape, axis, &index.view())?)])
        }))
    }

    /// [`Tensor::masked_fill`]: `value` where `mask` (of `self`'s shape, or broadcasting to it)
    /// is true. The gradient is the output's where the mask is false and zero where it filled
    /// (the output there does not depend on `self`). Host only for now (a value on a GPU gives
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)).
    ///
    /// # Errors
    /// As [`Tensor::masked_fill`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// use ndarray::array;
    /// let x = Var::param(Tensor::<f64>::from_shape_vec(&[2, 2], vec![1., 2., 3., 4.])?);
    /// // A causal mask: what lies above the diagonal becomes -inf before a softmax.
    /// let y = x.masked_fill(&array![[false, true], [false, false]], f64::NEG_INFINITY)?;
    /// assert_eq!(y.value().as_slice(), &[1., f64::NEG_INFINITY, 3., 4.]);
    /// y.softmax(1)?.sum().backward()?;
    /// assert_eq!(x.grad().unwrap().as_slice()[1], 0.0);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn masked_fill<D: Dimension>(&self, mask: &Array<bool, D>, value: T) -> Result<Var<'a, T>> {
        let out = self.value.masked_fill(mask, value)?;
        let mask = mask.view().into_dyn().to_owned();
        Ok(record(out, &[self], move |g, _| Ok(vec![Some(g.masked_fill(&mask, T::zero())?)])))
    }

    /// [`Tensor::select_where`] (as `torch.where(cond, a, b)`; `where` is a Rust keyword): `a`
    /// where `cond` is true, `b` where it is false, all three broadcast together. `a`'s gradient
    /// is the output's where `cond` is true (zero elsewhere), `b`'s where it is false, each
    /// summed over the axes its operand was broadcast along. Host only for now (a value on a GPU
    /// gives [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)).
    ///
    /// # Errors
    /// As [`Tensor::select_where`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// use ndarray::array;
    /// let a = Var::param(Tensor::<f64>::from_shape_vec(&[2], vec![1., 2.])?);
    /// let b = Var::param(Tensor::<f64>::from_shape_vec(&[2], vec![-1., -2.])?);
    /// let y = Var::select_where(&array![true, false], &a, &b)?;
    /// assert_eq!(y.value().as_slice(), &[1., -2.]);
    /// y.sum().backward()?;
    /// assert_eq!(a.grad().unwrap().as_slice(), &[1., 0.]);
    /// assert_eq!(b.grad().unwrap().as_slice(), &[0., 1.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn select_where<D: Dimension>(
        cond: &Array<bool, D>,
        a: &Var<'a, T>,
        b: &Var<'a, T>,
    ) -> Result<Var<'a, T>> {
        let value = Tensor::select_where(cond, &a.value, &b.value)?;
        let (a_shape, b_shape) = (a.shape().to_vec(), b.shape().to_vec());
        // `cond` broadcasts to the output's shape, which the gradient has: each operand's
        // gradient is the output's with the other's places zeroed, summed back to its shape.
        let taken_from_a = cond.view().into_dyn().to_owned();
        Ok(record(value, &[a, b], move |g, need| {
            // The output's gradient with the places `fill` marks zeroed, summed back to `shape`.
            let part = |fill: &ArrayD<bool>, shape: &[usize]| -> Result<Tensor<T>> {
                sum_to_shape(&g.masked_fill(fill, T::zero())?, shape)
            };
            let ga = need[0].then(|| part(&taken_from_a.mapv(|c| !c), &a_shape)).transpose()?;
            let gb = need[1].then(|| part(&taken_from_a, &b_shape)).transpose()?;
            Ok(vec![ga, gb])
        }))
    }
}
