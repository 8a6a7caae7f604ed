//! Where a [`Tensor`]'s elements live, in the manner of candle's storage enum: host memory the
//! tensor owns (an ndarray array), host memory lent to it (a block of the symmetric heap that
//! peers wrote a collective's result into), or a device's memory: a backend's
//! [`DeviceTensor`] (a GPU's, feature `cuda`), which this file and `dispatch.rs` alone look into.
//!
//! Host accessors (`view`, `as_slice`, their mutable forms, `to_array`, ...) work the same on the
//! two host variants; on a tensor that lives on a GPU they panic and say to call
//! [`Tensor::to_host`] first. Both host variants are shared copy-on-write between clones: the
//! first write through a clone that is not the only one copies the elements into an array of
//! its own.

use std::borrow::Cow;
use std::marker::PhantomData;
use std::sync::Arc;

use ndarray::{ArcArray, ArrayD, ArrayViewD, ArrayViewMutD, Dimension, IxDyn};

use super::backend::{DeviceArc, DeviceTensor, HostElements};
use super::{Device, Element, Tensor};
use crate::Result;

/// The elements of a tensor.
pub(crate) enum Storage<T: Element> {
    /// In host memory the tensor owns, row-major and contiguous; shared copy-on-write between
    /// clones.
    Host(ArcArray<T, IxDyn>),
    /// In host memory lent to the tensor (see [`LentMemory`]), row-major and contiguous; shared
    /// copy-on-write between clones.
    Lent(LentArray<T>),
    /// In a device's memory, behind the backend contract.
    Device(DeviceArc<T>),
}

/// Host memory that a tensor does not own but holds for as long as it lives: a block of the
/// symmetric heap lent by a collective that wrote its result there (`shmem::lent`). Dropping the
/// last holder gives the block back to its lender.
///
/// # Safety
/// An implementation promises that [`LentMemory::ptr`] is valid for reads and writes of
/// [`LentMemory::bytes`] bytes, aligned to [`LENT_ALIGN`], for as long as the value lives, and
/// that while it lives nothing but its holders accesses those bytes.
pub(crate) unsafe trait LentMemory: Send + Sync {
    /// The first byte.
    fn ptr(&self) -> *mut u8;
    /// How many bytes it holds.
    fn bytes(&self) -> usize;
}

/// The alignment lent memory has (at least that of every element type).
pub(crate) const LENT_ALIGN: usize = 64;

/// A row-major array in lent memory: the memory (shared by clones) and the shape.
pub(crate) struct LentArray<T> {
    memory: Arc<dyn LentMemory>,
    shape: IxDyn,
    _elem: PhantomData<T>,
}

impl<T: Element> LentArray<T> {
    fn ptr(&self) -> *mut T {
        self.memory.ptr().cast()
    }

    fn len(&self) -> usize {
        self.shape.size()
    }

    fn view(&self) -> ArrayViewD<'_, T> {
        // SAFETY: the memory holds the shape's elements, aligned (checked in `Tensor::lent`),
        // valid while `self` holds it; writes need `&mut` to the only holder (`unique_mut`).
        unsafe { ArrayViewD::from_shape_ptr(self.shape.clone(), self.ptr()) }
    }

    fn as_slice(&self) -> &[T] {
        // SAFETY: as in `view`.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }

    /// Whether this is the only holder of its memory (no clone shares it).
    fn is_unique(&mut self) -> bool {
        Arc::get_mut(&mut self.memory).is_some()
    }

    /// The elements to write; the caller has checked [`LentArray::is_unique`].
    fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `view`; `&mut self` and being the only holder make this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len()) }
    }
}

impl<T> Clone for LentArray<T> {
    fn clone(&self) -> Self {
        LentArray { memory: self.memory.clone(), shape: self.shape.clone(), _elem: PhantomData }
    }
}

