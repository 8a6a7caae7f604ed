//! all_to_all: every rank sends a piece of its input to every rank (MPI_Alltoall, _Alltoallv).

use super::workspace::{
    CHUNK_ELEMS, Chunks, Out, RotatedTasks, check_outputs, exchange_checked, with_workspace,
};
use crate::device::{LaunchMode, ascend, launch, tile};
use crate::shmem::{GlobalPtr, GlobalPtrMut, Rank};
use crate::tensor::split_offsets;
use crate::{Element, Result};

/// Sends the `p`-th of `world` equal pieces of `input` to rank `p`; returns the pieces received,
/// in rank order.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) on every rank when a rank's input
/// does not split into equal pieces; otherwise as [`all_to_all_v`].
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// let out = World::threads(2)?.run(|rank| {
///     let r = rank.rank() as f32 * 10.0;
///     collectives::all_to_all(rank, &[r, r + 1.0])
/// })?;
/// assert_eq!(out, vec![vec![0.0, 10.0], vec![1.0, 11.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_to_all<T: Element>(rank: &Rank<'_>, input: &[T]) -> Result<Vec<T>> {
    let n = rank.num_ranks();
    let counts = vec![input.len() / n; n];
    let problem = (!input.len().is_multiple_of(n))
        .then(|| format!("{} elements do not split into {n} equal pieces", input.len()));
    Ok(exchange_and_send(rank, input, &counts, problem, Out::Alloc)?.expect("allocated"))
}

/// [`all_to_all`] into the caller's `out`, which must hold everything this rank receives.
///
/// # Errors
/// As [`all_to_all`], and [`Error::InvalidArgument`](crate::Error::InvalidArgument) on every rank
/// when a rank's `out` has the wrong length.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// World::threads(2)?.run(|rank| {
///     let mut out = [0.0f32; 2];
///     collectives::all_to_all_into(rank, &[1.0, 2.0], &mut out)?;
///     assert_eq!(out, if rank.rank() == 0 { [1.0, 1.0] } else { [2.0, 2.0] });
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_to_all_into<T: Element>(rank: &Rank<'_>, input: &[T], out: &mut [T]) -> Result<()> {
    let n = rank.num_ranks();
    let counts = vec![input.len() / n; n];
    let problem = (!input.len().is_multiple_of(n))
        .then(|| format!("{} elements do not split into {n} equal pieces", input.len()));
    exchange_and_send(rank, input, &counts, problem, Out::Into(out)).map(drop)
}

/// Sends `send_counts[p]` elements of `input` (in order) to rank `p`; returns what every rank
/// sent to this one, in rank order. Counts may differ between ranks and may be zero.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) on every rank when a rank's counts
/// do not have one entry per rank or do not add up to its input length;
/// [`Error::PeerFailed`](crate::Error::PeerFailed),
/// [`Error::WaitTimeout`](crate::Error::WaitTimeout),
/// [`Error::SymmetricMemoryExhausted`](crate::Error::SymmetricMemoryExhausted) as for every
/// collective.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// let out = World::threads(2)?.run(|rank| {
///     if rank.rank() == 0 {
///         collectives::all_to_all_v(rank, &[1.0f64, 2.0, 3.0], &[1, 2])
///     } else {
///         collectives::all_to_all_v(rank, &[4.0f64], &[0, 1])
///     }
/// })?;
/// assert_eq!(out, vec![vec![1.0], vec![2.0, 3.0, 4.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_to_all_v<T: Element>(
    rank: &Rank<'_>,
    input: &[T],
    send_counts: &[usize],
) -> Result<Vec<T>> {
    let n = rank.num_ranks();
    let problem = if send_counts.len() != n {
        Some(format!("{} send counts for a world of {n} ranks", send_counts.len()))
    } else if send_counts.iter().sum::<usize>() != input.len() {
        Some(format!(
            "send counts add up to {}, the input has {} elements",
            send_counts.iter().sum::<usize>(),
            input.len()
        ))
    } else {
        None
    };
    Ok(exchange_and_send(rank, input, send_counts, problem, Out::Alloc)?.expect("allocated"))
}

