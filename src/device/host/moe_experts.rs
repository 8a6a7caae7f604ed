//! moe_experts' tile kernel on the host: dispatch, each expert's SwiGLU, and combine in one
//! launch (the op and its unfused baseline: [`crate::fused::moe_experts`]; the plan:
//! `moe_dispatch`).
//!
//! Three phases, no host barrier between them:
//! 1. the dispatch's puts: each row from the token's input into its owner's receive buffer, a
//!    signal per (program, owner) (`moe_dispatch::put_rows`);
//! 2. tasks of up to [`EXPERT_ROWS`] consecutive rows of one expert (its rows from every source
//!    lie together): once the sources of those rows have arrived (a chunk of the first sources
//!    starts before the last have sent), the expert's SwiGLU on the rows where they landed
//!    (`dot_store` straight from the receive buffer, no copy out), and each source's output
//!    rows put straight into its return buffer, where they are one contiguous run of its send
//!    order; a signal per (program, source);
//! 3. tasks of a few of this rank's tokens: once every owner's outputs have arrived, each
//!    token's rows weighted by its gate weights and summed (`moe_combine::weighted_sum`).
//!
//! Phase 2 waits only on phase 1 and phase 3 only on phase 2, so no wait is circular.

use super::moe_combine::{Sums, slot_rows, sum_tokens};
use super::moe_dispatch::{MoePlan, RowExchange, arrived_from, put_rows};
use crate::Result;
use crate::device::{LaunchMode, launch, tile};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalOp, Token, Workspace, consume_token,
    symm_at,
};
use crate::tensor::{Element, Tensor};

const OP: &str = "moe_experts";

/// Rows a second-phase task multiplies at most: each task packs its expert's weights for the
/// GEMM once, so small blocks pay that packing per few rows (blocks of 32 rows ran 1.2-1.35x
/// of the unfused baseline on the 2-core Zen 3; a block is also one contiguous run back).
const EXPERT_ROWS: usize = 256;

/// The receive buffer of the rows and the return buffer of the experts' outputs.
pub(crate) struct ExpertsWorkspace<T: Element> {
    rows: RowExchange<T>,
    back: RowExchange<T>,
}

impl<T: Element> Workspace for ExpertsWorkspace<T> {
    fn symmetric_bytes(&self) -> usize {
        self.rows.symmetric_bytes() + self.back.symmetric_bytes()
    }
}

/// A second-phase task: `rows` consecutive rows of this rank's expert `expert` (its index
/// here) from `first` of the receive buffer, which may come from several sources.
#[derive(Debug, Clone)]
struct Chunk {
    expert: usize,
    first: usize,
    rows: usize,
    pieces: Vec<Piece>,
}

/// The rows of a chunk from one source: `rows` from `offset` in the chunk, whose outputs go to
/// row `dest` of that source's return buffer (one contiguous run of its send order).
#[derive(Debug, Clone, Copy)]
struct Piece {
    source: usize,
    offset: usize,
    rows: usize,
    dest: usize,
}

/// Rank `owner`'s second-phase tasks: each of its experts' rows (all sources', contiguous in
/// its receive buffer) cut into chunks of [`EXPERT_ROWS`], each chunk's pieces by source.
/// Every rank computes every owner's, to know how many pieces it will be sent.
fn chunks(plan: &MoePlan, owner: usize) -> Vec<Chunk> {
    let mut out = Vec::new();
    for (i, e) in plan.experts_of(owner).enumerate() {
        let start = plan.recv_at(e, 0);
        let total: usize = plan.counts.iter().map(|c| c[e]).sum();
        for c in 0..total.div_ceil(EXPERT_ROWS) {
            let (lo, hi) = (c * EXPERT_ROWS, ((c + 1) * EXPERT_ROWS).min(total));
            let mut pieces = Vec::new();
            let mut at = 0; // where source s's rows start in the expert's range
            for s in 0..plan.ranks {
                let rows = plan.counts[s][e];
                let (a, b) = (at.max(lo), (at + rows).min(hi));
                if a < b {
                    let dest = plan.send_at(s, e) + (a - at);
                    pieces.push(Piece { source: s, offset: a - lo, rows: b - a, dest });
                }
                at += rows;
            }
            out.push(Chunk { expert: i, first: start + lo, rows: hi - lo, pieces });
        }
    }
    out
}

