//! Joining variables: [`Var::cat`] along an axis they have and [`Var::stack`] along a new one.
//! Each input's gradient is its own part of the output's gradient.

use ndarray::{Axis, Slice};

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Result, Tensor};

impl<'a, T: Element> Var<'a, T> {
    /// [`Tensor::cat`] of the values: joined along `axis`, which every one has. Tracked when
    /// any input is; each tracked input gets the slice of the gradient it filled. Host only for
    /// now (a value on a GPU gives [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)).
    ///
    /// # Errors
    /// As [`Tensor::cat`]: an empty list, an axis out of range, shapes that disagree off `axis`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let a = Var::param(Tensor::<f64>::from_shape_vec(&[1, 2], vec![1., 2.])?);
    /// let b = Var::constant(Tensor::<f64>::from_shape_vec(&[2, 2], vec![3., 4., 5., 6.])?);
    /// let c = Var::cat(&[&a, &b], 0)?;
    /// assert_eq!((c.shape(), c.value().as_slice()), (&[3, 2][..], &[1., 2., 3., 4., 5., 6.][..]));
    /// (&c * &c).sum().backward()?;
    /// assert_eq!(a.grad().unwrap().as_slice(), &[2., 4.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn cat(vars: &[&Var<'a, T>], axis: usize) -> Result<Var<'a, T>> {
        let values: Vec<&Tensor<T>> = vars.iter().map(|v| &v.value).collect();
        let value = Tensor::cat(&values, axis)?;
        // Where each input's part of the output starts and ends along `axis`.
        let mut ends = Vec::with_capacity(vars.len());
        let mut end = 0;
        for v in vars {
            let start = end;
            end += v.shape()[axis];
            ends.push((start, end));
        }
        Ok(record(value, vars, move |g, need| {
            let g = g.view();
            let part = |&(start, end): &(usize, usize)| {
                let slice = g.slice_axis(Axis(axis), Slice::from(start..end));
                Tensor::from_array(slice.to_owned())
            };
            Ok(ends.iter().zip(need).map(|(range, &need)| need.then(|| part(range))).collect())
        }))
    }

    /// [`Tensor::stack`] of the values: one shape, stacked along a new axis `axis`. Tracked
    /// when any input is; input `i` gets the gradient's index `i` along `axis`. Host only for
    /// now (a value on a GPU gives [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)).
    ///
    /// # Errors
    /// As [`Tensor::stack`]: an empty list, an axis above the number of dimensions, shapes
    /// that differ.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let a = Var::param(Tensor::<f64>::from_shape_vec(&[2], vec![1., 2.])?);
    /// let b = Var::param(Tensor::<f64>::from_shape_vec(&[2], vec![3., 4.])?);
    /// let s = Var::stack(&[&a, &b], 1)?;
    /// assert_eq!((s.shape(), s.value().as_slice()), (&[2, 2][..], &[1., 3., 2., 4.][..]));
    /// let w = Var::constant(Tensor::from_shape_vec(&[2, 2], vec![1., 10., 100., 1000.])?);
    /// (&s * &w).sum().backward()?;
    /// assert_eq!(a.grad().unwrap().as_slice(), &[1., 100.]);
    /// assert_eq!(b.grad().unwrap().as_slice(), &[10., 1000.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn stack(vars: &[&Var<'a, T>], axis: usize) -> Result<Var<'a, T>> {
        let values: Vec<&Tensor<T>> = vars.iter().map(|v| &v.value).collect();
        let value = Tensor::stack(&values, axis)?;
        Ok(record(value, vars, move |g, need| {
            let g = g.view();
            let part = |i: usize| Tensor::from_array(g.index_axis(Axis(axis), i).to_owned());
            Ok(need.iter().enumerate().map(|(i, &need)| need.then(|| part(i))).collect())
        }))
    }
}
