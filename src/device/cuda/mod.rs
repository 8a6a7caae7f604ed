//! NVIDIA GPUs (feature `cuda`): the same `DistTensor` ops on GPUs joined by NVLink.
//!
//! [`World::cuda`](crate::World::cuda)`(&[0, 1])` makes a world of one rank per GPU (one thread
//! each; a device listed twice holds two ranks, for correctness on one GPU), with peer access
//! between distinct GPUs and a symmetric heap in device memory. Tensors move with
//! [`Tensor::to_device`](crate::Tensor::to_device) / [`Tensor::to_host`](crate::Tensor::to_host);
//! in a GPU world, `DistTensor::from_global` / `from_local` put each rank's part on its GPU, and
//! `all_gather_matmul`, `matmul_reduce_scatter`, `all_to_all`, `to_global` and `redistribute` run
//! there. f32, f16, bf16 and f64.
//!
//! How it is built, bottom up (each a file of this folder):
//! - `driver`: CUDA loaded at run time through cudarc's dynamic loading (the crate builds with no
//!   CUDA installed; a machine without a driver gets [`Error::LibraryNotFound`](crate::Error::LibraryNotFound), never a panic).
//! - `memory`: plain `cuMemAlloc` allocations (a peer reaches them through peer access), cached
//!   by size; the symmetric heap, `symm_at` being the peer's base plus the offset.
//! - `world`: signals as 64-bit epoch counters in device memory, never reset; waits in kernels use
//!   `ld.acquire.sys` with backoff and time out (`%globaltimer`), writing rank, program, signal
//!   and values to host-mapped memory instead of trapping; a host-mapped abort word ends every
//!   wait of every GPU when any rank fails.
//! - `kernels`: CUDA C tile kernels in `kernels/`, compiled by NVRTC for the device at first use
//!   and cached per (kernel, dtype), in the seed's conventions: a program is a block, tasks are
//!   flattened and walked grid-stride, peers are visited as `(rank + i) % world`, bounds checks
//!   instead of padding, one thread signals; grids are sized from the multiprocessor count.
//! - `blas`: GEMMs through cuBLASLt, plans cached per shape; `nccl`: the unfused baselines.
//! - `ops`: the fused ops, their baselines and the collectives, one file each.
//!
//! The ops are called from each op's one dispatch (`fused::*`, `collectives::*`), which has
//! checked the capability table, agreed the arguments through the world's one exchange and moved
//! the inputs to the rank's GPU; the collectives here agree their own words through that same
//! exchange. Which path a fused op takes is a function of the shapes, public here
//! ([`all_gather_matmul_path`], [`matmul_reduce_scatter_path`]) and printed by the `gpu_report`
//! example, unless the call's options ask for one ([`AgPath`], [`RsPath`]).

use crate::device::path::{AgPath, RsPath};

#[cfg(feature = "cuda")]
mod api;
#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(not(feature = "cuda"))]
mod dummy;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod local;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod norm_grad;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod process;
#[cfg(feature = "cuda")]
mod storage;
#[cfg(feature = "cuda")]
mod train;
#[cfg(feature = "cuda")]
mod vmm;
#[cfg(feature = "cuda")]
mod world;

#[cfg(feature = "cuda")]
pub(crate) use api::*;
#[cfg(not(feature = "cuda"))]
pub(crate) use dummy::*;

pub use public::*;

#[cfg(feature = "cuda")]
pub(crate) use crate::tensor::backend::{Binary, Unary};

/// Rows per rank from which `all_gather_matmul` overlaps copies with per-rank GEMMs.
pub const AG_OVERLAP_MIN_ROWS: usize = 1024;
/// Output rows per rank from which `matmul_reduce_scatter` computes a GEMM per destination.
pub const RS_CHUNKED_MIN_ROWS: usize = 1024;

/// The path `all_gather_matmul` takes on GPUs for row shards of these sizes, unless the call's
/// options ask for one ([`MatmulOptions::all_gather_matmul_path`](crate::MatmulOptions)):
/// [`AgPath::Local`] for one rank; [`AgPath::Gather`] with fewer than [`AG_OVERLAP_MIN_ROWS`]
/// rows on every rank (decoding); [`AgPath::Overlap`] otherwise.
///
/// # Examples
/// ```
/// use dist_tensor::device::cuda::all_gather_matmul_path;
/// use dist_tensor::fused::AgPath;
/// assert_eq!(all_gather_matmul_path(&[128, 128]), AgPath::Gather);
/// assert_eq!(all_gather_matmul_path(&[4096, 4096]), AgPath::Overlap);
/// assert_eq!(all_gather_matmul_path(&[5]), AgPath::Local);
/// ```
pub fn all_gather_matmul_path(splits: &[usize]) -> AgPath {
    if splits.len() <= 1 {
        AgPath::Local
    } else if splits.iter().copied().max().unwrap_or(0) < AG_OVERLAP_MIN_ROWS {
        AgPath::Gather
    } else {
        AgPath::Overlap
    }
}

