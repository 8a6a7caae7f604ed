//! What the rest of the crate (and its users) call: opening a GPU world, moving tensors, and the
//! ops on a rank's device tensors. `dummy.rs` has the same names for builds without `cuda`; the
//! local math of a tensor on a GPU is `backend.rs`'s, through the tensor layer's contract.

use std::sync::Arc;
use std::time::Duration;

use super::driver::{self, CudaDevice, Event};
use super::ops::{
    all_gather_matmul as ag, all_to_all as a2a, collectives, matmul_reduce_scatter as rs,
};
use super::storage::Home;
use super::world::CudaRank;
use crate::device::path::{AgPath, RsPath};
use crate::shmem::Rank;
use crate::tensor::Element;
use crate::{Error, Result};

pub(crate) use super::backend::storage_of;
pub(crate) use super::storage::DeviceStorage;
pub(crate) use super::world::CudaWorld;

/// Opens a GPU world of `devices`.
pub(crate) fn open_world(devices: &[usize], wait_timeout: Duration) -> Result<Arc<CudaWorld>> {
    Ok(Arc::new(CudaWorld::open(devices, wait_timeout)?))
}

/// Opens this process's rank of a GPU world of processes (see `process`).
pub(crate) fn open_process_world(job: &crate::shmem::ProcessJob<'_>) -> Result<Arc<CudaWorld>> {
    super::process::open_process_world(job)
}

/// The world failed on the host (a rank returned an error or panicked): end every kernel.
pub(crate) fn world_failed(world: &CudaWorld, rank: usize, reason: &str) {
    world.watch.abort(Some(rank), reason);
}

/// At the end of a rank's part of `World::run`: waits until its GPU work is done, so that no
/// kernel outlives the run and a failure on the GPU is the run's error.
pub(crate) fn finish_rank(world: &CudaWorld, rank: usize) -> Result<()> {
    CudaRank::new(world, rank)?.synchronize()
}

/// The CUDA ordinal of `rank`'s GPU.
pub(crate) fn ordinal_of(world: &CudaWorld, rank: usize) -> usize {
    world.gpus[rank].ordinal
}

/// `host` (row-major, of `shape`) on GPU `ordinal`; in a world, the tensor reports the world's
/// failure when waited for.
pub(crate) fn upload<T: Element>(
    ordinal: usize,
    host: &[T],
    shape: &[usize],
    world: Option<(&CudaWorld, usize)>,
) -> Result<DeviceStorage<T>> {
    let gpu = CudaDevice::get(ordinal)?;
    gpu.bind()?;
    let home = match world {
        Some((w, r)) if w.gpus[r].ordinal == ordinal => CudaRank::new(w, r)?.home(),
        _ => Home::default(),
    };
    DeviceStorage::upload(&gpu, host, shape, home)
}

/// A product of two device tensors on their GPU (cuBLASLt): `Tensor::matmul`'s, through the
/// backend contract.
pub(crate) fn matmul<T: Element>(
    a: &DeviceStorage<T>,
    b: &DeviceStorage<T>,
) -> Result<DeviceStorage<T>> {
    // Queued where `a` lives (a world rank's stream, or the GPU's own), ordered after its writer.
    ag::matmul(a, b, a.home())
}

fn rank_of<'w>(world: &'w CudaWorld, rank: &'w Rank<'w>) -> Result<CudaRank<'w>> {
    CudaRank::of(world, rank)
}

/// `DistTensor::all_gather_matmul(_many)` (or `_unfused`) on GPUs.
#[allow(clippy::too_many_arguments)] // the op's operands and options, as the fused layer has them
pub(crate) fn all_gather_matmul<T: Element>(
    world: &CudaWorld,
    rank: &Rank<'_>,
    x: &DeviceStorage<T>,
    splits: &[usize],
    ws: &[&DeviceStorage<T>],
    weights_transposed: bool,
    fused: bool,
    path: Option<AgPath>,
) -> Result<Vec<DeviceStorage<T>>> {
    let g = rank_of(world, rank)?;
    if fused {
        ag::all_gather_matmul(&g, x, splits, ws, weights_transposed, path)
    } else {
        ag::all_gather_matmul_unfused(&g, x, splits, ws, weights_transposed)
    }
}

