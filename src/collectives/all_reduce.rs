//! all_reduce: every rank gets the sum over all ranks.

use super::all_gather::gather;
use super::reduce_scatter::reduce;
use super::workspace::Out;
use super::{Input, ReduceOp};
use crate::shmem::Rank;
use crate::tensor::array_split;
use crate::{Element, Result};

/// Its own name in both exchanges: a rank in all_reduce never meets a rank in a plain
/// reduce_scatter or all_gather (which would otherwise agree on the first half).
const OP: &str = "all_reduce";

/// The reduce_scatter half: this rank's piece of the sum.
fn reduced_piece<T: Element>(rank: &Rank<'_>, input: Input<'_, T>) -> Result<Vec<T>> {
    let counts = array_split(input.len(), rank.num_ranks());
    Ok(reduce(OP, rank, input, 1, &counts, ReduceOp::Sum, Out::Alloc)?.expect("allocated"))
}

/// Sums `input` over all ranks; every rank gets the whole sum.
///
/// Done as a [`reduce_scatter`](super::reduce_scatter) (each rank sums its piece, in rank order) followed by an
/// [`all_gather`](super::all_gather) of the pieces: every element is summed once, by one rank, so every rank gets the
/// same bits, and the same bits on every run.
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
    let piece = reduced_piece(rank, input.into())?;
    Ok(gather(OP, rank, (&piece).into(), 1, Out::Alloc)?.expect("allocated"))
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
    let piece = reduced_piece(rank, input.into())?;
    gather(OP, rank, (&piece).into(), 1, Out::Into(out)).map(drop)
}
