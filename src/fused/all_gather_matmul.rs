//! all_gather + matmul, fused: `[m_r, K]` row shards times a local `[K, n_r]` weight give the
//! full `[M, n_r]` product, computing on each shard as soon as it arrives.
//!
//! The kernel runs in mix mode. On vector sub-core 0 of every AI core, the communication part
//! pushes this rank's rows into every peer's symmetric `gathered` buffer (peers in rotated order,
//! chunks spread over the programs) and adds one to the peer's signal for this shard per chunk.
//! On the other sub-cores, the compute part walks output tiles grid-stride, its own shard first
//! (read straight from the input, so work starts before any data arrives), then the shards in the
//! order peers send them; before the first tile of a shard it waits for all of the shard's chunks,
//! consumes the token, and runs `dot` on the tile in place, with masks at ragged edges.
//!
//! Half types are widened to f32 once: the weights before the launch, the rows as they are pushed
//! (the `gathered` buffer holds f32), so that tiles run the f32 kernel in place.
//!
//! When shards are short (decode, or many ranks), tiles per shard would read the whole weight once
//! per shard; then every rank also copies its own rows into its `gathered` buffer and tiles run over
//! the gathered rows, waiting for the shards a tile covers, so the weight is read once.
//!
//! Across nodes (a world joined by MPI) the push is hierarchical, as Triton-distributed's
//! inter-node AllGather GEMM: a rank copies its rows to the ranks of its node, and puts them once
//! per other node, to its *stand-in* there (the rank with its local index; see `Nodes::stand_in`),
//! nodes in the order after its own; each chunk put carries the chunk's signal. A stand-in forwards
//! every chunk, as its signal arrives, to the other ranks of its node (a copy and a notify), so
//! each shard crosses to each node once. Remote puts go out from one communication lane per
//! target, in chunk order, so a count of arrived chunks says which have. The compute part takes
//! shards in the order they come: its own, its node's, then the nodes before its own, nearest
//! first (they send to this node first).

use ndarray::{Array2, ArrayView2, CowArray, Ix2};

use super::AgPath;
use super::operand::Operand;
use super::plan::scratch;
use super::plan::{
    AccData, GemmTiles, MIN_SHARD_ROWS, Output, Shards, WeightData, compute_lanes,
    computing_programs,
};
use super::routing::{GatherRoutes, REMOTE_CHUNK_ELEMS};
use super::schedule::{self, AgShape, HostMachine, PathTaken, Schedule};
use crate::collectives;
use crate::device::DeviceWorld;
use crate::device::ascend;
use crate::device::capability::{self, Feature, Op};
use crate::device::tile::{self, Tile};
use crate::device::{Device, cuda};
use crate::device::{LaunchMode, launch};
use crate::shmem::{
    Call, GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, Token,
    WaitCmp, WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::{Element, Tensor, matmul_into, pool};
use crate::{Error, Result};

const OP: &str = "all_gather_matmul";
const UNFUSED_OP: &str = "all_gather_matmul_unfused";
const MPI_OP: &str = "all_gather_matmul_unfused_mpi";
/// The most weights one call takes (metadata words are sized for them).
pub const MAX_WEIGHTS: usize = 16;
/// Elements the communication part moves per chunk.
const PUSH_CHUNK_ELEMS: usize = 64 * 1024;

/// The products of an all_gather_matmul: one `[M, n_i]` array per weight, and how the rows were
/// sharded (`row_counts[r]` rows came from rank `r`).
#[derive(Debug, Clone, PartialEq)]
pub struct AgMatmulOutput<T> {
    /// One product per weight, `[M, n_i]`.
    pub outputs: Vec<Array2<T>>,
    /// Rows each rank contributed, in rank order.
    pub row_counts: Vec<usize>,
    /// `col_counts[i][r]`: columns of rank `r`'s weight `i` (the global product of weight `i` has
    /// their sum).
    pub col_counts: Vec<Vec<usize>>,
    /// The gathered input `[M, K]`, every rank's rows in rank order: only from
    /// [`all_gather_matmul_keep_input`] (what a backward pass needs, without a second gather).
    pub gathered: Option<Array2<T>>,
    /// The device the products were computed on: the host in a host world, each rank's NPU or
    /// GPU in a device world (the outputs are copied to the host for this API).
    pub device: Device,
}

struct AgMatmulWorkspace<T: Element> {
    /// The gathered rows, in the accumulator type (half types are widened as they are pushed).
    gathered: Option<SymmBuf<T::Acc>>,
    /// `arrived[s]`: chunks of shard `s` that have landed in this rank's `gathered` buffer.
    arrived: SignalBuf,
    /// Cumulative count of chunks each shard has sent this rank, over all calls.
    expected: Vec<u64>,
}

impl<T: Element> Workspace for AgMatmulWorkspace<T> {
    fn symmetric_bytes(&self) -> usize {
        self.arrived.len() * 64
            + self.gathered.as_ref().map_or(0, |g| g.len() * size_of::<T::Acc>())
    }
}

impl<T: Element> AgMatmulWorkspace<T> {
    fn new(rank: &Rank<'_>) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(AgMatmulWorkspace {
            gathered: None,
            arrived: rank.alloc_signals_for("all_gather_matmul arrived", n)?,
            expected: vec![0; n],
        })
    }

    fn reserve(&mut self, rank: &Rank<'_>, len: usize) -> Result<()> {
        rank.reserve_for("all_gather_matmul gathered", &mut self.gathered, len)
    }
}

