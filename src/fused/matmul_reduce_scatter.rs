//! matmul + reduce_scatter, fused: `[M, k_r]` column shards times local `[k_r, N]` weights,
//! summed over ranks, each rank keeping its own rows `[m_r, N]`.
//!
//! On the host this is a tile kernel (see `device::host::matmul_reduce_scatter`): partial
//! products go into symmetric memory tile by tile, and each rank adds its rows' partials in rank
//! order as they complete.

use ndarray::{Array2, ArrayView2, ShapeBuilder};

use super::operand::Operand;
use crate::collectives::{self, ReduceOp};
use crate::device::DeviceWorld;
use crate::device::capability::{self, Feature, Op};
use crate::device::device_data;
use crate::device::host::plan::{AccData, Shards, in_memory_order, scratch};
use crate::device::host::schedule::{self, PathTaken, Schedule};
use crate::device::path::RsPath;
use crate::device::{ascend, cuda, host};
use crate::shmem::{Call, Rank};
use crate::tensor::{Element, Tensor, array_split, matmul_into, pool};
use crate::{Error, Result};

const OP: &str = "matmul_reduce_scatter";
const UNFUSED_OP: &str = "matmul_reduce_scatter_unfused";
const MPI_OP: &str = "matmul_reduce_scatter_unfused_mpi";

/// Exchanges shapes and the output rows each rank keeps (`my_rows`), and checks them on every
/// rank; returns the row shards of the result and `N`.
fn agree<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    x: (usize, usize),
    w: (usize, usize),
    (my_rows, path, transposed): (usize, u64, bool),
    problem: Option<String>,
) -> Result<(Shards, usize, Option<RsPath>, bool)> {
    // Then the path the call's options ask for (0: by shape), the same on every rank, and
    // whether this rank's weight is transposed (the host's schedule looks at every rank's).
    let words =
        [x.0 as u64, x.1 as u64, w.0 as u64, w.1 as u64, my_rows as u64, path, transposed as u64];
    let all = rank.exchange(Call::of::<T>(op), &words, problem, &[])?;
    for (r, v) in all.iter().enumerate() {
        if v[1] != v[2] {
            return Err(Error::InnerDimMismatch {
                op: OP,
                rank: r,
                left: vec![v[0] as usize, v[1] as usize],
                right: vec![v[2] as usize, v[3] as usize],
                left_global: None,
            });
        }
    }
    let m = all.agree(OP, 0, "M (rows of x)")? as usize;
    let n = all.agree(OP, 3, "N (columns of w)")? as usize;
    let asked = all.agree(OP, 5, "path asked for")?;
    let path = [RsPath::Local, RsPath::Single, RsPath::Chunked]
        .into_iter()
        .find(|&p| RsPath::word(Some(p)) == asked);
    let counts: Vec<usize> = all.iter().map(|v| v[4] as usize).collect();
    if counts.iter().sum::<usize>() != m {
        return Err(Error::InvalidArgument {
            op,
            rank: rank.rank(),
            reason: format!(
                "the output rows the ranks keep, {counts:?}, add up to {}, not M = {m}",
                counts.iter().sum::<usize>()
            ),
        });
    }
    let transposed = all.iter().any(|v| v[6] != 0);
    Ok((Shards::new(counts), n, path, transposed))
}

/// This rank's rows of an `m`-row output split as `numpy.array_split` splits it.
fn array_split_rows(rank: &Rank<'_>, m: usize) -> usize {
    array_split(m, rank.num_ranks())[rank.rank()]
}