/// `DistTensor::matmul_reduce_scatter` (or `_unfused`) on GPUs.
#[allow(clippy::too_many_arguments)] // the op's operands and options, as the fused layer has them
pub(crate) fn matmul_reduce_scatter<T: Element>(
    world: &CudaWorld,
    rank: &Rank<'_>,
    a: &DeviceStorage<T>,
    w: &DeviceStorage<T>,
    w_transposed: bool,
    splits: &[usize],
    fused: bool,
    path: Option<RsPath>,
) -> Result<DeviceStorage<T>> {
    let g = rank_of(world, rank)?;
    if fused {
        rs::matmul_reduce_scatter(&g, a, w, w_transposed, splits, path)
    } else {
        rs::matmul_reduce_scatter_unfused(&g, a, w, w_transposed, splits)
    }
}

/// `DistTensor::all_to_all` (or `_unfused`) on GPUs.
pub(crate) fn all_to_all<T: Element>(
    world: &CudaWorld,
    rank: &Rank<'_>,
    x: &DeviceStorage<T>,
    scatter: usize,
    gather: usize,
    gather_splits: &[usize],
    fused: bool,
) -> Result<DeviceStorage<T>> {
    let g = rank_of(world, rank)?;
    if fused {
        a2a::all_to_all(&g, x, scatter, gather, gather_splits)
    } else {
        a2a::all_to_all_unfused(&g, x, scatter, gather, gather_splits)
    }
}

/// `fused::flash_decode` (or `_unfused`) on GPUs: the output and its log-sum-exp.
pub(crate) fn flash_decode<T: Element>(
    world: &CudaWorld,
    rank: &Rank<'_>,
    layout: &crate::device::host::flash_decode::DecodeLayout,
    (q, k, v): (&DeviceStorage<T>, &DeviceStorage<T>, &DeviceStorage<T>),
    fused: bool,
) -> Result<(DeviceStorage<T>, DeviceStorage<T::Acc>)> {
    let g = rank_of(world, rank)?;
    if fused {
        super::ops::flash_decode::flash_decode(&g, layout, q, k, v)
    } else {
        super::ops::flash_decode::flash_decode_unfused(&g, layout, q, k, v)
    }
}

/// Concatenation of every rank's part along `dim`.
pub(crate) fn all_gather<T: Element>(
    world: &CudaWorld,
    rank: &Rank<'_>,
    x: &DeviceStorage<T>,
    dim: usize,
    splits: &[usize],
) -> Result<DeviceStorage<T>> {
    collectives::all_gather(&rank_of(world, rank)?, x, dim, splits)
}

/// Rank-order sum of every rank's part: all of it, or this rank's `array_split` share of `dim`.
pub(crate) fn reduce_sum<T: Element>(
    world: &CudaWorld,
    rank: &Rank<'_>,
    x: &DeviceStorage<T>,
    dim: Option<usize>,
) -> Result<DeviceStorage<T>> {
    collectives::reduce_sum(&rank_of(world, rank)?, x, dim)
}

/// Elements `[start, start + len)` of `dim`, on this rank's GPU.
pub(crate) fn slice<T: Element>(
    world: &CudaWorld,
    rank: &Rank<'_>,
    x: &DeviceStorage<T>,
    dim: usize,
    start: usize,
    len: usize,
) -> Result<DeviceStorage<T>> {
    collectives::slice(&rank_of(world, rank)?, x, dim, start, len)
}

fn gpu_rank<'a>(rank: &'a Rank<'a>) -> Result<CudaRank<'a>> {
    match rank.cuda_world() {
        Some(world) => CudaRank::of(world, rank),
        None => Err(Error::DeviceUnavailable {
            op: "device::cuda",
            device: "cuda".into(),
            reason: "this rank is not in a GPU world (make the world with World::cuda)".into(),
        }),
    }
}

