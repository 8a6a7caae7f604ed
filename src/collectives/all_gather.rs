//! all_gather: every rank gets every rank's block, in rank order.

use super::Input;
use super::workspace::{
    CHUNK_ELEMS, Chunks, Out, Region, RotatedTasks, check_outputs, exchange_checked, with_workspace,
};
use crate::device::DeviceWorld;
use crate::device::capability::Op;
use crate::device::device_data;
use crate::device::{LaunchMode, ascend, capability, cuda, launch, tile};
use crate::shmem::{Exchanged, GlobalPtr, GlobalPtrMut, Rank};
use crate::tensor::{Tensor, split_offsets};
use crate::{Element, Result};

/// Concatenates every rank's `local` in rank order. Lengths may differ between ranks, and may be
/// zero.
///
/// # Errors
/// [`Error::PeerFailed`](crate::Error::PeerFailed) or
/// [`Error::WaitTimeout`](crate::Error::WaitTimeout) when a peer fails or never arrives;
/// [`Error::SymmetricMemoryExhausted`](crate::Error::SymmetricMemoryExhausted) when the staging
/// buffer does not fit.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// let out = World::threads(3)?.run(|rank| {
///     let mine = vec![rank.rank() as f32; rank.rank()]; // lengths 0, 1, 2
///     collectives::all_gather(rank, &mine)
/// })?;
/// assert_eq!(out[0], vec![1.0, 2.0, 2.0]);
/// assert_eq!(out[2], out[0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather<'a, T: Element>(
    rank: &Rank<'_>,
    local: impl Into<Input<'a, T>>,
) -> Result<Vec<T>> {
    all_gather_cols(rank, local, 1)
}

/// Gathers column blocks: every rank holds a row-major `[rows, cols_r]` block (`cols_r =
/// local.len() / rows`, which may differ between ranks); the result is `[rows, sum of cols_r]`
/// with rank `p`'s block at columns `sum of cols_q for q < p`. This is the all_gather of a tensor
/// sharded on any dimension: `rows` is the product of the dimensions before it.
///
/// # Errors
/// [`Error::RanksDisagree`](crate::Error::RanksDisagree) when ranks pass different `rows`,
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when a rank's length is not a multiple
/// of `rows`; otherwise as [`all_gather`]. Every rank returns the error.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// let out = World::threads(2)?.run(|rank| {
///     let r = rank.rank() as f64;
///     collectives::all_gather_cols(rank, &[r, r + 0.5], 2) // a [2, 1] block per rank
/// })?;
/// assert_eq!(out[0], vec![0.0, 1.0, 0.5, 1.5]); // [[0, 1], [0.5, 1.5]]
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather_cols<'a, T: Element>(
    rank: &Rank<'_>,
    local: impl Into<Input<'a, T>>,
    rows: usize,
) -> Result<Vec<T>> {
    Ok(gather(Op::AllGather, rank, local.into(), rows, Out::Alloc)?.expect("allocated"))
}

/// [`all_gather`] into the caller's `out`, which must hold the whole result.
///
/// # Errors
/// As [`all_gather`], and [`Error::InvalidArgument`](crate::Error::InvalidArgument) on every rank
/// when a rank's `out` has the wrong length.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// World::threads(2)?.run(|rank| {
///     let mut out = [0.0f32; 2];
///     collectives::all_gather_into(rank, &[rank.rank() as f32], &mut out)?;
///     assert_eq!(out, [0.0, 1.0]);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather_into<'a, T: Element>(
    rank: &Rank<'_>,
    local: impl Into<Input<'a, T>>,
    out: &mut [T],
) -> Result<()> {
    gather(Op::AllGather, rank, local.into(), 1, Out::Into(out)).map(drop)
}

/// [`all_gather_cols`] into the caller's `out`, which must hold the whole `[rows, sum of cols_r]`.
///
/// # Errors
/// As [`all_gather_into`].
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// World::threads(2)?.run(|rank| {
///     let r = rank.rank() as f32;
///     let mut out = [0.0f32; 4];
///     collectives::all_gather_cols_into(rank, &[r, r + 0.5], 2, &mut out)?; // [2, 1] per rank
///     assert_eq!(out, [0.0, 1.0, 0.5, 1.5]); // [[0, 1], [0.5, 1.5]]
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather_cols_into<'a, T: Element>(
    rank: &Rank<'_>,
    local: impl Into<Input<'a, T>>,
    rows: usize,
    out: &mut [T],
) -> Result<()> {
    gather(Op::AllGather, rank, local.into(), rows, Out::Into(out)).map(drop)
}

/// The all_gather, for the call `op` (a composite op such as all_reduce names itself, so that
/// its exchanges never meet a plain all_gather's).
pub(crate) fn gather<T: Element>(
    op: Op,
    rank: &Rank<'_>,
    local: Input<'_, T>,
    rows: usize,
    out: Out<'_, T>,
) -> Result<Option<Vec<T>>> {
    gather_agreeing(op, rank, local, rows, out, &[], |_| Ok(()))
}

