//! Axis moves on [`Var`]: reshape, permute, transpose, insert_axis. Each gradient is the inverse
//! move of the output's gradient.

use crate::autograd::Var;
use crate::autograd::var::{record, record_from};
use crate::{Element, Result};

impl<'a, T: Element> Var<'a, T> {
    /// [`Tensor::reshape`](crate::Tensor::reshape).
    ///
    /// # Errors
    /// As [`Tensor::reshape`](crate::Tensor::reshape).
    pub fn reshape(&self, shape: &[usize]) -> Result<Var<'a, T>> {
        let from = self.shape().to_vec();
        Ok(record(self.value.reshape(shape)?, &[self], move |g, _| {
            Ok(vec![Some(g.reshape(&from)?)])
        }))
    }

    /// [`Tensor::permute`](crate::Tensor::permute).
    ///
    /// # Errors
    /// As [`Tensor::permute`](crate::Tensor::permute).
    pub fn permute(&self, axes: &[usize]) -> Result<Var<'a, T>> {
        let mut inverse = vec![0; axes.len()];
        let value = self.value.permute(axes)?;
        for (i, &a) in axes.iter().enumerate() {
            inverse[a] = i;
        }
        Ok(record(value, &[self], move |g, _| Ok(vec![Some(g.permute(&inverse)?)])))
    }

    /// [`Tensor::transpose`](crate::Tensor::transpose).
    ///
    /// # Errors
    /// As [`Tensor::transpose`](crate::Tensor::transpose).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Var<'a, T>> {
        let value = self.value.transpose(a, b)?;
        Ok(record(value, &[self], move |g, _| Ok(vec![Some(g.transpose(a, b)?)])))
    }

    /// [`Tensor::insert_axis`](crate::Tensor::insert_axis).
    ///
    /// # Errors
    /// As [`Tensor::insert_axis`](crate::Tensor::insert_axis).
    pub fn insert_axis(&self, axis: usize) -> Result<Var<'a, T>> {
        let from = self.shape().to_vec();
        Ok(record(self.value.insert_axis(axis)?, &[self], move |g, _| {
            Ok(vec![Some(g.reshape(&from)?)])
        }))
    }

    /// [`Tensor::cast`](crate::Tensor::cast); the gradient is cast back.
    pub fn cast<U: Element>(&self) -> Var<'a, U> {
        record_from(self.value.cast::<U>(), self, |g| Ok(g.cast::<T>()))
    }
}
