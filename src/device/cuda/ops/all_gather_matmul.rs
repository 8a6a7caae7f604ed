//! `all_gather(x) @ w` on GPUs, fused, and its unfused baseline (NCCL all_gather, then cuBLASLt).
//!
//! Two paths, chosen by shape (`all_gather_matmul_path`) or asked for through the call's options
//! (`fused::AgPath`):
//! - `gather` (few rows per rank, as in decoding): one `dt_exchange` kernel pushes this rank's
//!   rows into every rank's symmetric gather buffer (microseconds), then one GEMM per weight over
//!   all rows, so each weight is read once. The buffer is double: a call writes the half its
//!   epoch's parity names, which every peer last read two calls ago, before it signalled (in
//!   the last call) that this rank's rows had arrived; so the kernel needs no hand-shake before
//!   it writes, only one after (every peer's rows are here). (A version that published the
//!   buffer, waited for every peer's, pushed and hand-shook again was no faster on two H200s.)
//! - `overlap` (many rows): copy engines push this rank's rows into every peer's gather buffer on
//!   the high-priority copy stream while the compute stream multiplies this rank's own rows in
//!   place; then, per peer, a one-thread `dt_signal` waits for that peer's rows and the next GEMM
//!   runs. Copies use no multiprocessors, so the GEMMs keep the whole GPU. (Multiplying only part
//!   of the own rows first, about as long as the peers' rows take to arrive, then the rest in one
//!   GEMM, was no faster on two H200s.)

use super::{SMALL_CHUNK_BYTES, copy, exchange, offsets, out_tensor, signal};
use crate::device::cuda::all_gather_matmul_path;
use crate::device::cuda::blas;
use crate::device::cuda::kernels::{MAX_RANKS, Runs};
use crate::device::cuda::storage::{DeviceStorage, Home};
use crate::device::cuda::world::{CudaRank, OP_ALL_GATHER_MATMUL};
use crate::device::path::AgPath;
use crate::tensor::Element;
use crate::{Error, Result};

const OP: &str = "all_gather_matmul";

/// Checks the weights against `k` (stored `[n, k]` where `transposed`); the problem, if any.
fn weight_problem<T: Element>(
    k: usize,
    ws: &[&DeviceStorage<T>],
    transposed: bool,
) -> Option<String> {
    let (at, expected) = if transposed { (1, "[n, k]") } else { (0, "[k, n]") };
    ws.iter().enumerate().find_map(|(i, w)| {
        (w.shape().len() != 2 || w.shape()[at] != k).then(|| {
            format!("weight {i} has shape {:?}; expected {expected} with k = {k}", w.shape())
        })
    })
}

/// The output columns of weight `w`.
fn columns<T: Element>(w: &DeviceStorage<T>, transposed: bool) -> usize {
    w.shape()[usize::from(!transposed)]
}