/// `sum over ranks of x_r @ w_r`, each rank keeping its rows (split as `numpy.array_split`
/// splits `M`): `x` is this rank's `[M, k_r]` (a column shard, or a partial sum with `k_r = K`),
/// `w` its `[k_r, N]`. Collective; bitwise deterministic.
///
/// `w` may be a transposed view (`w.t()` of an `[N, k_r]` matrix, as a backward pass has it):
/// a row-major weight is read in place by the tiles, and so is a column-major one in a product
/// of at most one tile of rows; in a longer product the host's schedule runs a column-major
/// weight through one GEMM ([`RsPath::Single`](crate::device::path::RsPath::Single)), which reads it in place
/// and packs each block of it once. Forced onto the tiles, it is copied once into row-major
/// order (each tile's GEMM packs its block of the weight, for every block of rows, and packs a
/// column-major block much slower than a row-major one), as is any other layout.
///
/// # Reduction order
/// On one node, `P_0 + P_1 + ... + P_{n-1}` in rank order (`P_s = x_s @ w_s`, summed in the
/// accumulator type: f32 for f16 and bf16, rounded once). Across nodes (a world joined by MPI,
/// feature `mpi`) each node sums its ranks' products in rank order, then the node sums are added
/// in node order: with one rank per node that is the same order (the same bits as one node);
/// with `k` ranks per node it is `(P_0 + ... + P_{k-1}) + (P_k + ... + P_{2k-1}) + ...`, which
/// differs in rounding only. Each world shape always adds in its order: the same bits every run.
///
/// # Errors
/// On every rank: [`Error::InnerDimMismatch`] naming the rank whose `w` does not fit its `x`;
/// [`Error::RanksDisagree`] when ranks have different `M` or `N`; and as every collective.
///
/// # Examples
/// ```
/// use dist_tensor::fused::matmul_reduce_scatter;
/// use dist_tensor::World;
/// use ndarray::array;
///
/// let outs = World::threads(2)?.run(|rank| {
///     let x = array![[1.0f32], [2.0], [3.0]]; // [M = 3, k_r = 1]
///     let w = array![[rank.rank() as f32 + 1.0, 1.0]];
///     matmul_reduce_scatter(rank, x.view(), w.view())
/// })?;
/// assert_eq!(outs[0], array![[3.0f32, 2.0], [6.0, 4.0]]); // rows 0..2 of the sum
/// assert_eq!(outs[1], array![[9.0f32, 6.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn matmul_reduce_scatter<'a, T: Element>(
    rank: &Rank<'_>,
    x: impl Into<Operand<'a, T>>,
    w: impl Into<Operand<'a, T>>,
) -> Result<Array2<T>> {
    public(rank, x.into(), w.into(), true)
}

/// `matmul_reduce_scatter` (or its unfused baseline) on any world, keeping `my_rows` rows of the
/// output on this rank (the ranks' rows, in rank order, must add up to `M`): the one place it
/// chooses its backend. In turn: the capability table (the features asked for, before any
/// exchange; the element type travels in the agreement exchange with `problem`, a problem this
/// rank found in its inputs, so that every rank fails together), the agreement exchange, then one
/// `match` on the world's backend; inputs move to the world's device once, here. Returns this
/// rank's rows (a tensor where the world computes) and every rank's row count.
pub(crate) fn run<'a, T: Element>(
    rank: &Rank<'_>,
    x: Operand<'a, T>,
    w: Operand<'a, T>,
    my_rows: usize,
    problem: Option<String>,
    fused: bool,
    path: Option<RsPath>,
) -> Result<(Tensor<T>, Vec<usize>)> {
    let op = if fused { OP } else { UNFUSED_OP };
    let device = rank.device();
    let mut features = Vec::new();
    if x.ndim() > 2 {
        features.push(Feature::NdInput);
    }
    if w.transposed() {
        features.push(Feature::TransposedWeight);
    }
    capability::check_features(Op::MatmulReduceScatter, device, &features)?;
    let problem = problem
        .or_else(|| capability::dtype_problem(Op::MatmulReduceScatter, device, T::DTYPE))
        .or_else(|| schedule::local_problem(rank, path == Some(RsPath::Local)));
    // Its own name in the exchange for the unfused baseline, as in all_gather_matmul's.
    let words = (my_rows, RsPath::word(path), w.transposed());
    let (rows, n, path, transposed) = agree::<T>(op, rank, x.dim(), w.dim(), words, problem)?;
    let host = |out: Array2<T>| Tensor::from_array(out.into_dyn());
    let ran = match rank.device_world() {
        DeviceWorld::Host => (|| {
            let (x, w) = (x.host()?, w.host()?);
            let (x, w) = (x.view(), w.view());
            if !fused {
                unfused(rank, x, w, &rows, n).map(host)
            } else {
                let (path, why) = match path {
                    Some(path) => (path, "asked for by the call's options".to_string()),
                    None => schedule::host_rs_path(rank.num_ranks(), rows.total(), transposed),
                };
                let out = match path {
                    RsPath::Single if rank.num_ranks() > 1 => single(rank, x, w, &rows, n),
                    _ => host::matmul_reduce_scatter::matmul_reduce_scatter(rank, &rows, n, x, w),
                };
                out.and_then(|out| {
                    let path = PathTaken::MatmulReduceScatter(path);
                    schedule::record(rank, Schedule { path, why })?;
                    Ok(host(out))
                })
            }
        })(),
        DeviceWorld::Ascend(world) => (|| {
            let npu = ascend::AscendRank { world, rank };
            let (x, w) = (x.host()?, w.host()?);
            let (x, w) = (x.view(), w.view());
            let out = if fused {
                ascend::launch::matmul_reduce_scatter(&npu, rows.counts(), n, x, w)
            } else {
                ascend::launch::matmul_reduce_scatter_unfused(&npu, rows.counts(), n, x, w)
            };
            out.map(host)
        })(),
        DeviceWorld::Cuda(gpus) => (|| {
            // A transposed weight is read in place (cuBLASLt's transpose flag).
            let (x, (w, transposed)) = (x.on_device_matrix(rank)?, w.on_device_stored(rank)?);
            let (x, w) = (device_data(&x), device_data(&w));
            cuda::matmul_reduce_scatter(gpus, rank, x, w, transposed, rows.counts(), fused, path)
                .map(Tensor::from_device_storage)
        })(),
    };
    ran.inspect_err(|e| rank.fail_after_agreeing(e)).map(|out| (out, rows.counts().to_vec()))
}

