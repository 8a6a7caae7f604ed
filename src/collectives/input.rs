//! [`Input`]: what a collective reads, a host slice or a tensor on any device, so that a device
//! tensor reaches the collectives and host callers keep passing slices.

use std::borrow::Cow;

use crate::Result;
use crate::device::to_world_device;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};

/// A collective's input, read flat in row-major order: a host slice, or a tensor on the host or
/// a device. The collectives take `impl Into<Input>`, so slices, vectors, arrays and tensors are
/// passed as they are:
///
/// ```
/// use dist_tensor::{Tensor, World, collectives};
/// World::threads(2)?.run(|rank| {
///     let v = vec![rank.rank() as f32; 2];
///     let t = Tensor::from_shape_vec(&[2], v.clone())?;
///     assert_eq!(collectives::all_gather(rank, &v)?, collectives::all_gather(rank, &t)?);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
///
/// A tensor that lives where its world computes is read there (a GPU tensor in a
/// [`World::cuda`](crate::World::cuda) world never visits the host on its way in); one that lives
/// elsewhere moves there once, at the collective's entry.
#[derive(Clone, Copy)]
pub enum Input<'a, T: Element> {
    /// Host elements.
    Slice(&'a [T]),
    /// A tensor, on the host or a device.
    Tensor(&'a Tensor<T>),
}

impl<'a, T: Element> From<&'a [T]> for Input<'a, T> {
    fn from(s: &'a [T]) -> Self {
        Input::Slice(s)
    }
}

impl<'a, T: Element> From<&'a mut [T]> for Input<'a, T> {
    fn from(s: &'a mut [T]) -> Self {
        Input::Slice(s)
    }
}

impl<'a, T: Element, const N: usize> From<&'a [T; N]> for Input<'a, T> {
    fn from(s: &'a [T; N]) -> Self {
        Input::Slice(s)
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for Input<'a, T> {
    fn from(s: &'a Vec<T>) -> Self {
        Input::Slice(s)
    }
}

impl<'a, T: Element> From<&'a Tensor<T>> for Input<'a, T> {
    fn from(t: &'a Tensor<T>) -> Self {
        Input::Tensor(t)
    }
}

/// Data only one rank has (a broadcast's or a scatter's root): `None` on the others, read as
/// no elements, so the call reads as a user writes it first:
///
/// ```
/// use dist_tensor::{World, collectives};
/// let out = World::threads(3)?.run(|rank| {
///     let v = vec![1.0f32, 2.0];
///     let root = rank.rank() == 0;
///     collectives::broadcast(rank, root.then_some(&v), 0)
/// })?;
/// assert!(out.iter().all(|o| o == &vec![1.0, 2.0]));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
impl<'a, T: Element, I: Into<Input<'a, T>>> From<Option<I>> for Input<'a, T> {
    fn from(data: Option<I>) -> Self {
        data.map_or(Input::Slice(&[]), Into::into)
    }
}

impl<'a, T: Element> Input<'a, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Input::Slice(s) => s.len(),
            Input::Tensor(t) => t.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements on the host: borrowed where they are there, copied from a device otherwise.
    pub(crate) fn host(&self) -> Result<Cow<'a, [T]>> {
        match *self {
            Input::Slice(s) => Ok(Cow::Borrowed(s)),
            Input::Tensor(t) => t.host_elements(),
        }
    }

    /// The elements as a tensor of `shape` on `rank`'s device (its GPU in a CUDA world): a
    /// tensor already there is reshaped in place, anything else is moved there once.
    pub(crate) fn on_device(&self, rank: &Rank<'_>, shape: &[usize]) -> Result<Tensor<T>> {
        let t = match *self {
            Input::Slice(s) => Tensor::from_shape_vec(shape, s.to_vec())?,
            Input::Tensor(t) => t.reshape(shape)?,
        };
        to_world_device(rank, t)
    }
}
