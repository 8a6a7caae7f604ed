//! Where a tensor's elements live: ordinary memory, or a block of a rank's symmetric heap that
//! peers can write into (so that a collective can put its result straight into the output
//! tensor, with one copy instead of two).
//!
//! Either way the elements are host-addressable, contiguous and row-major: every host accessor
//! of [`Tensor`](super::Tensor) works the same on both.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ndarray::{ArrayD, ArrayViewD, ArrayViewMutD, Dimension, IxDyn};

use super::Element;
use crate::shmem::{SymmBuf, Writable};

pub(crate) enum Storage<T: Element> {
    /// Ordinary memory.
    Host(ArrayD<T>),
    /// The first elements of a block of this rank's symmetric heap.
    Symmetric(SymmetricBlock<T>),
}

/// A symmetric-heap block lent to one tensor. The lender (a fused op's workspace) keeps the
/// block and lends it again once the tensor is dropped and every rank's copy of it is free.
pub(crate) struct SymmetricBlock<T: Element> {
    buf: Arc<SymmBuf<T>>,
    lent: Arc<AtomicBool>,
    shape: IxDyn,
}

impl<T: Element> SymmetricBlock<T> {
    /// Lends `buf` (marked lent) to a tensor of `shape`, which must fit in it.
    pub(crate) fn lend(buf: Arc<SymmBuf<T>>, lent: Arc<AtomicBool>, shape: &[usize]) -> Self {
        assert!(shape.iter().product::<usize>() <= buf.len(), "the shape fits the block");
        lent.store(true, Ordering::Release);
        SymmetricBlock { buf, lent, shape: IxDyn(shape) }
    }

    fn ptr(&self) -> *mut T {
        self.buf.ptr().raw_write().0
    }
}

impl<T: Element> Drop for SymmetricBlock<T> {
    fn drop(&mut self) {
        // The tensor's last access happened-before this: the lender's next loan sees it free.
        self.lent.store(false, Ordering::Release);
    }
}

impl<T: Element> Storage<T> {
    pub(crate) fn shape(&self) -> &[usize] {
        match self {
            Storage::Host(a) => a.shape(),
            Storage::Symmetric(b) => b.shape.slice(),
        }
    }

    pub(crate) fn view(&self) -> ArrayViewD<'_, T> {
        match self {
            Storage::Host(a) => a.view(),
            // SAFETY: the block holds at least the shape's elements (checked when lent), they are
            // initialized (every element of a lent block is written before the tensor is handed
            // out), and the tensor alone accesses them while it lives.
            Storage::Symmetric(b) => unsafe {
                ArrayViewD::from_shape_ptr(b.shape.clone(), b.ptr())
            },
        }
    }

    pub(crate) fn view_mut(&mut self) -> ArrayViewMutD<'_, T> {
        match self {
            Storage::Host(a) => a.view_mut(),
            // SAFETY: as in `view`; `&mut self` makes this the only access.
            Storage::Symmetric(b) => unsafe {
                ArrayViewMutD::from_shape_ptr(b.shape.clone(), b.ptr())
            },
        }
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Storage::Host(a) => a.as_slice().expect("a Tensor is always contiguous"),
            // SAFETY: as in `view`.
            Storage::Symmetric(b) => unsafe { std::slice::from_raw_parts(b.ptr(), b.shape.size()) },
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        match self {
            Storage::Host(a) => a.as_slice_mut().expect("a Tensor is always contiguous"),
            // SAFETY: as in `view_mut`.
            Storage::Symmetric(b) => unsafe {
                std::slice::from_raw_parts_mut(b.ptr(), b.shape.size())
            },
        }
    }
}
