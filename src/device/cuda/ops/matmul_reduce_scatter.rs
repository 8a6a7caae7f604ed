//! `reduce_scatter(a @ w)` on GPUs, fused, and its unfused baseline (cuBLASLt, then NCCL
//! reduce_scatter).
//!
//! Each rank computes the partial products of every rank's output rows in f32 (f64 for f64); a
//! `dt_reduce` kernel then sums the partials of this rank's rows in rank order (0, 1, ...) and
//! rounds once: bitwise the same on every run. Paths, reported by `matmul_reduce_scatter_path`:
//! - `chunked`: a GEMM per destination, the next peer's rows first; copy engines push each
//!   partial into its owner's symmetric buffer while the next partial is computed.
//! - `single` (few rows, as in decoding): one GEMM over all rows reads the weight once; the
//!   reduce kernel then reads every peer's partial of this rank's rows over NVLink (`symm_at` of
//!   the published partials), with no copy. Two alternatives measured slower or no faster on
//!   two H200s (docs/results/2026-11-30-gpu-2x-h200.md has the figures): blocks of columns, each block's
//!   reduce overlapping the next block's product on a second stream; and one kernel that pushes
//!   each peer its rows of the partial into a double buffer, then sums locally.
//!
//! The path is chosen by shape, or asked for through the call's options (`fused::RsPath`).

use super::{SMALL_CHUNK_BYTES, copy, offsets, out_tensor, reduce, signal};
use crate::device::cuda::blas::{self, dtype_bytes};
use crate::device::cuda::kernels::{MAX_RANKS, Runs};
use crate::device::cuda::matmul_reduce_scatter_path;
use crate::device::cuda::storage::DeviceStorage;
use crate::device::cuda::world::{CudaRank, OP_MATMUL_REDUCE_SCATTER};
use crate::device::path::RsPath;
use crate::tensor::{DType, Element};
use crate::{Error, Result};

const OP: &str = "matmul_reduce_scatter";

/// The problem with the operands' shapes, if any (`w` stored `[N, k]` where `transposed`).
fn shape_problem<T: Element>(
    a: &DeviceStorage<T>,
    w: &DeviceStorage<T>,
    transposed: bool,
) -> Option<String> {
    let (sa, sw) = (a.shape(), w.shape());
    let (at, expected) = if transposed { (1, "[N, k]") } else { (0, "[k, N]") };
    if sa.len() != 2 || sw.len() != 2 || sa[1] != sw[at] {
        Some(format!("a has shape {sa:?} and w {sw:?}; expected [M, k] and {expected}"))
    } else {
        None
    }
}

/// `(M, k, N)` of valid operands.
fn dims<T: Element>(
    a: &DeviceStorage<T>,
    w: &DeviceStorage<T>,
    transposed: bool,
) -> (usize, usize, usize) {
    (a.shape()[0], a.shape()[1], w.shape()[usize::from(!transposed)])
}

/// The type partial products accumulate in.
fn partial_type(d: DType) -> DType {
    if d == DType::F64 { DType::F64 } else { DType::F32 }
}