/// The kernel: this rank's tokens' outputs `[tokens, hidden]`. `gate_up` is
/// `[local experts, hidden, 2 ffn]` (gate then up columns), `down` `[local experts, ffn, hidden]`.
pub(crate) fn moe_experts<T: Element>(
    rank: &Rank<'_>,
    plan: &MoePlan,
    x: &Tensor<T>,
    weight: &Tensor<T>,
    (gate_up, down): (&Tensor<T>, &Tensor<T>),
) -> Result<Tensor<T>> {
    let init = |r: &Rank<'_>| {
        Ok(ExpertsWorkspace {
            rows: RowExchange::new(r, "moe_experts rows arrived")?,
            back: RowExchange::new(r, "moe_experts outputs arrived")?,
        })
    };
    rank.with_workspace(init, |ws| run(rank, ws, plan, x, weight, (gate_up, down)))
}

fn run<T: Element>(
    rank: &Rank<'_>,
    ws: &mut ExpertsWorkspace<T>,
    plan: &MoePlan,
    x: &Tensor<T>,
    weight: &Tensor<T>,
    (gate_up, down): (&Tensor<T>, &Tensor<T>),
) -> Result<Tensor<T>> {
    let (me, n, k, h) = (plan.me, plan.ranks, plan.top_k, plan.hidden);
    let ffn = down.shape()[1];
    let most_sent = (0..n).map(|s| plan.counts[s].iter().sum::<usize>()).max().unwrap_or(0);
    rank.reserve_for("moe_experts receive", &mut ws.rows.recv, (plan.most_received() * h).max(1))?;
    rank.reserve_for("moe_experts return", &mut ws.back.recv, (most_sent * h).max(1))?;
    // Signals only grow: this call's share of each source's and owner's tasks.
    for s in 0..n {
        ws.rows.expected[s] += MoePlan::tasks_for(plan.sent(s, me)) as u64;
        let owner_chunks = chunks(plan, s);
        let from_owner = owner_chunks.iter().flat_map(|c| &c.pieces).filter(|p| p.source == me);
        ws.back.expected[s] += from_owner.count() as u64;
    }
    let tasks = plan.dispatch_tasks();
    let blocks = chunks(plan, me);
    let owners: Vec<usize> = (0..n).filter(|&d| plan.sent(me, d) > 0).collect();
    let slot_row = slot_rows(plan);
    let tokens = plan.tokens[me];
    let mut out = Tensor::<T>::scratch(OP, &[tokens, h])?;
    let out_ptr = GlobalPtrMut::from_slice(out.as_mut_slice());
    let (x, weight) = (x.as_slice(), weight.as_slice());
    let (gate_up, down) = (gate_up.as_slice(), down.as_slice());
    let ws = &*ws;
    // SAFETY: the plan gives every row one place in its owner's receive buffer and every output
    // row one place in its source's return buffer, each written by one task; each is read only
    // after its writer's signal; buffers are rewritten only after the next call's agreement;
    // output rows have one writer each.
    unsafe {
        launch(rank, LaunchMode::VectorOnly, rank.topology().aicore_num(), |p| {
            let mut staged = Vec::new();
            put_rows(
                p,
                &ws.rows,
                &tasks,
                x,
                h,
                |i| plan.token_of(i),
                |_, i| plan.lands_at(i),
                &mut staged,
            )?;
            // Phase 2: the experts.
            let recv = ws.rows.recv.as_ref().expect("reserved");
            let back = ws.back.recv.as_ref().expect("reserved");
            let mut arrived: Vec<Option<Token>> = vec![None; n];
            let mut scratch = Scratch::<T>::new(h, ffn);
            let mut done = vec![0u64; n];
            for b in p.tasks(blocks.len()) {
                let Chunk { expert, first, rows, ref pieces } = blocks[b];
                let mut token = None;
                for piece in pieces {
                    let t = match arrived[piece.source] {
                        Some(t) => t,
                        None => {
                            *arrived[piece.source].insert(arrived_from(p, &ws.rows, piece.source)?)
                        }
                    };
                    token = Some(t);
                }
                let token = token.expect("a chunk has rows");
                let from = GlobalPtr::from(consume_token(recv.ptr(), token)) + first * h;
                let w = (
                    &gate_up[expert * h * 2 * ffn..][..h * 2 * ffn],
                    &down[expert * ffn * h..][..ffn * h],
                );
                swiglu(from, rows, (h, ffn), w, &mut scratch);
                for piece in pieces {
                    let y = &scratch.y[piece.offset * h..(piece.offset + piece.rows) * h];
                    if p.is_local(piece.source) {
                        tile::store_1d(symm_at(back, piece.source) + piece.dest * h, y, y.len());
                        done[piece.source] += 1;
                    } else {
                        let signal = (&ws.back.arrived, me);
                        let to = back.ptr() + piece.dest * h;
                        p.put_signal(
                            to,
                            piece.source,
                            GlobalPtr::from_slice(y),
                            y.len(),
                            signal,
                            SignalOp::Add(1),
                        )?;
                    }
                }
            }
            for s in (1..=n).map(|i| (me + i) % n).filter(|&s| done[s] > 0) {
                p.notify(
                    &ws.back.arrived,
                    me,
                    s,
                    SignalOp::Add(done[s]),
                    Scope::Peer,
                    NotifySem::Release,
                )?;
            }
            // Phase 3: the combine.
            let sums =
                Sums { ex: &ws.back, owners: &owners, slot_row: &slot_row, weight, width: h };
            sum_tokens(p, &sums, tokens, k, out_ptr)?;
            Ok(())
        })?;
    }
    Ok(out)
}

