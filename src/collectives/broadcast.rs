//! broadcast: every rank gets the root's data.

use super::Input;
use super::workspace::{
    CHUNK_ELEMS, Chunks, Out, Region, check_outputs, exchange_checked, with_workspace,
};
use crate::device::DeviceWorld;
use crate::device::capability::Op;
use crate::device::to_world_device;
use crate::device::{LaunchMode, ascend, capability, cuda, launch, tile};
use crate::shmem::{GlobalPtr, GlobalPtrMut, Rank};
use crate::{Element, Result, Tensor};

/// Every rank gets a copy of `root`'s `data`; the other ranks' `data` is not read (pass `&[]`,
/// or `None`: `data` may be an `Option`, `root.then_some(&v)`).
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when `root` is outside the world,
/// [`Error::RanksDisagree`](crate::Error::RanksDisagree) when ranks name different roots, on every
/// rank; otherwise as for every collective.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// let out = World::threads(3)?.run(|rank| {
///     let data = if rank.rank() == 1 { vec![7.0f32, 8.0] } else { vec![] };
///     collectives::broadcast(rank, &data, 1)
/// })?;
/// assert!(out.iter().all(|o| o == &vec![7.0, 8.0]));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn broadcast<'a, T: Element>(
    rank: &Rank<'_>,
    data: impl Into<Input<'a, T>>,
    root: usize,
) -> Result<Vec<T>> {
    Ok(cast(rank, data.into(), root, Out::Alloc)?.expect("allocated"))
}

/// [`broadcast`] into the caller's `out`, which must hold the root's data.
///
/// # Errors
/// As [`broadcast`], and [`Error::InvalidArgument`](crate::Error::InvalidArgument) on every rank
/// when a rank's `out` has the wrong length.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// World::threads(2)?.run(|rank| {
///     let mut out = [0.0f64; 1];
///     collectives::broadcast_into(rank, &[rank.rank() as f64 + 5.0], 0, &mut out)?;
///     assert_eq!(out, [5.0]);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn broadcast_into<'a, T: Element>(
    rank: &Rank<'_>,
    data: impl Into<Input<'a, T>>,
    root: usize,
    out: &mut [T],
) -> Result<()> {
    cast(rank, data.into(), root, Out::Into(out)).map(drop)
}

fn cast<T: Element>(
    rank: &Rank<'_>,
    data: Input<'_, T>,
    root: usize,
    out: Out<'_, T>,
) -> Result<Option<Vec<T>>> {
    const OP: &str = "broadcast";
    let (me, n) = (rank.rank(), rank.num_ranks());
    let problem = (root >= n)
        .then(|| format!("root {root} is outside a world of {n} ranks"))
        .or_else(|| capability::dtype_problem(Op::Broadcast, rank.device(), T::DTYPE));
    let words = [root as u64, data.len() as u64, out.len_word()];
    let all = exchange_checked::<T>(rank, OP, &words, problem, &[])?;
    all.agree(OP, 0, "root")?;
    with_workspace::<T, _>(rank, |ws| {
        let len = all[root][1] as usize;
        check_outputs(OP, &all, 2, |_| len)?;
        let got = match rank.device_world() {
            DeviceWorld::Host => None,
            DeviceWorld::Ascend(world) => {
                let npu = ascend::AscendRank { world, rank };
                Some(data.host().and_then(|d| ascend::launch::broadcast(&npu, &d, root, len)))
            }
            DeviceWorld::Cuda(_) => Some((|| {
                // The root's data runs from its GPU (moved there once if it is not), and every
                // rank's copy comes back from its own.
                let mine = if me == root {
                    data.on_device(rank, &[len])?
                } else {
                    to_world_device(rank, Tensor::from_shape_vec(&[len], vec![T::zero(); len])?)?
                };
                let got = cuda::broadcast(rank, &mine, root)?.to_host()?;
                Ok(got.as_slice().to_vec())
            })()),
        };
        if let Some(got) = got {
            let got = got.inspect_err(|e| rank.fail_after_agreeing(e))?;
            return out.fill(OP, len, |out| {
                out.copy_from_slice(&got);
                Ok(())
            });
        }
        let data = data.host().inspect_err(|e| rank.fail_after_agreeing(e))?;
        let data = &*data;
        if n > 1 {
            ws.reserve(rank, len)?;
            ws.reserve_mirror(rank, len)?;
        }
        let region = Region::row(0, len);
        let targets =
            if me == root { ws.remote_targets(rank, |_| Some((region, 0))) } else { Vec::new() };

        let grid = rank.topology().aivector_core_num();
        let ready_at = ws.publish(|p| n > 1 && p == root, grid);
        let chunks = Chunks::new(1, len, CHUNK_ELEMS);
        let input = GlobalPtr::from_slice(data);
        let stream = len * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
        let ws = &*ws;
        out.fill(OP, len, |out| {
            let output = GlobalPtrMut::from_slice(out);
            // SAFETY: the root writes its own staging buffer before notifying; the others read it
            // after waiting; each task writes its own chunk of `out`.
            unsafe {
                launch(rank, LaunchMode::VectorOnly, grid, |p| {
                    if me == root && n > 1 {
                        ws.push_remote(p, input, &targets)?;
                        ws.publish_part(p, input, &chunks, len)?;
                    }
                    if chunks.count == 0 {
                        return Ok(());
                    }
                    let from = ws.source(p, root, input, &ready_at, region, 0)?;
                    for t in p.tasks(chunks.count) {
                        let c = chunks.get(t);
                        let (to, from) = (output + c.col, from.at(0, c.col));
                        tile::copy_2d_maybe_streaming(
                            stream,
                            to,
                            c.cols,
                            from,
                            c.cols,
                            (1, c.cols),
                        );
                    }
                    Ok(())
                })?;
            }
            rank.quiet()
        })
    })
}