/// What every rank agreed on.
struct Agreed {
    rows: Shards,
    k: usize,
    col_counts: Vec<Vec<usize>>,
    /// The path the call's options ask for (the same on every rank).
    path: Option<AgPath>,
    /// Rank 0's machine figures, from which every rank chooses the host path.
    machine: HostMachine,
}

/// Exchanges shapes and checks them on every rank, so that all fail together.
fn agree<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    (rows, cols): (usize, usize),
    weights: &[Operand<'_, T>],
    problem: Option<String>,
    path: u64,
) -> Result<Agreed> {
    let problem = problem.or_else(|| {
        (weights.len() > MAX_WEIGHTS || weights.is_empty())
            .then(|| format!("{} weights; one call takes 1 to {MAX_WEIGHTS}", weights.len()))
    });
    let mut words = vec![rows as u64, cols as u64, weights.len() as u64];
    for w in weights.iter().take(MAX_WEIGHTS) {
        let (k, n) = w.dim();
        words.extend([k as u64, n as u64]);
    }
    // Then the path the call's options ask for (0: by shape), the same on every rank, and last
    // this rank's machine figures (rank 0's decide the host path on every rank).
    words.push(path);
    // Only the fused op on the host measures them (once per process).
    let host = matches!(rank.device_world(), DeviceWorld::Host);
    let machine_words = if op == OP && host { HostMachine::get().words() } else { [1; 3] };
    words.extend(machine_words);
    let all = rank.exchange(Call::of::<T>(op), &words, problem, &[])?;
    for (r, w) in all.iter().enumerate() {
        let (m, k) = (w[0] as usize, w[1] as usize);
        for i in 0..w[2] as usize {
            let (kw, nw) = (w[3 + 2 * i] as usize, w[4 + 2 * i] as usize);
            if kw != k {
                return Err(Error::InnerDimMismatch {
                    op: OP,
                    rank: r,
                    left: vec![m, k],
                    right: vec![kw, nw],
                    left_global: None,
                });
            }
        }
    }
    let k = all.agree(OP, 1, "K (columns of x)")? as usize;
    all.agree(OP, 2, "number of weights")?;
    let asked = all.agree(OP, words.len() - 4, "path asked for")?;
    let machine = HostMachine::from_words(&all[0][words.len() - 3..]);
    let col_counts =
        (0..weights.len()).map(|i| all.iter().map(|w| w[4 + 2 * i] as usize).collect()).collect();
    let path = [AgPath::Local, AgPath::Gather, AgPath::Overlap]
        .into_iter()
        .find(|&p| AgPath::word(Some(p)) == asked);
    Ok(Agreed {
        rows: Shards::new(all.iter().map(|w| w[0] as usize).collect()),
        k,
        col_counts,
        path,
        machine,
    })
}

/// `all_gather(x) @ w_i` for every weight: `x` is this rank's `[m_r, K]` row shard, each `w_i` a
/// local `[K, n_i]` matrix (typically a column shard of a weight). Collective.
///
/// A weight may be a transposed view (`w.t()` of an `[n_i, K]` matrix, as a backward pass has
/// it): a row-major weight is read in place by the tiles, and so is a column-major one in a
/// product of at most one tile of rows; in a longer product a column-major weight, and any other
/// layout, is copied once into row-major order (the GEMM packs a column-major block of the weight
/// for every block of rows, much slower than a row-major one).
///
/// # Errors
/// On every rank: [`Error::InnerDimMismatch`] naming the rank whose weight does not fit its `x`;
/// [`Error::RanksDisagree`] when ranks have different `K` or numbers of weights;
/// [`Error::InvalidArgument`] for no weights or more than [`MAX_WEIGHTS`]; and as every
/// collective (a peer that fails, symmetric memory too small).
///
/// # Examples
/// ```
/// use dist_tensor::fused::all_gather_matmul;
/// use dist_tensor::World;
/// use ndarray::array;
///
/// let outs = World::threads(2)?.run(|rank| {
///     let x = array![[rank.rank() as f32 + 1.0, 1.0]]; // one row per rank
///     let w = array![[1.0f32], [10.0]];
///     Ok(all_gather_matmul(rank, x.view(), &[w.view()])?.outputs.remove(0))
/// })?;
/// assert_eq!(outs[0], array![[11.0f32], [12.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather_matmul<'a, T: Element, W: Into<Operand<'a, T>> + Copy>(
    rank: &Rank<'_>,
    x: impl Into<Operand<'a, T>>,
    weights: &[W],
) -> Result<AgMatmulOutput<T>> {
    public(rank, x.into(), weights, true, false)
}

