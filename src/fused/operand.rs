//! [`Operand`]: a matrix operand of a fused op, from a host view or a tensor on any device, and
//! [`to_world_device`], the one move of an input to the device its world computes on.

use ndarray::ArrayView2;

use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

/// A matrix operand: a host view, or a tensor `[..., cols]` read as rows of its last dimension
/// (`true`: read transposed, a weight `[n, k]` taken as `[k, n]`), on the host or a device. Host
/// callers lose nothing: views and tensors convert with `From`.
#[derive(Clone, Copy)]
pub(crate) enum Operand<'a, T: Element> {
    /// A host view, in any layout.
    View(ArrayView2<'a, T>),
    /// A tensor of 2 or more dimensions; whether to read it transposed.
    Tensor(&'a Tensor<T>, bool),
}

impl<'a, T: Element> From<ArrayView2<'a, T>> for Operand<'a, T> {
    fn from(view: ArrayView2<'a, T>) -> Self {
        Operand::View(view)
    }
}

impl<'a, T: Element> From<&'a Tensor<T>> for Operand<'a, T> {
    fn from(t: &'a Tensor<T>) -> Self {
        Operand::Tensor(t, false)
    }
}

impl<'a, T: Element> Operand<'a, T> {
    /// Dimensions of the operand as given (a view has 2).
    pub(crate) fn ndim(&self) -> usize {
        match self {
            Operand::View(_) => 2,
            Operand::Tensor(t, _) => t.ndim(),
        }
    }

    /// Whether it is read transposed.
    pub(crate) fn transposed(&self) -> bool {
        matches!(self, Operand::Tensor(_, true))
    }

    /// `(rows, cols)` of the matrix it is read as.
    pub(crate) fn dim(&self) -> (usize, usize) {
        match self {
            Operand::View(v) => v.dim(),
            Operand::Tensor(t, transposed) => {
                let cols = t.shape().last().copied().unwrap_or(1);
                let rows = t.shape()[..t.ndim().saturating_sub(1)].iter().product();
                if *transposed { (cols, rows) } else { (rows, cols) }
            }
        }
    }

    /// The matrix as a host view, without a copy.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] for a tensor that lives on a device: the host and Ascend
    /// worlds compute on host tensors (the ops move inputs to their world's device at entry).
    pub(crate) fn view(&self, op: &'static str) -> Result<ArrayView2<'a, T>> {
        match *self {
            Operand::View(v) => Ok(v),
            Operand::Tensor(t, transposed) => {
                if t.device_storage().is_some() {
                    return Err(Error::DeviceUnavailable {
                        op,
                        device: t.device().to_string(),
                        reason: "this world computes on the host: move the tensor with to_host()"
                            .into(),
                    });
                }
                let cols = t.shape().last().copied().unwrap_or(1);
                let rows = t.shape()[..t.ndim().saturating_sub(1)].iter().product();
                let v = ArrayView2::from_shape((rows, cols), t.as_slice())
                    .expect("a tensor is contiguous");
                Ok(if transposed { v.reversed_axes() } else { v })
            }
        }
    }

    /// The matrix as a row-major 2-D tensor on `rank`'s device (moved, or copied out of a view,
    /// once). Not for transposed tensors (the capability table refuses them first).
    pub(crate) fn on_device(&self, rank: &Rank<'_>) -> Result<Tensor<T>> {
        match *self {
            Operand::View(v) => {
                let owned = v.as_standard_layout().into_owned().into_dyn();
                to_world_device(rank, Tensor::from_array(owned))
            }
            Operand::Tensor(t, _) => to_world_device(rank, t.clone()),
        }
    }

    /// The matrix it is read as (`dim()`), row-major, where `rank`'s world keeps its tensors:
    /// an N-D tensor's leading dimensions as rows (a reshape, no copy); a transposed one turned
    /// into that layout on the device (the tiled transpose, one copy).
    pub(crate) fn on_device_matrix(&self, rank: &Rank<'_>) -> Result<Tensor<T>> {
        let t = self.on_device(rank)?;
        let (rows, cols) = self.dim();
        if self.transposed() {
            t.reshape(&[cols, rows])?.transpose(0, 1)
        } else {
            t.reshape(&[rows, cols])
        }
    }
}

/// `t` where `rank`'s world keeps its tensors (its GPU in a CUDA world, the host otherwise):
/// moved once if it lives elsewhere, as it is otherwise.
pub(crate) fn to_world_device<T: Element>(rank: &Rank<'_>, t: Tensor<T>) -> Result<Tensor<T>> {
    if t.device() == rank.tensor_device() { Ok(t) } else { t.to_rank(rank) }
}
