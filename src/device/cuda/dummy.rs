//! The GPU backend of a build without the `cuda` feature: the same names as `api.rs` that the
//! rest of the crate calls, no GPU world can be made (so no tensor lives on a GPU and nothing
//! implements the tensor layer's `DeviceTensor`), and the public functions say why.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

fn unavailable(op: &'static str) -> Error {
    Error::DeviceUnavailable {
        op,
        device: "cuda".into(),
        reason: "this build of dist-tensor has no GPU backend: build it with `--features cuda`"
            .into(),
    }
}

/// No GPU world exists in this build: the type has no values.
pub(crate) enum CudaWorld {}

/// No device tensor exists in this build: the type has no values.
pub(crate) struct DeviceStorage<T> {
    never: CudaWorld,
    _elem: PhantomData<T>,
}

impl<T> Clone for DeviceStorage<T> {
    fn clone(&self) -> Self {
        match self.never {}
    }
}

/// No tensor lives on a GPU in this build.
pub(crate) fn storage_of<T: Element>(_t: &Tensor<T>) -> Option<&DeviceStorage<T>> {
    None
}

impl<T: Element> Tensor<T> {
    pub(crate) fn from_device_storage(data: DeviceStorage<T>) -> Tensor<T> {
        match data.never {}
    }
}

pub(crate) fn open_world(_devices: &[usize], _wait_timeout: Duration) -> Result<Arc<CudaWorld>> {
    Err(unavailable("World::cuda"))
}

pub(crate) fn open_process_world(_job: &crate::shmem::ProcessJob<'_>) -> Result<Arc<CudaWorld>> {
    Err(unavailable("World::from_env"))
}

pub(crate) fn world_failed(world: &CudaWorld, _rank: usize, _reason: &str) {
    match *world {}
}

pub(crate) fn finish_rank(world: &CudaWorld, _rank: usize) -> Result<()> {
    match *world {}
}

pub(crate) fn ordinal_of(world: &CudaWorld, _rank: usize) -> usize {
    match *world {}
}

pub(crate) fn upload<T: Element>(
    _ordinal: usize,
    _host: &[T],
    _shape: &[usize],
    _world: Option<(&CudaWorld, usize)>,
) -> Result<DeviceStorage<T>> {
    Err(unavailable("Tensor::to_device"))
}

#[allow(clippy::too_many_arguments)] // as the CUDA build's
pub(crate) fn all_gather_matmul<T: Element>(
    world: &CudaWorld,
    _rank: &Rank<'_>,
    _x: &DeviceStorage<T>,
    _splits: &[usize],
    _ws: &[&DeviceStorage<T>],
    _weights_transposed: bool,
    _fused: bool,
    _path: Option<crate::device::path::AgPath>,
) -> Result<Vec<DeviceStorage<T>>> {
    match *world {}
}

#[allow(clippy::too_many_arguments)] // as the CUDA build's
pub(crate) fn matmul_reduce_scatter<T: Element>(
    world: &CudaWorld,
    _rank: &Rank<'_>,
    _a: &DeviceStorage<T>,
    _w: &DeviceStorage<T>,
    _w_transposed: bool,
    _splits: &[usize],
    _fused: bool,
    _path: Option<crate::device::path::RsPath>,
) -> Result<DeviceStorage<T>> {
    match *world {}
}

pub(crate) fn all_to_all<T: Element>(
    world: &CudaWorld,
    _rank: &Rank<'_>,
    _x: &DeviceStorage<T>,
    _scatter: usize,
    _gather: usize,
    _gather_splits: &[usize],
    _fused: bool,
) -> Result<DeviceStorage<T>> {
    match *world {}
}

pub(crate) fn flash_decode<T: Element>(
    world: &CudaWorld,
    _rank: &Rank<'_>,
    _layout: &crate::device::host::flash_decode::DecodeLayout,
    _qkv: (&DeviceStorage<T>, &DeviceStorage<T>, &DeviceStorage<T>),
    _fused: bool,
) -> Result<(DeviceStorage<T>, DeviceStorage<T::Acc>)> {
    match *world {}
}

pub(crate) fn all_gather<T: Element>(
    world: &CudaWorld,
    _rank: &Rank<'_>,
    _x: &DeviceStorage<T>,
    _dim: usize,
    _splits: &[usize],
) -> Result<DeviceStorage<T>> {
    match *world {}
}

pub(crate) fn reduce_sum<T: Element>(
    world: &CudaWorld,
    _rank: &Rank<'_>,
    _x: &DeviceStorage<T>,
    _dim: Option<usize>,
) -> Result<DeviceStorage<T>> {
    match *world {}
}

pub(crate) fn slice<T: Element>(
    world: &CudaWorld,
    _rank: &Rank<'_>,
    _x: &DeviceStorage<T>,
    _dim: usize,
    _start: usize,
    _len: usize,
) -> Result<DeviceStorage<T>> {
    match *world {}
}

pub(crate) mod public {
    use super::*;
    use crate::Tensor;