/// [`all_gather_matmul`] that also hands back the gathered input `[M, K]`
/// ([`AgMatmulOutput::gathered`]): the rows the kernel received anyway, copied out once as they
/// are consumed, so that a backward pass (the weight gradient `gathered^T @ dy`) needs no second
/// gather. Weights may be transposed views (`w.t()` of an `[n_i, K]` matrix), read as in
/// [`all_gather_matmul`].
///
/// # Errors
/// As [`all_gather_matmul`]; [`Error::DeviceUnavailable`] in an Ascend world (the NPU kernel does
/// not hand back its gathered rows).
///
/// # Examples
/// ```
/// use dist_tensor::fused::all_gather_matmul_keep_input;
/// use dist_tensor::World;
/// use ndarray::array;
///
/// let outs = World::threads(2)?.run(|rank| {
///     let x = array![[rank.rank() as f32 + 1.0, 1.0]]; // one row per rank
///     let w_t = array![[1.0f32, 10.0]]; // [n = 1, K = 2], read transposed in place
///     let out = all_gather_matmul_keep_input(rank, x.view(), &[w_t.t()])?;
///     Ok((out.outputs[0].clone(), out.gathered.expect("asked for")))
/// })?;
/// assert_eq!(outs[1].0, array![[11.0f32], [12.0]]);
/// assert_eq!(outs[1].1, array![[1.0f32, 1.0], [2.0, 1.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather_matmul_keep_input<'a, T: Element, W: Into<Operand<'a, T>> + Copy>(
    rank: &Rank<'_>,
    x: impl Into<Operand<'a, T>>,
    weights: &[W],
) -> Result<AgMatmulOutput<T>> {
    public(rank, x.into(), weights, true, true)
}

/// The products of [`run`], as tensors where the world computes (its GPU in a CUDA world).
pub(crate) struct AgProducts<T: Element> {
    /// One product per weight, `[M, n_i]`, rows in rank order.
    pub(crate) outputs: Vec<Tensor<T>>,
    pub(crate) row_counts: Vec<usize>,
    pub(crate) col_counts: Vec<Vec<usize>>,
    /// The gathered input `[M, K]`, when kept.
    pub(crate) gathered: Option<Tensor<T>>,
}

impl<T: Element> AgProducts<T> {
    fn from_host(out: AgMatmulOutput<T>) -> Self {
        let tensor = |a: Array2<T>| Tensor::from_array(a.into_dyn());
        AgProducts {
            outputs: out.outputs.into_iter().map(tensor).collect(),
            row_counts: out.row_counts,
            col_counts: out.col_counts,
            gathered: out.gathered.map(tensor),
        }
    }

    /// The public output: host arrays, and the device the products were computed on.
    fn into_output(self, device: Device) -> Result<AgMatmulOutput<T>> {
        let array = |t: Tensor<T>| -> Result<Array2<T>> {
            let host = t.into_host()?;
            Ok(host.into_array().into_dimensionality().expect("a product is 2-D"))
        };
        Ok(AgMatmulOutput {
            outputs: self.outputs.into_iter().map(array).collect::<Result<_>>()?,
            row_counts: self.row_counts,
            col_counts: self.col_counts,
            gathered: self.gathered.map(array).transpose()?,
            device,
        })
    }
}

/// The public entry's tail: [`run`], then host arrays.
fn public<'a, T: Element, W: Into<Operand<'a, T>> + Copy>(
    rank: &Rank<'_>,
    x: Operand<'a, T>,
    weights: &[W],
    fused: bool,
    keep_input: bool,
) -> Result<AgMatmulOutput<T>> {
    let ws: Vec<Operand<'_, T>> = weights.iter().map(|&w| w.into()).collect();
    run(rank, x, &ws, None, fused, keep_input, None)?.into_output(rank.device())
}

