//! The sequence-parallel flash-decode on GPUs (`fused::flash_decode`): fused, one
//! `dt_flash_decode` launch (records written straight into every rank's symmetric buffer over
//! NVLink, signalled, combined in the same kernel); unfused, what a user writes with a GPU
//! library: the local partial attention (the same kernel's first phase alone), an all_gather of
//! the records, the combine (its second phase alone).

use super::{collectives, out_tensor};
use crate::device::cuda::kernels::{self, FlashDecodeArgs, MAX_RANKS, Source};
use crate::device::cuda::storage::DeviceStorage;
use crate::device::cuda::world::{CudaRank, OP_FLASH_DECODE};
use crate::device::host::flash_decode::DecodeLayout;
use crate::tensor::Element;
use crate::{Error, Result};

const OP: &str = "flash_decode";
/// Keys per task (`FD_CHUNK` in flash_decode.cu).
const CHUNK: usize = 128;
/// The widest `d` and `dv` the kernel keeps in registers and shared memory (`FD_MAX_D`).
const MAX_D: usize = 256;
/// Threads per block (`FD_WARPS` warps).
const THREADS: u32 = 256;

/// The output `[batch, heads, dv]` and the log-sum-exp `[batch, heads]`.
pub(crate) type Decoded<T> = (DeviceStorage<T>, DeviceStorage<<T as Element>::Acc>);

/// What every launch of one call shares: shapes, inputs, outputs, every source's chunks.
fn base<T: Element>(
    l: &DecodeLayout,
    (q, k, v): (&DeviceStorage<T>, &DeviceStorage<T>, &DeviceStorage<T>),
    (out, lse): (&DeviceStorage<T>, &DeviceStorage<T::Acc>),
    me: usize,
) -> FlashDecodeArgs {
    let mut a = FlashDecodeArgs {
        batch: l.batch as u64,
        heads: l.heads as u64,
        kv_heads: l.kv_heads as u64,
        d: l.d as u64,
        dv: l.dv as u64,
        scale: l.scale,
        q: q.ptr(),
        k: k.ptr(),
        v: v.ptr(),
        out: out.ptr(),
        lse: lse.ptr(),
        keys: l.keys[me] as u64,
        ..FlashDecodeArgs::default()
    };
    let mut at = 0u64;
    for (r, &keys) in l.keys.iter().enumerate() {
        a.chunks[r] = keys.div_ceil(CHUNK) as u64;
        a.src_off[r] = at;
        at += records(l, keys) as u64;
    }
    a.src_off[l.keys.len()] = at;
    a
}

/// Values of the records of a source with `keys` keys.
fn records(l: &DecodeLayout, keys: usize) -> usize {
    l.batch * keys.div_ceil(CHUNK) * l.heads * (l.dv + 1)
}

fn check<T: Element>(g: &CudaRank<'_>, l: &DecodeLayout, k: &DeviceStorage<T>) -> Result<()> {
    g.check()?;
    if l.keys.len() > MAX_RANKS || l.keys[g.rank] != k.shape().get(1).copied().unwrap_or(0) {
        return Err(Error::InvalidShape {
            op: OP,
            reason: format!("keys {:?} do not fit k {:?}", l.keys, k.shape()),
        });
    }
    // The same on every rank (agreed shapes): every rank refuses together, before any launch.
    if l.d > MAX_D || l.dv > MAX_D {
        return Err(Error::InvalidShape {
            op: OP,
            reason: format!("d {} and dv {}: the GPU kernel takes at most {MAX_D}", l.d, l.dv),
        });
    }
    Ok(())
}

fn launch<T: Element>(g: &CudaRank<'_>, args: &FlashDecodeArgs, tasks: u64) -> Result<()> {
    let f = kernels::function(g.gpu(), Source::FlashDecode, T::DTYPE, "dt_flash_decode")?;
    let grid = g.grid_for(f, tasks.div_ceil(u64::from(THREADS / 32)).max(1));
    kernels::launch(f, grid, THREADS, g.stream(), args)
}

/// Checks the call; makes its outputs and the arguments every launch of it shares.
fn start<T: Element>(
    g: &CudaRank<'_>,
    l: &DecodeLayout,
    (q, k, v): (&DeviceStorage<T>, &DeviceStorage<T>, &DeviceStorage<T>),
) -> Result<(DeviceStorage<T>, DeviceStorage<T::Acc>, FlashDecodeArgs)> {
    check(g, l, k)?;
    let out: DeviceStorage<T> = out_tensor(g, &[l.batch, l.heads, l.dv])?;
    let lse: DeviceStorage<T::Acc> = out_tensor(g, &[l.batch, l.heads])?;
    let args = base(l, (q, k, v), (&out, &lse), g.rank);
    Ok((out, lse, args))
}

/// The fused op on this rank's GPU.
pub(crate) fn flash_decode<T: Element>(
    g: &CudaRank<'_>,
    l: &DecodeLayout,
    q: &DeviceStorage<T>,
    k: &DeviceStorage<T>,
    v: &DeviceStorage<T>,
) -> Result<Decoded<T>> {
    let (out, lse, mut args) = start(g, l, (q, k, v))?;
    let (n, me) = (g.num_ranks(), g.rank);
    let total = args.src_off[n] as usize;
    let tasks = (l.batch * l.heads * l.keys.iter().map(|&s| s.div_ceil(CHUNK)).max().unwrap_or(0))
        .max(l.batch * l.heads) as u64;
    g.with_state(OP, |st| {
        st.epoch += 1;
        let region = g.symmetric(st, "records", (total * size_of::<T::Acc>()).max(8))?;
        args.ctl = g.ctl(OP_FLASH_DECODE);
        args.sync = g.sync_args(st);
        (args.mode, args.ndst, args.nsrc, args.slot) = (1, n as u32, n as u32, me as u32);
        for i in 0..n {
            args.recv[i] = g.symm_at(region, (me + i) % n);
        }
        launch::<T>(g, &args, tasks)
    })?;
    Ok((out, lse))
}

/// The unfused baseline on this rank's GPU: the local records, the world's all_gather of them,
/// the combine.
pub(crate) fn flash_decode_unfused<T: Element>(
    g: &CudaRank<'_>,
    l: &DecodeLayout,
    q: &DeviceStorage<T>,
    k: &DeviceStorage<T>,
    v: &DeviceStorage<T>,
) -> Result<Decoded<T>> {
    let (out, lse, all) = start(g, l, (q, k, v))?;
    let (n, me) = (g.num_ranks(), g.rank);
    // Local: this rank's records alone, as source 0 of a buffer of its own.
    let mine = records(l, l.keys[me]);
    let part: DeviceStorage<T::Acc> = out_tensor(g, &[mine.max(1)])?;
    let mut local = all;
    (local.mode, local.ndst, local.nsrc, local.slot) = (0, 1, 1, 0);
    (local.chunks[0], local.src_off[0], local.recv[0]) = (all.chunks[me], 0, part.ptr());
    if mine > 0 {
        launch::<T>(g, &local, (l.batch * l.heads * l.keys[me].div_ceil(CHUNK)) as u64)?;
    }
    let splits: Vec<usize> = l.keys.iter().map(|&s| records(l, s)).collect();
    let part = if mine == 0 { out_tensor(g, &[0])? } else { part };
    let gathered = collectives::all_gather(g, &part, 0, &splits)?;
    let mut combine = all;
    (combine.mode, combine.ndst, combine.nsrc, combine.slot) = (2, 0, n as u32, 0);
    combine.recv[0] = gathered.ptr();
    launch::<T>(g, &combine, (l.batch * l.heads) as u64)?;
    Ok((out, lse))
}
