//! Picking elements: [`Tensor::index_select`] (whole slices along an axis), [`Tensor::gather`]
//! (one element per index, as `torch.gather`), [`Tensor::masked_fill`] and
//! [`Tensor::select_where`] (elementwise choice by a boolean mask), and the scatter-adds their
//! gradients need.
//!
//! Indices and masks are ndarray arrays of `usize` and `bool` (a [`Tensor`] holds only floating
//! point elements). Host only for now: a tensor on a GPU gives [`Error::DeviceUnavailable`].

use ndarray::{Array, ArrayD, ArrayViewD, Axis, Dimension, IxDyn, Zip};

use super::map::{broadcast_shape, require_host};
use super::{Element, Tensor};
use crate::{Error, Result};

/// `Ok` when `axis` is a dimension of a tensor of `ndim` dimensions.
pub(super) fn check_axis(op: &'static str, axis: usize, ndim: usize) -> Result<()> {
    if axis >= ndim {
        return Err(Error::DimOutOfRange { op, dim: axis, ndim });
    }
    Ok(())
}

/// The row-major strides (in elements) of `shape`.
fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// For each element of `index` in row-major order, the row-major offset, in a tensor of
/// `shape`, of the element [`Tensor::gather`] reads for it: the index element's own position
/// with its `axis` coordinate replaced by the index value. The index has been checked.
fn gather_offsets(shape: &[usize], axis: usize, index: &ArrayViewD<'_, usize>) -> Vec<usize> {
    let strides = row_major_strides(shape);
    index
        .indexed_iter()
        .map(|(pos, &i)| {
            let coordinate = |d: usize| if d == axis { i } else { pos[d] };
            (0..shape.len()).map(|d| coordinate(d) * strides[d]).sum()
        })
        .collect()
}

/// Sums in the accumulator type (f32 for the half types, so repeated indices do not round at
/// every addition), rounded once into a tensor of `shape`.
fn round_sums<T: Element>(
    shape: &[usize],
    sums: impl IntoIterator<Item = T::Acc>,
) -> Result<Tensor<T>> {
    Tensor::from_shape_vec(shape, sums.into_iter().map(T::from_acc).collect())
}