impl<T: Element> Storage<T> {
    pub(crate) fn shape(&self) -> &[usize] {
        match self {
            Storage::Host(a) => a.shape(),
            Storage::Lent(l) => l.shape.slice(),
            Storage::Device(d) => d.shape(),
        }
    }

    pub(crate) fn device(&self) -> Device {
        match self {
            Storage::Host(_) | Storage::Lent(_) => Device::Host,
            Storage::Device(d) => d.device(),
        }
    }

    /// A view of the elements in host memory.
    #[track_caller]
    pub(crate) fn view(&self) -> ArrayViewD<'_, T> {
        match self {
            Storage::Host(a) => a.view(),
            Storage::Lent(l) => l.view(),
            Storage::Device(_) => on_device(self.device()),
        }
    }

    /// The elements in row-major order.
    #[track_caller]
    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Storage::Host(a) => a.as_slice().expect("a Tensor is always contiguous"),
            Storage::Lent(l) => l.as_slice(),
            Storage::Device(_) => on_device(self.device()),
        }
    }

    /// Makes the elements writable in place: lent memory that a clone shares is copied into an
    /// array of this tensor's own first (an owned array copies itself on write).
    fn make_writable(&mut self) {
        if let Storage::Lent(l) = self
            && !l.is_unique()
        {
            *self = Storage::Host(l.view().to_owned().into_shared());
        }
    }

    /// The elements to write in row-major order (copied first if a clone shares them).
    #[track_caller]
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        self.make_writable();
        let device = self.device();
        match self {
            Storage::Host(a) => a.as_slice_mut().expect("a Tensor is always contiguous"),
            Storage::Lent(l) => l.as_mut_slice(),
            Storage::Device(_) => on_device(device),
        }
    }

    /// A mutable view (the elements are copied first if a clone shares them).
    #[track_caller]
    pub(crate) fn view_mut(&mut self) -> ArrayViewMutD<'_, T> {
        self.make_writable();
        let device = self.device();
        match self {
            Storage::Host(a) => a.view_mut(),
            Storage::Lent(l) => {
                let shape = l.shape.clone();
                ArrayViewMutD::from_shape(shape, l.as_mut_slice()).expect("length is the product")
            }
            Storage::Device(_) => on_device(device),
        }
    }

    /// A copy of the elements as an owned array.
    #[track_caller]
    pub(crate) fn to_array(&self) -> ArrayD<T> {
        match self {
            Storage::Host(a) => a.to_owned(),
            _ => self.view().to_owned(),
        }
    }

    /// The elements as an owned array: without a copy when this is the only holder of owned
    /// host memory, else copied.
    #[track_caller]
    pub(crate) fn into_array(self) -> ArrayD<T> {
        match self {
            Storage::Host(a) => a.into_owned(),
            other => other.to_array(),
        }
    }

    /// The same elements under another shape of equal size, shared; `None` if the sizes differ
    /// (an error only from a device).
    pub(crate) fn reshaped(&self, shape: &[usize]) -> Option<Result<Storage<T>>> {
        let len = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
        if len != self.shape().iter().product::<usize>() {
            return None;
        }
        Some(match self {
            Storage::Host(a) => {
                let a = a.clone().into_shape_with_order(IxDyn(shape));
                Ok(Storage::Host(a.expect("a contiguous array of the same size")))
            }
            Storage::Lent(l) => Ok(Storage::Lent(LentArray { shape: IxDyn(shape), ..l.clone() })),
            Storage::Device(d) => d.reshaped(shape).map(Storage::Device),
        })
    }
}

impl<T: Element> From<ArrayD<T>> for Storage<T> {
    fn from(a: ArrayD<T>) -> Self {
        Storage::Host(a.into_shared())
    }
}

#[track_caller]
fn on_device(device: Device) -> ! {
    panic!(
        "this tensor lives on {device}: call Tensor::to_host() before using its elements on the host"
    )
}

