//! Expert-parallel combine: the experts' outputs go back to the ranks their tokens came from and
//! are summed per token with the gate weights, the inverse of
//! [`moe_dispatch`](super::moe_dispatch).
//!
//! Fused (`moe_combine`): each output row is put straight into its source's symmetric return
//! buffer (laid out in the source's own send order), a signal per owner, and the source sums its
//! tokens' rows with their weights in the same kernel as they arrive (see
//! `device::host::moe_combine`). Unfused (`moe_combine_unfused`), as a user writes it: the rows
//! reordered source-major, [`all_to_all_v`](collectives::all_to_all_v), and the weighted sum.
//! Both sum a token's slots in slot order in the accumulator type, rounded once: the same bits.

use super::moe_dispatch::{Dispatched, foreign_plan, plan_digest};
use crate::collectives;
use crate::device::capability::{self, Op};
use crate::device::host::moe_combine::{rows_back, slot_rows, weighted_sum};
use crate::device::host::moe_dispatch::MoePlan;
use crate::device::{DeviceWorld, host};
use crate::shmem::{Call, Rank};
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

const OP: &str = "moe_combine";
const UNFUSED_OP: &str = "moe_combine_unfused";

/// Brings the experts' outputs `y` `[received, width]` (row `i` the output for row `i` of
/// `dispatched.rows`) back to the ranks their tokens came from, and sums each token's rows
/// weighted by `weight` `[tokens, top_k]` (the routing's weights, or any others of that shape):
/// `out[t] = sum_slot weight[t, slot] * y[row of (t, slot)]`, `[tokens, width]` on each rank,
/// 0 for a token whose every slot was dropped. Collective.
///
/// # Errors
/// On every rank: [`Error::InvalidArgument`] naming the rank whose `y` does not have a row per
/// dispatched row, whose `weight` is not `[tokens, top_k]`, or whose `dispatched` came from
/// another world or rank; [`Error::RanksDisagree`] when `width` differs between ranks or the
/// ranks pass the plans of different dispatches; and as every collective.
///
/// # Examples
/// ```
/// use dist_tensor::fused::{moe_combine, moe_dispatch};
/// use dist_tensor::tensor::{Routed, Tensor};
/// use dist_tensor::World;
/// // 2 experts, one per rank; every token to both, weights 0.25 and 0.75.
/// let outs = World::threads(2)?.run(|rank| {
///     let x = Tensor::<f64>::from_shape_vec(&[1, 2], vec![1.0, 2.0])?;
///     let w = Tensor::from_shape_vec(&[1, 2], vec![0.25, 0.75])?;
///     let routed = Routed::from_parts(2, vec![0, 1], w)?;
///     let got = moe_dispatch(rank, &x, &routed)?;
///     // Expert e multiplies by e + 1: 0.25 * x + 0.75 * 2x.
///     let y = &got.rows * (rank.rank() as f64 + 1.0);
///     Ok(moe_combine(rank, &y, &got, &routed.weight)?.as_slice().to_vec())
/// })?;
/// assert_eq!(outs, vec![vec![1.75, 3.5]; 2]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn moe_combine<T: Element>(
    rank: &Rank<'_>,
    y: &Tensor<T>,
    dispatched: &Dispatched<T>,
    weight: &Tensor<T>,
) -> Result<Tensor<T>> {
    run(rank, y, dispatched, weight, true)
}

/// The unfused baseline of [`moe_combine`], as a user writes it with this library: the outputs
/// reordered by source ([`Tensor::index_select`]), one
/// [`all_to_all_v`](collectives::all_to_all_v), and the weighted sum per token. The same bits as
/// [`moe_combine`].
///
/// # Errors
/// As [`moe_combine`].
pub fn moe_combine_unfused<T: Element>(
    rank: &Rank<'_>,
    y: &Tensor<T>,
    dispatched: &Dispatched<T>,
    weight: &Tensor<T>,
) -> Result<Tensor<T>> {
    run(rank, y, dispatched, weight, false)
}

