//! [`Operand`]: a matrix operand of a fused op, from a host view or a tensor on any device; it
//! moves to the device its world computes on with [`to_world_device`].

use ndarray::{ArrayView2, CowArray, Ix2};

use crate::device::to_world_device;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

/// A matrix operand of a fused op: a host view, or a tensor `[..., cols]` read as rows of its
/// last dimension, on the host or a device. The fused ops take `impl Into<Operand>`, so host
/// callers pass views as they always did, and tensors (a GPU's too) as they are:
///
/// ```
/// use dist_tensor::fused::all_gather_matmul;
/// use dist_tensor::{Tensor, World};
/// World::threads(2)?.run(|rank| {
///     let x = Tensor::<f64>::random(&[3, 4], rank.rank() as u64);
///     let w = Tensor::<f64>::random(&[4, 2], 7);
///     let from_tensors = all_gather_matmul(rank, &x, &[&w])?;
///     let from_views = all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?])?;
///     assert_eq!(from_tensors, from_views);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
///
/// Inputs move to the device their world computes on once, at the op's entry: a GPU tensor in
/// a [`World::cuda`](crate::World::cuda) world stays there, a host view is copied there; in a
/// host or Ascend world a GPU tensor comes to the host.
#[derive(Clone, Copy)]
pub enum Operand<'a, T: Element> {
    /// A host view, in any layout.
    View(ArrayView2<'a, T>),
    /// A tensor of 2 or more dimensions, and whether to read it transposed (`true`: a weight
    /// `[n, k]` taken as `[k, n]`, as a backward pass has it).
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
                if !t.is_on_host() {
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

    /// The matrix on the host: a view where it is there, copied from a device otherwise (once:
    /// the host and Ascend worlds compute on host memory).
    pub(crate) fn host(&self) -> Result<CowArray<'a, T, Ix2>> {
        match *self {
            Operand::Tensor(t, transposed) if !t.is_on_host() => {
                let (rows, cols) = Operand::Tensor(t, false).dim();
                let host = t.to_host()?;
                let a = host.into_array().into_shape_with_order((rows, cols)).map_err(|e| {
                    Error::InvalidShape { op: "Operand::host", reason: e.to_string() }
                })?;
                Ok(CowArray::from(if transposed { a.reversed_axes() } else { a }))
            }
            _ => self.view("Operand::host").map(CowArray::from),
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

    /// The matrix as it is stored, row-major, where `rank`'s world keeps its tensors, and
    /// whether it is read transposed: what a GEMM with a transpose flag takes (no copy).
    pub(crate) fn on_device_stored(&self, rank: &Rank<'_>) -> Result<(Tensor<T>, bool)> {
        let t = self.on_device(rank)?;
        let (rows, cols) = self.dim();
        if self.transposed() {
            Ok((t.reshape(&[cols, rows])?, true))
        } else {
            Ok((t.reshape(&[rows, cols])?, false))
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
