//! matmul + reduce_scatter across nodes (a world joined by MPI): reduce inside each node, then
//! across nodes, as Triton-distributed's inter-node GEMM + ReduceScatter.
//!
//! Every rank computes its partial product `P_s = x_s @ w_s` (`[M, N]`, in the accumulator type)
//! tile by tile into its symmetric `partials`, the rows of the nodes after its own first (nearest
//! first), then its node's other ranks' rows, its own last. For each rank `d` of another node,
//! one rank of this node reduces `d`'s rows here: `d`'s stand-in (see `Rank::stand_in`). Once
//! every rank of the node has written the tiles covering those rows (counted per node of
//! destination, so the first node's rows are reduced while the rest compute), the stand-in adds
//! them in rank order, chunk by chunk, into its `outgoing` buffer and puts each chunk into `d`'s
//! `incoming` slot for this node, with the chunk's signal. Meanwhile each rank reduces its own
//! rows: its node's partials (pulled through `symm_at`, in rank order) and, as their chunks
//! arrive, every other node's sums, added in node order.
//!
//! # Reduction order
//! Rows owned by rank `d` are `sum over nodes c = 0, 1, ... of (sum over the ranks s of node c,
//! in rank order, of P_s)`, in f32 for f16 and bf16 (rounded once), f64 for f64. So:
//! - one node: `P_0 + P_1 + ... + P_{n-1}`, the order of a world of threads: the same bits;
//! - one rank per node: `P_0 + P_1 + ...` again, the same bits;
//! - `k` ranks per node: `(P_0 + ... + P_{k-1}) + (P_k + ... + P_{2k-1}) + ...`, which differs from
//!   the threads' order in rounding only, within the f64 reference's tolerance.
//!
//! Each shape always adds in the same order, whatever the timing: the same bits on every run.

use ndarray::{Array2, ArrayView2};

use super::{MmRsWorkspace, OP};
use crate::Result;
use crate::device::host::plan::{
    AccData, GemmTiles, MIN_SHARD_ROWS, Shards, compute_lanes, computing_programs, row_chunks,
    scratch,
};
use crate::device::host::routing::{REMOTE_CHUNK_ELEMS, ReducePlan};
use crate::device::tile::{self, Tile};
use crate::device::{LaunchMode, Program, launch};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalOp, SymmBuf, Token, WaitCmp, WaitSem,
    consume_token, symm_at,
};
use crate::tensor::Element;

