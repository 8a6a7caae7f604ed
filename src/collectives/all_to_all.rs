//! all_to_all: every rank sends a piece of its input to every rank (MPI_Alltoall, _Alltoallv).
//!
//! The vector forms pull: each rank publishes its input in its staging buffer, and every rank
//! copies its pieces from its peers' staging buffers into its output (two copies of every
//! element). [`all_to_all_v_tensor`] pushes instead: its output is a tensor in a block of the
//! symmetric heap lent to it (`shmem::lent`), and every rank copies its pieces straight into its
//! peers' blocks (one copy).

use super::Input;
use super::workspace::{
    CHUNK_ELEMS, Chunks, Out, Region, RotatedTasks, check_outputs, exchange_checked, with_workspace,
};
use crate::device::DeviceWorld;
use crate::device::capability::Op;
use crate::device::{LaunchMode, ascend, capability, launch, tile};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, MAX_WORDS, NotifySem, Rank, Scope, SignalBuf, SignalOp, WaitCmp,
    WaitSem, Workspace, symm_at,
};
use crate::tensor::split_offsets;
use crate::{Element, Result, Tensor};

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
pub fn all_to_all<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
) -> Result<Vec<T>> {
    let input = input.into();
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
pub fn all_to_all_into<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
    out: &mut [T],
) -> Result<()> {
    let input = input.into();
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
pub fn all_to_all_v<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
    send_counts: &[usize],
) -> Result<Vec<T>> {
    let input = input.into();
    let problem = counts_problem(rank, input, send_counts);
    Ok(exchange_and_send(rank, input, send_counts, problem, Out::Alloc)?.expect("allocated"))
}

