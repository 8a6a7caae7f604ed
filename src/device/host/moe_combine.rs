//! moe_combine's tile kernel on the host (the op, its agreement and its unfused baseline:
//! [`crate::fused::moe_combine`]; the plan: `moe_dispatch`).
//!
//! The rows come back the way they went. An expert's owner holds the experts' outputs in the
//! order the dispatch handed it the rows ((expert, source) blocks); each source has a symmetric
//! return buffer laid out in its own send order. A task of the first phase is one chunk of
//! [`ROWS_PER_TASK`](super::moe_dispatch::ROWS_PER_TASK) rows bound for one source (sources
//! rotated from the next rank): it copies each output row straight into the source's return
//! buffer; each program then signals each source with its task count. A task of the second
//! phase is one chunk of this rank's tokens: once every owner's rows have arrived, it sums each
//! token's rows weighted by its gate weights, slot by slot in the accumulator type, and rounds
//! once. The weights are applied in this same pass: no weighted copy is ever stored.

use super::moe_dispatch::{MoePlan, RowExchange, arrived_from, put_rows};
use crate::Result;
use crate::device::{LaunchMode, launch};
use crate::shmem::{GlobalPtr, GlobalPtrMut, Rank, Workspace, consume_token};
use crate::tensor::{Element, Tensor};

const OP: &str = "moe_combine";

/// Tokens a second-phase task sums.
const TOKENS_PER_TASK: usize = 16;

/// The combine workspace (a type of its own, so that dispatch and combine keep their buffers).
pub(crate) struct CombineWorkspace<T: Element>(RowExchange<T>);

impl<T: Element> Workspace for CombineWorkspace<T> {
    fn symmetric_bytes(&self) -> usize {
        self.0.symmetric_bytes()
    }
}

/// Where the rows of an owner's outputs go back: for each source in turn (its rows contiguous
/// here), `(row of the outputs, row of the source's return buffer)`; and where each source's
/// rows start.
pub(crate) fn rows_back(plan: &MoePlan) -> (Vec<(usize, usize)>, Vec<usize>) {
    let mut back = Vec::with_capacity(plan.received(plan.me));
    let mut start = Vec::with_capacity(plan.ranks + 1);
    for s in 0..plan.ranks {
        start.push(back.len());
        for e in plan.experts_of(plan.me) {
            let (from, to) = (plan.recv_at(e, s), plan.send_at(s, e));
            back.extend((0..plan.counts[s][e]).map(|j| (from + j, to + j)));
        }
    }
    start.push(back.len());
    (back, start)
}

/// Each slot's row in this rank's send order (`usize::MAX` where dropped).
pub(crate) fn slot_rows(plan: &MoePlan) -> Vec<usize> {
    let mut at = vec![usize::MAX; plan.expert.len()];
    for (i, &slot) in plan.send.iter().enumerate() {
        at[slot] = i;
    }
    at
}

/// Token `t`'s output: the sum over its slots of weight times row (`load(i, into)` fetches
/// send-order row `i`), in the accumulator type, rounded once into `out`. The unfused baseline
/// sums the same way, so the two agree bit for bit.
pub(crate) fn weighted_sum<T: Element>(
    t: usize,
    k: usize,
    (slot_row, weight): (&[usize], &[T]),
    mut load: impl FnMut(usize, &mut [T]),
    (acc, scratch): (&mut [T::Acc], &mut [T]),
    out: &mut [T],
) {
    acc.fill(<T::Acc as Element>::zero());
    for slot in t * k..(t + 1) * k {
        let at = slot_row[slot];
        if at == usize::MAX {
            continue;
        }
        let w = weight[slot].to_acc();
        load(at, scratch);
        for (a, v) in acc.iter_mut().zip(scratch.iter()) {
            *a += w * v.to_acc();
        }
    }
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = T::from_acc(*a);
    }
}

/// The kernel: this rank's tokens' combined rows, `[tokens, width]`, from the experts' outputs
/// `y` `[received, width]` (in the order the dispatch handed them over) and this rank's slots'
/// `weight` `[tokens, top_k]`.
pub(crate) fn moe_combine<T: Element>(
    rank: &Rank<'_>,
    plan: &MoePlan,
    y: &Tensor<T>,
    weight: &Tensor<T>,
) -> Result<Tensor<T>> {
    let init = |r: &Rank<'_>| RowExchange::new(r, "moe_combine arrived").map(CombineWorkspace);
    rank.with_workspace(init, |ws| run(rank, &mut ws.0, plan, y, weight))
}

