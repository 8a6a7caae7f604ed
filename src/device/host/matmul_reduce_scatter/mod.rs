//! matmul_reduce_scatter's tile kernel on the host (the op, its agreement and its unfused
//! baselines: [`crate::fused::matmul_reduce_scatter`]).
//!
//! The kernel runs in mix mode. The compute part walks the partial product's tiles grid-stride,
//! the rows other ranks need first (rank `me + 1`'s, then `me + 2`'s, ..., its own last), writes
//! each tile in f32 (the accumulator type) into this rank's symmetric `partials` buffer, and adds
//! one to the owning rank's signal for this source. The reduction part (vector sub-core 0 from the
//! start, the compute sub-cores once their tiles are done) waits until every rank's partials for
//! this rank's rows are complete, then pulls them through `symm_at` and adds them in rank order
//! 0, 1, 2, ..., rounding once: the same bits on every run, whatever the timing.
//!
//! Across nodes (a world joined by MPI) it reduces inside each node first, then across nodes (see
//! `nodes`); the order of the sum then depends on the world's shape.

mod nodes;

use ndarray::{Array2, ArrayView2};

use crate::Result;
use crate::device::host::plan::{
    AccData, GemmTiles, MIN_SHARD_ROWS, Shards, WeightData, compute_lanes, computing_programs,
    row_chunks, scratch,
};
use crate::device::tile::{self, Tile};
use crate::device::{LaunchMode, launch};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, Token, WaitCmp,
    WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::Element;

const OP: &str = "matmul_reduce_scatter";
/// Elements per reduction task.
const REDUCE_CHUNK_ELEMS: usize = 16 * 1024;

/// The tile kernel: `x @ w` summed over ranks, this rank keeping its rows of `rows` (`n`
/// columns); on several nodes reduced inside each node first (see `nodes`). The kernel's buffers
/// and signals are kept in a workspace of the rank's between calls.
pub(crate) fn matmul_reduce_scatter<T: Element>(
    rank: &Rank<'_>,
    rows: &Shards,
    n: usize,
    x: ArrayView2<T>,
    w: ArrayView2<T>,
) -> Result<Array2<T>> {
    rank.with_workspace(MmRsWorkspace::<T>::new, |ws| {
        if rank.num_nodes() > 1 {
            nodes::run(rank, ws, rows, n, x, w)
        } else {
            run_fused(rank, ws, rows, n, x, w)
        }
    })
}

/// The workspace: partial products in the accumulator type, and per-source tile counts.
pub(super) struct MmRsWorkspace<T: Element> {
    pub(super) partials: Option<SymmBuf<T::Acc>>,
    /// `done[s * nodes + b]`: tiles that rank `s` of this node has written into its `partials`
    /// covering the rows this rank reduces for ranks of node `b` (on one node: its own rows).
    pub(super) done: SignalBuf,
    /// Cumulative tile count each rank announces to this one per node `b`, over all calls.
    pub(super) expected: Vec<u64>,
    /// Across nodes: this node's sums of other nodes' rows, put from here...
    pub(super) outgoing: Option<SymmBuf<T::Acc>>,
    /// ...into the row owner's slot for this node here; `node_done[c]` counts node `c`'s chunks.
    pub(super) incoming: Option<SymmBuf<T::Acc>>,
    pub(super) node_done: Option<SignalBuf>,
    pub(super) node_expected: Vec<u64>,
}

impl<T: Element> Workspace for MmRsWorkspace<T> {
    fn symmetric_bytes(&self) -> usize {
        let len = |b: &Option<SymmBuf<T::Acc>>| b.as_ref().map_or(0, |p| p.len());
        let signals = self.done.len() + self.node_done.as_ref().map_or(0, |s| s.len());
        signals * 64
            + (len(&self.partials) + len(&self.outgoing) + len(&self.incoming))
                * size_of::<T::Acc>()
    }
}

impl<T: Element> MmRsWorkspace<T> {
    fn new(rank: &Rank<'_>) -> Result<Self> {
        let nodes = rank.num_nodes();
        let done =
            rank.alloc_signals_for("matmul_reduce_scatter done", rank.num_ranks() * nodes)?;
        let node_done = if nodes > 1 {
            Some(rank.alloc_signals_for("matmul_reduce_scatter node_done", nodes)?)
        } else {
            None
        };
        Ok(MmRsWorkspace {
            partials: None,
            done,
            expected: vec![0; nodes],
            outgoing: None,
            incoming: None,
            node_done,
            node_expected: vec![0; nodes],
        })
    }
}

