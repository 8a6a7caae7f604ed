//! all_gather + matmul, fused: `[m_r, K]` row shards times a local `[K, n_r]` weight give the
//! full `[M, n_r]` product, computing on each shard as soon as it arrives.
//!
//! On the host this is a tile kernel (see `device::host::all_gather_matmul`): the communication
//! part pushes the rows to every peer while the compute part multiplies each shard as it arrives.

use ndarray::{Array2, ArrayView2, CowArray, Ix2};

use super::operand::Operand;
use crate::collectives;
use crate::device::capability::{self, Feature, Op};
use crate::device::host::plan::{Shards, scratch};
use crate::device::host::schedule::{self, HostMachine, PathTaken, Schedule};
use crate::device::path::AgPath;
use crate::device::{Device, DeviceWorld, ascend, cuda, device_data, host};
use crate::shmem::{Call, Rank};
use crate::tensor::{Element, Tensor, matmul_into, pool};
use crate::{Error, Result};

const OP: &str = "all_gather_matmul";
const UNFUSED_OP: &str = "all_gather_matmul_unfused";
const MPI_OP: &str = "all_gather_matmul_unfused_mpi";
/// The most weights one call takes (metadata words are sized for them).
pub const MAX_WEIGHTS: usize = 16;

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
            let schedule = if fused {
                let shape = (&agreed.rows, agreed.k);
                Some(host::all_gather_matmul::path(rank, agreed.path, &agreed.machine, shape, &ws))
            } else {
                None
            };
            let out = if let Some((path, why)) = schedule {
                match path {
                    AgPath::Gather if rank.num_ranks() > 1 => {
                        gather_then_gemm(rank, agreed, x, &ws, keep_input)
                    }
                    _ => host::all_gather_matmul::all_gather_matmul(
                        rank,
                        (&agreed.rows, agreed.k),
                        x,
                        &ws,
                        keep_input,
                    )
                    .map(|(outputs, gathered)| AgMatmulOutput {
                        outputs,
                        row_counts: agreed.rows.counts().to_vec(),
                        col_counts: agreed.col_counts.clone(),
                        gathered,
                        device: rank.device(),
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