/// The public entry's tail: [`run`], then a host array.
fn public<'a, T: Element>(
    rank: &Rank<'_>,
    x: Operand<'a, T>,
    w: Operand<'a, T>,
    fused: bool,
) -> Result<Array2<T>> {
    let my_rows = array_split_rows(rank, x.dim().0);
    let (out, _) = run(rank, x, w, my_rows, None, fused, None)?;
    let out = out.into_host()?;
    Ok(out.into_array().into_dimensionality().expect("the output is 2-D"))
}

/// The unfused baseline: the local product on this rank's compute cores (rounded to `T`), then
/// [`collectives::reduce_scatter_cols`] over the rows.
///
/// # Errors
/// As [`matmul_reduce_scatter`].
///
/// # Examples
/// ```
/// use dist_tensor::fused::{matmul_reduce_scatter, matmul_reduce_scatter_unfused};
/// use dist_tensor::{Tensor, World};
/// World::threads(2)?.run(|rank| {
///     let x = Tensor::<f64>::random(&[5, 3], rank.rank() as u64);
///     let w = Tensor::<f64>::random(&[3, 4], 7 + rank.rank() as u64);
///     let (x, w) = (x.view2("x")?, w.view2("w")?);
///     let (a, b) = (matmul_reduce_scatter(rank, x, w)?, matmul_reduce_scatter_unfused(rank, x, w)?);
///     assert!((&a - &b).iter().all(|d| d.abs() < 1e-12));
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn matmul_reduce_scatter_unfused<'a, T: Element>(
    rank: &Rank<'_>,
    x: impl Into<Operand<'a, T>>,
    w: impl Into<Operand<'a, T>>,
) -> Result<Array2<T>> {
    public(rank, x.into(), w.into(), false)
}

/// The unfused baseline on the host, after the agreement.
fn unfused<T: Element>(
    rank: &Rank<'_>,
    x: ArrayView2<T>,
    w: ArrayView2<T>,
    rows: &Shards,
    n: usize,
) -> Result<Array2<T>> {
    let mut partial = scratch(UNFUSED_OP, (rows.total(), n))?;
    matmul_into(partial.view_mut(), x, w, false, rank.topology().aicore_num())?;
    let counts: Vec<usize> = rows.counts().iter().map(|&m| m * n).collect();
    let flat = partial.as_slice().expect("fresh array");
    let mine = collectives::reduce_scatter_cols(rank, flat, 1, &counts, ReduceOp::Sum)?;
    pool::give(partial.into_raw_vec_and_offset().0);
    Ok(Array2::from_shape_vec((rows.count(rank.rank()), n), mine).expect("m_r x N"))
}

