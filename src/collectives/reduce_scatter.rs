//! reduce_scatter: every rank gets its own piece of the sum (or mean) over all ranks.

use super::Input;
use super::workspace::{
    CHUNK_ELEMS, Chunks, Out, Region, check_outputs, exchange_checked, with_workspace,
};
use crate::device::DeviceWorld;
use crate::device::capability::Op;
use crate::device::device_data;
use crate::device::tile::{self, Tile};
use crate::device::{LaunchMode, ascend, capability, cuda, launch};
use crate::shmem::{GlobalPtr, GlobalPtrMut, MAX_WORDS, Rank, digest};
use crate::tensor::{Tensor, array_split, split_offsets};
use crate::{Element, Result};

/// Elements per reduction task: each program holds one tile per rank, so these are smaller than
/// the copy chunks.
const REDUCE_CHUNK_ELEMS: usize = 4 * 1024;

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum over ranks.
    Sum,
    /// The sum over ranks divided by the number of ranks.
    Mean,
}

/// Sums (or averages) `input` over all ranks and gives rank `r` the `r`-th piece, split as
/// `numpy.array_split` splits `input.len()`: the first `len % world` ranks get one more element.
///
/// The sum runs in rank order 0, 1, 2, ... on every rank, accumulating in `T::Acc` and rounding
/// once: the same bits on every run.
///
/// # Errors
/// [`Error::RanksDisagree`](crate::Error::RanksDisagree) when the lengths (or ops) differ between
/// ranks; otherwise as [`all_gather`](super::all_gather).
///
/// # Examples
/// ```
/// use dist_tensor::collectives::{self, ReduceOp};
/// use dist_tensor::World;
/// let out = World::threads(2)?.run(|rank| {
///     let x = [1.0f32, 2.0, 3.0].map(|v| v * (rank.rank() + 1) as f32);
///     collectives::reduce_scatter(rank, &x, ReduceOp::Sum)
/// })?;
/// assert_eq!(out, vec![vec![3.0, 6.0], vec![9.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn reduce_scatter<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
    op: ReduceOp,
) -> Result<Vec<T>> {
    let input = input.into();
    reduce_scatter_cols(rank, input, 1, &array_split(input.len(), rank.num_ranks()), op)
}

/// [`reduce_scatter`] into the caller's `out`, which must hold this rank's piece.
///
/// # Errors
/// As [`reduce_scatter`], and [`Error::InvalidArgument`](crate::Error::InvalidArgument) on every
/// rank when a rank's `out` has the wrong length.
///
/// # Examples
/// ```
/// use dist_tensor::collectives::{self, ReduceOp};
/// use dist_tensor::World;
/// World::threads(2)?.run(|rank| {
///     let mut out = [0.0f32; 1];
///     collectives::reduce_scatter_into(rank, &[1.0, 2.0], ReduceOp::Sum, &mut out)?;
///     assert_eq!(out[0], if rank.rank() == 0 { 2.0 } else { 4.0 });
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn reduce_scatter_into<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
    op: ReduceOp,
    out: &mut [T],
) -> Result<()> {
    let input = input.into();
    let counts = array_split(input.len(), rank.num_ranks());
    reduce(Op::ReduceScatter, rank, input, 1, Pieces::Split(&counts), op, Out::Into(out)).map(drop)
}

/// [`reduce_scatter_cols`] into the caller's `out`, which must hold `[rows, counts[rank]]`.
///
/// # Errors
/// As [`reduce_scatter_into`].
///
/// # Examples
/// ```
/// use dist_tensor::collectives::{self, ReduceOp};
/// use dist_tensor::World;
/// World::threads(2)?.run(|rank| {
///     let x = [1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2, 3] on every rank
///     let mut out = vec![0.0; 2 * [1, 2][rank.rank()]]; // [2, counts[rank]]
///     collectives::reduce_scatter_cols_into(rank, &x, 2, &[1, 2], ReduceOp::Sum, &mut out)?;
///     let want: &[f64] = if rank.rank() == 0 { &[2.0, 8.0] } else { &[4.0, 6.0, 10.0, 12.0] };
///     assert_eq!(out, want);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn reduce_scatter_cols_into<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
    rows: usize,
    counts: &[usize],
    op: ReduceOp,
    out: &mut [T],
) -> Result<()> {
    reduce(Op::ReduceScatter, rank, input.into(), rows, Pieces::Split(counts), op, Out::Into(out))
        .map(drop)
}

