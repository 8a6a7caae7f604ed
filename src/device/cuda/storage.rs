//! The elements of a tensor that lives on a GPU: a device buffer, the shape, and (for tensors
//! made in a GPU world) the world's failure state, so that waiting for the tensor reports it.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::result as cu;

use super::driver::{Check, Event, Gpu};
use super::memory::DeviceBuffer;
use super::world::Watch;
use crate::tensor::Element;
use crate::{Error, Result};

/// A tensor's elements on a GPU. Immutable once written (ops make new tensors), so clones share
/// the buffer.
pub(crate) struct DeviceData<T> {
    buf: Arc<DeviceBuffer>,
    shape: Vec<usize>,
    watch: Option<(Arc<Watch>, usize)>,
    _elem: PhantomData<T>,
}

impl<T> Clone for DeviceData<T> {
    fn clone(&self) -> Self {
        DeviceData { buf: self.buf.clone(), shape: self.shape.clone(), watch: self.watch.clone(), _elem: PhantomData }
    }
}

impl<T: Element> DeviceData<T> {
    /// Room for a tensor of `shape` on `gpu`, contents unspecified (for outputs an op writes
    /// entirely).
    pub(crate) fn uninit(gpu: &Arc<Gpu>, shape: &[usize], watch: Option<(Arc<Watch>, usize)>) -> Result<Self> {
        let len: usize = shape.iter().product();
        let buf = DeviceBuffer::new(gpu, len * size_of::<T>())?;
        Ok(DeviceData { buf: Arc::new(buf), shape: shape.to_vec(), watch, _elem: PhantomData })
    }

    /// A copy of `host` (row-major, of `shape`) on `gpu`.
    pub(crate) fn upload(
        gpu: &Arc<Gpu>,
        host: &[T],
        shape: &[usize],
        watch: Option<(Arc<Watch>, usize)>,
    ) -> Result<Self> {
        let data = Self::uninit(gpu, shape, watch)?;
        if !host.is_empty() {
            gpu.bind()?;
            // SAFETY: the buffer holds host.len() elements; the copy from pageable memory is
            // staged before this returns, so `host` may go away after.
            unsafe { cu::memcpy_htod_async(data.ptr(), host, gpu.stream) }.check("cuMemcpyHtoDAsync")?;
        }
        Ok(data)
    }

    /// The elements, copied to the host once the work that writes them is done.
    pub(crate) fn download(&self) -> Result<Vec<T>> {
        let gpu = &self.buf.gpu;
        gpu.bind()?;
        self.wait()?;
        let mut host = vec![T::zero(); self.len()];
        if !host.is_empty() {
            // SAFETY: the buffer holds len() elements, all written (the stream is idle).
            unsafe { cu::memcpy_dtoh_async(&mut host, self.ptr(), gpu.stream) }.check("cuMemcpyDtoHAsync")?;
            self.wait()?;
        }
        Ok(host)
    }

    /// Waits until the GPU's queued work is done, reporting the world's failure if there is one.
    pub(crate) fn wait(&self) -> Result<()> {
        let gpu = &self.buf.gpu;
        let event = Event::new(false)?;
        event.record(gpu.stream)?;
        match &self.watch {
            Some((watch, rank)) => watch.wait_event(*rank, &event),
            None => {
                // No world: every kernel on this stream is bounded, so polling ends.
                while !event.done()? {
                    std::thread::yield_now();
                }
                Ok(())
            }
        }
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.buf.ptr
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub(crate) fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.buf.gpu
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.buf.gpu.ordinal
    }

    /// The same elements under another shape of equal size (no copy).
    pub(crate) fn reshaped(&self, shape: &[usize]) -> Result<Self> {
        if shape.iter().product::<usize>() != self.len() {
            return Err(Error::InvalidShape {
                op: "Tensor::reshape",
                reason: format!("cannot reshape {:?} into {shape:?}", self.shape),
            });
        }
        Ok(DeviceData { shape: shape.to_vec(), ..self.clone() })
    }

    /// Whether both are the same device buffer.
    pub(crate) fn same_buffer(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf) && self.shape == other.shape
    }
}