/// `all_gather_matmul` (or its unfused baseline) on any world: the one place it chooses its
/// backend. In turn: the capability table (the features asked for, before any exchange; the
/// element type travels in the agreement exchange with `problem`, a problem this rank found in
/// its inputs, so that every rank fails together), the agreement exchange, then one `match` on
/// the world's backend; inputs move to the world's device once, here. With `keep_input`, the
/// output also holds the gathered input.
pub(crate) fn run<'a, T: Element>(
    rank: &Rank<'_>,
    x: Operand<'a, T>,
    weights: &[Operand<'a, T>],
    problem: Option<String>,
    fused: bool,
    keep_input: bool,
    path: Option<AgPath>,
) -> Result<AgProducts<T>> {
    let op = if fused { OP } else { UNFUSED_OP };
    let device = rank.device();
    let mut features = Vec::new();
    if x.ndim() > 2 {
        features.push(Feature::NdInput);
    }
    if weights.iter().any(Operand::transposed) {
        features.push(Feature::TransposedWeight);
    }
    if keep_input {
        features.push(Feature::KeptInput);
    }
    capability::check_features(Op::AllGatherMatmul, device, &features)?;
    let problem = problem
        .or_else(|| capability::dtype_problem(Op::AllGatherMatmul, device, T::DTYPE))
        .or_else(|| schedule::local_problem(rank, path == Some(AgPath::Local)));
    // Its own name in the exchange for the unfused baseline: a rank in the fused op and one in
    // the unfused one would otherwise agree on the shapes and then wait for each other in
    // different protocols.
    let agreed = agree(op, rank, x.dim(), weights, problem, AgPath::word(path))?;
    let ran = match rank.device_world() {
        DeviceWorld::Host => (|| {
            let (x, ws) = host_arrays(x, weights)?;
            let x = x.view();
            let ws: Vec<ArrayView2<T>> = ws.iter().map(|w| w.view()).collect();
            let schedule = if fused { Some(host_path(rank, &agreed, &ws)) } else { None };
            let out = if let Some((path, why)) = schedule {
                match path {
                    AgPath::Gather if rank.num_ranks() > 1 => {
                        gather_then_gemm(rank, agreed, x, &ws, keep_input)
                    }
                    _ => rank.with_workspace(AgMatmulWorkspace::<T>::new, |work| {
                        run_fused(rank, work, &agreed, x, &ws, keep_input)
                    }),
                }
                .and_then(|out| {
                    let path = PathTaken::AllGatherMatmul(path);
                    schedule::record(rank, Schedule { path, why })?;
                    Ok(out)
                })
            } else {
                let x = x.as_standard_layout();
                collectives::all_gather(rank, x.as_slice().expect("standard layout"))
                    .and_then(|gathered| products(op, rank, gathered, agreed, &ws, keep_input))
            };
            out.map(AgProducts::from_host)
        })(),
        DeviceWorld::Ascend(world) => (|| {
            let npu = ascend::AscendRank { world, rank };
            let (x, ws) = host_arrays(x, weights)?;
            let x = x.view();
            let ws: Vec<ArrayView2<T>> = ws.iter().map(|w| w.view()).collect();
            let (rows, k) = (agreed.rows.counts(), agreed.k);
            let outputs = if fused {
                ascend::launch::all_gather_matmul(&npu, rows, k, x, &ws)
            } else {
                ascend::launch::all_gather_matmul_unfused(&npu, rows, k, x, &ws)
            };
            outputs.map(|outputs| {
                let (row_counts, col_counts) = (rows.to_vec(), agreed.col_counts);
                AgProducts::from_host(AgMatmulOutput {
                    outputs,
                    row_counts,
                    col_counts,
                    gathered: None,
                    device: rank.device(),
                })
            })
        })(),
        DeviceWorld::Cuda(gpus) => (|| {
            let x = x.on_device_matrix(rank)?;
            // Transposed weights are read in place (cuBLASLt's transpose flag) when all are.
            let transposed = !weights.is_empty() && weights.iter().all(|w| w.transposed());
            let ws: Vec<Tensor<T>> = weights
                .iter()
                .map(|w| {
                    if transposed {
                        w.on_device_stored(rank).map(|s| s.0)
                    } else {
                        w.on_device_matrix(rank)
                    }
                })
                .collect::<Result<_>>()?;
            let storages: Vec<_> = ws.iter().map(device_data).collect();
            let rows = agreed.rows.counts();
            let x = device_data(&x);
            let outs =
                cuda::all_gather_matmul(gpus, rank, x, rows, &storages, transposed, fused, path)?;
            // The kernels gather into buffers they reuse on the next call: a kept input is
            // gathered again into a tensor of its own (one more collective).
            let gathered = if keep_input {
                let all = cuda::all_gather(gpus, rank, x, 0, rows)?;
                Some(Tensor::from_device_storage(all))
            } else {
                None
            };
            Ok(AgProducts {
                outputs: outs.into_iter().map(Tensor::from_device_storage).collect(),
                row_counts: rows.to_vec(),
                col_counts: agreed.col_counts,
                gathered,
            })
        })(),
    };
    ran.inspect_err(|e| rank.fail_after_agreeing(e))
}

/// The path this call takes on the host, and why: the one the call's options ask for, else one
/// rank's (rank 0's) machine decides, identically on every rank. Across nodes, the tile kernel
/// (its routing is what crosses nodes once).
fn host_path<T: Element>(
    rank: &Rank<'_>,
    agreed: &Agreed,
    weights: &[ArrayView2<T>],
) -> (AgPath, String) {
    if let Some(path) = agreed.path {
        return (path, "asked for by the call's options".into());
    }
    if rank.num_ranks() > 1 && rank.num_nodes() > 1 {
        return (AgPath::Overlap, "several nodes: each shard crosses to each node once".into());
    }
    let (grid, sub_vec_num) = (rank.topology().aicore_num(), rank.topology().sub_vec_num());
    let (comm, first_compute) = compute_lanes(sub_vec_num);
    let shape = AgShape {
        rows: agreed.rows.counts(),
        k: agreed.k,
        n: weights.iter().map(|w| w.ncols()).sum(),
        elem_bytes: size_of::<T::Acc>(),
        rank: rank.rank(),
        ranks_here: rank.node_ranks(rank.node_of(rank.rank())).len(),
        compute_lanes: computing_programs(grid, sub_vec_num),
        // With one sub-core per AI core the copies run before the tiles, on the same thread.
        comm_lanes: if first_compute > 0 { grid * comm } else { 0 },
        min_shard_rows: MIN_SHARD_ROWS,
    };
    schedule::all_gather_matmul_path(&agreed.machine, &shape)
}

/// [`AgPath::Gather`] on the host: the collective, then one GEMM per weight over all rows. A
/// transposed weight is read in place: one GEMM packs each block of it once, and the `gemm`
/// crate packs a column-major block about as fast as a row-major one there (on a 2-core Intel
/// Xeon: 56 to 58 ms against 55 to 58 for a `[2048, 1024] x [1024, 2048]` f32 product, one core),
/// where a row-major copy first (as the tile kernel makes, whose tiles pack the weight once per
/// block of rows) took another 5 ms.
fn gather_then_gemm<T: Element>(
    rank: &Rank<'_>,
    agreed: Agreed,
    x: ArrayView2<T>,
    weights: &[ArrayView2<T>],
    keep_input: bool,
) -> Result<AgMatmulOutput<T>> {
    let x = x.as_standard_layout();
    let gathered = collectives::all_gather(rank, x.as_slice().expect("standard layout"))?;
    products(OP, rank, gathered, agreed, weights, keep_input)
}