/// The fused op: `x` is this rank's `[splits[rank], K]` rows, each of `ws` this rank's `[K, n_j]`;
/// returns `[M, n_j]` per weight.
pub(crate) fn all_gather_matmul<T: Element>(
    g: &CudaRank<'_>,
    x: &DeviceStorage<T>,
    splits: &[usize],
    ws: &[&DeviceStorage<T>],
    transposed: bool,
    forced: Option<AgPath>,
) -> Result<Vec<DeviceStorage<T>>> {
    g.check()?;
    let (n, r) = (g.num_ranks(), g.rank);
    let k = x.shape()[1];
    let path = match forced {
        Some(path) if n > 1 => path,
        _ => all_gather_matmul_path(splits),
    };
    // The caller agreed K, the weights and every rank's rows through the world's one exchange;
    // the path is a function of the rows, so every rank takes the same one.
    if let Some(reason) = weight_problem(k, ws, transposed) {
        return Err(Error::InvalidShape { op: OP, reason });
    }
    let off = offsets(splits);
    let m = off[n];
    let es = size_of::<T>();
    let outs: Vec<DeviceStorage<T>> =
        ws.iter().map(|w| out_tensor(g, &[m, columns(w, transposed)])).collect::<Result<_>>()?;
    let gemm = |a: u64, rows: usize, row0: usize| -> Result<()> {
        for (w, out) in ws.iter().zip(&outs) {
            let nj = columns(w, transposed);
            blas::matmul(
                g.gpu(),
                g.stream(),
                (a, w.ptr(), out.ptr() + (row0 * nj * es) as u64),
                (rows, nj, k),
                blas::Transposed { a: false, b: transposed },
                T::DTYPE,
                T::DTYPE,
            )?;
        }
        Ok(())
    };
    match path {
        AgPath::Local => gemm(x.ptr(), m, 0)?,
        AgPath::Gather => g.with_state("all_gather_matmul.gather", |st| {
            st.epoch += 1;
            let half = m * k * es;
            let buf = g.symmetric(st, "gathered", 2 * half)?;
            let parity = (st.epoch % 2) as usize;
            let at = |p: usize| g.symm_at(buf, p) + (parity * half) as u64;
            // Part i is rank (r + i) % n; each gets this rank's rows at its offset.
            let run = Runs::contiguous(splits[r] * k, 0, off[r] * k, es, SMALL_CHUNK_BYTES);
            let parts = vec![run; n];
            let peers: Vec<u64> = (0..n).map(|i| at((r + i) % n)).collect();
            let stream = g.stream();
            exchange::<T>(
                g,
                Some(st),
                OP_ALL_GATHER_MATMUL,
                2,
                0,
                x.ptr(),
                &parts,
                &peers,
                stream,
            )?;
            gemm(at(r), m, 0)
        })?,
        AgPath::Overlap => g.with_state("all_gather_matmul.overlap", |st| {
            st.epoch += 1;
            let epoch = st.epoch;
            let buf = g.symmetric(st, "gathered", m * k * es)?;
            let sync = g.sync_args(st);
            let (main, copies) = (g.stream(), g.copy_stream());
            let peers: Vec<usize> = (1..n).map(|i| (r + i) % n).collect();
            // Copy stream: once every peer's buffer is free of the last call, push our rows.
            g.join(st, 0, main, copies)?;
            let free: Vec<(u64, u64)> =
                peers.iter().map(|&p| (sync.done + 8 * p as u64, (MAX_RANKS + p) as u64)).collect();
            signal(g, OP_ALL_GATHER_MATMUL, copies, epoch - 1, &free, 0, &[])?;
            for &p in &peers {
                let dst = g.symm_at(buf, p) + (off[r] * k * es) as u64;
                copy(dst, x.ptr(), splits[r] * k * es, copies)?;
            }
            let ready: Vec<u64> =
                peers.iter().map(|&p| sync.ready_peer[p] + 8 * r as u64).collect();
            signal(g, OP_ALL_GATHER_MATMUL, copies, 0, &[], epoch, &ready)?;
            // Compute stream: own rows in place, then each peer's as they arrive (the nearest
            // sender first: rank r - i pushes to us as its i-th target).
            gemm(x.ptr(), splits[r], off[r])?;
            for i in 1..n {
                let src = (r + n - i) % n;
                signal(
                    g,
                    OP_ALL_GATHER_MATMUL,
                    main,
                    epoch,
                    &[(sync.ready + 8 * src as u64, src as u64)],
                    0,
                    &[],
                )?;
                let rows = g.symm_at(buf, r) + (off[src] * k * es) as u64;
                gemm(rows, splits[src], off[src])?;
            }
            // `x` is read by the copies until they finish; later work on `x` waits for them.
            g.join(st, 1, copies, main)?;
            // Our products are done with the buffer: peers may push into it again.
            g.join(st, 2, main, copies)?;
            let done: Vec<u64> = peers.iter().map(|&p| sync.done_peer[p] + 8 * r as u64).collect();
            signal(g, OP_ALL_GATHER_MATMUL, copies, 0, &[], epoch, &done)
        })?,
    }
    Ok(outs)
}

