//! all_reduce: every rank gets the sum over all ranks.

use super::all_gather::{gather, gather_agreeing};
use super::reduce_scatter::reduce;
use super::workspace::{Out, check_outputs};
use super::{Input, ReduceOp};
use crate::device::DeviceWorld;
use crate::device::capability::Op;
use crate::shmem::{Exchanged, Rank};
use crate::tensor::{array_split, pool};
use crate::{Element, Result};

/// Its own name in both exchanges: a rank in all_reduce never meets a rank in a plain
/// reduce_scatter or all_gather (which would otherwise agree on the first half).
const OP: &str = "all_reduce";

/// Whether the sum goes as [`pair_sum`]: two ranks on the host (a device world keeps its own
/// kernels).
fn as_pair(rank: &Rank<'_>) -> bool {
    rank.num_ranks() == 2 && matches!(rank.device_world(), DeviceWorld::Host)
}

/// all_reduce over two ranks: each gets the other's whole input in one exchange and adds the
/// two in rank order. The same bytes cross as in a reduce_scatter then an all_gather (half the
/// input each way, twice), in one round instead of two, each round an agreement and a wait for
/// the peer: on a cross-node data-parallel pair behind a slow link, half the hops of the
/// averaging. The sums are the owner's of the two-step form, element for element, so the bits
/// are the same.
fn pair_sum<T: Element>(
    rank: &Rank<'_>,
    input: Input<'_, T>,
    out: Out<'_, T>,
) -> Result<Option<Vec<T>>> {
    let len = input.len();
    let agree = |all: &Exchanged| {
        all.agree(OP, 1, "input length")?;
        check_outputs(OP, all, 3, |_| len)
    };
    let both =
        gather_agreeing(Op::AllReduce, rank, input, 1, Out::Alloc, &[out.len_word()], agree)?
            .expect("allocated");
    let (first, second) = both.split_at(len);
    let summed = out.fill(OP, len, |out| {
        for ((o, &a), &b) in out.iter_mut().zip(first).zip(second) {
            *o = T::from_acc(a.to_acc() + b.to_acc());
        }
        Ok(())
    });
    // The next call's exchange takes this buffer again instead of fresh pages.
    pool::give(both);
    summed
}

/// The reduce_scatter half: this rank's piece of the sum.
fn reduced_piece<T: Element>(rank: &Rank<'_>, input: Input<'_, T>) -> Result<Vec<T>> {
    let counts = array_split(input.len(), rank.num_ranks());
    Ok(reduce(Op::AllReduce, rank, input, 1, &counts, ReduceOp::Sum, Out::Alloc)?
        .expect("allocated"))
}

/// Sums `input` over all ranks; every rank gets the whole sum.
///
/// Done as a [`reduce_scatter`](super::reduce_scatter) (each rank sums its piece, in rank order) followed by an
/// [`all_gather`](super::all_gather) of the pieces: every element is summed once, by one rank, so every rank gets the
/// same bits, and the same bits on every run. Over two ranks of the host it is one exchange of
/// the whole inputs instead, each rank adding the two in rank order: the same bytes in half the
/// rounds, and the same bits.
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
    if as_pair(rank) {
        return Ok(pair_sum(rank, input.into(), Out::Alloc)?.expect("allocated"));
    }
    let piece = reduced_piece(rank, input.into())?;
    Ok(gather(Op::AllReduce, rank, (&piece).into(), 1, Out::Alloc)?.expect("allocated"))
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
    if as_pair(rank) {
        return pair_sum(rank, input.into(), Out::Into(out)).map(drop);
    }
    let piece = reduced_piece(rank, input.into())?;
    gather(Op::AllReduce, rank, (&piece).into(), 1, Out::Into(out)).map(drop)
}