/// A matrix on the host, borrowed or copied there.
type HostMatrix<'a, T> = CowArray<'a, T, Ix2>;

/// The operands on the host: views where they are there (no copy), copied from a device once
/// otherwise.
fn host_arrays<'a, T: Element>(
    x: Operand<'a, T>,
    weights: &[Operand<'a, T>],
) -> Result<(HostMatrix<'a, T>, Vec<HostMatrix<'a, T>>)> {
    Ok((x.host()?, weights.iter().map(Operand::host).collect::<Result<_>>()?))
}

/// The device data of a tensor the op moved to its world's device.
pub(crate) fn device_data<T: Element>(t: &Tensor<T>) -> &cuda::DeviceStorage<T> {
    cuda::storage_of(t).expect("moved to the world's device at the op's entry")
}

/// The unfused baseline: [`collectives::all_gather`] of the rows, then one local product per
/// weight on this rank's compute cores. Same results as [`all_gather_matmul`].
///
/// # Errors
/// As [`all_gather_matmul`].
///
/// # Examples
/// ```
/// use dist_tensor::fused::{all_gather_matmul, all_gather_matmul_unfused};
/// use dist_tensor::{Tensor, World};
///
/// World::threads(3)?.run(|rank| {
///     let x = Tensor::<f32>::random(&[5, 7], rank.rank() as u64);
///     let w = Tensor::<f32>::random(&[7, 4], 99);
///     let (x, w) = (x.view2("x")?, w.view2("w")?);
///     let fused = all_gather_matmul(rank, x, &[w])?;
///     let unfused = all_gather_matmul_unfused(rank, x, &[w])?;
///     assert_eq!((fused.row_counts, fused.col_counts), (unfused.row_counts, unfused.col_counts));
///     let differ = &fused.outputs[0] - &unfused.outputs[0];
///     assert_eq!(unfused.outputs[0].dim(), (15, 4));
///     assert!(differ.iter().all(|d| d.abs() < 1e-5), "{differ}");
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather_matmul_unfused<'a, T: Element, W: Into<Operand<'a, T>> + Copy>(
    rank: &Rank<'_>,
    x: impl Into<Operand<'a, T>>,
    weights: &[W],
) -> Result<AgMatmulOutput<T>> {
    public(rank, x.into(), weights, false, false)
}

/// The unfused baseline as a user of MPI writes it: `MPI_Allgatherv` of the rows (run by the
/// proxy, see [`World::from_env`](crate::World::from_env)), then one local product per weight on
/// this rank's compute cores. Same results as [`all_gather_matmul`].
///
/// # Errors
/// As [`all_gather_matmul`]; [`Error::InvalidArgument`] in a world not joined by MPI (feature
/// `mpi`, started by mpirun), which has no MPI collective to run.
///
/// # Examples
/// ```
/// use dist_tensor::fused::all_gather_matmul_unfused_mpi;
/// use dist_tensor::World;
/// use ndarray::array;
/// let err = World::threads(1)?.run(|rank| {
///     let x = array![[1.0f32]];
///     Ok(all_gather_matmul_unfused_mpi(rank, x.view(), &[x.view()]).unwrap_err())
/// })?;
/// assert!(err[0].to_string().contains("needs a world joined by MPI"), "{}", err[0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather_matmul_unfused_mpi<'a, T: Element, W: Into<Operand<'a, T>> + Copy>(
    rank: &Rank<'_>,
    x: impl Into<Operand<'a, T>>,
    weights: &[W],
) -> Result<AgMatmulOutput<T>> {
    let x = x.into();
    let ws: Vec<Operand<'_, T>> = weights.iter().map(|&w| w.into()).collect();
    // MPI runs on host memory: device operands come to the host first (a failure travels in
    // the agreement, so that every rank fails together).
    let host = host_arrays(x, &ws);
    let problem = host.as_ref().err().map(ToString::to_string);
    let agreed = agree(MPI_OP, rank, x.dim(), &ws, problem, 0)?;
    let (x, weights) = host.expect("a problem fails the agreement");
    let weights: Vec<ArrayView2<T>> = weights.iter().map(|w| w.view()).collect();
    let x = x.as_standard_layout();
    let counts: Vec<usize> = agreed.rows.counts().iter().map(|&m| m * agreed.k).collect();
    let mine = x.as_slice().expect("standard layout").to_vec();
    let gathered = rank.mpi_all_gather_v(mine, &counts)?;
    products(MPI_OP, rank, gathered, agreed, &weights, false)
}

/// The local products of the gathered rows with every weight; the gathered rows too, if kept.
fn products<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    gathered: Vec<T>,
    agreed: Agreed,
    weights: &[ArrayView2<T>],
    keep_input: bool,
) -> Result<AgMatmulOutput<T>> {
    let a = ArrayView2::from_shape((agreed.rows.total(), agreed.k), &gathered).expect("M x K");
    let threads = rank.topology().aicore_num();
    let mut outputs = Vec::with_capacity(weights.len());
    for w in weights {
        let mut c =
            scratch(op, (a.nrows(), w.ncols())).inspect_err(|e| rank.fail_after_agreeing(e))?;
        matmul_into(c.view_mut(), a, *w, false, threads)?;
        outputs.push(c);
    }
    let gathered = if keep_input {
        Some(Array2::from_shape_vec((agreed.rows.total(), agreed.k), gathered).expect("M x K"))
    } else {
        pool::give(gathered);
        None
    };
    Ok(AgMatmulOutput {
        outputs,
        row_counts: agreed.rows.counts().to_vec(),
        col_counts: agreed.col_counts,
        gathered,
        device: rank.device(),
    })
}

