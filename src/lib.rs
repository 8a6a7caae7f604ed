#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![doc(test(attr(deny(warnings))))]

//! # dist-tensor
//!
//! Tensors distributed over the ranks of a world, and fused communication + compute ops on them,
//! each a tile kernel in the programming model of Triton-distributed for Ascend NPUs. Where no NPU
//! is present (the default), the same kernels run on a host simulation of the NPU.
//!
//! *The seed*, in these docs, is the programming model this crate follows: Triton-distributed
//! for Ascend NPUs as its single-operator development guide writes it (tile kernels over
//! symmetric memory, `symm_at`, `notify` / `wait` with tokens, grid-stride task loops, masks
//! instead of padding, core counts from the topology). "As in the seed" means "as that model
//! does".
//!
//! # The model in a page
//!
//! **Ranks.** A [`World`] is a set of ranks; [`World::run`] runs a closure once per rank, each on
//! its own thread, and returns the results in rank order. A [`Rank`] is a rank's handle: who it
//! is, its symmetric memory, its signals. The ranks can also be the processes of one host
//! ([`World::from_env`], started by mpirun, torchrun, Slurm or [`World::spawn_local`]): the same
//! program runs unchanged, and `run` runs the closure once, for this process's rank. With the
//! `mpi` feature, a job started by mpirun may span many hosts: MPI starts it and moves data
//! between nodes (see *Many hosts* below).
//!
//! **Distributed tensors.** A [`DistTensor`] is one rank's part of a global tensor and its
//! [`Placement`] (sharded on a dimension, cut as a [`Split`] says; replicated; or partial sums).
//! It borrows its rank, so it lives inside [`World::run`] and cannot leave it: return tensors
//! ([`DistTensor::to_global`], [`DistTensor::into_local`]). Its fused ops and `redistribute` are
//! collective; its local updates ([`DistTensor::map_local`], [`DistTensor::reshape`], ...)
//! exchange nothing. Between the fused ops, [`Tensor`] has the local math a model needs.
//!
//! **Symmetric memory.** Every rank owns a heap segment of the same capacity.
//! [`Rank::alloc`] is collective: every rank gets a [`SymmBuf`](shmem::SymmBuf) at the same
//! offset. [`symm_at`](shmem::symm_at)`(&buf, peer)` is the peer's copy, a plain pointer: offsets
//! are added after it, and loads, stores and copies through it are the same as on local memory.
//! The local copy is `buf.ptr()`, equal to `symm_at(&buf, my_rank)`.
//!
//! **Signals and tokens.** [`Rank::notify`] sets or adds to a peer's signal (with release or
//! relaxed ordering); [`Rank::wait`] waits for a value on one's own and returns a
//! [`Token`](shmem::Token). Symmetric memory can be read only through
//! [`consume_token`](shmem::consume_token)`(ptr, token)`: reading without it does not compile.
//! [`Rank::barrier_all`] waits for every rank and returns a token too. Waits spin briefly, then
//! block; they time out with an error naming the rank, program and signal.
//!
//! **Tile kernels.** [`device::launch`] runs a kernel as a grid of programs, every program
//! resident at once; each is told its [`Program`](device::Program) context (`program_id`,
//! `num_programs`, `sub_vec_id`, `sub_vec_num`, rank). Kernels walk flattened task spaces
//! grid-stride ([`Program::tasks`](device::Program::tasks)), rotate their target rank by their own,
//! and use masked tile operations ([`device::tile`]): loads and stores with masks instead of
//! padding, `atomic_add`, and `dot` with f32 accumulation reading tiles in place.
//!
//! **Launch modes.** A kernel with a cube part (`dot`) runs in [`LaunchMode::Mix`](device::LaunchMode):
//! each program runs once per vector sub-core of the [`Topology`](device::Topology) (1 cube : 2
//! vector on an Ascend AI core), and communication is gated to `sub_vec_id() == 0`. A kernel
//! without one runs [`LaunchMode::VectorOnly`](device::LaunchMode). Core counts come from the
//! topology, never from constants.
//!
//! **The host simulation.** Ranks and program instances are threads over real shared memory: the
//! heap is one anonymous mapping per rank, program threads stay resident between launches, and the
//! default topology shares the machine's cores between the ranks. A panic or error anywhere fails
//! the whole world: every waiting rank stops with [`Error::PeerFailed`], and `run` returns
//! [`Error::RankFailed`] naming the rank that failed first, with its error typed (as `source`,
//! and through [`Error::rank_error`] and [`Error::downcast_ref`]) and every rank that failed. A
//! rank that returns from `run` while a peer still waits for it ends that wait at once
//! ([`Error::PeerGone`]). What the ranks must see of each other (the failure record, each rank's
//! state, who is blocked) lives in a shared control block, and blocked waits sleep on
//! process-shared futexes.
//!
//! **Collective calls meet in one exchange.** Every collective call (a collective, a fused op, a
//! symmetric allocation, a barrier) starts by telling every rank what it is (op, element type,
//! the rank's call number) and its arguments. Ranks in different calls fail together with
//! [`Error::OpMismatch`] naming both sides (`rank 0 is in all_gather<f32> #12, rank 1 in
//! broadcast<f32> #12`), never with a wrong value or a wait that outlasts its cause.
//!
//! **Many hosts (feature `mpi`).** Under mpirun, [`World::from_env`] takes MPI's communicator:
//! the ranks of one node (one host, or `DIST_TENSOR_RANKS_PER_NODE` ranks to make several nodes of
//! one host) share memory exactly as processes of one host do; a rank of another node has no
//! pointer here ([`Rank::is_local`] says which; [`symm_at`](shmem::symm_at) on one fails with
//! [`Error::PeerNotLocal`]), and data reaches it through [`Rank::put_signal`]: the data, then a
//! signal, ordered. One proxy thread per process is the only caller of MPI and keeps transfers
//! moving while kernels compute (two-sided sends and receives straight into the heap). The
//! collectives and the fused ops run hierarchically across nodes (see each op's docs for what
//! moves where and, for `matmul_reduce_scatter`, the order of the sum per world shape); a rank
//! that fails or dies on any node ends every rank with an error naming it. The unfused baselines a
//! user of MPI writes are [`fused::all_gather_matmul_unfused_mpi`] and its siblings.
//!
//! **Devices.** A [`Device`] says where a tensor lives and its ops run: the host (the default),
//! an NVIDIA GPU (feature `cuda`: [`Tensor::to_device`], [`World::cuda`]) or an Ascend NPU.
//!
//! **One backend per world.** Where a world runs is set once, when it is made (threads,
//! processes and MPI ranks: the host simulation; [`World::cuda`]: GPUs; [`World::ascend`]: NPUs),
//! and [`Rank::device`] reads it. Every public collective and fused op chooses its backend in one
//! function, from the world, never from where one tensor happens to be: it checks the
//! [capability table](device::capability) (op x backend x element type x feature), agrees with
//! the other ranks through the one exchange (the same in every world), moves its inputs to the
//! world's device once, and takes one `match` on the backend. [`DistTensor`] and [`nn`] name no
//! backend.
//!
//! **Ascend.** [`World::ascend`] runs one rank per NPU: the fused ops and collectives run as tile
//! kernels written in Ascend C (one beside each host kernel), compiled at run time by CANN's
//! `aclrtc` and launched on Ascend SHMEM's symmetric heap; CANN is opened at run time (no
//! build-time dependency), and where it is absent the error lists every path tried. This backend
//! has been checked against a stand-in CANN only, never on an NPU: [`device::ascend`] says what
//! was verified where.
//!
//! # Layers
//!
//! | module | holds |
//! | --- | --- |
//! | [`checkpoint`] | save and load sharded tensors and training state (safetensors files, an index), resharded on load; published weights into a sharded layout |
//! | [`autograd`] | reverse-mode autograd: [`Var`](autograd::Var) over [`Tensor`], [`DVar`](autograd::DVar) over [`DistTensor`] with the fused ops' duals, `gradcheck`, modules, the layers of a GPT |
//! | [`mesh`] | meshes of ranks with named dimensions, a group per dimension; data parallelism with bucketed gradient averaging overlapping the backward pass |
//! | [`nn`] | layers that train: column- and row-parallel linear, MLP, Ulysses attention, each with its backward pass; optimizers |
//! | [`dist_tensor`](mod@dist_tensor) | [`DistTensor`], [`Placement`]: validate, lay out, never name a backend |
//! | [`fused`] | one file per fused op, with its unfused baseline; each op's one backend `match` |
//! | [`collectives`] | all_gather, reduce_scatter, all_reduce, all_to_all, broadcast; each one backend `match` |
//! | [`device`] | the backends (`host`, `cuda`, `ascend`), the capability table, topologies, launches, tile operations |
//! | [`shmem`] | the world (and where it runs), ranks, the symmetric heap, signals, tokens, the one exchange |
//! | [`tensor`] | [`Tensor`], [`Element`] (f32, f64, f16, bf16), local matmul through `gemm`, local math |
//!
//! # Features
//!
//! | what | where |
//! | --- | --- |
//! | element types | f32, f64, `half::f16`, `half::bf16` (half types accumulate in f32, round once) |
//! | placements | `Shard(d)` (uneven, empty shards allowed), `Replicate`, `Partial` |
//! | splits | [`Split`]: even (`numpy.array_split`), whole units (attention heads), explicit sizes |
//! | local updates | `map_local`, `zip_local`, `local_mut`, `cast`, `reshape`, `permute`: no exchange |
//! | local math | operators with broadcasting, `map`, `zip_map`, GELU, SiLU, softmax, sums, means, RMS and layer norm, batched matmul |
//! | fused ops | `all_gather_matmul` (one or several weights), `matmul_reduce_scatter`, on `[..., K]`; `all_to_all`; weights read transposed in place and the gathered input kept ([`MatmulOptions`]) |
//! | training | [`nn`]: tensor-parallel layers with backward passes through the dual fused ops, SGD and Adam |
//! | collectives | all_gather, reduce_scatter (sum, mean), all_reduce, all_to_all(_v), broadcast |
//! | determinism | reductions in a fixed rank order: the same bits on every run |
//! | devices | host simulation (default); Ascend NPUs through CANN (`World::ascend`, not yet run on hardware); NVIDIA GPUs joined by NVLink (feature `cuda`, [`World::cuda`]) |
//! | checkpoints | [`checkpoint`]: safetensors files per rank and an index; loaded into any world size, placement and split; published weights straight into a sharded layout; crash-safe, checksummed |
//! | ranks | threads of one process, or processes of one host (memfd segments, fd passing), or processes on many hosts joined by MPI (feature `mpi`) |
//!
//! # Errors and panics
//!
//! Anything one rank can get wrong at run time (a shape, a placement, a peer that failed or never
//! signalled, symmetric memory running out, an output the machine cannot hold) returns [`Error`],
//! because a panic on one rank would leave the others waiting; allocations are fallible
//! ([`Error::OutOfMemory`] names the op and the bytes, never an abort). Errors of the user's own
//! code travel too: `?` on an `std::io::Error` inside `run` works ([`Error::User`]), and the
//! error comes back typed. Collective ops exchange their arguments first, so a bad argument on
//! one rank fails every rank at once, naming that rank. Only programmer mistakes that cannot depend
//! on run-time data panic (a tile access out of bounds inside a kernel, which then fails the
//! launch and the world rather than hanging them), and those functions say so under `# Panics`.
//!
//! # Example
//!
//! ```
//! use dist_tensor::{DistTensor, Placement, Tensor, World};
//!
//! let x = Tensor::<f32>::random(&[64, 32], 1);
//! let w1 = Tensor::<f32>::random(&[32, 48], 2);
//! let w2 = Tensor::<f32>::random(&[48, 16], 3);
//! let want = x.matmul(&w1)?.matmul(&w2)?;
//! let outs = World::threads(4)?.run(|rank| {
//!     let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
//!     let w1 = DistTensor::from_global(rank, &w1, Placement::Shard(1))?;
//!     let w2 = DistTensor::from_global(rank, &w2, Placement::Shard(0))?;
//!     let h = x.all_gather_matmul(w1.local())?; // [64, 12] per rank, Shard(1)
//!     let y = h.matmul_reduce_scatter(w2.local())?; // [16, 16] per rank, Shard(0)
//!     y.to_global()
//! })?;
//! let err = outs[0].as_slice().iter().zip(want.as_slice()).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
//! assert!(err < 1e-4);
//! # Ok::<(), dist_tensor::Error>(())
//! ```