pub(crate) mod public {
    use super::*;
    use crate::Tensor;
    use crate::device::cuda::kernels::{self, Source};

    /// Number of CUDA devices this process sees.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] when the NVIDIA driver is absent (it lists the names tried);
    /// [`Error::DeviceStatus`] when the driver fails; [`Error::DeviceUnavailable`] in a build
    /// without the `cuda` feature.
    ///
    /// # Examples
    /// ```
    /// match dist_tensor::device::cuda::device_count() {
    ///     Ok(n) => println!("{n} GPUs"),
    ///     Err(e) => println!("no GPUs: {e}"),
    /// }
    /// ```
    pub fn device_count() -> Result<usize> {
        driver::device_count()
    }

    /// Free and total bytes of GPU `ordinal`'s memory (`cuMemGetInfo`): what a test reads
    /// before and after a job to show that the job left no GPU memory behind.
    ///
    /// # Errors
    /// As [`device_count`]; [`Error::DeviceUnavailable`] for a device that does not exist.
    ///
    /// # Examples
    /// ```
    /// if let Ok((free, total)) = dist_tensor::device::cuda::memory_info(0) {
    ///     assert!(free <= total);
    /// }
    /// ```
    pub fn memory_info(ordinal: usize) -> Result<(usize, usize)> {
        let gpu = CudaDevice::get(ordinal)?;
        gpu.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: a context is current; both are written.
        unsafe { cudarc::driver::sys::cuMemGetInfo_v2(&mut free, &mut total) }
            .result()
            .map_err(|e| driver::status("cuMemGetInfo", e))?;
        Ok((free, total))
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

    /// The GPU of `rank` (in a world made by [`World::cuda`](crate::World::cuda)).
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] outside a GPU world.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// if let Ok(world) = World::cuda(&[0]) {
    ///     let names = world.run(|rank| Ok(cuda::gpu_info(rank)?.name))?;
    ///     assert!(!names[0].is_empty());
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gpu_info(rank: &Rank<'_>) -> Result<GpuInfo> {
        let g = gpu_rank(rank)?;
        let gpu = g.gpu();
        Ok(GpuInfo {
            ordinal: gpu.ordinal,
            name: gpu.name.clone(),
            multiprocessors: gpu.sm_count,
            compute_capability: gpu.arch,
        })
    }

    /// Waits until the work queued on `rank`'s GPU is done (ops return once their work is
    /// queued). Fails, instead of hanging, when the world fails.
    ///
    /// # Errors
    /// As the ops: [`Error::WaitTimeout`] naming rank, program, signal and values;
    /// [`Error::PeerFailed`]; [`Error::DeviceUnavailable`] outside a GPU world.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// if let Ok(world) = World::cuda(&[0]) {
    ///     world.run(|rank| cuda::synchronize(rank))?;
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn synchronize(rank: &Rank<'_>) -> Result<()> {
        gpu_rank(rank)?.synchronize()
    }

    /// A barrier on the GPUs: work queued after it on any rank's GPU starts once every rank's GPU
    /// reached it. Collective.
    ///
    /// # Errors
    /// As [`synchronize`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// if let Ok(world) = World::cuda(&[0]) {
    ///     world.run(|rank| cuda::barrier(rank))?;
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn barrier(rank: &Rank<'_>) -> Result<()> {
        collectives::barrier(&gpu_rank(rank)?)
    }

    /// Times work queued on a rank's GPU with CUDA events.
    pub struct Timer {
        start: Event,
        stop: Event,
        ordinal: usize,
    }

