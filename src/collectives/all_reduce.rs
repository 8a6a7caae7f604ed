//! all_reduce: every rank gets the sum over all ranks.

use super::all_gather::gather;
use super::reduce_scatter::{Pieces, reduce};
use super::workspace::Out;
use super::{Input, ReduceOp};
use crate::device::DeviceWorld;
use crate::device::capability::Op;
use crate::shmem::Rank;
use crate::tensor::array_split;
use crate::{Element, Result};

/// On a host world of `n` ranks, [`all_reduce`] goes one-shot (one round in which each rank
/// reads every peer's whole input and sums it) while the ranks together read at most this many
/// bytes, `n * n * bytes per rank`; past it, two-shot (a reduce_scatter, then an all_gather: two
/// rounds, each an agreement, a launch and a wait for the peers, but every rank reads `2 / n`
/// of the inputs instead of all of them). Measured with `perf_report --all-reduce` on a 2-core
/// Zen 3 (docs/results/2026-12-07-all-reduce-zen3.md): one-shot took 0.43 to 0.83 of two-shot's
/// time up to 64 KiB per rank at 4 ranks and 16 KiB at 8, and 1.10 to 1.17 at 256 KiB and
/// 64 KiB; this budget puts the change between them (128 KiB at 4 ranks, 32 KiB at 8).
pub const ONE_SHOT_MAX_READ_BYTES: usize = 2 << 20;

/// How an all_reduce goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shots {
    One,
    Two,
}

/// The form [`all_reduce`] takes for `bytes` of input: one-shot on the host within
/// [`ONE_SHOT_MAX_READ_BYTES`] (and at any size over two ranks, where both forms read the same
/// bytes); one-shot on GPUs, whose reduction kernel sums every rank's whole input anyway; two
/// rounds on NPUs, whose kernels reduce pieces only.
fn shots(rank: &Rank<'_>, bytes: usize) -> Shots {
    match rank.device_world() {
        DeviceWorld::Host => {
            let n = rank.num_ranks();
            let read = bytes.saturating_mul(n * n);
            if n <= 2 || read <= ONE_SHOT_MAX_READ_BYTES { Shots::One } else { Shots::Two }
        }
        DeviceWorld::Cuda(_) => Shots::One,
        _ => Shots::Two,
    }
}

/// The sum in `shots`, into `out`.
fn sum<T: Element>(
    rank: &Rank<'_>,
    input: Input<'_, T>,
    out: Out<'_, T>,
    shots: Shots,
) -> Result<Option<Vec<T>>> {
    match shots {
        Shots::One => reduce(Op::AllReduce, rank, input, 1, Pieces::Whole, ReduceOp::Sum, out),
        Shots::Two => {
            let counts = array_split(input.len(), rank.num_ranks());
            let piece = reduce(
                Op::AllReduce,
                rank,
                input,
                1,
                Pieces::Split(&counts),
                ReduceOp::Sum,
                Out::Alloc,
            )?
            .expect("allocated");
            gather(Op::AllReduce, rank, (&piece).into(), 1, out)
        }
    }
}

/// Sums `input` over all ranks; every rank gets the whole sum.
///
/// Every element is summed in rank order, accumulating in `T::Acc` and rounding once, so every
/// rank gets the same bits, on every run, whichever form the sum takes: one-shot (each rank
/// reads every peer's whole input and sums it: one round) for small inputs on the host (within
/// [`ONE_SHOT_MAX_READ_BYTES`]), over two host ranks, and on GPUs; otherwise two-shot, a
/// [`reduce_scatter`](super::reduce_scatter) (each rank sums its piece) then an
/// [`all_gather`](super::all_gather) of the pieces ([`all_reduce_one_shot`] and
/// [`all_reduce_two_shot`] choose).
///
/// # Errors
/// As [`reduce_scatter`](super::reduce_scatter).
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// let out = World::threads(3)?.run(|rank| {
///     collectives::all_reduce(rank, &[1.0f32, rank.rank() as f32])
/// })?;
/// assert!(out.iter().all(|o| o == &vec![3.0, 3.0]));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_reduce<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
) -> Result<Vec<T>> {
    let input = input.into();
    let shots = shots(rank, input.len() * size_of::<T>());
    Ok(sum(rank, input, Out::Alloc, shots)?.expect("allocated"))
}

/// [`all_reduce`] in one round whatever the size: each rank reads every peer's whole input
/// (through `symm_at` in one node) and sums it in rank order. The same bits as
/// [`all_reduce_two_shot`]. On an NPU world it goes in two rounds (its kernels reduce pieces).
///
/// # Errors
/// As [`all_reduce`].
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// World::threads(3)?.run(|rank| {
///     let x: Vec<f32> = (0..5).map(|i| (i * (rank.rank() + 1)) as f32 / 7.0).collect();
///     assert_eq!(collectives::all_reduce_one_shot(rank, &x)?, collectives::all_reduce_two_shot(rank, &x)?);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_reduce_one_shot<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
) -> Result<Vec<T>> {
    let shots = match rank.device_world() {
        DeviceWorld::Ascend(_) => Shots::Two,
        _ => Shots::One,
    };
    Ok(sum(rank, input.into(), Out::Alloc, shots)?.expect("allocated"))
}

/// [`all_reduce`] in two rounds whatever the size: a reduce_scatter (each rank sums its
/// `array_split` piece of every rank's input) then an all_gather of the pieces.
///
/// # Errors
/// As [`all_reduce`].
pub fn all_reduce_two_shot<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
) -> Result<Vec<T>> {
    Ok(sum(rank, input.into(), Out::Alloc, Shots::Two)?.expect("allocated"))
}

/// [`all_reduce`] into the caller's `out`, which must be as long as `input`.
///
/// # Errors
/// As [`all_reduce`], and [`Error::InvalidArgument`](crate::Error::InvalidArgument) on every rank
/// when a rank's `out` has the wrong length.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
/// World::threads(2)?.run(|rank| {
///     let mut out = [0.0f32; 2];
///     collectives::all_reduce_into(rank, &[1.0, 2.0], &mut out)?;
///     assert_eq!(out, [2.0, 4.0]);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_reduce_into<'a, T: Element>(
    rank: &Rank<'_>,
    input: impl Into<Input<'a, T>>,
    out: &mut [T],
) -> Result<()> {
    let input = input.into();
    let shots = shots(rank, input.len() * size_of::<T>());
    sum(rank, input, Out::Into(out), shots).map(drop)
}