/// [`all_to_all_v`] with the result as a 1-D tensor, written by every rank straight into its
/// place: the tensor lives in a block of this rank's symmetric heap, and each rank copies its
/// pieces from its input into its peers' blocks, so every element is copied once (where
/// [`all_to_all_v`] copies twice: into the sender's staging buffer, then out of it). Where no
/// block can be had (too many such outputs alive, the heap full, more than 62 ranks, ranks on
/// several nodes) it copies twice as [`all_to_all_v`] does, into a tensor in ordinary memory.
///
/// # Errors
/// As [`all_to_all_v`].
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// let out = World::threads(2)?.run(|rank| {
///     if rank.rank() == 0 {
///         collectives::all_to_all_v_tensor(rank, &[1.0f64, 2.0, 3.0], &[1, 2])
///     } else {
///         collectives::all_to_all_v_tensor(rank, &[4.0f64], &[0, 1])
///     }
/// })?;
/// assert_eq!(out[0].as_slice(), &[1.0]);
/// assert_eq!(out[1].as_slice(), &[2.0, 3.0, 4.0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_to_all_v_tensor<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
    send_counts: &[usize],
) -> Result<Tensor<T>> {
    let input = input.into();
    const OP: &str = "all_to_all_v_tensor";
    let (me, n) = (rank.rank(), rank.num_ranks());
    let problem = counts_problem(rank, input, send_counts)
        .or_else(|| capability::dtype_problem(Op::AllToAllV, rank.device(), T::DTYPE));
    // Every rank's counts for every rank, where they fit in the exchange (else no push).
    let push = n + 2 <= MAX_WORDS;
    let mut words = vec![input.len() as u64, rank.free_output_blocks()];
    if push {
        words.extend((0..n).map(|r| send_counts.get(r).map_or(0, |&c| c as u64)));
    }
    let all = exchange_checked::<T>(rank, OP, &words, problem, &personal_words(send_counts, n))?;
    let recv: Vec<usize> = (0..n).map(|p| all.personal(p)[0] as usize).collect();
    // Two copies, into a tensor in ordinary memory.
    let pulled = || {
        let send_start: Vec<usize> = (0..n).map(|p| all.personal(p)[1] as usize).collect();
        let input_lens: Vec<usize> = all.iter().map(|w| w[0] as usize).collect();
        let got = pull(rank, input, send_counts, &input_lens, &recv, &send_start, Out::Alloc)?
            .expect("allocated");
        Tensor::from_shape_vec(&[got.len()], got)
    };
    // Across nodes (a world joined by MPI) peers of other nodes have no block to copy into
    // here: the pull kernel puts to them.
    if !matches!(rank.device_world(), DeviceWorld::Host) || !push || rank.num_nodes() > 1 {
        return pulled();
    }
    // counts[s][d]: what rank s sends rank d.
    let counts: Vec<&[u64]> = all.iter().map(|w| &w[2..2 + n]).collect();
    let total = |d: usize| (0..n).map(|s| counts[s][d] as usize).sum::<usize>();
    let longest = (0..n).map(total).max().unwrap_or(0);
    let free_everywhere = all.iter().fold(u64::MAX, |mask, w| mask & w[1]);
    let block = if n > 1 && longest > 0 {
        rank.output_block(free_everywhere, longest * size_of::<T>())?
    } else {
        None
    };
    let Some(block) = block else {
        return pulled();
    };
    let input = input.host().inspect_err(|e| rank.fail_after_agreeing(e))?;
    let input = &*input;
    // Where my piece starts in rank d's output: after the pieces of the ranks before me.
    let at_peer: Vec<usize> =
        (0..n).map(|d| (0..me).map(|s| counts[s][d] as usize).sum()).collect();
    let pieces: Vec<Chunks> = send_counts.iter().map(|&c| Chunks::new(1, c, CHUNK_ELEMS)).collect();
    let send_start = split_offsets(send_counts);
    rank.with_workspace(PushWorkspace::new, |ws| {
        for (s, expected) in ws.expected.iter_mut().enumerate() {
            if s != me {
                *expected += Chunks::new(1, counts[s][me] as usize, CHUNK_ELEMS).count as u64;
            }
        }
        let tasks = RotatedTasks::new(me, &pieces.iter().map(|c| c.count).collect::<Vec<_>>());
        let input_ptr = GlobalPtr::from_slice(input);
        let stream = longest * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
        let (arrived, expected, buf) = (&ws.arrived, &ws.expected, block.buf());
        // SAFETY: every rank writes into a peer's block only its own piece (disjoint ranges,
        // from the agreed counts), before telling the peer; a rank hands its block out only
        // after every source told it all of its piece arrived; a block is written only in a
        // call where every rank has it free.
        unsafe {
            launch(rank, LaunchMode::VectorOnly, rank.topology().aivector_core_num(), |p| {
                let mut sent: Option<(usize, u64)> = None;
                let tell = |sent: Option<(usize, u64)>| match sent {
                    Some((dst, count)) if dst != me => p.notify(
                        arrived,
                        me,
                        dst,
                        SignalOp::Add(count),
                        Scope::Peer,
                        NotifySem::Release,
                    ),
                    _ => Ok(()),
                };
                for t in p.tasks(tasks.total()) {
                    let (dst, task) = tasks.locate(t);
                    let c = pieces[dst].get(task);
                    let to = symm_at(buf, dst).cast::<T>() + (at_peer[dst] + c.col);
                    let from = input_ptr + (send_start[dst] + c.col);
                    tile::copy_2d_maybe_streaming(stream, to, c.cols, from, c.cols, (1, c.cols));
                    // A program's tasks for one peer are consecutive: one notify per peer.
                    match &mut sent {
                        Some((to, count)) if *to == dst => *count += 1,
                        _ => tell(sent.replace((dst, 1)))?,
                    }
                }
                tell(sent)?;
                for t in p.tasks(n - 1) {
                    let src = (me + 1 + t) % n;
                    let want = WaitCmp::Ge(expected[src]);
                    let _ = p.wait_from(arrived, src, src, want, WaitSem::Acquire)?;
                }
                Ok(())
            })?;
        }
        Ok(())
    })
    .inspect_err(|e| rank.fail_after_agreeing(e))?;
    Ok(Tensor::lent(block.lend(), &[recv.iter().sum()]))
}

