//! The ops on GPUs, one file each: the fused ops with their unfused baselines (NCCL, then
//! cuBLASLt), and the collectives. Each takes this rank's device tensors and returns new ones.
//!
//! Every op is collective. The fused ops are called after the caller (`fused::*::run`) agreed
//! their shapes through the world's one exchange; the collectives agree their own words through
//! that same exchange ([`agree`]), so a bad argument on one rank fails every rank at once and
//! mismatched calls are an error instead of a hang.

pub(crate) mod all_gather_matmul;
pub(crate) mod all_to_all;
pub(crate) mod collectives;
pub(crate) mod flash_decode;
pub(crate) mod matmul_reduce_scatter;

use cudarc::driver::{result as cu, sys};

use super::driver::Check;
use super::kernels::{self, ExchangeArgs, MAX_RANKS, ReduceArgs, Runs, SignalArgs, Source};
use super::storage::DeviceStorage;
use super::world::{CudaRank, OpState};
use crate::Result;
use crate::shmem::{Call, Exchanged};
use crate::tensor::{DType, Element};

/// Bytes each task of a data-moving kernel moves at most.
pub(crate) const CHUNK_BYTES: usize = 16 << 10;
/// Smaller tasks for latency-bound moves (a few MiB, as in decoding): more warps in flight.
pub(crate) const SMALL_CHUNK_BYTES: usize = 4 << 10;

/// Start offsets of shards of the given sizes, and the total.
pub(crate) fn offsets(splits: &[usize]) -> Vec<usize> {
    let mut o = Vec::with_capacity(splits.len() + 1);
    let mut acc = 0;
    o.push(0);
    for &s in splits {
        acc += s;
        o.push(acc);
    }
    o
}

/// `numpy.array_split` sizes: the first `len % n` parts get one more.
pub(crate) fn array_split(len: usize, n: usize) -> Vec<usize> {
    (0..n).map(|r| len / n + usize::from(r < len % n)).collect()
}

/// Tells every rank `words` for call `op` through the world's one exchange (the same as every
/// other world's: ranks in different calls fail with [`Error::OpMismatch`](crate::Error)), and
/// fails every rank if any had a `problem`; returns every rank's words.
pub(crate) fn agree(
    g: &CudaRank<'_>,
    op: &'static str,
    words: &[u64],
    problem: Option<String>,
) -> Result<Exchanged> {
    g.host()?.exchange(Call::untyped(op), words, problem, &[])
}

/// The watch new tensors of this rank carry.
pub(crate) fn out_tensor<T: Element>(
    g: &CudaRank<'_>,
    shape: &[usize],
) -> Result<DeviceStorage<T>> {
    DeviceStorage::uninit(g.gpu(), shape, g.home())
}

/// Launches `dt_exchange`: `parts[i]` are the runs for rank (rank + i) % world; `peers[i]` that
/// rank's output in mode 2 (empty otherwise).
#[allow(clippy::too_many_arguments)] // the kernel's arguments, named at each call
pub(crate) fn exchange<T: Element>(
    g: &CudaRank<'_>,
    state: Option<&OpState>,
    op: u32,
    mode: u32,
    mine: u64,
    local: u64,
    parts: &[Runs],
    peers: &[u64],
    stream: sys::CUstream,
) -> Result<()> {
    assert!(parts.len() <= MAX_RANKS);
    let f = kernels::function(g.gpu(), Source::Exchange, T::DTYPE, "dt_exchange")?;
    let mut args = ExchangeArgs {
        ctl: g.ctl(op),
        mode,
        nparts: parts.len() as u32,
        mine,
        local,
        ..ExchangeArgs::default()
    };
    if let Some(state) = state {
        args.sync = g.sync_args(state);
        // Peers read the published input: it must be memory they have mapped.
        args.mine = g.publishable(state, mine, stream)?;
    }
    for (i, r) in parts.iter().enumerate() {
        args.runs[i] = *r;
        args.prefix[i + 1] = args.prefix[i] + r.tasks();
    }
    args.peers[..peers.len()].copy_from_slice(peers);
    let grid = g.grid_for(f, args.prefix[parts.len()]);
    kernels::launch(f, grid, kernels::BLOCK, stream, &args)
}

/// Launches `dt_reduce` (see reduce.cu for the modes).
#[allow(clippy::too_many_arguments)] // the kernel's arguments, named at each call
pub(crate) fn reduce<T: Element>(
    g: &CudaRank<'_>,
    state: &OpState,
    op: u32,
    mode: u32,
    mine: u64,
    out: u64,
    parts: &[u64],
    runs: Runs,
    stream: sys::CUstream,
) -> Result<()> {
    let f = kernels::function(g.gpu(), Source::Reduce, T::DTYPE, "dt_reduce")?;
    let mut args = ReduceArgs {
        ctl: g.ctl(op),
        sync: g.sync_args(state),
        mode,
        world: g.num_ranks() as u32,
        // Peers read the published input: it must be memory they have mapped.
        mine: g.publishable(state, mine, stream)?,
        out,
        runs,
        ..ReduceArgs::default()
    };
    args.parts[..parts.len()].copy_from_slice(parts);
    let grid = g.grid_for(f, runs.tasks());
    kernels::launch(f, grid, kernels::BLOCK, stream, &args)
}

/// Launches `dt_signal` on `stream`: wait until every `waits` word (with its signal number) is
/// at least `want`, then set every `notifies` word to `value`.
pub(crate) fn signal(
    g: &CudaRank<'_>,
    op: u32,
    stream: sys::CUstream,
    want: u64,
    waits: &[(u64, u64)],
    value: u64,
    notifies: &[u64],
) -> Result<()> {
    let f = kernels::function(g.gpu(), Source::Signal, DType::F32, "dt_signal")?;
    let mut args = SignalArgs {
        ctl: g.ctl(op),
        want,
        value,
        n_wait: waits.len() as u32,
        n_notify: notifies.len() as u32,
        ..SignalArgs::default()
    };
    for (i, &(w, index)) in waits.iter().enumerate() {
        args.wait[i] = w;
        args.wait_index[i] = index;
    }
    args.notify[..notifies.len()].copy_from_slice(notifies);
    kernels::launch(f, 1, 32, stream, &args)
}

/// Asynchronous device-to-device copy of `bytes` (peer addresses go over NVLink by copy engine).
pub(crate) fn copy(dst: u64, src: u64, bytes: usize, stream: sys::CUstream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: both ranges are device memory of at least `bytes`, reachable from this context.
    unsafe { cu::memcpy_dtod_async(dst, src, bytes, stream) }.check("cuMemcpyDtoDAsync")
}