fn exchange_and_send<T: Element>(
    rank: &Rank<'_>,
    input: &[T],
    send_counts: &[usize],
    problem: Option<String>,
    out: Out<'_, T>,
) -> Result<Option<Vec<T>>> {
    const OP: &str = "all_to_all";
    let (me, n) = (rank.rank(), rank.num_ranks());
    let words = [input.len() as u64, out.len_word()];
    // To each rank in particular: how much it gets, and where that starts in this input.
    let mut personal = Vec::with_capacity(2 * n);
    let mut start = 0u64;
    for r in 0..n {
        let count = send_counts.get(r).map_or(0, |&c| c as u64);
        personal.extend([count, start]);
        start = start.saturating_add(count);
    }
    let problem = problem.or_else(|| rank.ascend().and_then(|_| ascend::check_dtype::<T>(OP)));
    let all = exchange_checked::<T>(rank, OP, &words, problem, &personal)?;
    // What rank p sends me, and where in p's input it starts.
    let recv: Vec<usize> = (0..n).map(|p| all.personal(p)[0] as usize).collect();
    let send_start: Vec<usize> = (0..n).map(|p| all.personal(p)[1] as usize).collect();
    let recv_offsets = split_offsets(&recv);
    // Only the `_into` form names an output length, and it splits inputs evenly: every rank
    // receives a 1/n of every input.
    let even_total: usize = all.iter().map(|w| w[0] as usize / n).sum();
    check_outputs(OP, &all, 1, |_| even_total)?;
    if let Some(npu) = rank.ascend() {
        let longest = all.iter().map(|w| w[0] as usize).max().unwrap_or(0);
        let got = ascend::launch::all_to_all_v(&npu, input, &recv, &send_start, longest)
            .inspect_err(|e| rank.fail_after_agreeing(e))?;
        return out.fill(OP, got.len(), |out| {
            out.copy_from_slice(&got);
            Ok(())
        });
    }
    with_workspace::<T, _>(rank, |ws| {
        if n > 1 {
            ws.reserve(rank, all.iter().map(|w| w[0] as usize).max().unwrap_or(0))?;
        }

        let grid = rank.topology().aivector_core_num();
        let ready_at = ws.publish(|_| n > 1, grid);
        let publish = Chunks::new(1, input.len(), CHUNK_ELEMS);
        let pieces: Vec<Chunks> = recv.iter().map(|&c| Chunks::new(1, c, CHUNK_ELEMS)).collect();
        let tasks = RotatedTasks::new(me, &pieces.iter().map(|c| c.count).collect::<Vec<_>>());
        let input_ptr = GlobalPtr::from_slice(input);
        let stream = recv_offsets[n] * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
        let ws = &*ws;
        out.fill(OP, recv_offsets[n], |out| {
            let output = GlobalPtrMut::from_slice(out);
            // SAFETY: as in all_gather: a rank writes its own staging buffer before notifying, peers
            // read it after waiting; each task writes its own chunk of `out`.
            unsafe {
                launch(rank, LaunchMode::VectorOnly, grid, |p| {
                    if n > 1 {
                        ws.publish_part(p, input_ptr, &publish, input.len())?;
                    }
                    for t in p.tasks(tasks.total()) {
                        let (src, task) = tasks.locate(t);
                        let c = pieces[src].get(task);
                        let from = ws.source(p, src, input_ptr, &ready_at)?;
                        let at = send_start[src] + c.col;
                        tile::copy_2d_maybe_streaming(
                            stream,
                            output + (recv_offsets[src] + c.col),
                            c.cols,
                            from + at,
                            c.cols,
                            (1, c.cols),
                        );
                    }
                    Ok(())
                })
            }
        })
    })
}