/// The fused op on a world of several nodes (see the module docs).
pub(super) fn run<T: Element>(
    rank: &Rank<'_>,
    ws: &mut MmRsWorkspace<T>,
    rows: &Shards,
    n: usize,
    x: ArrayView2<T>,
    w: ArrayView2<T>,
) -> Result<Array2<T>> {
    let me = rank.rank();
    let plan = ReducePlan::new(rank);
    let (nodes, node) = (plan.nodes, plan.node);
    let (m, k) = (rows.total(), x.ncols());
    let x = x.as_standard_layout();
    let w = w.as_standard_layout();
    let x_acc = AccData::new(OP, x.as_slice().expect("standard layout"))?;
    let w_acc = AccData::new(OP, w.as_slice().expect("standard layout"))?;
    let mine = rows.count(me);
    let mut out = scratch(OP, (mine, n))?;
    let widest = rows.counts().iter().copied().max().unwrap_or(0);
    rank.reserve_for("matmul_reduce_scatter partials", &mut ws.partials, m.saturating_mul(n))?;
    rank.reserve_for("matmul_reduce_scatter outgoing", &mut ws.outgoing, m.saturating_mul(n))?;
    let incoming_len = nodes.saturating_mul(widest).saturating_mul(n);
    rank.reserve_for("matmul_reduce_scatter incoming", &mut ws.incoming, incoming_len)?;

    // Tiles: the rows of the nodes after this one first, then this node's other ranks', own last.
    let order = plan.tile_order(rank);
    let per_owner = rows.counts().iter().all(|&c| c == 0 || c >= MIN_SHARD_ROWS);
    let segments: Vec<(usize, usize)> = if per_owner {
        order.iter().map(|&r| (rows.offset(r), rows.count(r))).collect()
    } else {
        vec![(0, m)]
    };
    let (grid, sub_vec_num) = (rank.topology().aicore_num(), rank.topology().sub_vec_num());
    let tiles = GemmTiles::new(&segments, &[n], computing_programs(grid, sub_vec_num));
    // Every rank of the node cuts the product the same way, so each announces the same tiles to
    // this rank, per node of destination.
    for t in 0..tiles.count() {
        let task = tiles.get(t);
        for (reducer, b) in plan.announce(rows.covering(task.row, task.rows)) {
            if reducer == me {
                ws.expected[b] += 1;
            }
        }
    }
    // Chunks of rows: what a stand-in puts at once, and what the owner reduces at once.
    // A node's sum moves (and is reduced) in the chunks every op puts across nodes.
    let chunk_rows = row_chunks(n, REMOTE_CHUNK_ELEMS);
    let chunks_of = |d: usize| if n == 0 { 0 } else { rows.count(d).div_ceil(chunk_rows) };
    let node_before = ws.node_expected.clone();
    for c in (0..nodes).filter(|&c| c != node) {
        ws.node_expected[c] += chunks_of(me) as u64;
    }

    let (x_ptr, w_ptr) = (GlobalPtr::from_slice(&x_acc), GlobalPtr::from_slice(&w_acc));
    let out_ptr = GlobalPtrMut::from_slice(out.as_slice_mut().expect("fresh array"));
    let ws = &*ws;
    let bufs = Buffers {
        partials: ws.partials.as_ref().expect("reserved above"),
        outgoing: ws.outgoing.as_ref().expect("reserved above"),
        incoming: ws.incoming.as_ref().expect("reserved above"),
        widest,
        n,
        chunk_rows,
    };
    let (comm_lanes, first_compute) = compute_lanes(sub_vec_num);
    let own_tasks = chunks_of(me);
    // SAFETY: each rank writes only its own `partials` and `outgoing`, each tile or chunk once,
    // before announcing it; a stand-in reads its node's partials only after acquiring their tile
    // counts; an owner reads a node's sum only after its chunk's signal; buffers are rewritten
    // only after the next call's exchange. Each output chunk has one writer.
    unsafe {
        launch(rank, LaunchMode::Mix, grid, |p| {
            for t in p.tasks_on_sub_vecs(first_compute, tiles.count()) {
                let task = tiles.get(t);
                let valid = (task.rows, k, task.cols);
                let at = task.row * n + task.col;
                let (a, b) = (x_ptr + task.row * k, w_ptr + task.col);
                tile::dot_store(bufs.partials.ptr() + at, n, a, k, b, n, valid, false);
                for (reducer, b) in plan.announce(rows.covering(task.row, task.rows)) {
                    let scope = if reducer == me { Scope::Device } else { Scope::Peer };
                    let index = me * nodes + b;
                    p.notify(
                        &ws.done,
                        index,
                        reducer,
                        SignalOp::Add(1),
                        scope,
                        NotifySem::Release,
                    )?;
                }
            }
            // Other nodes' rows on the communication lanes, from the start: a computing lane
            // would get to them only after all its tiles.
            if p.sub_vec_id() < comm_lanes {
                for i in p.tasks(plan.served.len()) {
                    send_node_sum(p, ws, &plan, &bufs, rows, plan.served[i])?;
                }
            }
            for t in p.tasks_on_sub_vecs(0, own_tasks) {
                reduce_own(p, ws, &plan, &bufs, rows, &node_before, t, out_ptr)?;
            }
            Ok(())
        })?;
    }
    rank.quiet()?; // the node sums put to other nodes have left `outgoing`
    Ok(out)
}

/// The buffers of a call, and how rows are chunked.
struct Buffers<'a, A: Element> {
    partials: &'a SymmBuf<A>,
    outgoing: &'a SymmBuf<A>,
    incoming: &'a SymmBuf<A>,
    widest: usize,
    n: usize,
    chunk_rows: usize,
}

/// Waits until every rank of this node has written its tiles for the rows this rank reduces
/// for node `b`; returns a token.
fn wait_node<T: Element>(
    p: &Program<'_>,
    ws: &MmRsWorkspace<T>,
    plan: &ReducePlan,
    b: usize,
) -> Result<Option<Token>> {
    let mut token = None;
    for &s in &plan.locals {
        let want = WaitCmp::Ge(ws.expected[b]);
        token = Some(p.wait_from(&ws.done, s * plan.nodes + b, s, want, WaitSem::Acquire)?);
    }
    Ok(token)
}

/// Adds rows `row..row + count` of `d`'s rows over this node's ranks, in rank order, into `sum`.
fn sum_node<A: crate::tensor::Accumulator>(
    bufs: &Buffers<'_, A>,
    plan: &ReducePlan,
    rows: &Shards,
    d: usize,
    (row, count): (usize, usize),
    token: Token,
    (sum, part): (&mut Tile<A>, &mut Tile<A>),
) {
    let n = bufs.n;
    let at = (rows.offset(d) + row) * n;
    for (i, &s) in plan.locals.iter().enumerate() {
        let from = GlobalPtr::from(consume_token(symm_at(bufs.partials, s), token)) + at;
        let target = if i == 0 { &mut *sum } else { &mut *part };
        // SAFETY: rank `s` wrote these rows before the release notifies acquired by `token`.
        unsafe { tile::load_2d(from, n, (count, n), <A as Element>::zero(), target) };
        if i > 0 {
            for (x, &y) in sum.as_mut_slice().iter_mut().zip(part.as_slice()) {
                *x += y;
            }
        }
    }
}