/// Reduces row-major `[rows, sum of counts]` inputs over all ranks and gives rank `r` its column
/// block `[rows, counts[r]]` (the reduce_scatter of a tensor onto a shard of any dimension).
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when `counts` does not have one entry
/// per rank or `input` is not `rows x sum(counts)`;
/// [`Error::RanksDisagree`](crate::Error::RanksDisagree) when ranks pass different `rows`,
/// `counts` or `op`. Every rank returns the error.
///
/// # Examples
/// ```
/// use dist_tensor::collectives::{self, ReduceOp};
/// use dist_tensor::World;
/// let out = World::threads(2)?.run(|rank| {
///     // [2, 3] on every rank; rank 0 gets columns 0..1, rank 1 columns 1..3.
///     let x = [1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0];
///     collectives::reduce_scatter_cols(rank, &x, 2, &[1, 2], ReduceOp::Mean)
/// })?;
/// assert_eq!(out, vec![vec![1.0, 4.0], vec![2.0, 3.0, 5.0, 6.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn reduce_scatter_cols<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
    rows: usize,
    counts: &[usize],
    op: ReduceOp,
) -> Result<Vec<T>> {
    Ok(reduce(Op::ReduceScatter, rank, input.into(), rows, Pieces::Split(counts), op, Out::Alloc)?
        .expect("allocated"))
}

/// The reduce_scatter, for the call `name` (see `all_gather::gather`).
/// The reduction on a CUDA world's GPUs: the input moves to this rank's GPU, is summed there in
/// rank order over every rank, and this rank's columns come back.
fn on_gpus<T: Element>(
    gpus: &cuda::CudaWorld,
    rank: &Rank<'_>,
    input: Input<'_, T>,
    rows: usize,
    counts: &[usize],
    whole: bool,
    op: ReduceOp,
) -> Result<Vec<T>> {
    let me = rank.rank();
    let total: usize = counts.iter().sum();
    let block = input.on_device(rank, &[rows, total])?;
    let sum = cuda::reduce_sum(gpus, rank, device_data(&block), None)?;
    let sum = Tensor::from_device_storage(sum).to_host()?;
    let (start, len) = if whole { (0, total) } else { (split_offsets(counts)[me], counts[me]) };
    let scale = 1.0 / rank.num_ranks() as f64;
    let mut mine = Vec::with_capacity(rows * len);
    for row in sum.as_slice().chunks(total.max(1)).take(rows) {
        let cols = &row[start..start + len];
        match op {
            ReduceOp::Sum => mine.extend_from_slice(cols),
            ReduceOp::Mean => mine.extend(cols.iter().map(|&v| T::from_f64(v.to_f64() * scale))),
        }
    }
    Ok(mine)
}

/// Which columns of the sum each rank gets.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pieces<'a> {
    /// Rank `r` gets `counts[r]` columns, in rank order (a reduce_scatter).
    Split(&'a [usize]),
    /// Every rank gets every column (a one-shot all_reduce: each rank reads every peer's whole
    /// input and sums it, in one round).
    Whole,
}