/// The unfused baseline: NCCL all_gather of the rows, then one cuBLASLt GEMM per weight. In a
/// world whose ranks share a GPU (which NCCL refuses) the gather is the world's own all_gather.
pub(crate) fn all_gather_matmul_unfused<T: Element>(
    g: &CudaRank<'_>,
    x: &DeviceStorage<T>,
    splits: &[usize],
    ws: &[&DeviceStorage<T>],
    transposed: bool,
) -> Result<Vec<DeviceStorage<T>>> {
    g.check()?;
    let (n, r) = (g.num_ranks(), g.rank);
    let k = x.shape()[1];
    if let Some(reason) = weight_problem(k, ws, transposed) {
        return Err(Error::InvalidShape { op: OP, reason });
    }
    let off = offsets(splits);
    let m = off[n];
    let es = size_of::<T>();
    let gathered = if n == 1 {
        x.clone()
    } else if g.world.shares_devices() {
        super::collectives::all_gather(g, x, 0, splits)?
    } else {
        let gathered: DeviceStorage<T> = out_tensor(g, &[m, k])?;
        let nccl = g.world.nccl()?;
        if splits.iter().all(|&s| s == splits[0]) {
            nccl.all_gather(r, g.stream(), T::DTYPE, x.ptr(), gathered.ptr(), splits[r] * k)?;
        } else {
            let send = vec![(x.ptr(), splits[r] * k); n];
            let recv: Vec<(u64, usize)> = (0..n)
                .map(|p| (gathered.ptr() + (off[p] * k * es) as u64, splits[p] * k))
                .collect();
            nccl.send_recv(r, g.stream(), T::DTYPE, &send, &recv)?;
        }
        gathered
    };
    ws.iter()
        .map(|w| {
            let nj = columns(w, transposed);
            let out: DeviceStorage<T> = out_tensor(g, &[m, nj])?;
            blas::matmul(
                g.gpu(),
                g.stream(),
                (gathered.ptr(), w.ptr(), out.ptr()),
                (m, nj, k),
                blas::Transposed { a: false, b: transposed },
                T::DTYPE,
                T::DTYPE,
            )?;
            Ok(out)
        })
        .collect()
}

/// A local GEMM `a[m, k] @ b[k, n]` on this rank's GPU: the one-GPU ceiling of the report, and
/// `Tensor::matmul` for tensors on a GPU.
pub(crate) fn matmul<T: Element>(
    a: &DeviceStorage<T>,
    b: &DeviceStorage<T>,
    home: Home,
) -> Result<DeviceStorage<T>> {
    let gpu = a.gpu();
    let (sa, sb) = (a.shape(), b.shape());
    if sa.len() != 2 || sb.len() != 2 {
        return Err(Error::InvalidShape {
            op: "Tensor::matmul",
            reason: format!("expected 2-D tensors, got {sa:?} and {sb:?}"),
        });
    }
    if sa[1] != sb[0] {
        return Err(Error::InnerDimMismatch {
            op: "Tensor::matmul",
            rank: 0,
            left: sa.to_vec(),
            right: sb.to_vec(),
            left_global: None,
        });
    }
    if a.ordinal() != b.ordinal() {
        return Err(Error::InvalidArgument {
            op: "Tensor::matmul",
            rank: 0,
            reason: format!(
                "operands on different devices: cuda:{} and cuda:{}",
                a.ordinal(),
                b.ordinal()
            ),
        });
    }
    gpu.bind()?;
    let out = DeviceStorage::uninit(gpu, &[sa[0], sb[1]], home)?;
    blas::matmul(
        gpu,
        out.stream(),
        (a.ptr(), b.ptr(), out.ptr()),
        (sa[0], sb[1], sa[1]),
        blas::Transposed::default(),
        T::DTYPE,
        T::DTYPE,
    )?;
    Ok(out)
}
