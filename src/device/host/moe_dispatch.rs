//! moe_dispatch's tile kernel on the host, and the plan it shares with moe_combine's (the ops,
//! their agreement and their unfused baselines: [`crate::fused::moe_dispatch`]).
//!
//! The experts are split over the ranks as `numpy.array_split` splits them (rank `r` holds a
//! contiguous range). A source rank sends its routed rows in its *send order*: its slots
//! (token, then slot) sorted by expert, stably. Every rank knows every rank's rows per expert
//! (the agreed counts), so each knows where its rows go in each owner's receive buffer: grouped
//! by the owner's expert, then by source rank, then in the source's send order. That is the
//! order the op hands the rows to the experts, so the receive buffer is copied out whole.
//!
//! One launch, two phases, no host barrier between them. A task of the first phase is one chunk
//! of [`ROWS_PER_TASK`] rows bound for one owner (owners rotated from the next rank): it copies
//! each row from the token's input straight into the owner's symmetric receive buffer (a put
//! that carries its own signal to an owner on another node). Each program then adds the tasks it
//! did for each owner to that owner's signal for this source. A task of the second phase is one
//! (expert, source) block of this rank's receive buffer: once that source's tasks have all
//! arrived, it copies the block out, so copying starts with the first source complete.
//!
//! A receive buffer is rewritten only in the next call, after its agreement exchange, which
//! every rank enters only once it has read its buffer in this one.

use crate::Result;
use crate::device::{LaunchMode, launch};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, Token, WaitCmp,
    WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::{DROPPED, Element, Tensor, array_split, split_offsets};

const OP: &str = "moe_dispatch";

/// Rows a task of either op moves at most.
pub(crate) const ROWS_PER_TASK: usize = 32;

/// The agreed shape of one dispatch (and of the combine that brings its rows back).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MoePlan {
    /// This rank and the world's size.
    pub(crate) me: usize,
    pub(crate) ranks: usize,
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    /// The width of the dispatched rows.
    pub(crate) hidden: usize,
    /// Tokens of each rank.
    pub(crate) tokens: Vec<usize>,
    /// Where each rank's experts start, and (last) the number of experts.
    pub(crate) expert_start: Vec<usize>,
    /// `counts[s][e]`: the rows rank `s` sends expert `e`.
    pub(crate) counts: Vec<Vec<usize>>,
    /// This rank's send order: its kept slots (`token * top_k + slot`), sorted by expert.
    pub(crate) send: Vec<usize>,
    /// This rank's slots' experts (`DROPPED` where dropped).
    pub(crate) expert: Vec<u32>,
    /// For each expert: where this rank's rows for it land in its owner's receive buffer, less
    /// where they start in this rank's send order (so row `i` lands at `i` plus this).
    landing: Vec<isize>,
}

impl MoePlan {
    /// The plan for this rank, from every rank's counts.
    pub(crate) fn new(
        (me, ranks): (usize, usize),
        (experts, top_k, hidden): (usize, usize, usize),
        tokens: Vec<usize>,
        counts: Vec<Vec<usize>>,
        expert: &[u32],
    ) -> MoePlan {
        let expert_start = split_offsets(&array_split(experts, ranks));
        // A counting sort by expert: stable, so token then slot order within an expert.
        let mut at = split_offsets(&counts[me]);
        let mut send = vec![0; at[experts]];
        for (slot, &e) in expert.iter().enumerate().filter(|(_, e)| **e != DROPPED) {
            send[at[e as usize]] = slot;
            at[e as usize] += 1;
        }
        let expert = expert.to_vec();
        let landing = Vec::new();
        let mut plan = MoePlan {
            me,
            ranks,
            experts,
            top_k,
            hidden,
            tokens,
            expert_start,
            counts,
            send,
            expert,
            landing,
        };
        // Computed once here: `lands_at` runs for every row moved.
        plan.landing = (0..experts)
            .map(|e| plan.recv_at(e, me) as isize - plan.send_at(me, e) as isize)
            .collect();
        plan
    }

    /// The plan of the same rows with each slot a token of its own (`top_k` 1): the same counts
    /// and send order, so rows sent with it land where this plan's do. The backward passes use
    /// it to move per-slot rows.
    pub(crate) fn flat(&self) -> MoePlan {
        MoePlan {
            top_k: 1,
            tokens: self.tokens.iter().map(|t| t * self.top_k).collect(),
            ..self.clone()
        }
    }

    /// Rank `r`'s experts.
    pub(crate) fn experts_of(&self, r: usize) -> std::ops::Range<usize> {
        self.expert_start[r]..self.expert_start[r + 1]
    }

    /// The rank that holds expert `e`.
    pub(crate) fn owner(&self, e: usize) -> usize {
        self.expert_start.partition_point(|&s| s <= e) - 1
    }

    /// Rows rank `d` receives.
    pub(crate) fn received(&self, d: usize) -> usize {
        self.experts_of(d).map(|e| self.counts.iter().map(|c| c[e]).sum::<usize>()).sum()
    }

