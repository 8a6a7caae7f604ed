//! Collectives on GPUs, as `dt_exchange` / `dt_reduce` kernels in pull mode: every rank publishes
//! its input's address, then reads its peers' inputs over NVLink. all_gather (any dim), reduce
//! (all_reduce and reduce_scatter along any dim, summed in rank order), broadcast, a device
//! barrier, and the local slice a `Replicate -> Shard` redistribution takes.

use super::{CHUNK_BYTES, agree, exchange, offsets, out_tensor, reduce};
use crate::device::cuda::kernels::Runs;
use crate::device::cuda::storage::DeviceStorage;
use crate::device::cuda::world::{CudaRank, OP_ALL_GATHER, OP_BARRIER, OP_BROADCAST, OP_REDUCE};
use crate::tensor::Element;
use crate::{Error, Result};

fn outer_inner(shape: &[usize], dim: usize) -> (usize, usize) {
    (shape[..dim].iter().product(), shape[dim + 1..].iter().product())
}

/// A device barrier: a kernel on every rank that publishes, waits for every peer, and ends when
/// all have. Work queued after it on any rank starts after every rank reached it.
pub(crate) fn barrier(g: &CudaRank<'_>) -> Result<()> {
    g.check()?;
    agree(g, "barrier", &[], None)?;
    if g.num_ranks() == 1 {
        return Ok(());
    }
    let parts = vec![Runs::default(); g.num_ranks()];
    g.with_state("barrier", |st| {
        st.epoch += 1;
        exchange::<f32>(g, Some(st), OP_BARRIER, 1, 0, 0, &parts, &[], g.stream())
    })
}

/// Concatenates every rank's `x` along `dim` (sizes `splits`), on every rank.
pub(crate) fn all_gather<T: Element>(
    g: &CudaRank<'_>,
    x: &DeviceStorage<T>,
    dim: usize,
    splits: &[usize],
) -> Result<DeviceStorage<T>> {
    g.check()?;
    let shape = x.shape().to_vec();
    let problem = (dim >= shape.len()).then(|| format!("dim {dim} of a {}-D tensor", shape.len()));
    let all = agree(g, "all_gather", &[dim as u64, shape.len() as u64], problem)?;
    all.agree("all_gather", 0, "dim")?;
    let (n, r) = (g.num_ranks(), g.rank);
    let off = offsets(splits);
    let mut out_shape = shape.clone();
    out_shape[dim] = off[n];
    if n == 1 && out_shape == shape {
        // One rank: the gather is `x` itself (tensors are immutable, so it is shared, not
        // copied: a world of one GPU pays no copy for a kept input or a gathered gradient).
        return Ok(x.clone());
    }
    let out: DeviceStorage<T> = out_tensor(g, &out_shape)?;
    let (outer, inner) = outer_inner(&shape, dim);
    let es = size_of::<T>();
    let parts: Vec<Runs> = (0..n)
        .map(|i| {
            let src = (r + i) % n;
            let len = splits[src] * inner;
            Runs::new(
                (outer, 1, 1),
                len,
                (0, len, 0, 0),
                (off[src] * inner, off[n] * inner, 0, 0),
                es,
                CHUNK_BYTES,
            )
        })
        .collect();
    if n == 1 {
        exchange::<T>(g, None, OP_ALL_GATHER, 0, x.ptr(), out.ptr(), &parts, &[], g.stream())?;
        return Ok(out);
    }
    g.with_state("all_gather", |st| {
        st.epoch += 1;
        exchange::<T>(g, Some(st), OP_ALL_GATHER, 1, x.ptr(), out.ptr(), &parts, &[], g.stream())
    })?;
    Ok(out)
}