impl<T: Element> Clone for Storage<T> {
    /// Host elements are shared until one of the clones writes (copy-on-write); device tensors
    /// share their (immutable) buffer.
    fn clone(&self) -> Self {
        match self {
            Storage::Host(a) => Storage::Host(a.clone()),
            Storage::Lent(l) => Storage::Lent(l.clone()),
            Storage::Device(d) => Storage::Device(d.clone()),
        }
    }
}

impl<T: Element> PartialEq for Storage<T> {
    /// Host elements compare by value (shape and elements, owned or lent alike); device tensors
    /// are equal when they are the same buffer (call `to_host` to compare values).
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Storage::Device(a), Storage::Device(b)) => a.same_buffer(b.as_ref()),
            (Storage::Device(_), _) | (_, Storage::Device(_)) => false,
            _ => self.view() == other.view(),
        }
    }
}

impl<T: Element> std::fmt::Debug for Storage<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Host(a) => a.fmt(f),
            Storage::Lent(l) => l.view().fmt(f),
            Storage::Device(d) => write!(f, "Tensor on {} of shape {:?}", self.device(), d.shape()),
        }
    }
}

impl<T: Element> Tensor<T> {
    /// Where the elements live: [`Device::Host`], or the device a backend holds them on
    /// ([`Device::Cuda`] for a tensor on a GPU).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Device, Tensor};
    /// assert_eq!(Tensor::<f32>::zeros(&[2]).device(), Device::Host);
    /// ```
    pub fn device(&self) -> Device {
        self.data.device()
    }

    /// This tensor where `like` lives: a host tensor uploaded to `like`'s device (into the same
    /// rank's memory and stream), or brought to the host when `like` is on the host.
    ///
    /// # Errors
    /// As [`Tensor::to_device`] and [`Tensor::to_host`].
    pub(crate) fn into_place_of<U: Element>(self, like: &Tensor<U>) -> Result<Tensor<T>> {
        match (&like.data, &self.data) {
            (Storage::Device(d), Storage::Host(_) | Storage::Lent(_)) => {
                let up = d.upload_like(HostElements::of(self.as_slice()), self.shape())?;
                Ok(Tensor::from_device(up.typed("Tensor::to_device")?))
            }
            (Storage::Host(_) | Storage::Lent(_), Storage::Device(_)) => self.to_host(),
            _ => Ok(self),
        }
    }

