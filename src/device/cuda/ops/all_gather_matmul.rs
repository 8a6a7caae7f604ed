//! `all_gather(x) @ w` on GPUs, fused, and its unfused baseline (NCCL all_gather, then cuBLASLt).
//!
//! Two paths, chosen by shape and reported by `all_gather_matmul_path`:
//! - `gather` (few rows per rank, as in decoding): one `dt_exchange` kernel pushes this rank's
//!   rows into every rank's symmetric gather buffer (microseconds), then one GEMM per weight over
//!   all rows, so each weight is read once. The buffer is double: a call writes the half its
//!   epoch's parity names, which every peer last read two calls ago, before it signalled (in
//!   the last call) that this rank's rows had arrived; so the kernel needs no hand-shake before
//!   it writes, only one after (every peer's rows are here). (The first version published the
//!   buffer, waited for every peer's, pushed, and hand-shook again: 0.107 ms against 0.103 for
//!   M=256 K=8192 N_local=14336 on two H200s, in the same run.)
//! - `overlap` (many rows): copy engines push this rank's rows into every peer's gather buffer on
//!   the high-priority copy stream while the compute stream multiplies the first of this rank's
//!   own rows in place (`all_gather_matmul_first_rows`: about as long as the peers' rows take to
//!   arrive); the copy stream then copies the rest of the own rows into the gather buffer, and
//!   once every peer's rows are here (a one-thread `dt_signal`) one GEMM multiplies all the other
//!   rows, at the efficiency of a large product. Copies use no multiprocessors, so the GEMMs keep
//!   the whole GPU.

use super::{
    SMALL_CHUNK_BYTES, agree, copy, exchange, offsets, out_tensor, same_everywhere, signal,
};
use crate::device::cuda::blas;
use crate::device::cuda::kernels::{MAX_RANKS, Runs};
use crate::device::cuda::storage::{DeviceData, Home};
use crate::device::cuda::world::{GpuRank, OP_ALL_GATHER_MATMUL};
use crate::device::cuda::{all_gather_matmul_first_rows, all_gather_matmul_path, path_code};
use crate::tensor::Element;
use crate::{Error, Result};

const OP: &str = "all_gather_matmul";

/// Checks the weights against `k`; the problem, if any, for the agreement exchange.
fn weight_problem<T: Element>(k: usize, ws: &[&DeviceData<T>]) -> Option<String> {
    ws.iter().enumerate().find_map(|(i, w)| {
        (w.shape().len() != 2 || w.shape()[0] != k)
            .then(|| format!("weight {i} has shape {:?}; expected [{k}, n]", w.shape()))
    })
}

/// The rows of `[0, m)` outside `[start, end)`, as at most two ranges.
fn outside(m: usize, (start, end): (usize, usize)) -> Vec<(usize, usize)> {
    [(0, start), (end, m)].into_iter().filter(|&(a, b)| b > a).collect()
}