/// A program's buffers for one block's SwiGLU.
struct Scratch<T: Element> {
    gu: Vec<T::Acc>,
    act: Vec<T>,
    y_acc: Vec<T::Acc>,
    y: Vec<T>,
}

impl<T: Element> Scratch<T> {
    fn new(h: usize, ffn: usize) -> Self {
        let zero = <T::Acc as Element>::zero();
        let r = EXPERT_ROWS;
        Scratch {
            gu: vec![zero; r * 2 * ffn],
            act: vec![T::zero(); r * ffn],
            y_acc: vec![zero; r * h],
            y: vec![T::zero(); r * h],
        }
    }
}

/// `y = (silu(x w_g) * (x w_u)) w_d` for `rows` rows at `x`, each product accumulated in the
/// accumulator type and rounded once to `T`, the activation's two factors and product rounded as
/// the models' reference does.
///
/// # Safety
/// `x` holds `rows x h` complete values nobody writes meanwhile.
unsafe fn swiglu<T: Element>(
    x: GlobalPtr<'_, T>,
    rows: usize,
    (h, ffn): (usize, usize),
    (gate_up, down): (&[T], &[T]),
    s: &mut Scratch<T>,
) {
    // SAFETY: the caller's contract; the scratch is this program's own.
    unsafe {
        let gu = GlobalPtrMut::from_slice(&mut s.gu);
        tile::dot_store(
            gu,
            2 * ffn,
            x,
            h,
            GlobalPtr::from_slice(gate_up),
            2 * ffn,
            (rows, h, 2 * ffn),
            false,
        );
    }
    for r in 0..rows {
        let g = &s.gu[r * 2 * ffn..(r + 1) * 2 * ffn];
        for i in 0..ffn {
            s.act[r * ffn + i] = swiglu_unit::<T>(g[i], g[ffn + i]);
        }
    }
    // SAFETY: as above.
    unsafe {
        let y = GlobalPtrMut::from_slice(&mut s.y_acc);
        let act = GlobalPtr::from_slice(&s.act);
        tile::dot_store(y, h, act, ffn, GlobalPtr::from_slice(down), h, (rows, ffn, h), false);
    }
    for (y, a) in s.y[..rows * h].iter_mut().zip(&s.y_acc) {
        *y = T::from_acc(*a);
    }
}

/// `silu(gate) * up` of one unit from its two products (in the accumulator type): each product
/// rounded to `T` (as a product stored in `T`), the silu rounded, the product rounded; the
/// arithmetic in the accumulator type.
pub(crate) fn swiglu_unit<T: Element>(gate: T::Acc, up: T::Acc) -> T {
    use num_traits::Float;
    let round = |v: T::Acc| T::from_acc(v).to_acc();
    let (gate, up) = (round(gate), round(up));
    let one = <T::Acc as Element>::from_f64(1.0);
    T::from_acc(round(gate / (one + (-gate).exp())) * up)
}
