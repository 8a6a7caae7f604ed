//! Expert-parallel dispatch: each rank's tokens go to the ranks that hold their experts (the
//! experts split over the ranks as `numpy.array_split` splits them), as a [`Routed`] says.
//!
//! Fused (`moe_dispatch`), in the seed's model: one small exchange of every rank's rows per
//! expert (with the agreement), then each row is put straight from the token's input into its
//! owner's symmetric buffer at the offset the counts give it, a signal per source, and the
//! owner copies out each source's block as soon as that source is complete (see
//! `device::host::moe_dispatch`). Unfused (`moe_dispatch_unfused`), as a user writes it: the
//! rows gathered in expert order, [`all_to_all_v`](collectives::all_to_all_v), and the received
//! rows reordered from source-major to expert-major. Both give the same bits.
//!
//! [`moe_combine`](super::moe_combine) brings the experts' outputs back the same way.

use std::ops::Range;

use crate::Result;
use crate::collectives;
use crate::device::capability::{self, Op};
use crate::device::host::moe_dispatch::MoePlan;
use crate::device::{DeviceWorld, host};
use crate::shmem::{Call, MAX_WORDS, Rank, digest};
use crate::tensor::{DROPPED, Element, Routed, Tensor};

const OP: &str = "moe_dispatch";
const UNFUSED_OP: &str = "moe_dispatch_unfused";

/// What a rank's experts receive from a dispatch, and the plan that brings their outputs back.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatched<T: Element> {
    /// `[received, hidden]`: the rows of this rank's experts, grouped by expert (in order), then
    /// by source rank, then in the source's token order (a token's slots in decreasing weight).
    pub rows: Tensor<T>,
    /// The experts this rank holds.
    pub experts: Range<usize>,
    /// Rows of each of this rank's experts.
    pub expert_rows: Vec<usize>,
    pub(crate) plan: MoePlan,
}

impl<T: Element> Dispatched<T> {
    /// The rows of `rows` that expert `e` (one of this rank's) takes.
    ///
    /// # Panics
    /// If this rank does not hold `e`.
    pub fn rows_of(&self, e: usize) -> Range<usize> {
        assert!(self.experts.contains(&e), "expert {e} is not one of {:?}", self.experts);
        let before: usize = self.expert_rows[..e - self.experts.start].iter().sum();
        before..before + self.expert_rows[e - self.experts.start]
    }
}

/// Sends each of this rank's tokens `x` `[tokens, hidden]` to the experts `routed` picks for it,
/// each expert held by one rank (experts split over the ranks as `numpy.array_split` splits
/// them). Collective.
///
/// Returns the rows this rank's experts receive ([`Dispatched::rows`]), with the plan
/// [`moe_combine`](super::moe_combine) takes to bring the experts' outputs back. Token counts
/// may differ between ranks and be 0; experts may receive nothing; dropped slots stay home.
///
/// # Errors
/// On every rank: [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming the rank whose `x` is not `[tokens, hidden]`
/// for its routing's tokens, whose routing names an expert out of range, or whose backend has no
/// kernel for the op or the element type (the capability table); [`Error::RanksDisagree`](crate::Error::RanksDisagree) when
/// ranks pass different `hidden`, number of experts or `top_k`; and as every collective
/// (a symmetric heap too small for the rows an owner receives is
/// [`Error::SymmetricMemoryExhausted`](crate::Error::SymmetricMemoryExhausted)).
///
/// # Examples
/// ```
/// use dist_tensor::fused::{moe_combine, moe_dispatch};
/// use dist_tensor::tensor::{route, Router, Tensor};
/// use dist_tensor::World;
///
/// // 4 experts over 2 ranks (0-1 on rank 0, 2-3 on rank 1), top-2, 5 tokens a rank.
/// let outs = World::threads(2)?.run(|rank| {
///     let x = Tensor::<f64>::random(&[5, 8], rank.rank() as u64);
///     let logits = Tensor::<f64>::random(&[5, 4], 10 + rank.rank() as u64);
///     let routed = route(&logits, &Router::softmax_top_k(2))?;
///     let got = moe_dispatch(rank, &x, &routed)?;
///     assert_eq!(got.rows.shape()[0], got.expert_rows.iter().sum::<usize>());
///     // Experts that return their rows unchanged give back each token times its weights' sum.
///     let back = moe_combine(rank, &got.rows, &got, &routed.weight)?;
///     let same = back.as_slice().iter().zip(x.as_slice()).all(|(a, b)| (a - b).abs() < 1e-12);
///     Ok(same)
/// })?;
/// assert_eq!(outs, vec![true, true]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn moe_dispatch<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    routed: &Routed<T>,
) -> Result<Dispatched<T>> {
    run(rank, x, routed, true)
}