/// Signals of [`all_to_all_v_tensor`]: one per source rank, counting the pieces it pushed.
struct PushWorkspace {
    arrived: SignalBuf,
    expected: Vec<u64>,
}

impl Workspace for PushWorkspace {
    fn symmetric_bytes(&self) -> usize {
        self.arrived.len() * 64
    }
}

impl PushWorkspace {
    fn new(rank: &Rank<'_>) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(PushWorkspace {
            arrived: rank.alloc_signals_for("all_to_all_v_tensor arrived", n)?,
            expected: vec![0; n],
        })
    }
}

/// What is wrong with `send_counts` for `input`, if anything.
fn counts_problem<T: Element>(
    rank: &Rank<'_>,
    input: Input<'_, T>,
    send_counts: &[usize],
) -> Option<String> {
    let n = rank.num_ranks();
    if send_counts.len() != n {
        Some(format!("{} send counts for a world of {n} ranks", send_counts.len()))
    } else if send_counts.iter().sum::<usize>() != input.len() {
        Some(format!(
            "send counts add up to {}, the input has {} elements",
            send_counts.iter().sum::<usize>(),
            input.len()
        ))
    } else {
        None
    }
}

/// To each rank in particular: how much it gets, and where that starts in this input.
fn personal_words(send_counts: &[usize], n: usize) -> Vec<u64> {
    let mut personal = Vec::with_capacity(2 * n);
    let mut start = 0u64;
    for r in 0..n {
        let count = send_counts.get(r).map_or(0, |&c| c as u64);
        personal.extend([count, start]);
        start = start.saturating_add(count);
    }
    personal
}

fn exchange_and_send<T: Element>(
    rank: &Rank<'_>,
    input: Input<'_, T>,
    send_counts: &[usize],
    problem: Option<String>,
    out: Out<'_, T>,
) -> Result<Option<Vec<T>>> {
    const OP: &str = "all_to_all";
    let n = rank.num_ranks();
    let words = [input.len() as u64, out.len_word()];
    let personal = personal_words(send_counts, n);
    let problem =
        problem.or_else(|| capability::dtype_problem(Op::AllToAllV, rank.device(), T::DTYPE));
    let all = exchange_checked::<T>(rank, OP, &words, problem, &personal)?;
    // What rank p sends me, and where in p's input it starts.
    let recv: Vec<usize> = (0..n).map(|p| all.personal(p)[0] as usize).collect();
    let send_start: Vec<usize> = (0..n).map(|p| all.personal(p)[1] as usize).collect();
    // Only the `_into` form names an output length, and it splits inputs evenly: every rank
    // receives a 1/n of every input.
    let even_total: usize = all.iter().map(|w| w[0] as usize / n).sum();
    check_outputs(OP, &all, 1, |_| even_total)?;
    let input_lens: Vec<usize> = all.iter().map(|w| w[0] as usize).collect();
    pull(rank, input, send_counts, &input_lens, &recv, &send_start, out)
}