    /// Number of CUDA devices this process sees.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build, which has no GPU backend.
    ///
    /// # Examples
    /// ```
    /// match dist_tensor::device::cuda::device_count() {
    ///     Ok(n) => println!("{n} GPUs"),
    ///     Err(e) => println!("no GPUs: {e}"),
    /// }
    /// ```
    pub fn device_count() -> Result<usize> {
        Err(unavailable("device_count"))
    }

    /// What a rank's GPU is.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct GpuInfo {
        /// CUDA ordinal.
        pub ordinal: usize,
        /// The device's name, such as `NVIDIA H200`.
        pub name: String,
        /// Streaming multiprocessors: what kernel grids are sized from.
        pub multiprocessors: usize,
        /// Compute capability (major, minor).
        pub compute_capability: (i32, i32),
    }

    /// The GPU of `rank`.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// let info = World::threads(1)?.run(|rank| Ok(cuda::gpu_info(rank).is_err()))?;
    /// assert!(info[0]); // not a GPU world
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gpu_info(_rank: &Rank<'_>) -> Result<GpuInfo> {
        Err(unavailable("gpu_info"))
    }

    /// Waits until the work queued on `rank`'s GPU is done.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// assert!(World::threads(1)?.run(|rank| cuda::synchronize(rank)).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn synchronize(_rank: &Rank<'_>) -> Result<()> {
        Err(unavailable("synchronize"))
    }

    /// A barrier on the GPUs.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// assert!(World::threads(1)?.run(|rank| cuda::barrier(rank)).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn barrier(_rank: &Rank<'_>) -> Result<()> {
        Err(unavailable("barrier"))
    }

    /// Times work queued on a rank's GPU with CUDA events.
    pub struct Timer {
        _never: CudaWorld,
    }

    impl Timer {
        /// A timer for `rank`'s GPU.
        ///
        /// # Errors
        /// Always [`Error::DeviceUnavailable`] in this build.
        ///
        /// # Examples
        /// ```
        /// use dist_tensor::{device::cuda, World};
        /// assert!(World::threads(1)?.run(|rank| cuda::Timer::new(rank).map(|_| ())).is_err());
        /// # Ok::<(), dist_tensor::Error>(())
        /// ```
        pub fn new(_rank: &Rank<'_>) -> Result<Timer> {
            Err(unavailable("Timer::new"))
        }

        /// Records the start on `rank`'s compute stream.
        ///
        /// # Errors
        /// Never returns in this build (no timer exists).
        pub fn start(&mut self, _rank: &Rank<'_>) -> Result<()> {
            match self._never {}
        }

        /// Records the stop on `rank`'s compute stream.
        ///
        /// # Errors
        /// Never returns in this build (no timer exists).
        pub fn stop(&mut self, _rank: &Rank<'_>) -> Result<()> {
            match self._never {}
        }

        /// Milliseconds between start and stop.
        ///
        /// # Errors
        /// Never returns in this build (no timer exists).
        pub fn elapsed_ms(&self) -> Result<f32> {
            match self._never {}
        }
    }

    /// Rank `root`'s tensor on every rank's GPU.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, Tensor, World};
    /// let t = Tensor::<f32>::zeros(&[2]);
    /// assert!(World::threads(1)?.run(|rank| cuda::broadcast(rank, &t, 0).map(|_| ())).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn broadcast<T: Element>(
        _rank: &Rank<'_>,
        _t: &Tensor<T>,
        _root: usize,
    ) -> Result<Tensor<T>> {
        Err(unavailable("broadcast"))
    }

    /// Free and total bytes of a GPU's memory.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build.
    ///
    /// # Examples
    /// ```
    /// assert!(dist_tensor::device::cuda::memory_info(0).is_err());
    /// ```
    pub fn memory_info(_ordinal: usize) -> Result<(usize, usize)> {
        Err(unavailable("memory_info"))
    }

    /// A device-to-device copy of `t` on `rank`'s GPU.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, Tensor, World};
    /// let t = Tensor::<f32>::zeros(&[2]);
    /// assert!(World::threads(1)?.run(|rank| cuda::device_copy(rank, &t).map(|_| ())).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn device_copy<T: Element>(_rank: &Rank<'_>, _t: &Tensor<T>) -> Result<Tensor<T>> {
        Err(unavailable("device_copy"))
    }

    /// cuBLASLt's candidate algorithms for a product on `rank`'s GPU.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// let r = World::threads(1)?.run(|rank| cuda::gemm_candidates::<f32>(rank, (2, 2, 2), (false, false), 1).map(drop));
    /// assert!(r.is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gemm_candidates<T: Element>(
        _rank: &Rank<'_>,
        _mnk: (usize, usize, usize),
        _transposed: (bool, bool),
        _count: usize,
    ) -> Result<Vec<super::super::GemmCandidate>> {
        Err(unavailable("gemm_candidates"))
    }

    /// A random tensor on `rank`'s GPU.
    ///
    /// # Errors
    /// Always [`Error::DeviceUnavailable`] in this build.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// assert!(World::threads(1)?.run(|rank| cuda::random::<f32>(rank, &[2], 1).map(|_| ())).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn random<T: Element>(_rank: &Rank<'_>, _shape: &[usize], _seed: u64) -> Result<Tensor<T>> {
        Err(unavailable("random"))
    }
}