/// Sums every rank's `x` (same shape on each) in rank order: all of it (`dim` = None, an
/// all_reduce) or this rank's `array_split` share along `dim` (a reduce_scatter).
pub(crate) fn reduce_sum<T: Element>(
    g: &CudaRank<'_>,
    x: &DeviceStorage<T>,
    dim: Option<usize>,
) -> Result<DeviceStorage<T>> {
    g.check()?;
    let shape = x.shape().to_vec();
    let problem =
        dim.filter(|&d| d >= shape.len()).map(|d| format!("dim {d} of a {}-D tensor", shape.len()));
    let mut words = vec![dim.map_or(u64::MAX, |d| d as u64), shape.len() as u64];
    words.extend(shape.iter().map(|&s| s as u64));
    let all = agree(g, "reduce", &words, problem)?;
    for i in 0..words.len() {
        all.agree("reduce", i, "shape")?;
    }
    let (n, r) = (g.num_ranks(), g.rank);
    if n == 1 {
        // One rank's sum, and all of it its share: `x` itself, shared (tensors are immutable).
        return Ok(x.clone());
    }
    let es = size_of::<T>();
    let (out_shape, runs) = match dim {
        None => (shape.clone(), Runs::contiguous(x.len(), 0, 0, es, CHUNK_BYTES)),
        Some(d) => {
            let split = super::array_split(shape[d], n);
            let off = offsets(&split);
            let (outer, inner) = outer_inner(&shape, d);
            let len = split[r] * inner;
            let mut s = shape.clone();
            s[d] = split[r];
            (
                s,
                Runs::new(
                    (outer, 1, 1),
                    len,
                    (off[r] * inner, shape[d] * inner, 0, 0),
                    (0, len, 0, 0),
                    es,
                    CHUNK_BYTES,
                ),
            )
        }
    };
    let out: DeviceStorage<T> = out_tensor(g, &out_shape)?;
    g.with_state("reduce", |st| {
        st.epoch += 1;
        reduce::<T>(g, st, OP_REDUCE, 1, x.ptr(), out.ptr(), &[], runs, g.stream())
    })?;
    Ok(out)
}

/// Rank `root`'s `x` on every rank (every rank passes a tensor of the same shape).
pub(crate) fn broadcast<T: Element>(
    g: &CudaRank<'_>,
    x: &DeviceStorage<T>,
    root: usize,
) -> Result<DeviceStorage<T>> {
    g.check()?;
    let (n, r) = (g.num_ranks(), g.rank);
    let problem = (root >= n).then(|| format!("root {root} in a world of {n}"));
    let all = agree(g, "broadcast", &[root as u64, x.len() as u64], problem)?;
    all.agree("broadcast", 0, "root")?;
    all.agree("broadcast", 1, "length")?;
    if n == 1 {
        // The root's tensor is `x`: shared, not copied (tensors are immutable).
        return Ok(x.clone());
    }
    let out: DeviceStorage<T> = out_tensor(g, x.shape())?;
    let es = size_of::<T>();
    let parts: Vec<Runs> = (0..n)
        .map(|i| {
            if (r + i) % n == root {
                Runs::contiguous(x.len(), 0, 0, es, CHUNK_BYTES)
            } else {
                Runs::default()
            }
        })
        .collect();
    g.with_state("broadcast", |st| {
        st.epoch += 1;
        exchange::<T>(g, Some(st), OP_BROADCAST, 1, x.ptr(), out.ptr(), &parts, &[], g.stream())
    })?;
    Ok(out)
}

/// Elements `[start, start + len)` of `x` along `dim`, copied into a new tensor (local).
pub(crate) fn slice<T: Element>(
    g: &CudaRank<'_>,
    x: &DeviceStorage<T>,
    dim: usize,
    start: usize,
    len: usize,
) -> Result<DeviceStorage<T>> {
    let shape = x.shape();
    if dim >= shape.len() || start + len > shape[dim] {
        return Err(Error::InvalidShape {
            op: "slice",
            reason: format!("[{start}, {}) of dim {dim} of {shape:?}", start + len),
        });
    }
    let (outer, inner) = outer_inner(shape, dim);
    let mut s = shape.to_vec();
    s[dim] = len;
    let out: DeviceStorage<T> = out_tensor(g, &s)?;
    let es = size_of::<T>();
    let runs = Runs::new(
        (outer, 1, 1),
        len * inner,
        (start * inner, shape[dim] * inner, 0, 0),
        (0, len * inner, 0, 0),
        es,
        CHUNK_BYTES,
    );
    exchange::<T>(g, None, 0, 0, x.ptr(), out.ptr(), &[runs], &[], g.stream())?;
    Ok(out)
}