fn run_fused<T: Element>(
    rank: &Rank<'_>,
    ws: &mut AgMatmulWorkspace<T>,
    agreed: &Agreed,
    x: ArrayView2<T>,
    weights: &[ArrayView2<T>],
    keep_input: bool,
) -> Result<AgMatmulOutput<T>> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let (rows, k) = (&agreed.rows, agreed.k);
    let m_total = rows.total();
    // Tiles per shard, or over the gathered rows when shards are too short to be worth it.
    let per_shard = n == 1 || rows.counts().iter().all(|&m| m == 0 || m >= MIN_SHARD_ROWS);
    let x = x.as_standard_layout();
    let x_acc = AccData::new(OP, x.as_slice().expect("standard layout"))?;
    let input = GlobalPtr::from_slice(&x_acc);
    let chunks = Chunking {
        rows,
        k,
        local: super::plan::row_chunks(k, PUSH_CHUNK_ELEMS),
        remote: super::plan::row_chunks(k, REMOTE_CHUNK_ELEMS),
    };
    // The counts before this call: a forwarded chunk `c` of shard `s` has arrived once
    // `arrived[s]` passes `before[s] + c`.
    let before = ws.expected.clone();
    if n > 1 {
        ws.reserve(rank, m_total * k)?;
        for s in 0..n {
            if s != me || !per_shard {
                // A shard of another node comes in that node's chunks (put, then forwarded).
                let across = rank.node_of(s) != rank.node_of(me);
                ws.expected[s] += chunks.count(s, across) as u64;
            }
        }
    }
    let routes = GatherRoutes::new(rank, per_shard);
    // Who signals each shard's arrival here (a wait names that rank, so that only its leaving
    // `run` early fails the wait).
    let signaller = routes.signallers(rank);
    // Row-major weights are read in place; transposed (column-major) ones too, or copied once
    // into row-major order when many blocks of rows would pack them (see `WeightData::new`).
    let w_data: Vec<WeightData<'_, T::Acc>> =
        weights.iter().map(|w| WeightData::new(OP, *w, m_total)).collect::<Result<_>>()?;
    let w_ptrs: Vec<(GlobalPtr<'_, T::Acc>, [usize; 2])> =
        w_data.iter().map(|w| (w.ptr(), w.strides)).collect();
    let widths: Vec<usize> = weights.iter().map(|w| w.ncols()).collect();
    let mut outputs: Vec<Array2<T>> =
        widths.iter().map(|&nw| scratch(OP, (m_total, nw))).collect::<Result<_>>()?;
    let out_ptrs: Vec<Output<'_, T>> =
        outputs.iter_mut().map(|o| Output::new(o.as_slice_mut().expect("fresh array"))).collect();
    // The gathered input, when kept: copied out in chunks of whole rows after the tiles.
    let mut kept = if keep_input { Some(scratch(OP, (m_total, k))?) } else { None };
    let kept_ptr = kept.as_mut().map(|g| Output::<T>::new(g.as_slice_mut().expect("fresh array")));
    let x_own = GlobalPtr::from_slice(x.as_slice().expect("standard layout"));
    let keep_rows = super::plan::row_chunks(k, PUSH_CHUNK_ELEMS);
    let keep_tasks = if kept_ptr.is_some() && k > 0 { m_total.div_ceil(keep_rows) } else { 0 };

    // The compute tiles, in the order data becomes available: own shard, then the others rotated
    // (on several nodes: this node's, then the nodes before this one, nearest first).
    let order = routes.arrival_order(rank);
    let segments: Vec<(usize, usize)> = if per_shard {
        order.iter().map(|&s| (rows.offset(s), rows.count(s))).collect()
    } else {
        vec![(0, m_total)]
    };
    let (grid, sub_vec_num) = (rank.topology().aicore_num(), rank.topology().sub_vec_num());
    let tiles = GemmTiles::new(&segments, &widths, computing_programs(grid, sub_vec_num));
    let ws = &*ws;
    let gathered = ws.gathered.as_ref();
    let (comm_lanes, first_compute) = compute_lanes(sub_vec_num);

    // SAFETY: a rank's rows land in a peer's `gathered` buffer at the rows of that shard, written
    // only by the pushing rank and read by the peer only after it acquired the shard's count of
    // chunks; buffers are reused only after the next call's exchange (see WordExchange). Every
    // output tile is written by exactly one task.
    unsafe {
        launch(rank, LaunchMode::Mix, grid, |p| {
            if n > 1 && p.sub_vec_id() < comm_lanes {
                let gathered = gathered.expect("reserved");
                push_rows(p, gathered, &ws.arrived, input, &chunks, &routes)?;
                forward_rows(p, gathered, &ws.arrived, &chunks, &routes, &before)?;
            }
            let mut tokens: Vec<Option<Token>> = vec![None; n];
            // Accumulator tiles, for outputs that must be rounded (half types) only.
            let mut tiles_for_rounding = None;
            for t in p.tasks_on_sub_vecs(first_compute, tiles.count()) {
                let task = tiles.get(t);
                let a = if n == 1 || (per_shard && order[task.segment] == me) {
                    input + (task.row - rows.offset(me)) * k
                } else {
                    // Wait, once per program, for every shard the tile covers.
                    let mut token = None;
                    for s in rows.covering(task.row, task.rows) {
                        if tokens[s].is_none() {
                            let want = WaitCmp::Ge(ws.expected[s]);
                            let from = signaller[s];
                            tokens[s] =
                                Some(p.wait_from(&ws.arrived, s, from, want, WaitSem::Acquire)?);
                        }
                        token = tokens[s];
                    }
                    let Some(token) = token else { continue };
                    let base = gathered.expect("reserved").ptr();
                    GlobalPtr::from(consume_token(base, token)) + task.row * k
                };
                let nw = widths[task.weight];
                let (w, w_strides) = w_ptrs[task.weight];
                let b = w + task.col * w_strides[1];
                let valid = (task.rows, k, task.cols);
                let at = task.row * nw + task.col;
                let a_strides = [k, 1];
                match out_ptrs[task.weight] {
                    Output::Direct(out) => tile::dot_store_strided(
                        out + at,
                        nw,
                        a,
                        a_strides,
                        b,
                        w_strides,
                        valid,
                        false,
                    ),
                    Output::Rounded(out) => {
                        let (acc, rounded) = tiles_for_rounding.get_or_insert_with(|| {
                            let (r, c) = (tiles.block_rows, tiles.block_cols);
                            (
                                Tile::new(r, c, <T::Acc as Element>::zero()),
                                Tile::new(r, c, T::zero()),
                            )
                        });
                        // The product overwrites the accumulator (no zeroing, no read of it),
                        // then is rounded once. Only the valid part is rounded and stored.
                        let width = acc.cols();
                        let acc_mem = GlobalPtrMut::from_slice(acc.as_mut_slice());
                        tile::dot_store_strided(
                            acc_mem, width, a, a_strides, b, w_strides, valid, false,
                        );
                        acc.cast_into(rounded);
                        tile::store_2d(out + at, nw, rounded, (task.rows, task.cols));
                    }
                }
            }
            if let Some(out) = kept_ptr {
                let source = KeptSource {
                    input: x_own,
                    input_acc: input,
                    gathered,
                    per_shard,
                    signaller: &signaller,
                };
                for t in p.tasks_on_sub_vecs(0, keep_tasks) {
                    let row = t * keep_rows;
                    let count = tile::valid_len(row, keep_rows, m_total);
                    keep_rows_of(p, ws, &source, rows, k, (row, count), out, &mut tokens)?;
                }
            }
            Ok(())
        })?;
    }
    rank.quiet()?; // the rows put to other nodes have left `x_acc`
    Ok(AgMatmulOutput {
        outputs,
        row_counts: rows.counts().to_vec(),
        col_counts: agreed.col_counts.clone(),
        gathered: kept,
        device: rank.device(),
    })
}