/// The pull kernel, after the exchange: `recv[p]` elements from rank `p`, starting at
/// `send_start[p]` of its input; `input_lens[p]` is rank `p`'s input length, `send_counts` what
/// this rank sends each rank.
fn pull<T: Element>(
    rank: &Rank<'_>,
    input: Input<'_, T>,
    send_counts: &[usize],
    input_lens: &[usize],
    recv: &[usize],
    send_start: &[usize],
    out: Out<'_, T>,
) -> Result<Option<Vec<T>>> {
    const OP: &str = "all_to_all";
    let (me, n) = (rank.rank(), rank.num_ranks());
    let longest = input_lens.iter().copied().max().unwrap_or(0);
    let recv_offsets = split_offsets(recv);
    match rank.device_world() {
        DeviceWorld::Host => {}
        DeviceWorld::Ascend(world) => {
            let npu = ascend::AscendRank { world, rank };
            let got = input
                .host()
                .and_then(|input| {
                    ascend::launch::all_to_all_v(&npu, &input, recv, send_start, longest)
                })
                .inspect_err(|e| rank.fail_after_agreeing(e))?;
            return out.fill(OP, got.len(), |out| {
                out.copy_from_slice(&got);
                Ok(())
            });
        }
        // Refused in the exchange above (the capability table has no GPU kernel for it).
        DeviceWorld::Cuda(_) => capability::check(Op::AllToAllV, rank.device(), T::DTYPE, &[])?,
    }
    let input = input.host().inspect_err(|e| rank.fail_after_agreeing(e))?;
    let input = &*input;
    // Ranks of other nodes put what they send this rank into its mirror, each at the offset of
    // its input among all inputs (every rank knows the input lengths, not what others send each
    // other): room for every input, of which the pages written are what this rank receives.
    let input_offsets = split_offsets(input_lens);
    let my_starts = split_offsets(
        &(0..n).map(|r| send_counts.get(r).copied().unwrap_or(0)).collect::<Vec<_>>(),
    );
    with_workspace::<T, _>(rank, |ws| {
        if n > 1 {
            ws.reserve(rank, longest)?;
            ws.reserve_mirror(rank, input_offsets[n])?;
        }
        let targets = ws.remote_targets(rank, |dst| {
            Some((Region::row(my_starts[dst], send_counts[dst]), input_offsets[me]))
        });

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
                        ws.push_remote(p, input_ptr, &targets)?;
                        ws.publish_part(p, input_ptr, &publish, input.len())?;
                    }
                    for t in p.tasks(tasks.total()) {
                        let (src, task) = tasks.locate(t);
                        let c = pieces[src].get(task);
                        let region = Region::row(send_start[src], recv[src]);
                        let from =
                            ws.source(p, src, input_ptr, &ready_at, region, input_offsets[src])?;
                        tile::copy_2d_maybe_streaming(
                            stream,
                            output + (recv_offsets[src] + c.col),
                            c.cols,
                            from.at(0, c.col),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::World;

    /// What rank `p` sends with the counts of `counts(p)`: its input is `p * 1000 + i`.
    fn sent(p: usize, counts: &[usize]) -> Vec<f32> {
        (0..counts.iter().sum::<usize>()).map(|i| (p * 1000 + i) as f32).collect()
    }

    /// The pushed result lives in a lent block (from 2 ranks on), and one a rank holds keeps its
    /// values while later calls push into other blocks.
    #[test]
    fn pushed_results_are_lent_and_keep_their_values() {
        for n in [1, 3] {
            let counts = |p: usize, salt: usize| -> Vec<usize> {
                (0..n).map(|d| (p + 2 * d + salt) % 4 * 700).collect()
            };
            let want = |me: usize, salt: usize| -> Vec<f32> {
                (0..n)
                    .flat_map(|p| {
                        let c = counts(p, salt);
                        let start: usize = c[..me].iter().sum();
                        sent(p, &c)[start..start + c[me]].to_vec()
                    })
                    .collect()
            };
            World::threads(n)
                .unwrap()
                .run(|rank| {
                    let me = rank.rank();
                    let call = |salt| {
                        let c = counts(me, salt);
                        all_to_all_v_tensor(rank, &sent(me, &c), &c)
                    };
                    let first = call(1)?;
                    assert_eq!(first.is_lent(), n > 1);
                    let first = (me == 0).then_some(first);
                    for salt in 2..5 {
                        let got = call(salt)?;
                        assert_eq!(got.as_slice(), want(me, salt));
                    }
                    if let Some(first) = first {
                        assert_eq!(first.as_slice(), want(0, 1), "a held result was overwritten");
                    }
                    Ok(())
                })
                .unwrap();
        }
    }
}