pub(crate) fn reduce<T: Element>(
    which: Op,
    rank: &Rank<'_>,
    input: Input<'_, T>,
    rows: usize,
    pieces: Pieces<'_>,
    op: ReduceOp,
    out: Out<'_, T>,
) -> Result<Option<Vec<T>>> {
    let name = which.name();
    let (me, n) = (rank.rank(), rank.num_ranks());
    // A whole sum agrees on the even split of the columns (the same on every rank that agrees
    // on the length).
    let even;
    let (counts, whole) = match pieces {
        Pieces::Split(counts) => (counts, false),
        Pieces::Whole => {
            even = array_split(input.len().checked_div(rows).unwrap_or(0), n);
            (&even[..], true)
        }
    };
    let total = counts.iter().try_fold(0usize, |t, &c| t.checked_add(c));
    let problem = if counts.len() != n {
        Some(format!("{} split counts for a world of {n} ranks", counts.len()))
    } else if total.and_then(|t| rows.checked_mul(t)) != Some(input.len()) {
        Some(format!("{} elements are not {rows} rows of {total:?}", input.len()))
    } else {
        capability::dtype_problem(which, rank.device(), T::DTYPE)
    };
    let total = total.unwrap_or(0);
    // The counts must be the same on every rank: each sends a digest, and the counts themselves
    // where they fit (for a message that names the count that differs).
    let spelled = n + 5 <= MAX_WORDS;
    let mut words = vec![
        rows as u64,
        input.len() as u64,
        // The op, and whether every rank gets the whole sum (one-shot and two-shot calls must
        // not meet).
        op as u64 | u64::from(whole) << 8,
        digest(counts.iter().map(|&c| c as u64)),
        out.len_word(),
    ];
    if spelled {
        words.extend((0..n).map(|i| counts.get(i).map_or(u64::MAX, |&c| c as u64)));
    }
    let all = exchange_checked::<T>(rank, name, &words, problem, &[])?;
    all.agree(name, 0, "rows")?;
    all.agree(name, 1, "input length")?;
    all.agree(name, 2, "reduce op (and one-shot or not)")?;
    if spelled {
        for i in 0..n {
            all.agree(name, 5 + i, &format!("count[{i}]"))?;
        }
    }
    all.agree(name, 3, "digest of the split counts")?;
    check_outputs(name, &all, 4, |r| if whole { rows * total } else { rows * counts[r] })?;
    let mine =
        match rank.device_world() {
            DeviceWorld::Host => None,
            DeviceWorld::Ascend(world) => {
                let npu = ascend::AscendRank { world, rank };
                let mean = op == ReduceOp::Mean;
                assert!(!whole, "a whole sum on an NPU goes as reduce_scatter then all_gather");
                Some(input.host().and_then(|input| {
                    ascend::launch::reduce_scatter(&npu, &input, rows, counts, mean)
                }))
            }
            DeviceWorld::Cuda(gpus) => Some(on_gpus(gpus, rank, input, rows, counts, whole, op)),
        };
    if let Some(mine) = mine {
        let mine = mine.inspect_err(|e| rank.fail_after_agreeing(e))?;
        return out.fill(name, mine.len(), |out| {
            out.copy_from_slice(&mine);
            Ok(())
        });
    }
    let input = input.host().inspect_err(|e| rank.fail_after_agreeing(e))?;
    let input = &*input;
    with_workspace::<T, _>(rank, |ws| {
        let col_offsets = split_offsets(counts);
        let piece = |r: usize| if whole { (0, total) } else { (col_offsets[r], counts[r]) };
        let mine = piece(me).1;
        if n > 1 {
            ws.reserve(rank, input.len())?;
            // Ranks of other nodes put this rank's columns of their input here, one slot each.
            let widest = (0..n).map(|r| piece(r).1).max().unwrap_or(0);
            ws.reserve_mirror(rank, n * rows * widest)?;
        }
        let region = |dst: usize| {
            let (start, cols) = piece(dst);
            Region { start, stride: total, rows, cols }
        };
        let slot = |src: usize, dst: usize| src * rows * piece(dst).1;
        let targets = ws.remote_targets(rank, |dst| Some((region(dst), slot(me, dst))));

        let grid = rank.topology().aivector_core_num();
        let ready_at = ws.publish(|_| n > 1, grid);
        let publish = Chunks::new(rows, total, CHUNK_ELEMS);
        let reduce = Chunks::new(rows, mine, REDUCE_CHUNK_ELEMS);
        let ranks = <T::Acc as Element>::from_f64(n as f64);
        let input_ptr = GlobalPtr::from_slice(input);
        let ws = &*ws;
        out.fill(name, rows.saturating_mul(mine), |out| {
            let output = GlobalPtrMut::from_slice(out);
            // SAFETY: as in all_gather: a rank writes its own staging buffer before notifying, peers
            // read it after waiting; each task writes its own chunk of `out`.
            unsafe {
                launch(rank, LaunchMode::VectorOnly, grid, |p| {
                    if n > 1 {
                        ws.push_remote(p, input_ptr, &targets)?;
                        ws.publish_part(p, input_ptr, &publish, total)?;
                    }
                    let (br, bc) = reduce.block();
                    let mut parts: Vec<Tile<T>> =
                        (0..n).map(|_| Tile::new(br, bc, T::zero())).collect();
                    let mut acc = Tile::new(br, bc, <T::Acc as Element>::zero());
                    let mut rounded = Tile::new(br, bc, T::zero());
                    for t in p.tasks(reduce.count) {
                        let c = reduce.get(t);
                        // Load in rotated order, so ranks do not all read the same peer at once...
                        for i in 0..n {
                            let src = (me + i) % n;
                            let from =
                                ws.source(p, src, input_ptr, &ready_at, region(me), slot(src, me))?;
                            tile::load_2d(
                                from.at(c.row, c.col),
                                from.stride,
                                (c.rows, c.cols),
                                T::zero(),
                                &mut parts[src],
                            );
                        }
                        // ...and add in rank order, so every run gives the same bits.
                        let acc_data = acc.as_mut_slice();
                        for (a, &x) in acc_data.iter_mut().zip(parts[0].as_slice()) {
                            *a = x.to_acc();
                        }
                        for part in &parts[1..] {
                            for (a, &x) in acc_data.iter_mut().zip(part.as_slice()) {
                                *a += x.to_acc();
                            }
                        }
                        if op == ReduceOp::Mean {
                            for a in acc_data.iter_mut() {
                                *a = *a / ranks;
                            }
                        }
                        acc.cast_into(&mut rounded);
                        tile::store_2d(
                            output + (c.row * mine + c.col),
                            mine,
                            &rounded,
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