/// How shards are cut into chunks of rows of `k` elements: `local` rows per chunk copied on a
/// node, `remote` rows per chunk put to another node (and forwarded there as they came).
struct Chunking<'a> {
    rows: &'a Shards,
    k: usize,
    local: usize,
    remote: usize,
}

impl Chunking<'_> {
    fn rows_per(&self, across: bool) -> usize {
        if across { self.remote } else { self.local }
    }

    /// Chunks of `shard`, for a node of its own or (`across`) another one.
    fn count(&self, shard: usize, across: bool) -> usize {
        if self.k == 0 { 0 } else { self.rows.count(shard).div_ceil(self.rows_per(across)) }
    }

    /// First row (within the shard) and rows of chunk `c` of `shard`.
    fn chunk(&self, shard: usize, c: usize, across: bool) -> (usize, usize) {
        let per = self.rows_per(across);
        let row = c * per;
        (row, tile::valid_len(row, per, self.rows.count(shard)))
    }
}

/// Where the kept copy of the gathered input reads rows from: this rank's own (in `T` and in the
/// accumulator type) from its input when tiles read them there, every other row from the
/// `gathered` buffer.
struct KeptSource<'a, T: Element> {
    input: GlobalPtr<'a, T>,
    input_acc: GlobalPtr<'a, T::Acc>,
    gathered: Option<&'a SymmBuf<T::Acc>>,
    per_shard: bool,
    /// Who signals each shard's arrival here (see `run_fused`).
    signaller: &'a [usize],
}