fn run_fused<T: Element>(
    rank: &Rank<'_>,
    ws: &mut MmRsWorkspace<T>,
    rows: &Shards,
    n: usize,
    x: ArrayView2<T>,
    w: ArrayView2<T>,
) -> Result<Array2<T>> {
    let (me, world) = (rank.rank(), rank.num_ranks());
    let (m, k) = (rows.total(), x.ncols());
    let x = x.as_standard_layout();
    // Half types widened once, so that every tile runs the f32 kernel in place; a transposed
    // weight (`w.t()`, the backward pass's) is read in place too, or copied once into row-major
    // order when many blocks of rows would pack it (see `WeightData::new`).
    let x_acc = AccData::new(OP, x.as_slice().expect("standard layout"))?;
    let w_data = WeightData::new(OP, w, m)?;
    let mine = rows.count(me);
    let mut out = scratch(OP, (mine, n))?;
    let partial_len = m.saturating_mul(n);
    rank.reserve_for("matmul_reduce_scatter partials", &mut ws.partials, partial_len)?;
    // Tiles of the rows each rank owns, the other ranks' rows first and this rank's last; when
    // shards are short, tiles over all rows instead (a tile then serves several owners).
    let order: Vec<usize> = (1..=world).map(|i| (me + i) % world).collect();
    let per_owner = rows.counts().iter().all(|&c| c == 0 || c >= MIN_SHARD_ROWS);
    let segments: Vec<(usize, usize)> = if per_owner {
        order.iter().map(|&r| (rows.offset(r), rows.count(r))).collect()
    } else {
        vec![(0, m)]
    };
    let (grid, sub_vec_num) = (rank.topology().aicore_num(), rank.topology().sub_vec_num());
    let tiles = GemmTiles::new(&segments, &[n], computing_programs(grid, sub_vec_num));
    // Every rank cuts the product the same way (the plan depends on M, N and the topology only),
    // so every rank announces the same tiles for this rank's rows: those that cover them.
    let covering_me = (0..tiles.count())
        .filter(|&t| {
            let task = tiles.get(t);
            rows.covering(task.row, task.rows).any(|owner| owner == me)
        })
        .count();
    ws.expected[0] += covering_me as u64;

    let (x_ptr, w_ptr, w_strides) = (GlobalPtr::from_slice(&x_acc), w_data.ptr(), w_data.strides);
    let out_ptr = GlobalPtrMut::from_slice(out.as_slice_mut().expect("fresh array"));
    let reduce_rows = row_chunks(n, REDUCE_CHUNK_ELEMS).min(mine.max(1));
    let reduce_tasks = if n == 0 { 0 } else { mine.div_ceil(reduce_rows) };
    let ws = &*ws;
    let partials = ws.partials.as_ref().expect("allocated above");
    let (_, first_compute) = compute_lanes(sub_vec_num);

    // SAFETY: each rank writes only its own `partials`, each tile once, before announcing it;
    // a rank reads a peer's partials for its rows only after acquiring all of them; the buffer
    // is rewritten only after the next call's exchange. Each output chunk has one writer.
    unsafe {
        launch(rank, LaunchMode::Mix, grid, |p| {
            for t in p.tasks_on_sub_vecs(first_compute, tiles.count()) {
                let task = tiles.get(t);
                let valid = (task.rows, k, task.cols);
                let at = task.row * n + task.col;
                // The partial product goes straight into the symmetric buffer, in f32.
                let (a, b) = (x_ptr + task.row * k, w_ptr + task.col * w_strides[1]);
                let dst = partials.ptr() + at;
                tile::dot_store_strided(dst, n, a, [k, 1], b, w_strides, valid, false);
                for owner in rows.covering(task.row, task.rows) {
                    let scope = if owner == me { Scope::Device } else { Scope::Peer };
                    p.notify(&ws.done, me, owner, SignalOp::Add(1), scope, NotifySem::Release)?;
                }
            }
            reduce_rows_of(p, ws, partials, rows, n, out_ptr, reduce_rows, reduce_tasks)
        })?;
    }
    Ok(out)
}

/// The reduction part: this rank's rows of every rank's partials, added in rank order.
#[allow(clippy::too_many_arguments)]
fn reduce_rows_of<T: Element>(
    p: &crate::device::Program<'_>,
    ws: &MmRsWorkspace<T>,
    partials: &SymmBuf<T::Acc>,
    rows: &Shards,
    n: usize,
    out: GlobalPtrMut<'_, T>,
    block: usize,
    tasks: usize,
) -> Result<()> {
    let (me, world) = (p.rank(), p.num_ranks());
    let mut tokens: Vec<Option<Token>> = vec![None; world];
    let mut sum = Tile::new(block, n, <T::Acc as Element>::zero());
    let mut part = Tile::new(block, n, <T::Acc as Element>::zero());
    let mut rounded = Tile::new(block, n, T::zero());
    for t in p.tasks_on_sub_vecs(0, tasks) {
        let row = t * block;
        let count = tile::valid_len(row, block, rows.count(me));
        let at = (rows.offset(me) + row) * n;
        // Added in rank order 0, 1, 2, ...: the same bits on every run.
        for (src, held) in tokens.iter_mut().enumerate() {
            let token = match *held {
                Some(token) => token,
                None => {
                    let want = WaitCmp::Ge(ws.expected[0]);
                    *held.insert(p.wait_from(&ws.done, src, src, want, WaitSem::Acquire)?)
                }
            };
            let from = consume_token(symm_at(partials, src), token);
            let target = if src == 0 { &mut sum } else { &mut part };
            let zero = <T::Acc as Element>::zero();
            // SAFETY: rank `src` finished writing these partials before its release notifies,
            // all acquired above; nobody writes them again before the next call's exchange.
            unsafe { tile::load_2d(GlobalPtr::from(from) + at, n, (count, n), zero, target) };
            if src > 0 {
                for (s, &v) in sum.as_mut_slice().iter_mut().zip(part.as_slice()) {
                    *s += v;
                }
            }
        }
        sum.cast_into(&mut rounded);
        // SAFETY: each chunk of this rank's output is written by one task.
        unsafe { tile::store_2d(out + row * n, n, &rounded, (count, n)) };
    }
    Ok(())
}