fn agree<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    y: &Tensor<T>,
    plan: &MoePlan,
    weight: &Tensor<T>,
) -> Result<()> {
    let (s, rows) = (y.shape(), plan.received(plan.me));
    let problem = foreign_plan(rank, plan)
        .or_else(|| {
            (s.len() != 2 || s[0] != rows)
                .then(|| format!("y {s:?} does not have the {rows} dispatched rows"))
        })
        .or_else(|| {
            (!y.is_on_host() || !weight.is_on_host()).then(|| "a tensor on a device".into())
        })
        .or_else(|| {
            let want = [plan.tokens[plan.me], plan.top_k];
            (weight.shape() != want)
                .then(|| format!("weight {:?} is not [tokens, top_k] = {want:?}", weight.shape()))
        })
        .or_else(|| capability::dtype_problem(Op::MoeCombine, rank.device(), T::DTYPE));
    let width = s.get(1).copied().unwrap_or(0) as u64;
    let all = rank.exchange(Call::of::<T>(op), &[width, plan_digest(plan)], problem, &[])?;
    all.agree(op, 0, "width")?;
    if let Some(bad) = all.iter().position(|w| w[1] != all[0][1]) {
        return Err(Error::RanksDisagree {
            op,
            rank_a: 0,
            value_a: format!("the plan of one dispatch (digest {:#x})", all[0][1]),
            rank_b: bad,
            value_b: format!("the plan of another (digest {:#x})", all[bad][1]),
        });
    }
    Ok(())
}

fn run<T: Element>(
    rank: &Rank<'_>,
    y: &Tensor<T>,
    dispatched: &Dispatched<T>,
    weight: &Tensor<T>,
    fused: bool,
) -> Result<Tensor<T>> {
    combine_with(rank, y, &dispatched.plan, weight, fused)
}

/// [`moe_combine`] (or its baseline) with a plan: the backward passes' return of rows.
pub(crate) fn combine_with<T: Element>(
    rank: &Rank<'_>,
    y: &Tensor<T>,
    plan: &MoePlan,
    weight: &Tensor<T>,
    fused: bool,
) -> Result<Tensor<T>> {
    let op = if fused { OP } else { UNFUSED_OP };
    agree(op, rank, y, plan, weight)?;
    match rank.device_world() {
        DeviceWorld::Host if fused => host::moe_combine::moe_combine(rank, plan, y, weight),
        _ => unfused(rank, plan, y, weight),
    }
    .inspect_err(|e| rank.fail_after_agreeing(e))
}

/// The unfused baseline after the agreement.
fn unfused<T: Element>(
    rank: &Rank<'_>,
    plan: &MoePlan,
    y: &Tensor<T>,
    weight: &Tensor<T>,
) -> Result<Tensor<T>> {
    let (me, n, k, width) = (plan.me, plan.ranks, plan.top_k, y.shape()[1]);
    let (back, start) = rows_back(plan);
    let send = y.index_select(0, &back.iter().map(|&(from, _)| from).collect::<Vec<_>>())?;
    let counts: Vec<usize> = (0..n).map(|s| (start[s + 1] - start[s]) * width).collect();
    // Arrives in (owner, expert, order): this rank's send order.
    let got = collectives::all_to_all_v(rank, send.as_slice(), &counts)?;
    let (slot_row, tokens) = (slot_rows(plan), plan.tokens[me]);
    let mut out = vec![T::zero(); tokens * width];
    let zero = <T::Acc as Element>::zero();
    let (mut acc, mut scratch) = (vec![zero; width], vec![T::zero(); width]);
    for (t, row) in out.chunks_exact_mut(width.max(1)).enumerate().take(tokens) {
        let load = |i: usize, into: &mut [T]| into.copy_from_slice(&got[i * width..][..width]);
        weighted_sum(t, k, (&slot_row, weight.as_slice()), load, (&mut acc, &mut scratch), row);
    }
    Tensor::from_shape_vec(&[tokens, width], out)
}