/// The path `matmul_reduce_scatter` takes on GPUs for output row shards of these sizes, unless
/// the call's options ask for one
/// ([`MatmulOptions::matmul_reduce_scatter_path`](crate::MatmulOptions)): [`RsPath::Local`] for
/// one rank; [`RsPath::Single`] with fewer than [`RS_CHUNKED_MIN_ROWS`] rows on every rank;
/// [`RsPath::Chunked`] otherwise.
///
/// # Examples
/// ```
/// use dist_tensor::device::cuda::matmul_reduce_scatter_path;
/// use dist_tensor::fused::RsPath;
/// assert_eq!(matmul_reduce_scatter_path(&[128, 128]), RsPath::Single);
/// assert_eq!(matmul_reduce_scatter_path(&[4096, 4096]), RsPath::Chunked);
/// ```
pub fn matmul_reduce_scatter_path(splits: &[usize]) -> RsPath {
    if splits.len() <= 1 {
        RsPath::Local
    } else if splits.iter().copied().max().unwrap_or(0) < RS_CHUNKED_MIN_ROWS {
        RsPath::Single
    } else {
        RsPath::Chunked
    }
}

/// One of cuBLASLt's candidate algorithms for a product, as
/// [`gemm_candidates`] timed it.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmCandidate {
    /// Its place in cuBLASLt's heuristic order (0: the heuristic's first choice).
    pub heuristic_rank: usize,
    /// Its configuration as cuBLASLt numbers it: algorithm id, tile, stages, split-k, CTA
    /// swizzling, cluster shape.
    pub config: String,
    /// Milliseconds of one product (infinite: it failed to launch).
    pub ms: f64,
    /// Whether the library's plan for this product uses it.
    pub chosen: bool,
}

mod public {
    #[cfg(feature = "cuda")]
    pub use super::api::public::*;
    #[cfg(not(feature = "cuda"))]
    pub use super::dummy::public::*;
}

impl crate::World {
    /// A world of one rank per NVIDIA GPU: rank `r` on CUDA device `devices[r]`, each a thread of
    /// this process, with peer access between every pair and a symmetric heap in each GPU's
    /// memory (capacity [`GPU_HEAP_BYTES_ENV`] or 4 GiB). Tensors of its ranks live on their GPUs;
    /// the `DistTensor` ops run there. For other settings (the wait timeout) use
    /// [`WorldBuilder::cuda`](crate::shmem::WorldBuilder::cuda).
    ///
    /// A device may be listed more than once (`World::cuda(&[0, 0, 0])`): those ranks share the
    /// GPU, each with its own heap segment and streams, and no peer access is asked for between
    /// them. That is for correctness on a machine with fewer GPUs than ranks: every kernel and
    /// path runs unchanged, waiting kernels take a rank's share of the GPU's blocks so that all
    /// ranks' kernels are resident at once, the unfused baselines use the world's own
    /// collectives (NCCL refuses two ranks on one GPU), and
    /// [`Timer::new`](crate::device::cuda::Timer::new) refuses to time (the ranks take turns on
    /// one GPU, so a timing would say nothing).
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`](crate::Error::LibraryNotFound) naming the NVIDIA driver and every
    /// file name tried when it is absent; [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)
    /// for a device that does not exist, GPUs that cannot reach each other, or a build without
    /// the `cuda` feature; [`Error::DeviceStatus`](crate::Error::DeviceStatus) when the driver
    /// fails.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Device, Error, World};
    /// match World::cuda(&[0]) {
    ///     Ok(world) => {
    ///         let devices = world.run(|rank| Ok(rank.device()))?;
    ///         assert_eq!(devices, vec![Device::Cuda(0)]);
    ///     }
    ///     // No GPU here: a typed error says what is missing.
    ///     Err(e @ (Error::LibraryNotFound { .. } | Error::DeviceUnavailable { .. })) => println!("{e}"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn cuda(devices: &[usize]) -> crate::Result<crate::World> {
        crate::World::builder(devices.len()).cuda(devices).build()
    }
}

/// Environment variable that overrides the capacity of each GPU's symmetric heap, in bytes.
pub const GPU_HEAP_BYTES_ENV: &str = "DIST_TENSOR_GPU_HEAP_BYTES";

/// Environment variable that chooses how a large product's algorithm is picked (read once per
/// process): `cublas` (the default: cuBLAS's own choice, `cublasGemmEx`, what PyTorch runs;
/// cuBLASLt's first candidate where cuBLAS cannot run the product), `tuned` (the fastest of
/// cuBLASLt's candidates and cuBLAS's own choice, each timed alone once per shape when the shape
/// is first multiplied) or `heuristic` (cuBLASLt's first candidate). Any other value makes the
/// product fail with [`Error::Environment`](crate::Error::Environment) naming it.
pub const GEMM_ALGO_ENV: &str = "DIST_TENSOR_GEMM_ALGO";

impl<'w> crate::Rank<'w> {
    /// The GPUs of this rank's world, when it runs on GPUs; `None` otherwise.
    pub(crate) fn cuda_world(&self) -> Option<&'w CudaWorld> {
        match self.device_world() {
            crate::device::DeviceWorld::Cuda(gpus) => Some(gpus),
            _ => None,
        }
    }
}

/// What the runtime needs of a GPU world: each rank's GPU, an end to every kernel when a rank
/// fails, and a rank's part of a run ending once its GPU work is done.
impl crate::shmem::DeviceRuntime for CudaWorld {
    fn device_of(&self, rank: usize) -> crate::Device {
        crate::Device::Cuda(ordinal_of(self, rank) as u32)
    }

    fn failed(&self, rank: usize, reason: &str) {
        world_failed(self, rank, reason);
    }

    fn finish_rank(&self, rank: usize) -> crate::Result<()> {
        finish_rank(self, rank)
    }

    /// The kernels' waits read device memory: host failures are carried there.
    fn watches_host_failures(&self) -> bool {
        true
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