    impl Timer {
        /// A timer for `rank`'s GPU (its events made now, so that starting it later costs the
        /// host little).
        ///
        /// # Errors
        /// As [`synchronize`]; [`Error::InvalidArgument`] in a world whose ranks share a GPU
        /// (`World::cuda(&[0, 0])`): ranks there take turns on one GPU, so a timing would say
        /// nothing about the op.
        ///
        /// # Examples
        /// ```
        /// use dist_tensor::{device::cuda, World};
        /// if let Ok(world) = World::cuda(&[0]) {
        ///     world.run(|rank| {
        ///         let mut t = cuda::Timer::new(rank)?;
        ///         t.start(rank)?;
        ///         t.stop(rank)?;
        ///         cuda::synchronize(rank)?;
        ///         assert!(t.elapsed_ms()? >= 0.0);
        ///         Ok(())
        ///     })?;
        /// }
        /// # Ok::<(), dist_tensor::Error>(())
        /// ```
        pub fn new(rank: &Rank<'_>) -> Result<Timer> {
            let g = gpu_rank(rank)?;
            if g.world.shares_devices() {
                return Err(Error::InvalidArgument {
                    op: "Timer::new",
                    rank: rank.rank(),
                    reason: format!(
                        "the ranks of this world share cuda:{} (a world for correctness on one \
                         GPU): their timings would mean nothing",
                        g.gpu().ordinal
                    ),
                });
            }
            Ok(Timer {
                start: Event::new(true)?,
                stop: Event::new(true)?,
                ordinal: g.gpu().ordinal,
            })
        }

        /// Records the start on `rank`'s compute stream.
        ///
        /// # Errors
        /// As [`Timer::stop`].
        pub fn start(&mut self, rank: &Rank<'_>) -> Result<()> {
            let g = self.on(rank)?;
            self.start.record(g.stream())
        }

        fn on<'a>(&self, rank: &'a Rank<'a>) -> Result<CudaRank<'a>> {
            let g = gpu_rank(rank)?;
            if g.gpu().ordinal != self.ordinal {
                return Err(Error::InvalidArgument {
                    op: "Timer",
                    rank: rank.rank(),
                    reason: format!("the timer belongs to cuda:{}", self.ordinal),
                });
            }
            Ok(g)
        }

        /// Records the stop on `rank`'s compute stream.
        ///
        /// # Errors
        /// As [`synchronize`]; [`Error::InvalidArgument`] for another rank's GPU.
        pub fn stop(&mut self, rank: &Rank<'_>) -> Result<()> {
            let g = self.on(rank)?;
            self.stop.record(g.stream())
        }

        /// Milliseconds between start and stop, once the work between them is done (the caller
        /// synchronizes first).
        ///
        /// # Errors
        /// [`Error::DeviceStatus`] if the stop was not recorded or is not done.
        pub fn elapsed_ms(&self) -> Result<f32> {
            self.start.elapsed_ms(&self.stop)
        }
    }

    /// Rank `root`'s `t` on every rank's GPU (every rank passes a tensor of the same length; the
    /// others' contents are not read). Collective.
    ///
    /// # Errors
    /// On every rank: [`Error::InvalidArgument`] for a root outside the world;
    /// [`Error::RanksDisagree`] when lengths differ; as [`synchronize`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, Tensor, World};
    /// if let Ok(world) = World::cuda(&[0]) {
    ///     let t = Tensor::<f32>::random(&[4], 3);
    ///     let got = world.run(|rank| cuda::broadcast(rank, &t.to_rank(rank)?, 0)?.to_host())?;
    ///     assert_eq!(got[0], t);
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn broadcast<T: Element>(rank: &Rank<'_>, t: &Tensor<T>, root: usize) -> Result<Tensor<T>> {
        let g = gpu_rank(rank)?;
        let t = if t.device() == rank.device() { t.clone() } else { t.to_rank(rank)? };
        let data = storage_of(&t).expect("on the rank's GPU");
        Ok(Tensor::from_device_storage(collectives::broadcast(&g, data, root)?))
    }