impl<T: Element> Tensor<T> {
    /// The slices at `indices` along `axis`, in that order (as `torch.index_select`): the result
    /// has `indices.len()` along `axis` and `self`'s lengths elsewhere. An index may repeat.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] for an axis the tensor does not have;
    /// [`Error::InvalidArgument`] for an index not below the axis' length;
    /// [`Error::DeviceUnavailable`] for a tensor on a GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?;
    /// let s = t.index_select(1, &[2, 0, 2])?;
    /// assert_eq!((s.shape(), s.as_slice()), (&[2, 3][..], &[3., 1., 3., 6., 4., 6.][..]));
    /// assert!(t.index_select(0, &[2]).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn index_select(&self, axis: usize, indices: &[usize]) -> Result<Tensor<T>> {
        const OP: &str = "Tensor::index_select";
        check_axis(OP, axis, self.ndim())?;
        require_host(OP, self)?;
        let len = self.shape()[axis];
        if let Some((at, bad)) = indices.iter().enumerate().find(|&(_, &i)| i >= len) {
            return Err(Error::InvalidArgument {
                op: OP,
                rank: 0,
                reason: format!(
                    "index {bad} (at position {at}) is not below the length {len} of axis {axis}"
                ),
            });
        }
        let mut shape = self.shape().to_vec();
        shape[axis] = indices.len();
        let mut out = Tensor::<T>::scratch(OP, &shape)?;
        let input = self.view();
        let mut o = out.view_mut();
        for (j, &i) in indices.iter().enumerate() {
            o.index_axis_mut(Axis(axis), j).assign(&input.index_axis(Axis(axis), i));
        }
        Ok(out)
    }

    /// The gradient of [`Tensor::index_select`]: `self` (the output's gradient) scatter-added
    /// into zeros of `shape` (the input's) at `indices` along `axis`; a repeated index gets the
    /// sum of its slices. The arguments were checked by the forward pass.
    pub(crate) fn index_select_backward(
        &self,
        shape: &[usize],
        axis: usize,
        indices: &[usize],
    ) -> Result<Tensor<T>> {
        require_host("Var::index_select backward", self)?;
        let mut sums = ArrayD::<T::Acc>::zeros(IxDyn(shape));
        let g = self.view();
        for (j, &i) in indices.iter().enumerate() {
            sums.index_axis_mut(Axis(axis), i)
                .zip_mut_with(&g.index_axis(Axis(axis), j), |s, &x| *s += x.to_acc());
        }
        round_sums(shape, sums)
    }

    /// Elements picked along `axis` by `index` (as `torch.gather`): the result has `index`'s
    /// shape, and its element at position `p` is `self`'s at `p` with coordinate `axis` replaced
    /// by `index[p]`. For a 2-D tensor and `axis` 1: `out[i][j] = self[i][index[i][j]]`.
    ///
    /// `index` has `self`'s number of dimensions, at most `self`'s length on every axis but
    /// `axis`, any length along `axis`; its values may repeat. Pass any ndarray array of `usize`
    /// (`Array2`, `ArrayD`, ...).
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] for an axis the tensor does not have; [`Error::InvalidShape`]
    /// when `index` has another number of dimensions or is longer than `self` on an axis other
    /// than `axis`; [`Error::InvalidArgument`] for an index value not below `self`'s length
    /// along `axis`; [`Error::DeviceUnavailable`] for a tensor on a GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// use ndarray::array;
    /// let t = Tensor::<f64>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?;
    /// // Row 0 takes columns 2 and 2, row 1 columns 0 and 1.
    /// let g = t.gather(1, &array![[2, 2], [0, 1]])?;
    /// assert_eq!((g.shape(), g.as_slice()), (&[2, 2][..], &[3., 3., 4., 5.][..]));
    /// assert!(t.gather(1, &array![[3]]).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gather<D: Dimension>(&self, axis: usize, index: &Array<usize, D>) -> Result<Tensor<T>> {
        const OP: &str = "Tensor::gather";
        let index = index.view().into_dyn();
        self.check_gather(OP, axis, &index)?;
        let offsets = gather_offsets(self.shape(), axis, &index);
        let mut out = Tensor::<T>::scratch(OP, index.shape())?;
        let input = self.as_slice();
        for (o, &at) in out.as_mut_slice().iter_mut().zip(&offsets) {
            *o = input[at];
        }
        Ok(out)
    }

    /// Checks `index` for [`Tensor::gather`] on `self` (and the tensor's place).
    fn check_gather(
        &self,
        op: &'static str,
        axis: usize,
        index: &ArrayViewD<'_, usize>,
    ) -> Result<()> {
        check_axis(op, axis, self.ndim())?;
        require_host(op, self)?;
        let (shape, ishape) = (self.shape(), index.shape());
        let fits = ishape.len() == shape.len()
            && ishape.iter().zip(shape).enumerate().all(|(d, (i, s))| d == axis || i <= s);
        if !fits {
            return Err(Error::InvalidShape {
                op,
                reason: format!(
                    "an index of shape {ishape:?} for a tensor of shape {shape:?} along axis \
                     {axis}: it must have {} dimensions and be no longer than the tensor on \
                     every other axis",
                    shape.len()
                ),
            });
        }
        let len = shape[axis];
        if let Some((pos, bad)) = index.indexed_iter().find(|&(_, &i)| i >= len) {
            return Err(Error::InvalidArgument {
                op,
                rank: 0,
                reason: format!(
                    "index {bad} at position {:?} is not below the length {len} of axis {axis}",
                    pos.slice()
                ),
            });
        }
        Ok(())
    }

    /// The gradient of [`Tensor::gather`]: `self` (the output's gradient, of `index`'s shape)
    /// scatter-added into zeros of `shape` (the input's) where the forward pass read; an
    /// element read several times gets the sum. The arguments were checked by the forward pass.
    pub(crate) fn gather_backward(
        &self,
        shape: &[usize],
        axis: usize,
        index: &ArrayViewD<'_, usize>,
    ) -> Result<Tensor<T>> {
        require_host("Var::gather backward", self)?;
        let mut sums = vec![<T::Acc as Element>::zero(); shape.iter().product()];
        for (&at, &g) in gather_offsets(shape, axis, index).iter().zip(self.as_slice()) {
            sums[at] += g.to_acc();
        }
        round_sums(shape, sums)
    }

    /// `self` with `value` where `mask` is true (as `torch.masked_fill`). `mask` has `self`'s
    /// shape or broadcasts to it (numpy's rule: trailing axes aligned, a length of 1
    /// stretches); the result always has `self`'s shape: a mask cannot widen it. Pass any
    /// ndarray array of `bool`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `mask` does not broadcast to `self`'s shape;
    /// [`Error::DeviceUnavailable`] for a tensor on a GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// use ndarray::array;
    /// let t = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?;
    /// // One row of mask, broadcast over both rows: a causal mask is built the same way.
    /// let m = t.masked_fill(&array![false, true, false], -1.0)?;
    /// assert_eq!(m.as_slice(), &[1., -1., 3., 4., -1., 6.]);
    /// assert!(t.masked_fill(&array![true, false], 0.0).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn masked_fill<D: Dimension>(&self, mask: &Array<bool, D>, value: T) -> Result<Tensor<T>> {
        const OP: &str = "Tensor::masked_fill";
        require_host(OP, self)?;
        let mask = mask.view().into_dyn();
        let Some(mask) = mask.broadcast(self.shape()) else {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!(
                    "a mask of shape {:?} does not broadcast to the tensor's shape {:?} \
                     (trailing axes must be equal or 1 in the mask)",
                    mask.shape(),
                    self.shape()
                ),
            });
        };
        let mut out = self.clone();
        Zip::from(out.view_mut()).and(&mask).for_each(|o, &m| {
            if m {
                *o = value;
            }
        });
        Ok(out)
    }

    /// `a` where `cond` is true, `b` where it is false (as `torch.where(cond, a, b)`; `where` is
    /// a Rust keyword). `cond`, `a` and `b` broadcast together (numpy's rule) to the result's
    /// shape. Pass any ndarray array of `bool`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the three shapes do not broadcast together;
    /// [`Error::DeviceUnavailable`] when `a` or `b` is on a GPU (host only for now).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// use ndarray::array;
    /// let a = Tensor::<f64>::from_shape_vec(&[2, 2], vec![1., 2., 3., 4.])?;
    /// let b = Tensor::<f64>::from_shape_vec(&[], vec![0.])?; // a scalar, broadcast
    /// let w = Tensor::select_where(&array![[true, false], [false, true]], &a, &b)?;
    /// assert_eq!(w.as_slice(), &[1., 0., 0., 4.]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn select_where<D: Dimension>(
        cond: &Array<bool, D>,
        a: &Tensor<T>,
        b: &Tensor<T>,
    ) -> Result<Tensor<T>> {
        const OP: &str = "Tensor::select_where";
        require_host(OP, a)?;
        require_host(OP, b)?;
        let cond = cond.view().into_dyn();
        let shape = broadcast_shape(cond.shape(), a.shape())
            .and_then(|s| broadcast_shape(&s, b.shape()))
            .ok_or_else(|| Error::InvalidShape {
                op: OP,
                reason: format!(
                    "the condition's shape {:?} and the values' {:?} and {:?} do not broadcast \
                     together (trailing axes must be equal or 1)",
                    cond.shape(),
                    a.shape(),
                    b.shape()
                ),
            })?;
        let stretched = "checked by broadcast_shape";
        let (av, bv) = (a.view(), b.view());
        let c = cond.broadcast(shape.as_slice()).expect(stretched);
        let av = av.broadcast(shape.as_slice()).expect(stretched);
        let bv = bv.broadcast(shape.as_slice()).expect(stretched);
        let mut out = Tensor::<T>::scratch(OP, &shape)?;
        Zip::from(out.view_mut()).and(&c).and(&av).and(&bv).for_each(|o, &c, &x, &y| {
            *o = if c { x } else { y };
        });
        Ok(out)
    }
}