/// The unfused baseline of [`moe_dispatch`], as a user writes it with this library: the rows
/// gathered in expert order ([`Tensor::index_select`]), one
/// [`all_to_all_v`](collectives::all_to_all_v), and the received rows reordered by expert. The
/// same bits as [`moe_dispatch`].
///
/// # Errors
/// As [`moe_dispatch`].
pub fn moe_dispatch_unfused<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    routed: &Routed<T>,
) -> Result<Dispatched<T>> {
    run(rank, x, routed, false)
}

/// What is wrong with this rank's inputs, if anything.
fn problem<T: Element>(rank: &Rank<'_>, x: &Tensor<T>, routed: &Routed<T>) -> Option<String> {
    let (s, k, e) = (x.shape(), routed.top_k, routed.experts);
    if s.len() != 2 {
        return Some(format!("x {s:?} is not [tokens, hidden]"));
    }
    if !x.is_on_host() {
        return Some(format!("x is on {}; dispatch takes host tensors", x.device()));
    }
    if k == 0 || routed.expert.len() != s[0] * k || routed.weight.shape() != [s[0], k] {
        return Some(format!(
            "routing of {} slots, weights {:?} and top_k {k} for x {s:?}",
            routed.expert.len(),
            routed.weight.shape()
        ));
    }
    if let Some(bad) = routed.expert.iter().find(|&&x| x != DROPPED && x as usize >= e) {
        return Some(format!("the routing names expert {bad} of {e}"));
    }
    capability::dtype_problem(Op::MoeDispatch, rank.device(), T::DTYPE)
}

/// Fixed words of the first exchange: hidden, experts, top_k, tokens.
const FIXED: usize = 4;

/// Exchanges every rank's rows per expert with the agreement, in as many exchanges as the
/// counts need; the plan of this rank.
pub(crate) fn agree<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    x: &Tensor<T>,
    routed: &Routed<T>,
    more: impl FnOnce() -> Option<String>,
) -> Result<MoePlan> {
    let problem = problem(rank, x, routed).or_else(more);
    let experts = routed.experts;
    let mut counts = vec![0u64; experts];
    if problem.is_none() {
        for &e in routed.expert.iter().filter(|&&e| e != DROPPED) {
            counts[e as usize] += 1;
        }
    }
    let dim = |i: usize| x.shape().get(i).copied().unwrap_or(0) as u64;
    let first = counts.len().min(MAX_WORDS - FIXED);
    let mut words = vec![dim(1), experts as u64, routed.top_k as u64, dim(0)];
    words.extend_from_slice(&counts[..first]);
    let all = rank.exchange(Call::of::<T>(op), &words, problem, &[])?;
    for (i, what) in ["hidden", "experts", "top_k"].into_iter().enumerate() {
        all.agree(op, i, what)?;
    }
    let mut by_rank: Vec<Vec<usize>> =
        all.iter().map(|w| w[FIXED..].iter().map(|&c| c as usize).collect()).collect();
    for chunk in counts[first..].chunks(MAX_WORDS) {
        let more = rank.exchange(Call::of::<T>(op), chunk, None, &[])?;
        for (r, w) in more.iter().enumerate() {
            by_rank[r].extend(w.iter().map(|&c| c as usize));
        }
    }
    let tokens = all.iter().map(|w| w[3] as usize).collect();
    let shape = (experts, routed.top_k, x.shape()[1]);
    Ok(MoePlan::new((rank.rank(), rank.num_ranks()), shape, tokens, by_rank, &routed.expert))
}

/// A word that differs between ranks whose plans differ (for the combine's agreement).
pub(crate) fn plan_digest(plan: &MoePlan) -> u64 {
    let counts = plan.counts.iter().flatten().map(|&c| c as u64);
    digest([plan.ranks, plan.experts, plan.top_k].map(|v| v as u64).into_iter().chain(counts))
}