    /// A copy in host memory (for a tensor on a GPU: once the work that writes it is done).
    ///
    /// # Errors
    /// For a tensor on a GPU: what the GPU work that writes it failed with ([`Error::WaitTimeout`](crate::Error::WaitTimeout)
    /// naming rank, program, signal and values; [`Error::PeerFailed`](crate::Error::PeerFailed); [`Error::DeviceStatus`](crate::Error::DeviceStatus)).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f64>::random(&[2, 3], 5);
    /// assert_eq!(t.to_host()?, t);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn to_host(&self) -> Result<Tensor<T>> {
        match &self.data {
            Storage::Host(_) | Storage::Lent(_) => Ok(self.clone()),
            Storage::Device(d) => Tensor::from_shape_vec(d.shape(), d.to_host()?),
        }
    }

    /// Zeros of `shape` where this tensor lives: made on its GPU (no copy from the host) for a
    /// tensor on a GPU, on the host otherwise.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) when it cannot be allocated; for a tensor on a GPU, what the GPU
    /// fails with ([`Error::DeviceStatus`](crate::Error::DeviceStatus)).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Device, Tensor};
    /// let t = Tensor::<f32>::random(&[2, 3], 1);
    /// let z = t.zeros_like(&[4])?;
    /// assert_eq!((z.device(), z.as_slice()), (Device::Host, &[0.0f32; 4][..]));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn zeros_like(&self, shape: &[usize]) -> Result<Tensor<T>> {
        match &self.data {
            Storage::Device(d) => Ok(Tensor::from_device(d.zeros_like(shape)?)),
            Storage::Host(_) | Storage::Lent(_) => Tensor::try_zeros(shape),
        }
    }

    /// This tensor on the host, without a copy where it is there (see [`Tensor::to_host`]).
    ///
    /// # Errors
    /// As [`Tensor::to_host`].
    pub(crate) fn into_host(self) -> Result<Tensor<T>> {
        match self.data {
            Storage::Host(_) | Storage::Lent(_) => Ok(self),
            Storage::Device(_) => self.to_host(),
        }
    }

    /// This tensor on the host: borrowed where it is there, copied from its device otherwise.
    ///
    /// # Errors
    /// As [`Tensor::to_host`].
    pub(crate) fn host_tensor(&self) -> Result<Cow<'_, Tensor<T>>> {
        match self.data {
            Storage::Host(_) | Storage::Lent(_) => Ok(Cow::Borrowed(self)),
            Storage::Device(_) => self.to_host().map(Cow::Owned),
        }
    }

    /// The elements on the host in row-major order: borrowed where they are there, copied from
    /// the device otherwise.
    ///
    /// # Errors
    /// As [`Tensor::to_host`].
    pub(crate) fn host_elements(&self) -> Result<Cow<'_, [T]>> {
        match self.data {
            Storage::Host(_) | Storage::Lent(_) => Ok(Cow::Borrowed(self.as_slice())),
            Storage::Device(_) => Ok(Cow::Owned(self.to_host()?.as_slice().to_vec())),
        }
    }

    /// Whether the elements are in host memory (owned or lent).
    pub(crate) fn is_on_host(&self) -> bool {
        matches!(self.data, Storage::Host(_) | Storage::Lent(_))
    }

    /// Zeros of `shape` and element type `U` where this tensor lives (see
    /// [`Tensor::zeros_like`]).
    ///
    /// # Errors
    /// As [`Tensor::zeros_like`]; on a device, as [`Tensor::cast`] there (an error rather
    /// than its panic).
    pub(crate) fn zeros_beside<U: Element>(&self, shape: &[usize]) -> Result<Tensor<U>> {
        match self.data {
            Storage::Device(_) => super::dispatch::cast::<T, U>(self)?.zeros_like(shape),
            Storage::Host(_) | Storage::Lent(_) => Tensor::try_zeros(shape),
        }
    }

    /// A tensor on a device, from its backend's storage.
    pub(crate) fn from_device(data: DeviceArc<T>) -> Tensor<T> {
        Tensor { data: Storage::Device(data) }
    }

    /// The device storage behind the backend contract, if the tensor lives on a device: read by
    /// the tensor's dispatch (`dispatch.rs`) and by the backends under `src/device/` only.
    pub(crate) fn device_storage(&self) -> Option<&dyn DeviceTensor<T>> {
        match &self.data {
            Storage::Host(_) | Storage::Lent(_) => None,
            Storage::Device(d) => Some(d.as_ref()),
        }
    }

    /// A tensor of `shape` in lent memory (see [`LentMemory`]), whose first elements its
    /// lender has written.
    ///
    /// # Panics
    /// If the memory is too small for the shape or not aligned for `T` (a bug of the lender).
    pub(crate) fn lent(memory: Arc<dyn LentMemory>, shape: &[usize]) -> Tensor<T> {
        let bytes = shape.iter().product::<usize>().checked_mul(size_of::<T>());
        assert!(
            bytes.is_some_and(|b| b <= memory.bytes()),
            "lent memory of {} bytes cannot hold a tensor of shape {shape:?}",
            memory.bytes()
        );
        assert!(memory.ptr().cast::<T>().is_aligned(), "lent memory is aligned for every element");
        Tensor {
            data: Storage::Lent(LentArray { memory, shape: IxDyn(shape), _elem: PhantomData }),
        }
    }

    /// Whether the elements live in lent memory (a block of the symmetric heap).
    #[cfg(test)]
    pub(crate) fn is_lent(&self) -> bool {
        matches!(self.data, Storage::Lent(_))
    }
}
