//! The elements of a tensor that lives on a GPU: a device buffer, the shape, and (for tensors
//! made in a GPU world) the world's failure state, so that waiting for the tensor reports it.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::result as cu;

use cudarc::driver::sys;

use super::driver::{Check, CudaDevice, Event, Streams};
use super::memory::{DeviceBuffer, TensorPool};
use super::world::Watch;
use crate::tensor::Element;
use crate::{Error, Result};

/// A tensor's elements on a GPU. Immutable once written (ops make new tensors), so clones share
/// the buffer.
pub(crate) struct DeviceStorage<T> {
    buf: Arc<DeviceBuffer>,
    shape: Vec<usize>,
    /// The world rank's streams that write it; `None`: the GPU's own stream (outside worlds).
    streams: Option<Arc<Streams>>,
    watch: Option<(Arc<Watch>, usize)>,
    _elem: PhantomData<T>,
}

/// Where a new tensor belongs: a world rank's streams and failure state, or neither; and in a
/// world of processes, the pool its memory comes from (see `memory::TensorPool`).
#[derive(Clone, Default)]
pub(crate) struct Home {
    pub(crate) streams: Option<Arc<Streams>>,
    pub(crate) watch: Option<(Arc<Watch>, usize)>,
    pub(crate) pool: Option<Arc<TensorPool>>,
}

impl<T> Clone for DeviceStorage<T> {
    fn clone(&self) -> Self {
        DeviceStorage {
            buf: self.buf.clone(),
            shape: self.shape.clone(),
            streams: self.streams.clone(),
            watch: self.watch.clone(),
            _elem: PhantomData,
        }
    }
}

impl<T: Element> DeviceStorage<T> {
    /// Room for a tensor of `shape` on `gpu`, contents unspecified (for outputs an op writes
    /// entirely).
    pub(crate) fn uninit(gpu: &Arc<CudaDevice>, shape: &[usize], home: Home) -> Result<Self> {
        let len: usize = shape.iter().product();
        let stream = home.streams.as_ref().map_or(gpu.stream, |s| s.main);
        let buf = match &home.pool {
            Some(pool) => DeviceBuffer::in_pool(pool, len * size_of::<T>(), stream)?,
            None => DeviceBuffer::new(gpu, len * size_of::<T>(), stream)?,
        };
        Ok(DeviceStorage {
            buf: Arc::new(buf),
            shape: shape.to_vec(),
            streams: home.streams,
            watch: home.watch,
            _elem: PhantomData,
        })
    }

    /// The stream work on this tensor is queued on.
    pub(crate) fn stream(&self) -> sys::CUstream {
        self.streams.as_ref().map_or(self.buf.gpu.stream, |s| s.main)
    }

    /// A copy of `host` (row-major, of `shape`) on `gpu`.
    /// Outside a world (`home` without streams) this waits until the copy is done, so that a
    /// world's streams may use the tensor without ordering against the GPU's own stream.
    pub(crate) fn upload(
        gpu: &Arc<CudaDevice>,
        host: &[T],
        shape: &[usize],
        home: Home,
    ) -> Result<Self> {
        let outside = home.streams.is_none();
        let data = Self::uninit(gpu, shape, home)?;
        if !host.is_empty() {
            gpu.bind()?;
            // SAFETY: the buffer holds host.len() elements; the copy from pageable memory is
            // staged before this returns, so `host` may go away after.
            unsafe { cu::memcpy_htod_async(data.ptr(), host, data.stream()) }
                .check("cuMemcpyHtoDAsync")?;
            if outside {
                data.wait()?;
            }
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
            unsafe { cu::memcpy_dtoh_async(&mut host, self.ptr(), self.stream()) }
                .check("cuMemcpyDtoHAsync")?;
            self.wait()?;
        }
        Ok(host)
    }

    /// Waits until the GPU's queued work is done, reporting the world's failure if there is one.
    pub(crate) fn wait(&self) -> Result<()> {
        self.buf.gpu.bind()?;
        let event = Event::new(false)?;
        event.record(self.stream())?;
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

    /// Where this tensor belongs, for tensors made from it.
    pub(crate) fn home(&self) -> Home {
        Home {
            streams: self.streams.clone(),
            watch: self.watch.clone(),
            pool: self.buf.pool.clone(),
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

    pub(crate) fn gpu(&self) -> &Arc<CudaDevice> {
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
        Ok(DeviceStorage { shape: shape.to_vec(), ..self.clone() })
    }

    /// Whether both are the same device buffer.
    pub(crate) fn same_buffer(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf) && self.shape == other.shape
    }
}