    /// A copy of `t` on `rank`'s GPU made by the driver's device-to-device copy: the memory
    /// ceiling the report compares the all_to_all with.
    ///
    /// # Errors
    /// As [`synchronize`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, Tensor, World};
    /// if let Ok(world) = World::cuda(&[0]) {
    ///     let t = Tensor::<f32>::random(&[4, 3], 3);
    ///     let got = world.run(|rank| cuda::device_copy(rank, &t.to_rank(rank)?)?.to_host())?;
    ///     assert_eq!(got[0], t);
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn device_copy<T: Element>(rank: &Rank<'_>, t: &Tensor<T>) -> Result<Tensor<T>> {
        let g = gpu_rank(rank)?;
        let t = if t.device() == rank.device() { t.clone() } else { t.to_rank(rank)? };
        let src = storage_of(&t).expect("on the rank's GPU");
        let out = super::super::ops::out_tensor::<T>(&g, src.shape())?;
        super::super::ops::copy(out.ptr(), src.ptr(), src.len() * size_of::<T>(), g.stream())?;
        Ok(Tensor::from_device_storage(out))
    }

    /// cuBLASLt's candidate algorithms (up to `count`, in its heuristic's order) for the
    /// row-major product `[m, k] x [k, n]` of `T` on `rank`'s GPU, `a` stored as `[k, m]` and
    /// `b` as `[n, k]` where `transposed` says so, each timed on random operands under sustained
    /// load (every candidate run 30 times first, then the fastest of three passes of 20
    /// products): a diagnostic of the algorithm the library's products use, marked
    /// [`GemmCandidate::chosen`](super::super::GemmCandidate::chosen) (its plan is made and
    /// tuned by this call if it was not yet).
    /// `gpu_report --gemm` prints them for the training step's products.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] outside a GPU world; [`Error::DeviceStatus`] when cuBLASLt
    /// has no algorithm for the product or fails.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// if let Ok(world) = World::cuda(&[0]) {
    ///     let found = world.run(|rank| cuda::gemm_candidates::<f32>(rank, (64, 48, 32), (false, true), 4))?;
    ///     assert!(found[0].iter().filter(|c| c.chosen).count() <= 1);
    ///     assert!(found[0].iter().all(|c| c.ms > 0.0));
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gemm_candidates<T: Element>(
        rank: &Rank<'_>,
        mnk: (usize, usize, usize),
        (a, b): (bool, bool),
        count: usize,
    ) -> Result<Vec<super::super::GemmCandidate>> {
        let g = gpu_rank(rank)?;
        let timing = super::super::blas::Timing { warmup: 30, warm_all: true, passes: 3, runs: 20 };
        let transposed = super::super::blas::Transposed { a, b };
        let found = super::super::blas::candidates(
            g.gpu(),
            g.stream(),
            mnk,
            transposed,
            T::DTYPE,
            count.max(1),
            timing,
        )?;
        g.synchronize()?;
        Ok(found)
    }

    /// A tensor of `shape` on `rank`'s GPU, uniform in `[-1, 1)`, drawn on the GPU by a
    /// counter-based hash of (seed, index) (fast, for benchmarks: the host's
    /// [`Tensor::random`](crate::Tensor::random) draws other values).
    ///
    /// # Errors
    /// As [`synchronize`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::cuda, World};
    /// if let Ok(world) = World::cuda(&[0]) {
    ///     let t = world.run(|rank| cuda::random::<f32>(rank, &[3, 5], 7)?.to_host())?;
    ///     assert!(t[0].as_slice().iter().all(|x| (-1.0..1.0).contains(x) && *x != 0.0));
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn random<T: Element>(rank: &Rank<'_>, shape: &[usize], seed: u64) -> Result<Tensor<T>> {
        let g = gpu_rank(rank)?;
        let data = super::super::ops::out_tensor::<T>(&g, shape)?;
        let len = data.len() as u64;
        if len > 0 {
            let f = kernels::function(g.gpu(), Source::Signal, T::DTYPE, "dt_fill_random")?;
            let (mut ptr, mut n, mut s) = (data.ptr(), len, seed);
            let mut params = [
                &mut ptr as *mut u64 as *mut std::ffi::c_void,
                &mut n as *mut u64 as *mut std::ffi::c_void,
                &mut s as *mut u64 as *mut std::ffi::c_void,
            ];
            let grid = g.grid_for(f, len.div_ceil(32 * 8));
            kernels::launch_raw(f, grid, kernels::BLOCK, g.stream(), &mut params)?;
        }
        Ok(Tensor::from_device_storage(data))
    }
}