fn run<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    routed: &Routed<T>,
    fused: bool,
) -> Result<Dispatched<T>> {
    let op = if fused { OP } else { UNFUSED_OP };
    let plan = agree(op, rank, x, routed, || None)?;
    let rows = rows_with(rank, &plan, x, fused)?;
    Ok(dispatched(rows, plan))
}

/// The rows of `x` moved as `plan` says, after the agreement.
pub(crate) fn rows_with<T: Element>(
    rank: &Rank<'_>,
    plan: &MoePlan,
    x: &Tensor<T>,
    fused: bool,
) -> Result<Tensor<T>> {
    match rank.device_world() {
        DeviceWorld::Host if fused => host::moe_dispatch::moe_dispatch(rank, plan, x),
        _ => unfused(rank, plan, x),
    }
    .inspect_err(|e| rank.fail_after_agreeing(e))
}

/// Dispatches the rows of `x` (`[tokens of plan, width]`, any width) as an earlier dispatch's
/// `plan` did, without routing them again: the backward passes' move. Collective; the ranks
/// agree on the width and the plan first.
pub(crate) fn dispatch_again<T: Element>(
    rank: &Rank<'_>,
    plan: &MoePlan,
    x: &Tensor<T>,
    fused: bool,
) -> Result<Tensor<T>> {
    const AGAIN: &str = "moe_dispatch (backward)";
    let s = x.shape();
    let problem = foreign_plan(rank, plan).or_else(|| {
        (s.len() != 2 || s[0] != plan.tokens[plan.me])
            .then(|| format!("x {s:?} does not have the plan's {} rows", plan.tokens[plan.me]))
    });
    let width = s.get(1).copied().unwrap_or(0) as u64;
    let all = rank.exchange(Call::of::<T>(AGAIN), &[width, plan_digest(plan)], problem, &[])?;
    all.agree(AGAIN, 0, "width")?;
    all.agree(AGAIN, 1, "plan digest")?;
    rows_with(rank, plan, x, fused)
}

/// The result of a dispatch.
pub(crate) fn dispatched<T: Element>(rows: Tensor<T>, plan: MoePlan) -> Dispatched<T> {
    let experts = plan.experts_of(plan.me);
    let expert_rows = experts.clone().map(|e| plan.counts.iter().map(|c| c[e]).sum()).collect();
    Dispatched { rows, experts, expert_rows, plan }
}

/// The unfused baseline after the agreement.
fn unfused<T: Element>(rank: &Rank<'_>, plan: &MoePlan, x: &Tensor<T>) -> Result<Tensor<T>> {
    let (me, n, h) = (plan.me, plan.ranks, x.shape()[1]);
    let tokens: Vec<usize> = plan.send.iter().map(|slot| slot / plan.top_k).collect();
    let send = x.index_select(0, &tokens)?;
    let send_counts: Vec<usize> = (0..n).map(|d| plan.sent(me, d) * h).collect();
    let got = collectives::all_to_all_v(rank, send.as_slice(), &send_counts)?;
    // From (source, expert, order) to (expert, source, order).
    let source_at: Vec<usize> = (0..n)
        .scan(0, |at, s| {
            let start = *at;
            *at += plan.sent(s, me);
            Some(start)
        })
        .collect();
    let mut rows = Vec::with_capacity(got.len());
    for e in plan.experts_of(me) {
        for s in 0..n {
            let within: usize = (plan.expert_start[me]..e).map(|x| plan.counts[s][x]).sum();
            let start = (source_at[s] + within) * h;
            rows.extend_from_slice(&got[start..start + plan.counts[s][e] * h]);
        }
    }
    Tensor::from_shape_vec(&[plan.received(me), h], rows)
}

/// The error for a combine whose plan another world made.
pub(crate) fn foreign_plan(rank: &Rank<'_>, plan: &MoePlan) -> Option<String> {
    (plan.me != rank.rank() || plan.ranks != rank.num_ranks()).then(|| {
        format!(
            "the dispatch was rank {} of {}, this is rank {} of {}",
            plan.me,
            plan.ranks,
            rank.rank(),
            rank.num_ranks()
        )
    })
}