    /// Where source `s`'s rows for expert `e` start in its owner's receive buffer (in rows).
    pub(crate) fn recv_at(&self, e: usize, s: usize) -> usize {
        let owner = self.owner(e);
        let before: usize = (self.expert_start[owner]..e)
            .map(|x| self.counts.iter().map(|c| c[x]).sum::<usize>())
            .sum();
        before + (0..s).map(|x| self.counts[x][e]).sum::<usize>()
    }

    /// Where rank `s`'s rows for expert `e` start in its send order.
    pub(crate) fn send_at(&self, s: usize, e: usize) -> usize {
        self.counts[s][..e].iter().sum()
    }

    /// Rows rank `s` sends rank `d` (contiguous in its send order).
    pub(crate) fn sent(&self, s: usize, d: usize) -> usize {
        self.experts_of(d).map(|e| self.counts[s][e]).sum()
    }

    /// This rank's dispatch tasks: its rows for each owner (contiguous in its send order).
    pub(crate) fn dispatch_tasks(&self) -> Vec<Task> {
        let me = self.me;
        self.send_tasks(|d| (self.send_at(me, self.expert_start[d]), self.sent(me, d)))
    }

    /// The token of row `i` of this rank's send order.
    pub(crate) fn token_of(&self, i: usize) -> usize {
        self.send[i] / self.top_k
    }

    /// Where row `i` of this rank's send order lands in its owner's receive buffer: in the
    /// owner's block for (its expert, this rank).
    pub(crate) fn lands_at(&self, i: usize) -> usize {
        let e = self.expert[self.send[i]] as usize;
        (i as isize + self.landing[e]) as usize
    }

    /// Tasks moving `rows` rows.
    pub(crate) fn tasks_for(rows: usize) -> usize {
        rows.div_ceil(ROWS_PER_TASK)
    }

    /// The largest receive buffer of any rank, in rows: the symmetric size.
    pub(crate) fn most_received(&self) -> usize {
        (0..self.ranks).map(|d| self.received(d)).max().unwrap_or(0)
    }

    /// The (expert, source) blocks of this rank's receive buffer that hold rows, in its order:
    /// `(source, first row, rows)`.
    pub(crate) fn blocks(&self) -> Vec<(usize, usize, usize)> {
        let mut blocks = Vec::new();
        let mut at = 0;
        for e in self.experts_of(self.me) {
            for s in 0..self.ranks {
                let rows = self.counts[s][e];
                if rows > 0 {
                    blocks.push((s, at, rows));
                }
                at += rows;
            }
        }
        blocks
    }

    /// This rank's first-phase tasks of the dispatch (and of the combine, which moves rows the
    /// other way): `(peer, first row in the send order, rows)`, peers rotated from the next rank.
    pub(crate) fn send_tasks(&self, rows_to: impl Fn(usize) -> (usize, usize)) -> Vec<Task> {
        let mut tasks = Vec::new();
        for peer in (1..=self.ranks).map(|i| (self.me + i) % self.ranks) {
            let (start, rows) = rows_to(peer);
            for c in 0..Self::tasks_for(rows) {
                let first = c * ROWS_PER_TASK;
                tasks.push(Task {
                    peer,
                    start: start + first,
                    rows: ROWS_PER_TASK.min(rows - first),
                });
            }
        }
        tasks
    }
}

/// A chunk of rows bound for one peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Task {
    pub(crate) peer: usize,
    /// The first row, in the sender's order.
    pub(crate) start: usize,
    pub(crate) rows: usize,
}

/// A symmetric receive buffer of rows and the signals that say how much of it arrived, kept
/// between calls (one per op and element type).
pub(crate) struct RowExchange<T: Element> {
    pub(crate) recv: Option<SymmBuf<T>>,
    pub(crate) arrived: SignalBuf,
    /// Every source's tasks so far (signals only grow).
    pub(crate) expected: Vec<u64>,
}

impl<T: Element> Workspace for RowExchange<T> {
    fn symmetric_bytes(&self) -> usize {
        self.arrived.len() * 64 + self.recv.as_ref().map_or(0, |r| r.len() * size_of::<T>())
    }
}

impl<T: Element> RowExchange<T> {
    pub(crate) fn new(rank: &Rank<'_>, purpose: &'static str) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(RowExchange {
            recv: None,
            arrived: rank.alloc_signals_for(purpose, n)?,
            expected: vec![0; n],
        })
    }
}

/// The dispatch workspace (a type of its own, so that dispatch and combine keep their buffers).
pub(crate) struct DispatchWorkspace<T: Element>(RowExchange<T>);

impl<T: Element> Workspace for DispatchWorkspace<T> {
    fn symmetric_bytes(&self) -> usize {
        self.0.symmetric_bytes()
    }
}