/// [`gather`] whose one exchange also carries the caller's `extra` words (after the gather's own
/// three: rows, this rank's length, its output's length), and `agree` checks what every rank
/// sent before anything moves: a composite op's own conditions, without an exchange of its own.
pub(crate) fn gather_agreeing<T: Element>(
    which: Op,
    rank: &Rank<'_>,
    local: Input<'_, T>,
    rows: usize,
    out: Out<'_, T>,
    extra: &[u64],
    agree: impl FnOnce(&Exchanged) -> Result<()>,
) -> Result<Option<Vec<T>>> {
    let op = which.name();
    let (me, n) = (rank.rank(), rank.num_ranks());
    let problem = match rows {
        0 if !local.is_empty() => Some(format!("{} elements cannot form 0 rows", local.len())),
        r if r > 0 && !local.len().is_multiple_of(r) => {
            Some(format!("{} elements do not form {r} whole rows", local.len()))
        }
        _ => None,
    };
    let problem = problem.or_else(|| capability::dtype_problem(which, rank.device(), T::DTYPE));
    let mut words = vec![rows as u64, local.len() as u64, out.len_word()];
    words.extend_from_slice(extra);
    let all = exchange_checked::<T>(rank, op, &words, problem, &[])?;
    all.agree(op, 0, "rows")?;
    agree(&all)?;
    with_workspace::<T, _>(rank, |ws| {
        let cols: Vec<usize> =
            all.iter().map(|w| (w[1] as usize).checked_div(rows).unwrap_or(0)).collect();
        let col_offsets = split_offsets(&cols);
        let total_cols = col_offsets[n];
        check_outputs(op, &all, 2, |_| rows * total_cols)?;
        let gathered = match rank.device_world() {
            DeviceWorld::Host => None,
            DeviceWorld::Ascend(world) => {
                let npu = ascend::AscendRank { world, rank };
                Some(local.host().and_then(|l| ascend::launch::all_gather(&npu, &l, rows, &cols)))
            }
            DeviceWorld::Cuda(gpus) => Some((|| {
                // The block runs on this rank's GPU (moved there once if it is not), and the
                // whole comes back to the host for this API.
                let block = local.on_device(rank, &[rows, cols[me]])?;
                let whole = cuda::all_gather(gpus, rank, device_data(&block), 1, &cols)?;
                Ok(Tensor::from_device_storage(whole).to_host()?.as_slice().to_vec())
            })()),
        };
        if let Some(gathered) = gathered {
            let gathered = gathered.inspect_err(|e| rank.fail_after_agreeing(e))?;
            return out.fill(op, gathered.len(), |out| {
                out.copy_from_slice(&gathered);
                Ok(())
            });
        }
        let local = local.host().inspect_err(|e| rank.fail_after_agreeing(e))?;
        let local = &*local;
        if n > 1 {
            ws.reserve(rank, all.iter().map(|w| w[1] as usize).max().unwrap_or(0))?;
            // Ranks of other nodes put their whole input here, where it sits in the result.
            ws.reserve_mirror(rank, rows * total_cols)?;
        }
        let region = |src: usize| Region { start: 0, stride: cols[src], rows, cols: cols[src] };
        let slot = |src: usize| rows * col_offsets[src];
        let targets = ws.remote_targets(rank, |_| Some((region(me), slot(me))));

        let grid = rank.topology().aivector_core_num();
        let ready_at = ws.publish(|_| n > 1, grid);
        let chunks: Vec<Chunks> = cols.iter().map(|&c| Chunks::new(rows, c, CHUNK_ELEMS)).collect();
        let tasks = RotatedTasks::new(me, &chunks.iter().map(|c| c.count).collect::<Vec<_>>());
        let input = GlobalPtr::from_slice(local);
        let stream = rows * total_cols * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
        let ws = &*ws;
        out.fill(op, rows.saturating_mul(total_cols), |out| {
            let output = GlobalPtrMut::from_slice(out);
            // SAFETY: each rank writes only its own staging buffer, and only before it notifies;
            // peers read it only after waiting for every program's notify. Each task writes its own
            // chunk of `out`.
            unsafe {
                launch(rank, LaunchMode::VectorOnly, grid, |p| {
                    if n > 1 {
                        ws.push_remote(p, input, &targets)?;
                        ws.publish_part(p, input, &chunks[me], cols[me])?;
                    }
                    for t in p.tasks(tasks.total()) {
                        let (src, task) = tasks.locate(t);
                        let c = chunks[src].get(task);
                        let from = ws.source(p, src, input, &ready_at, region(src), slot(src))?;
                        let to = c.row * total_cols + col_offsets[src] + c.col;
                        tile::copy_2d_maybe_streaming(
                            stream,
                            output + to,
                            total_cols,
                            from.at(c.row, c.col),
                            from.stride,
                            (c.rows, c.cols),
                        );
                    }
                    Ok(())
                })?;
            }
            rank.quiet()
        })
    })
}
