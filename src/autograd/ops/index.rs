//! Indexing on [`Var`]: [`Var::narrow`] (a range along one axis; the gradient is padded back
//! with zeros) and [`Var::gather_rows`] (an embedding lookup; the gradient is scatter-added into
//! the rows looked up).

use ndarray::{Axis, Slice};

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::{Element, Error, Result, Tensor};

impl<'a, T: Element> Var<'a, T> {
    /// Elements `start..start + len` along `axis` (a copy).
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] for an axis the value does not have; [`Error::InvalidShape`]
    /// when the range does not fit.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let x = Var::param(Tensor::<f64>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?);
    /// let y = x.narrow(1, 1, 2)?;
    /// assert_eq!(y.value().as_slice(), &[2., 3., 5., 6.]);
    /// y.sum().backward()?;
    /// assert_eq!(x.grad().unwrap().as_slice(), &[0., 1., 1., 0., 1., 1.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Var<'a, T>> {
        let shape = self.shape().to_vec();
        if axis >= shape.len() {
            return Err(Error::DimOutOfRange { op: "Var::narrow", dim: axis, ndim: shape.len() });
        }
        if start + len > shape[axis] {
            return Err(Error::InvalidShape {
                op: "Var::narrow",
                reason: format!("{start}..{} along axis {axis} of {shape:?}", start + len),
            });
        }
        let range = Slice::from(start..start + len);
        let value = Tensor::from_array(
            self.value.view().slice_axis(Axis(axis), range).as_standard_layout().into_owned(),
        );
        Ok(record(value, &[self], move |g, _| {
            let mut dx = Tensor::<T>::try_zeros(&shape)?;
            dx.view_mut().slice_axis_mut(Axis(axis), range).assign(&g.view());
            Ok(vec![Some(dx)])
        }))
    }

    /// Rows of a 2-D `self` (`[V, E]`, an embedding table) for each id: `[ids.len(), E]`, a row
    /// of zeros where an id is `None` (a token another rank's part of the table holds).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `self` is 2-D; [`Error::InvalidArgument`] for an id not
    /// below `V`.
    pub fn gather_rows(&self, ids: &[Option<usize>]) -> Result<Var<'a, T>> {
        let [v, e] = self.shape() else {
            return Err(Error::InvalidShape {
                op: "Var::gather_rows",
                reason: format!("the table must be 2-D [V, E]; got {:?}", self.shape()),
            });
        };
        let (v, e) = (*v, *e);
        if let Some(bad) = ids.iter().flatten().find(|&&i| i >= v) {
            return Err(Error::InvalidArgument {
                op: "Var::gather_rows",
                rank: 0,
                reason: format!("id {bad} is not below the table's {v} rows"),
            });
        }
        let mut out = Tensor::<T>::try_zeros(&[ids.len(), e])?;
        let table = self.value.as_slice();
        if e > 0 {
            for (o, id) in out.as_mut_slice().chunks_exact_mut(e).zip(ids) {
                if let Some(i) = id {
                    o.copy_from_slice(&table[i * e..(i + 1) * e]);
                }
            }
        }
        let ids = ids.to_vec();
        Ok(record(out, &[self], move |g, _| {
            let mut dt = vec![<T::Acc as Element>::zero(); v * e];
            if e > 0 {
                for (gr, id) in g.as_slice().chunks_exact(e).zip(&ids) {
                    if let Some(i) = id {
                        for (d, x) in dt[i * e..(i + 1) * e].iter_mut().zip(gr) {
                            *d += x.to_acc();
                        }
                    }
                }
            }
            let dt = Tensor::from_shape_vec(&[v, e], dt.into_iter().map(T::from_acc).collect())?;
            Ok(vec![Some(dt)])
        }))
    }
}