/// A stand-in's work for rank `d` of another node: this node's sum of `d`'s rows, chunk by
/// chunk, each put into `d`'s slot for this node with its signal.
fn send_node_sum<T: Element>(
    p: &Program<'_>,
    ws: &MmRsWorkspace<T>,
    plan: &ReducePlan,
    bufs: &Buffers<'_, T::Acc>,
    rows: &Shards,
    d: usize,
) -> Result<()> {
    let n = bufs.n;
    let count = rows.count(d);
    if n == 0 || count == 0 {
        return Ok(());
    }
    let Some(token) = wait_node(p, ws, plan, plan.node_of[d])? else { return Ok(()) };
    let block = bufs.chunk_rows.min(count);
    let mut sum = Tile::new(block, n, <T::Acc as Element>::zero());
    let mut part = Tile::new(block, n, <T::Acc as Element>::zero());
    let node_done = ws.node_done.as_ref().expect("several nodes");
    for c in 0..count.div_ceil(block) {
        let row = c * block;
        let len = tile::valid_len(row, block, count);
        sum_node(bufs, plan, rows, d, (row, len), token, (&mut sum, &mut part));
        let at = (rows.offset(d) + row) * n;
        // SAFETY: only this rank writes these rows of its `outgoing`, once per call; the put
        // reads them until the rank's quiet after the launch.
        unsafe { tile::store_2d(bufs.outgoing.ptr() + at, n, &sum, (len, n)) };
        let from = GlobalPtr::from(consume_token(bufs.outgoing.ptr(), token)) + at;
        let slot = (plan.node * bufs.widest + row) * n;
        let signal = Some((node_done, plan.node, SignalOp::Add(1)));
        // SAFETY: `d` reads its slot for this node only after this chunk's signal; the slot is
        // rewritten only after the next call's exchange.
        unsafe { p.put_rows(bufs.incoming.ptr() + slot, n, d, from, n, (len, n), signal)? };
    }
    Ok(())
}

/// This rank's own rows, chunk `t`: every node's sum, in node order, this node's made here.
#[allow(clippy::too_many_arguments)]
fn reduce_own<T: Element>(
    p: &Program<'_>,
    ws: &MmRsWorkspace<T>,
    plan: &ReducePlan,
    bufs: &Buffers<'_, T::Acc>,
    rows: &Shards,
    node_before: &[u64],
    t: usize,
    out: GlobalPtrMut<'_, T>,
) -> Result<()> {
    let (me, n) = (plan.me, bufs.n);
    let block = bufs.chunk_rows.min(rows.count(me).max(1));
    let row = t * block;
    let count = tile::valid_len(row, block, rows.count(me));
    let zero = <T::Acc as Element>::zero();
    let (mut total, mut node_sum, mut part) =
        (Tile::new(block, n, zero), Tile::new(block, n, zero), Tile::new(block, n, zero));
    let node_done = ws.node_done.as_ref().expect("several nodes");
    for (c, &before) in node_before.iter().enumerate() {
        let target = if c == 0 { &mut total } else { &mut node_sum };
        if c == plan.node {
            let Some(token) = wait_node(p, ws, plan, c)? else { continue };
            sum_node(bufs, plan, rows, me, (row, count), token, (&mut *target, &mut part));
        } else {
            let want = WaitCmp::Ge(before + t as u64 + 1);
            let sender = plan.senders[c];
            let token = p.wait_from(node_done, c, sender, want, WaitSem::Acquire)?;
            let slot = (c * bufs.widest + row) * n;
            let from = GlobalPtr::from(consume_token(bufs.incoming.ptr(), token)) + slot;
            // SAFETY: node `c`'s stand-in put these rows before the signal acquired above.
            unsafe { tile::load_2d(from, n, (count, n), zero, target) };
        }
        if c > 0 {
            for (x, &y) in total.as_mut_slice().iter_mut().zip(node_sum.as_slice()) {
                *x += y;
            }
        }
    }
    let mut rounded = Tile::new(block, n, T::zero());
    total.cast_into(&mut rounded);
    // SAFETY: each chunk of this rank's output is written by one task.
    unsafe { tile::store_2d(out + row * n, n, &rounded, (count, n)) };
    Ok(())
}