/// The fused op: `a` is this rank's `[M, k_r]` (a column shard), `w` its `[k_r, N]`; returns this
/// rank's `[splits[rank], N]` rows of the sum over ranks, `splits` being `array_split(M)`.
pub(crate) fn matmul_reduce_scatter<T: Element>(
    g: &CudaRank<'_>,
    a: &DeviceStorage<T>,
    w: &DeviceStorage<T>,
    transposed: bool,
    splits: &[usize],
    forced: Option<RsPath>,
) -> Result<DeviceStorage<T>> {
    g.check()?;
    let (n, r) = (g.num_ranks(), g.rank);
    let problem = shape_problem(a, w, transposed);
    let (m, kr, big_n) = if problem.is_none() { dims(a, w, transposed) } else { (0, 0, 0) };
    let path = match forced {
        Some(path) if n > 1 => path,
        _ => matmul_reduce_scatter_path(splits),
    };
    // The caller agreed M, N and every rank's rows through the world's one exchange; the path
    // is a function of the rows, so every rank takes the same one.
    if let Some(reason) = problem {
        return Err(Error::InvalidShape { op: OP, reason });
    }
    let off = offsets(splits);
    let es = size_of::<T>();
    let out: DeviceStorage<T> = out_tensor(g, &[splits[r], big_n])?;
    if n == 1 {
        blas::matmul(
            g.gpu(),
            g.stream(),
            (a.ptr(), w.ptr(), out.ptr()),
            (m, big_n, kr),
            blas::Transposed { a: false, b: transposed },
            T::DTYPE,
            T::DTYPE,
        )?;
        return Ok(out);
    }
    let pt = partial_type(T::DTYPE);
    let pb = dtype_bytes(pt);
    let product = |partials: u64, row0: usize, rows: usize| {
        blas::matmul(
            g.gpu(),
            g.stream(),
            (a.ptr() + (row0 * kr * es) as u64, w.ptr(), partials + (row0 * big_n * pb) as u64),
            (rows, big_n, kr),
            blas::Transposed { a: false, b: transposed },
            T::DTYPE,
            pt,
        )
    };
    if path == RsPath::Single {
        g.with_state("matmul_reduce_scatter.single", |st| {
            st.epoch += 1;
            let partials = g.local(st, "partials", m * big_n * pb)?;
            product(partials, 0, m)?;
            // Every rank sums its rows of every rank's partials, read in place.
            let runs =
                Runs::contiguous(splits[r] * big_n, off[r] * big_n, 0, pb, SMALL_CHUNK_BYTES);
            reduce::<T>(
                g,
                st,
                OP_MATMUL_REDUCE_SCATTER,
                3,
                partials,
                out.ptr(),
                &[],
                runs,
                g.stream(),
            )
        })?;
        return Ok(out);
    }
    let max_rows = splits.iter().copied().max().unwrap_or(0);
    g.with_state("matmul_reduce_scatter.chunked", |st| {
        st.epoch += 1;
        let epoch = st.epoch;
        // recv slot s holds rank s's partial of this rank's rows.
        let recv = g.symmetric(st, "received", n * max_rows * big_n * pb)?;
        let partials = g.local(st, "partials", m * big_n * pb)?;
        let sync = g.sync_args(st);
        let (main, copies) = (g.stream(), g.copy_stream());
        let rows_at = |d: usize| partials + (off[d] * big_n * pb) as u64;
        // Waits until `d` has summed our last push, pushes our partial of its rows, says so.
        let push = |d: usize| -> Result<()> {
            let free = [(sync.done + 8 * d as u64, (MAX_RANKS + d) as u64)];
            signal(g, OP_MATMUL_REDUCE_SCATTER, copies, epoch - 1, &free, 0, &[])?;
            let slot = g.symm_at(recv, d) + (r * max_rows * big_n * pb) as u64;
            copy(slot, rows_at(d), splits[d] * big_n * pb, copies)?;
            signal(
                g,
                OP_MATMUL_REDUCE_SCATTER,
                copies,
                0,
                &[],
                epoch,
                &[sync.ready_peer[d] + 8 * r as u64],
            )
        };
        for i in 1..n {
            let d = (r + i) % n;
            product(partials, off[d], splits[d])?;
            g.join(st, i, main, copies)?;
            push(d)?;
        }
        product(partials, off[r], splits[r])?;
        let parts: Vec<u64> = (0..n)
            .map(|s| {
                if s == r {
                    rows_at(r)
                } else {
                    g.symm_at(recv, r) + (s * max_rows * big_n * pb) as u64
                }
            })
            .collect();
        // The reduce kernel spins on every multiprocessor until the peers' partials are here; it
        // must not start before our own pushes are done, or it could starve their small signal
        // kernels of multiprocessors while every peer does the same (a deadlock seen on two
        // H200s). Waiting also keeps our partials unwritten until the copies have read them.
        g.join(st, 0, copies, main)?;
        let runs = Runs::contiguous(splits[r] * big_n, 0, 0, pb, SMALL_CHUNK_BYTES);
        reduce::<T>(g, st, OP_MATMUL_REDUCE_SCATTER, 2, 0, out.ptr(), &parts, runs, main)
    })?;
    Ok(out)
}

/// The unfused baseline: one cuBLASLt GEMM into the element type, then NCCL reduce_scatter. In a
/// world whose ranks share a GPU (which NCCL refuses) the reduction is the world's own.
pub(crate) fn matmul_reduce_scatter_unfused<T: Element>(
    g: &CudaRank<'_>,
    a: &DeviceStorage<T>,
    w: &DeviceStorage<T>,
    transposed: bool,
    splits: &[usize],
) -> Result<DeviceStorage<T>> {
    g.check()?;
    let (n, r) = (g.num_ranks(), g.rank);
    let problem = shape_problem(a, w, transposed);
    let (m, kr, big_n) = if problem.is_none() { dims(a, w, transposed) } else { (0, 0, 0) };
    if let Some(reason) = problem {
        return Err(Error::InvalidShape { op: OP, reason });
    }
    let off = offsets(splits);
    let es = size_of::<T>();
    let product: DeviceStorage<T> = out_tensor(g, &[m, big_n])?;
    blas::matmul(
        g.gpu(),
        g.stream(),
        (a.ptr(), w.ptr(), product.ptr()),
        (m, big_n, kr),
        blas::Transposed { a: false, b: transposed },
        T::DTYPE,
        T::DTYPE,
    )?;
    if n == 1 {
        return Ok(product);
    }
    if g.world.shares_devices() {
        // NCCL refuses ranks that share a GPU: the world's own reduction, summed in rank order.
        if splits == super::array_split(m, n) {
            return super::collectives::reduce_sum(g, &product, Some(0));
        }
        let sum = super::collectives::reduce_sum(g, &product, None)?;
        return super::collectives::slice(g, &sum, 0, off[r], splits[r]);
    }
    let out: DeviceStorage<T> = out_tensor(g, &[splits[r], big_n])?;
    let nccl = g.world.nccl()?;
    if splits.iter().all(|&s| s == splits[0]) {
        nccl.reduce_scatter(r, g.stream(), T::DTYPE, product.ptr(), out.ptr(), splits[r] * big_n)?;
    } else {
        let parts: Vec<(u64, usize)> = (0..n)
            .map(|p| (product.ptr() + (off[p] * big_n * es) as u64, splits[p] * big_n))
            .collect();
        nccl.reduce_to_each(r, g.stream(), T::DTYPE, &parts, out.ptr())?;
    }
    Ok(out)
}