/// The fused op: `x` is this rank's `[splits[rank], K]` rows, each of `ws` this rank's `[K, n_j]`;
/// returns `[M, n_j]` per weight.
pub(crate) fn all_gather_matmul<T: Element>(
    g: &GpuRank<'_>,
    x: &DeviceData<T>,
    splits: &[usize],
    ws: &[&DeviceData<T>],
) -> Result<Vec<DeviceData<T>>> {
    g.check()?;
    let (n, r) = (g.num_ranks(), g.rank);
    let k = x.shape()[1];
    let path = all_gather_matmul_path(splits);
    let words = [k as u64, ws.len() as u64, path_code(path)];
    let all = agree(g, OP, OP_ALL_GATHER_MATMUL, &words, weight_problem(k, ws))?;
    same_everywhere(OP, &all, 0, "K")?;
    same_everywhere(OP, &all, 1, "number of weights")?;
    same_everywhere(OP, &all, 2, "path")?;
    let off = offsets(splits);
    let m = off[n];
    let es = size_of::<T>();
    let outs: Vec<DeviceData<T>> =
        ws.iter().map(|w| out_tensor(g, &[m, w.shape()[1]])).collect::<Result<_>>()?;
    // Rows `rows` of the gathered input, starting at `a`, times every weight, into the outputs.
    let gemm = |a: u64, (row0, row1): (usize, usize)| -> Result<()> {
        for (w, out) in ws.iter().zip(&outs) {
            let nj = w.shape()[1];
            blas::matmul(
                g.gpu(),
                g.stream(),
                (a, w.ptr(), out.ptr() + (row0 * nj * es) as u64),
                (row1 - row0, nj, k),
                T::DTYPE,
                T::DTYPE,
            )?;
        }
        Ok(())
    };
    match path {
        "local" => gemm(x.ptr(), (0, m))?,
        "gather" => g.with_state("all_gather_matmul.gather", |st| {
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
            gemm(at(r), (0, m))
        })?,
        _ => g.with_state("all_gather_matmul.overlap", |st| {
            st.epoch += 1;
            let epoch = st.epoch;
            let buf = g.symmetric(st, "gathered", m * k * es)?;
            let sync = g.sync_args(st);
            let (main, copies) = (g.stream(), g.copy_stream());
            let peers: Vec<usize> = (1..n).map(|i| (r + i) % n).collect();
            let own = splits[r];
            let n_total: usize = ws.iter().map(|w| w.shape()[1]).sum();
            let first = all_gather_matmul_first_rows(own, m - own, k, n_total, es);
            // The first rows sit at the end of the own block that leaves the rest contiguous
            // where it can (rank 0: its first rows; the last rank: its last rows).
            let firsts = if r + 1 == n && r > 0 {
                (off[r + 1] - first, off[r + 1])
            } else {
                (off[r], off[r] + first)
            };
            let rest = outside(m, firsts);
            let mine = g.symm_at(buf, r);
            let row_at = |base: u64, row: usize| base + (row * k * es) as u64;
            // Copy stream: once every peer's buffer is free of the last call, push our rows.
            g.join(st, 0, main, copies)?;
            let free: Vec<(u64, u64)> =
                peers.iter().map(|&p| (sync.done + 8 * p as u64, (MAX_RANKS + p) as u64)).collect();
            signal(g, OP_ALL_GATHER_MATMUL, copies, epoch - 1, &free, 0, &[])?;
            for &p in &peers {
                copy(row_at(g.symm_at(buf, p), off[r]), x.ptr(), own * k * es, copies)?;
            }
            let ready: Vec<u64> =
                peers.iter().map(|&p| sync.ready_peer[p] + 8 * r as u64).collect();
            signal(g, OP_ALL_GATHER_MATMUL, copies, 0, &[], epoch, &ready)?;
            // Then the own rows the rest's GEMMs read from the gather buffer.
            for &(a, b) in &rest {
                let (a, b) = (a.max(off[r]), b.min(off[r + 1]));
                if b > a {
                    copy(row_at(mine, a), row_at(x.ptr(), a - off[r]), (b - a) * k * es, copies)?;
                }
            }
            // Compute stream: the first own rows in place, then the rest once it is here.
            gemm(row_at(x.ptr(), firsts.0 - off[r]), firsts)?;
            g.join(st, 3, copies, main)?;
            for &(a, b) in &rest {
                let waits: Vec<(u64, u64)> = peers
                    .iter()
                    .filter(|&&p| off[p] < b && off[p + 1] > a && splits[p] > 0)
                    .map(|&p| (sync.ready + 8 * p as u64, p as u64))
                    .collect();
                if !waits.is_empty() {
                    signal(g, OP_ALL_GATHER_MATMUL, main, epoch, &waits, 0, &[])?;
                }
                gemm(row_at(mine, a), (a, b))?;
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

/// The unfused baseline: NCCL all_gather of the rows, then one cuBLASLt GEMM per weight.
pub(crate) fn all_gather_matmul_unfused<T: Element>(
    g: &GpuRank<'_>,
    x: &DeviceData<T>,
    splits: &[usize],
    ws: &[&DeviceData<T>],
) -> Result<Vec<DeviceData<T>>> {
    g.check()?;
    let (n, r) = (g.num_ranks(), g.rank);
    let k = x.shape()[1];
    let all =
        agree(g, OP, OP_ALL_GATHER_MATMUL, &[k as u64, ws.len() as u64], weight_problem(k, ws))?;
    same_everywhere(OP, &all, 0, "K")?;
    let off = offsets(splits);
    let m = off[n];
    let es = size_of::<T>();
    let gathered = if n == 1 {
        x.clone()
    } else {
        let gathered: DeviceData<T> = out_tensor(g, &[m, k])?;
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
            let out: DeviceData<T> = out_tensor(g, &[m, w.shape()[1]])?;
            blas::matmul(
                g.gpu(),
                g.stream(),
                (gathered.ptr(), w.ptr(), out.ptr()),
                (m, w.shape()[1], k),
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
    a: &DeviceData<T>,
    b: &DeviceData<T>,
    home: Home,
) -> Result<DeviceData<T>> {
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
    let out = DeviceData::uninit(gpu, &[sa[0], sb[1]], home)?;
    blas::matmul(
        gpu,
        out.stream(),
        (a.ptr(), b.ptr(), out.ptr()),
        (sa[0], sb[1], sa[1]),
        T::DTYPE,
        T::DTYPE,
    )?;
    Ok(out)
}