/// [`RsPath::Single`] on the host: the unfused shape with the fused op's arithmetic: one GEMM over
/// all rows on this rank's computing cores, in the accumulator type, then
/// [`collectives::reduce_scatter_cols`], which adds the partials in rank order and rounds once.
/// The weight is read in its own memory order (a transposed one in place; a half type widened
/// in one contiguous pass, keeping that order): one GEMM packs each block of it once.
fn single<T: Element>(
    rank: &Rank<'_>,
    x: ArrayView2<T>,
    w: ArrayView2<T>,
    rows: &Shards,
    n: usize,
) -> Result<Array2<T>> {
    let (m, k) = (rows.total(), x.ncols());
    let x = x.as_standard_layout();
    let x_acc = AccData::new(OP, x.as_slice().expect("standard layout"))?;
    let x_acc = ArrayView2::from_shape((m, k), &x_acc).expect("M x k_r");
    let standard;
    let (w_data, [rs, cs]) = match in_memory_order(w) {
        Some(found) => found,
        None => {
            standard = w.as_standard_layout();
            (standard.as_slice().expect("standard layout"), [n, 1])
        }
    };
    let w_acc = AccData::new(OP, w_data)?;
    let w_acc = ArrayView2::from_shape((k, n).strides((rs, cs)), &w_acc).expect("k_r x N");
    let mut partial = scratch::<T::Acc>(OP, (m, n))?;
    matmul_into(partial.view_mut(), x_acc, w_acc, false, rank.topology().aicore_num())?;
    let counts: Vec<usize> = rows.counts().iter().map(|&c| c * n).collect();
    let flat = partial.as_slice().expect("fresh array");
    let mine = collectives::reduce_scatter_cols(rank, flat, 1, &counts, ReduceOp::Sum)?;
    pool::give(partial.into_raw_vec_and_offset().0);
    let mine: Vec<T> = mine.into_iter().map(T::from_acc).collect();
    Ok(Array2::from_shape_vec((rows.count(rank.rank()), n), mine).expect("m_r x N"))
}

/// The unfused baseline as a user of MPI writes it: the local product on this rank's compute
/// cores, then `MPI_Reduce_scatter` over the rows (run by the proxy, see
/// [`World::from_env`](crate::World::from_env)). f32 and f64 are summed by MPI as they are; f16
/// and bf16 products are widened to f32 for MPI (it has no half types) and rounded once after.
/// MPI picks the order of the sum: close to [`matmul_reduce_scatter`], not bitwise equal.
///
/// # Errors
/// As [`matmul_reduce_scatter`]; [`Error::InvalidArgument`] in a world not joined by MPI
/// (feature `mpi`, started by mpirun), which has no MPI collective to run.
///
/// # Examples
/// ```
/// use dist_tensor::fused::matmul_reduce_scatter_unfused_mpi;
/// use dist_tensor::World;
/// use ndarray::array;
/// let err = World::threads(1)?.run(|rank| {
///     let x = array![[1.0f64]];
///     Ok(matmul_reduce_scatter_unfused_mpi(rank, x.view(), x.view()).unwrap_err())
/// })?;
/// assert!(err[0].to_string().contains("needs a world joined by MPI"), "{}", err[0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn matmul_reduce_scatter_unfused_mpi<'a, T: Element>(
    rank: &Rank<'_>,
    x: impl Into<Operand<'a, T>>,
    w: impl Into<Operand<'a, T>>,
) -> Result<Array2<T>> {
    let (x, w) = (x.into(), w.into());
    let my_rows = array_split_rows(rank, x.dim().0);
    // MPI runs on host memory: device operands come to the host first (a failure travels in
    // the agreement, so that every rank fails together).
    let host = x.host().and_then(|x| Ok((x, w.host()?)));
    let problem = host.as_ref().err().map(ToString::to_string);
    let words = (my_rows, 0, w.transposed());
    let (rows, n, ..) = agree::<T>(MPI_OP, rank, x.dim(), w.dim(), words, problem)?;
    let (x, w) = host.expect("a problem fails the agreement");
    let (x, w) = (x.view(), w.view());
    let mut partial =
        scratch(MPI_OP, (rows.total(), n)).inspect_err(|e| rank.fail_after_agreeing(e))?;
    matmul_into(partial.view_mut(), x, w, false, rank.topology().aicore_num())?;
    let counts: Vec<usize> = rows.counts().iter().map(|&m| m * n).collect();
    let partial = partial.into_raw_vec_and_offset().0;
    let mine = match T::DTYPE {
        crate::DType::F32 | crate::DType::F64 => rank.mpi_reduce_scatter(partial, &counts)?,
        _ => {
            let wide: Vec<f32> = partial.iter().map(|v| v.to_f64() as f32).collect();
            pool::give(partial);
            let sum = rank.mpi_reduce_scatter(wide, &counts)?;
            sum.iter().map(|&v| T::from_f64(f64::from(v))).collect()
        }
    };
    Ok(Array2::from_shape_vec((rows.count(rank.rank()), n), mine).expect("m_r x N"))
}