pub mod autograd;
pub mod checkpoint;
pub mod collectives;
pub mod device;
pub mod dist_tensor;
pub mod error;
pub mod fused;
pub mod mesh;
pub mod models;
pub mod nn;
pub mod shmem;
pub mod tensor;
pub mod train;

pub use device::Device;
pub use dist_tensor::{DistTensor, MatmulOptions, Placement, Split};
pub use error::{Error, Result};
pub use shmem::{Rank, World};
pub use tensor::{DType, Element, Tensor};

/// The ndarray crate this one is built on (its arrays convert to and from [`Tensor`]): use it
/// through this path to get the same version.
///
/// # Examples
/// ```
/// use dist_tensor::{Tensor, ndarray};
/// let t = Tensor::from(ndarray::Array2::<f32>::eye(3));
/// assert_eq!(t.sum(), 3.0);
/// ```
pub use ndarray;

/// The half crate whose `f16` and `bf16` are element types here: use it through this path to get
/// the same version.
///
/// # Examples
/// ```
/// use dist_tensor::{Tensor, half::bf16};
/// let t = Tensor::<bf16>::from(vec![bf16::from_f32(1.5)]);
/// assert_eq!(t.as_slice()[0].to_f32(), 1.5);
/// ```
pub use half;

/// The README's examples, compiled and run as doc-tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