fn run<T: Element>(
    rank: &Rank<'_>,
    ex: &mut RowExchange<T>,
    plan: &MoePlan,
    y: &Tensor<T>,
    weight: &Tensor<T>,
) -> Result<Tensor<T>> {
    let (me, n, k) = (plan.me, plan.ranks, plan.top_k);
    let width = y.shape()[1];
    let most_sent = (0..n).map(|s| plan.counts[s].iter().sum::<usize>()).max().unwrap_or(0);
    rank.reserve_for("moe_combine return", &mut ex.recv, (most_sent * width).max(1))?;
    let senders: Vec<usize> = (0..n).filter(|&d| plan.sent(me, d) > 0).collect();
    for &d in &senders {
        ex.expected[d] += MoePlan::tasks_for(plan.sent(me, d)) as u64;
    }
    let (back, start) = rows_back(plan);
    let tasks = plan.send_tasks(|s| (start[s], start[s + 1] - start[s]));
    let slot_row = slot_rows(plan);
    let tokens = plan.tokens[me];
    let mut out = Tensor::<T>::scratch(OP, &[tokens, width])?;
    let out_ptr = GlobalPtrMut::from_slice(out.as_mut_slice());
    let (y, weight) = (y.as_slice(), weight.as_slice());
    let ex = &*ex;
    // SAFETY: every (source, send-order row) has one writer, an owner's task; the return buffer
    // is read after every owner's signal; each output row has one writer.
    unsafe {
        launch(rank, LaunchMode::VectorOnly, rank.topology().aicore_num(), |p| {
            let mut staged = Vec::new();
            put_rows(p, ex, &tasks, y, width, |i| back[i].0, |_, i| back[i].1, &mut staged)?;
            let sums = Sums { ex, owners: &senders, slot_row: &slot_row, weight, width };
            sum_tokens(p, &sums, tokens, k, out_ptr)?;
            Ok(())
        })?;
    }
    Ok(out)
}

/// What the combine's last phase reads: the return buffer and its signals, the owners that send
/// rows here, each slot's row in the send order, the slots' weights, the rows' width.
pub(crate) struct Sums<'a, T: Element> {
    pub(crate) ex: &'a RowExchange<T>,
    pub(crate) owners: &'a [usize],
    pub(crate) slot_row: &'a [usize],
    pub(crate) weight: &'a [T],
    pub(crate) width: usize,
}

/// The combine's last phase in a program: tasks of [`TOKENS_PER_TASK`] of this rank's
/// `tokens`, each token's rows (from the return buffer, once every owner has signalled)
/// weighted and summed into its row of `out`.
///
/// # Safety
/// Each owner writes its rows of the return buffer before its signal and not after, until the
/// next call's agreement; `out` has `tokens x width` elements that only this phase writes.
pub(crate) unsafe fn sum_tokens<T: Element>(
    p: &crate::device::Program<'_>,
    s: &Sums<'_, T>,
    tokens: usize,
    k: usize,
    out: GlobalPtrMut<'_, T>,
) -> Result<()> {
    let width = s.width;
    let recv = s.ex.recv.as_ref().expect("reserved");
    let mut ret: Option<GlobalPtr<'_, T>> = None;
    let zero = <T::Acc as Element>::zero();
    let (mut acc, mut scratch) = (vec![zero; width], vec![T::zero(); width]);
    let mut row_out = vec![T::zero(); width];
    for task in p.tasks(tokens.div_ceil(TOKENS_PER_TASK)) {
        if ret.is_none() {
            let mut token = None;
            for &d in s.owners {
                token = Some(arrived_from(p, s.ex, d)?);
            }
            // Without owners no slot is kept here and nothing is read.
            ret = token.map(|t| GlobalPtr::from(consume_token(recv.ptr(), t)));
        }
        for tok in task * TOKENS_PER_TASK..tokens.min((task + 1) * TOKENS_PER_TASK) {
            let load = |i: usize, into: &mut [T]| {
                let from = ret.expect("a kept slot has its owner's signal") + i * width;
                // SAFETY: the row is complete (every owner's signal) and in the buffer.
                unsafe { crate::device::tile::load_1d(from, into, width, T::zero()) }
            };
            let sums = (&mut acc[..], &mut scratch[..]);
            weighted_sum(tok, k, (s.slot_row, s.weight), load, sums, &mut row_out);
            // SAFETY: the caller's contract; token `tok`'s row is this task's alone.
            unsafe { crate::device::tile::store_1d(out + tok * width, &row_out, width) };
        }
    }
    Ok(())
}