/// Moves the rows of `tasks` into each peer's receive buffer: row `i` of the sender's order is
/// `row(i)` of `from` (a row index, of `width` values) and lands at row `dest(peer, i)`. Each
/// program then signals each peer with its task count for it. Run inside a launch.
///
/// # Safety
/// Every destination row is written by one task of one rank, and read only after its signal.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn put_rows<T: Element>(
    p: &crate::device::Program<'_>,
    ex: &RowExchange<T>,
    tasks: &[Task],
    from: &[T],
    width: usize,
    row: impl Fn(usize) -> usize,
    dest: impl Fn(usize, usize) -> usize,
    staged: &mut Vec<T>,
) -> Result<()> {
    let (me, n) = (p.rank(), p.num_ranks());
    let recv = ex.recv.as_ref().expect("reserved");
    let mut done = vec![0u64; n];
    for t in p.tasks(tasks.len()) {
        let Task { peer, start, rows } = tasks[t];
        if p.is_local(peer) {
            let to = symm_at(recv, peer);
            for i in start..start + rows {
                let src = &from[row(i) * width..][..width];
                // SAFETY: the caller's contract; the row is inside the buffer (the plan).
                unsafe { crate::device::tile::store_1d(to + dest(peer, i) * width, src, width) };
            }
            done[peer] += 1;
        } else {
            // Through the proxy: one put per run of rows that land next to each other, the
            // task's last carrying the signal.
            staged.clear();
            for i in start..start + rows {
                staged.extend_from_slice(&from[row(i) * width..][..width]);
            }
            let mut first = 0;
            for j in 0..rows {
                let last = j + 1 == rows;
                if !last && dest(peer, start + j + 1) == dest(peer, start + j) + 1 {
                    continue;
                }
                let run = &staged[first * width..(j + 1) * width];
                let (signal, add) = ((&ex.arrived, me), SignalOp::Add(u64::from(last)));
                let to = recv.ptr() + dest(peer, start + first) * width;
                // SAFETY: as above; a blocking put, so `staged` may be reused after it.
                unsafe {
                    p.put_signal(to, peer, GlobalPtr::from_slice(run), run.len(), signal, add)?
                };
                first = j + 1;
            }
        }
    }
    for peer in (1..=n).map(|i| (me + i) % n).filter(|&d| done[d] > 0) {
        p.notify(
            &ex.arrived,
            me,
            peer,
            SignalOp::Add(done[peer]),
            Scope::Peer,
            NotifySem::Release,
        )?;
    }
    Ok(())
}

/// Waits until source `src`'s tasks for this call have all arrived; its token.
pub(crate) fn arrived_from<T: Element>(
    p: &crate::device::Program<'_>,
    ex: &RowExchange<T>,
    src: usize,
) -> Result<Token> {
    p.wait_from(&ex.arrived, src, src, WaitCmp::Ge(ex.expected[src]), WaitSem::Acquire)
}

/// The kernel: the rows this rank's experts receive, `[received, width]` (`x`'s), in the plan's
/// order.
pub(crate) fn moe_dispatch<T: Element>(
    rank: &Rank<'_>,
    plan: &MoePlan,
    x: &Tensor<T>,
) -> Result<Tensor<T>> {
    let init = |r: &Rank<'_>| RowExchange::new(r, "moe_dispatch arrived").map(DispatchWorkspace);
    rank.with_workspace(init, |ws| run(rank, &mut ws.0, plan, x))
}

fn run<T: Element>(
    rank: &Rank<'_>,
    ex: &mut RowExchange<T>,
    plan: &MoePlan,
    x: &Tensor<T>,
) -> Result<Tensor<T>> {
    let (me, n, h) = (plan.me, plan.ranks, x.shape()[1]);
    rank.reserve_for("moe_dispatch receive", &mut ex.recv, (plan.most_received() * h).max(1))?;
    for s in 0..n {
        ex.expected[s] += MoePlan::tasks_for(plan.sent(s, me)) as u64;
    }
    let tasks = plan.dispatch_tasks();
    let blocks = plan.blocks();
    let received = plan.received(me);
    let mut out = Tensor::<T>::scratch(OP, &[received, h])?;
    let out_ptr = GlobalPtrMut::from_slice(out.as_mut_slice());
    let x = x.as_slice();
    let ex = &*ex;
    // SAFETY: the plan gives every (source, row) its own place in its owner's buffer; blocks are
    // read after their source's signal; the output's blocks have one writer each.
    unsafe {
        launch(rank, LaunchMode::VectorOnly, rank.topology().aicore_num(), |p| {
            let mut staged = Vec::new();
            put_rows(
                p,
                ex,
                &tasks,
                x,
                h,
                |i| plan.token_of(i),
                |_, i| plan.lands_at(i),
                &mut staged,
            )?;
            let recv = ex.recv.as_ref().expect("reserved");
            let mut tokens: Vec<Option<Token>> = vec![None; n];
            for b in p.tasks(blocks.len()) {
                let (src, at, rows) = blocks[b];
                let token = match tokens[src] {
                    Some(t) => t,
                    None => *tokens[src].insert(arrived_from(p, ex, src)?),
                };
                let from = GlobalPtr::from(consume_token(recv.ptr(), token));
                crate::device::tile::copy_2d(out_ptr + at * h, h, from + at * h, h, (rows, h));
            }
            Ok(())
        })?;
    }
    Ok(out)
}