/// Copies rows `row..row + count` of the gathered input into `out` (the kept copy), waiting for
/// each shard they cover once per program (`tokens`, shared with the compute part). Half types
/// come back from the f32 `gathered` buffer exactly: they were widened from `T`.
#[allow(clippy::too_many_arguments)]
fn keep_rows_of<T: Element>(
    p: &crate::device::Program<'_>,
    ws: &AgMatmulWorkspace<T>,
    source: &KeptSource<'_, T>,
    rows: &Shards,
    k: usize,
    (row, count): (usize, usize),
    out: Output<'_, T>,
    tokens: &mut [Option<Token>],
) -> Result<()> {
    let (me, n) = (p.rank(), p.num_ranks());
    for s in rows.covering(row, count) {
        let start = row.max(rows.offset(s));
        let end = (row + count).min(rows.offset(s) + rows.count(s));
        let valid = (end - start, k);
        if n == 1 || (source.per_shard && s == me) {
            let from = start - rows.offset(me);
            // SAFETY: this rank's own input, only read; each row of `out` has one writer.
            unsafe {
                match out {
                    Output::Direct(out) => {
                        tile::copy_2d(out + start * k, k, source.input_acc + from * k, k, valid)
                    }
                    Output::Rounded(out) => {
                        tile::copy_2d(out + start * k, k, source.input + from * k, k, valid)
                    }
                }
            }
            continue;
        }
        let token = match tokens[s] {
            Some(token) => token,
            None => {
                let want = WaitCmp::Ge(ws.expected[s]);
                let from = source.signaller[s];
                *tokens[s].insert(p.wait_from(&ws.arrived, s, from, want, WaitSem::Acquire)?)
            }
        };
        let base = source.gathered.expect("reserved when peers send").ptr();
        let from = GlobalPtr::from(consume_token(base, token)) + start * k;
        // SAFETY: shard `s` landed before its acquired count; nobody writes `gathered` before
        // the next call's exchange; each row of `out` has one writer.
        unsafe {
            match out {
                Output::Direct(out) => tile::copy_2d(out + start * k, k, from, k, valid),
                Output::Rounded(out) => {
                    let mut acc = Tile::new(valid.0, k, <T::Acc as Element>::zero());
                    let mut rounded = Tile::new(valid.0, k, T::zero());
                    tile::load_2d(from, k, valid, <T::Acc as Element>::zero(), &mut acc);
                    acc.cast_into(&mut rounded);
                    tile::store_2d(out + start * k, k, &rounded, valid);
                }
            }
        }
    }
    Ok(())
}

/// The communication part, sending: this rank's rows copied into the `gathered` buffer of every
/// rank of its node (its own too, when tiles read the gathered rows), chunks spread over the
/// programs; and put to its stand-in on every other node, one program per target sending its
/// chunks in order. One signal per chunk.
fn push_rows<A: Element>(
    p: &crate::device::Program<'_>,
    gathered: &SymmBuf<A>,
    arrived: &SignalBuf,
    input: GlobalPtr<'_, A>,
    chunks: &Chunking<'_>,
    routes: &GatherRoutes,
) -> Result<()> {
    let me = p.rank();
    let (rows, k) = (chunks.rows, chunks.k);
    let count = chunks.count(me, false);
    // One communication lane per program: sub-core 0.
    for task in p.tasks(routes.local.len() * count) {
        let peer = routes.local[task / count];
        let (row, len) = chunks.chunk(me, task % count, false);
        let dst = symm_at(gathered, peer) + (rows.offset(me) + row) * k;
        // SAFETY: only this rank writes its shard's rows of a peer's `gathered` buffer, each chunk
        // once; the peer reads them only after acquiring the chunk count.
        unsafe { tile::copy_2d(dst, k, input + row * k, k, (len, k)) };
        let scope = if peer == me { Scope::Device } else { Scope::Peer };
        p.notify(arrived, me, peer, SignalOp::Add(1), scope, NotifySem::Release)?;
    }
    for target in p.tasks(routes.remote.len()) {
        let peer = routes.remote[target];
        for c in 0..chunks.count(me, true) {
            let (row, len) = chunks.chunk(me, c, true);
            let at = (rows.offset(me) + row) * k;
            let signal = Some((arrived, me, SignalOp::Add(1)));
            // SAFETY: as above, on the stand-in of another node; `input` stays unchanged until
            // the rank's quiet after the launch.
            unsafe {
                p.put_rows(gathered.ptr() + at, k, peer, input + row * k, k, (len, k), signal)?
            };
        }
    }
    Ok(())
}

/// The communication part, forwarding: each chunk of a shard of another node that this rank
/// receives for its node, as soon as it lands, copied into the `gathered` buffer of the other
/// ranks of the node, with its signal. One program per shard, in chunk order.
fn forward_rows<A: Element>(
    p: &crate::device::Program<'_>,
    gathered: &SymmBuf<A>,
    arrived: &SignalBuf,
    chunks: &Chunking<'_>,
    routes: &GatherRoutes,
    before: &[u64],
) -> Result<()> {
    let (rows, k) = (chunks.rows, chunks.k);
    for i in p.tasks(routes.forwards.len()) {
        let s = routes.forwards[i];
        for c in 0..chunks.count(s, true) {
            let want = WaitCmp::Ge(before[s] + c as u64 + 1);
            let token = p.wait_from(arrived, s, s, want, WaitSem::Acquire)?;
            let (row, len) = chunks.chunk(s, c, true);
            let at = (rows.offset(s) + row) * k;
            let from = GlobalPtr::from(consume_token(gathered.ptr(), token)) + at;
            for &peer in &routes.neighbours {
                // SAFETY: the chunk landed here (its signal was acquired); only this rank writes
                // shard `s`'s rows on its node's other ranks, each chunk once, and they read them
                // only after the chunk count.
                unsafe { tile::copy_2d(symm_at(gathered, peer) + at, k, from, k, (len, k)) };
                p.notify(arrived, s, peer, SignalOp::Add(1), Scope::Peer, NotifySem::Release)?;
            }
        }
    }
    Ok(())
}
