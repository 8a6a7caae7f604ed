//! all_gather_matmul's tile kernel on the host (the op, its agreement and its unfused baseline:
//! [`crate::fused::all_gather_matmul`]).
//!
//! The kernel runs in mix mode. On vector sub-core 0 of every AI core, the communication part
//! pushes this rank's rows into every peer's symmetric `gathered` buffer (peers in rotated order,
//! chunks spread over the programs) and adds one to the peer's signal for this shard per chunk.
//! On the other sub-cores, the compute part walks output tiles grid-stride, its own shard first
//! (read straight from the input, so work starts before any data arrives), then the shards in the
//! order peers send them; before the first tile of a shard it waits for all of the shard's chunks,
//! consumes the token, and runs `dot` on the tile in place, with masks at ragged edges.
//!
//! Half types are widened to f32 once: the weights before the launch, the rows as they are pushed
//! (the `gathered` buffer holds f32), so that tiles run the f32 kernel in place.
//!
//! When shards are short (decode, or many ranks), tiles per shard would read the whole weight once
//! per shard; then every rank also copies its own rows into its `gathered` buffer and tiles run over
//! the gathered rows, waiting for the shards a tile covers, so the weight is read once.
//!
//! Across nodes (a world joined by MPI) the push is hierarchical, as Triton-distributed's
//! inter-node AllGather GEMM: a rank copies its rows to the ranks of its node, and puts them once
//! per other node, to its *stand-in* there (the rank with its local index; see `Nodes::stand_in`),
//! nodes in the order after its own; each chunk put carries the chunk's signal. A stand-in forwards
//! every chunk, as its signal arrives, to the other ranks of its node (a copy and a notify), so
//! each shard crosses to each node once. Remote puts go out from one communication lane per
//! target, in chunk order, so a count of arrived chunks says which have. The compute part takes
//! shards in the order they come: its own, its node's, then the nodes before its own, nearest
//! first (they send to this node first).

use ndarray::{Array2, ArrayView2};

use crate::Result;
use crate::device::host::plan::{
    AccData, GemmTiles, MIN_SHARD_ROWS, Output, Shards, WeightData, compute_lanes,
    computing_programs, row_chunks, scratch,
};
use crate::device::host::routing::{GatherRoutes, REMOTE_CHUNK_ELEMS};
use crate::device::host::schedule::{AgShape, HostMachine, all_gather_matmul_path};
use crate::device::path::AgPath;
use crate::device::tile::{self, Tile};
use crate::device::{LaunchMode, launch};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, Token, WaitCmp,
    WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::Element;

const OP: &str = "all_gather_matmul";
/// Elements the communication part moves per chunk.
const PUSH_CHUNK_ELEMS: usize = 64 * 1024;

/// The kernel's products: one `[M, n_i]` array per weight, and the gathered input `[M, K]` when
/// kept.
pub(crate) type HostProducts<T> = (Vec<Array2<T>>, Option<Array2<T>>);

/// The tile kernel: `all_gather(x) @ w_i` for every weight, `rows` the agreed shards of `k`
/// columns; the gathered input too with `keep_input`. The kernel's buffers and signals are kept
/// in a workspace of the rank's between calls.
pub(crate) fn all_gather_matmul<T: Element>(
    rank: &Rank<'_>,
    shape: (&Shards, usize),
    x: ArrayView2<T>,
    weights: &[ArrayView2<T>],
    keep_input: bool,
) -> Result<HostProducts<T>> {
    rank.with_workspace(AgMatmulWorkspace::<T>::new, |work| {
        run_fused(rank, work, shape, x, weights, keep_input)
    })
}

/// The path this call takes on the host, and why: the one the call's options ask for, else one
/// rank's (rank 0's) machine decides, identically on every rank. Across nodes, the tile kernel
/// (its routing is what crosses nodes once).
pub(crate) fn path<T: Element>(
    rank: &Rank<'_>,
    asked: Option<AgPath>,
    machine: &HostMachine,
    (rows, k): (&Shards, usize),
    weights: &[ArrayView2<T>],
) -> (AgPath, String) {
    if let Some(path) = asked {
        return (path, "asked for by the call's options".into());
    }
    if rank.num_ranks() > 1 && rank.num_nodes() > 1 {
        return (AgPath::Overlap, "several nodes: each shard crosses to each node once".into());
    }
    let (grid, sub_vec_num) = (rank.topology().aicore_num(), rank.topology().sub_vec_num());
    let (comm, first_compute) = compute_lanes(sub_vec_num);
    let shape = AgShape {
        rows: rows.counts(),
        k,
        n: weights.iter().map(|w| w.ncols()).sum(),
        elem_bytes: size_of::<T::Acc>(),
        rank: rank.rank(),
        ranks_here: rank.node_ranks(rank.node_of(rank.rank())).len(),
        compute_lanes: computing_programs(grid, sub_vec_num),
        // With one sub-core per AI core the copies run before the tiles, on the same thread.
        comm_lanes: if first_compute > 0 { grid * comm } else { 0 },
        min_shard_rows: MIN_SHARD_ROWS,
    };
    all_gather_matmul_path(machine, &shape)
}

struct AgMatmulWorkspace<T: Element> {
    /// The gathered rows, in the accumulator type (half types are widened as they are pushed).
    gathered: Option<SymmBuf<T::Acc>>,
    /// `arrived[s]`: chunks of shard `s` that have landed in this rank's `gathered` buffer.
    arrived: SignalBuf,
    /// Cumulative count of chunks each shard has sent this rank, over all calls.
    expected: Vec<u64>,
}

impl<T: Element> Workspace for AgMatmulWorkspace<T> {
    fn symmetric_bytes(&self) -> usize {
        self.arrived.len() * 64
            + self.gathered.as_ref().map_or(0, |g| g.len() * size_of::<T::Acc>())
    }
}

impl<T: Element> AgMatmulWorkspace<T> {
    fn new(rank: &Rank<'_>) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(AgMatmulWorkspace {
            gathered: None,
            arrived: rank.alloc_signals_for("all_gather_matmul arrived", n)?,
            expected: vec![0; n],
        })
    }

    fn reserve(&mut self, rank: &Rank<'_>, len: usize) -> Result<()> {
        rank.reserve_for("all_gather_matmul gathered", &mut self.gathered, len)
    }
}

fn run_fused<T: Element>(
    rank: &Rank<'_>,
    ws: &mut AgMatmulWorkspace<T>,
    (rows, k): (&Shards, usize),
    x: ArrayView2<T>,
    weights: &[ArrayView2<T>],
    keep_input: bool,
) -> Result<HostProducts<T>> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let m_total = rows.total();
    // Tiles per shard, or over the gathered rows when shards are too short to be worth it.
    let per_shard = n == 1 || rows.counts().iter().all(|&m| m == 0 || m >= MIN_SHARD_ROWS);
    let x = x.as_standard_layout();
    let x_acc = AccData::new(OP, x.as_slice().expect("standard layout"))?;
    let input = GlobalPtr::from_slice(&x_acc);
    let chunks = Chunking {
        rows,
        k,
        local: row_chunks(k, PUSH_CHUNK_ELEMS),
        remote: row_chunks(k, REMOTE_CHUNK_ELEMS),
    };
    // The counts before this call: a forwarded chunk `c` of shard `s` has arrived once
    // `arrived[s]` passes `before[s] + c`.
    let before = ws.expected.clone();
    if n > 1 {
        ws.reserve(rank, m_total * k)?;
        for s in 0..n {
            if s != me || !per_shard {
                // A shard of another node comes in that node's chunks (put, then forwarded).
                let across = rank.node_of(s) != rank.node_of(me);
                ws.expected[s] += chunks.count(s, across) as u64;
            }
        }
    }
    let routes = GatherRoutes::new(rank, per_shard);
    // Who signals each shard's arrival here (a wait names that rank, so that only its leaving
    // `run` early fails the wait).
    let signaller = routes.signallers(rank);
    // Row-major weights are read in place; transposed (column-major) ones too, or copied once
    // into row-major order when many blocks of rows would pack them (see `WeightData::new`).
    let w_data: Vec<WeightData<'_, T::Acc>> =
        weights.iter().map(|w| WeightData::new(OP, *w, m_total)).collect::<Result<_>>()?;
    let w_ptrs: Vec<(GlobalPtr<'_, T::Acc>, [usize; 2])> =
        w_data.iter().map(|w| (w.ptr(), w.strides)).collect();
    let widths: Vec<usize> = weights.iter().map(|w| w.ncols()).collect();
    let mut outputs: Vec<Array2<T>> =
        widths.iter().map(|&nw| scratch(OP, (m_total, nw))).collect::<Result<_>>()?;
    let out_ptrs: Vec<Output<'_, T>> =
        outputs.iter_mut().map(|o| Output::new(o.as_slice_mut().expect("fresh array"))).collect();
    // The gathered input, when kept: copied out in chunks of whole rows after the tiles.
    let mut kept = if keep_input { Some(scratch(OP, (m_total, k))?) } else { None };
    let kept_ptr = kept.as_mut().map(|g| Output::<T>::new(g.as_slice_mut().expect("fresh array")));
    let x_own = GlobalPtr::from_slice(x.as_slice().expect("standard layout"));
    let keep_rows = row_chunks(k, PUSH_CHUNK_ELEMS);
    let keep_tasks = if kept_ptr.is_some() && k > 0 { m_total.div_ceil(keep_rows) } else { 0 };

    // The compute tiles, in the order data becomes available: own shard, then the others rotated
    // (on several nodes: this node's, then the nodes before this one, nearest first).
    let order = routes.arrival_order(rank);
    let segments: Vec<(usize, usize)> = if per_shard {
        order.iter().map(|&s| (rows.offset(s), rows.count(s))).collect()
    } else {
        vec![(0, m_total)]
    };
    let (grid, sub_vec_num) = (rank.topology().aicore_num(), rank.topology().sub_vec_num());
    let tiles = GemmTiles::new(&segments, &widths, computing_programs(grid, sub_vec_num));
    let ws = &*ws;
    let gathered = ws.gathered.as_ref();
    let (comm_lanes, first_compute) = compute_lanes(sub_vec_num);

    // SAFETY: a rank's rows land in a peer's `gathered` buffer at the rows of that shard, written
    // only by the pushing rank and read by the peer only after it acquired the shard's count of
    // chunks; buffers are reused only after the next call's exchange (see WordExchange). Every
    // output tile is written by exactly one task.
    unsafe {
        launch(rank, LaunchMode::Mix, grid, |p| {
            if n > 1 && p.sub_vec_id() < comm_lanes {
                let gathered = gathered.expect("reserved");
                push_rows(p, gathered, &ws.arrived, input, &chunks, &routes)?;
                forward_rows(p, gathered, &ws.arrived, &chunks, &routes, &before)?;
            }
            let mut tokens: Vec<Option<Token>> = vec![None; n];
            // Accumulator tiles, for outputs that must be rounded (half types) only.
            let mut tiles_for_rounding = None;
            for t in p.tasks_on_sub_vecs(first_compute, tiles.count()) {
                let task = tiles.get(t);
                let a = if n == 1 || (per_shard && order[task.segment] == me) {
                    input + (task.row - rows.offset(me)) * k
                } else {
                    // Wait, once per program, for every shard the tile covers.
                    let mut token = None;
                    for s in rows.covering(task.row, task.rows) {
                        if tokens[s].is_none() {
                            let want = WaitCmp::Ge(ws.expected[s]);
                            let from = signaller[s];
                            tokens[s] =
                                Some(p.wait_from(&ws.arrived, s, from, want, WaitSem::Acquire)?);
                        }
                        token = tokens[s];
                    }
                    let Some(token) = token else { continue };
                    let base = gathered.expect("reserved").ptr();
                    GlobalPtr::from(consume_token(base, token)) + task.row * k
                };
                let nw = widths[task.weight];
                let (w, w_strides) = w_ptrs[task.weight];
                let b = w + task.col * w_strides[1];
                let valid = (task.rows, k, task.cols);
                let at = task.row * nw + task.col;
                let a_strides = [k, 1];
                match out_ptrs[task.weight] {
                    Output::Direct(out) => tile::dot_store_strided(
                        out + at,
                        nw,
                        a,
                        a_strides,
                        b,
                        w_strides,
                        valid,
                        false,
                    ),
                    Output::Rounded(out) => {
                        let (acc, rounded) = tiles_for_rounding.get_or_insert_with(|| {
                            let (r, c) = (tiles.block_rows, tiles.block_cols);
                            (
                                Tile::new(r, c, <T::Acc as Element>::zero()),
                                Tile::new(r, c, T::zero()),
                            )
                        });
                        // The product overwrites the accumulator (no zeroing, no read of it),
                        // then is rounded once. Only the valid part is rounded and stored.
                        let width = acc.cols();
                        let acc_mem = GlobalPtrMut::from_slice(acc.as_mut_slice());
                        tile::dot_store_strided(
                            acc_mem, width, a, a_strides, b, w_strides, valid, false,
                        );
                        acc.cast_into(rounded);
                        tile::store_2d(out + at, nw, rounded, (task.rows, task.cols));
                    }
                }
            }
            if let Some(out) = kept_ptr {
                let source = KeptSource {
                    input: x_own,
                    input_acc: input,
                    gathered,
                    per_shard,
                    signaller: &signaller,
                };
                for t in p.tasks_on_sub_vecs(0, keep_tasks) {
                    let row = t * keep_rows;
                    let count = tile::valid_len(row, keep_rows, m_total);
                    keep_rows_of(p, ws, &source, rows, k, (row, count), out, &mut tokens)?;
                }
            }
            Ok(())
        })?;
    }
    rank.quiet()?; // the rows put to other nodes have left `x_acc`
    Ok((outputs, kept))
}

/// How shards are cut into chunks of rows of `k` elements: `local` rows per chunk copied on a
/// node, `remote` rows per chunk put to another node (and forwarded there as they came).
struct Chunking<'a> {
    rows: &'a Shards,
    k: usize,
    local: usize,
    remote: usize,
}

impl Chunking<'_> {
    fn rows_per(&self, across: bool) -> usize {
        if across { self.remote } else { self.local }
    }

    /// Chunks of `shard`, for a node of its own or (`across`) another one.
    fn count(&self, shard: usize, across: bool) -> usize {
        if self.k == 0 { 0 } else { self.rows.count(shard).div_ceil(self.rows_per(across)) }
    }

    /// First row (within the shard) and rows of chunk `c` of `shard`.
    fn chunk(&self, shard: usize, c: usize, across: bool) -> (usize, usize) {
        let per = self.rows_per(across);
        let row = c * per;
        (row, tile::valid_len(row, per, self.rows.count(shard)))
    }
}

/// Where the kept copy of the gathered input reads rows from: this rank's own (in `T` and in the
/// accumulator type) from its input when tiles read them there, every other row from the
/// `gathered` buffer.
struct KeptSource<'a, T: Element> {
    input: GlobalPtr<'a, T>,
    input_acc: GlobalPtr<'a, T::Acc>,
    gathered: Option<&'a SymmBuf<T::Acc>>,
    per_shard: bool,
    /// Who signals each shard's arrival here (see `run_fused`).
    signaller: &'a [usize],
}

/// Copies rows `row..row + count` of the gathered input into `out` (the kept copy), waiting for
/// each shard they cover once per program (`tokens`, shared with the compute part). Half types
/// come back from the f32 `gathered` buffer exactly: they were widened from `T`.
#[allow(clippy::too_many_arguments)]
fn keep_rows_of<T: Element>(
    p: &crate::device::Program<'_>,
    ws: &AgMatmulWorkspace<T>,
    source: &KeptSource<'_, T>,
    rows: &Shards,
    k: usize,
    (row, count): (usize, usize),
    out: Output<'_, T>,
    tokens: &mut [Option<Token>],
) -> Result<()> {
    let (me, n) = (p.rank(), p.num_ranks());
    for s in rows.covering(row, count) {
        let start = row.max(rows.offset(s));
        let end = (row + count).min(rows.offset(s) + rows.count(s));
        let valid = (end - start, k);
        if n == 1 || (source.per_shard && s == me) {
            let from = start - rows.offset(me);
            // SAFETY: this rank's own input, only read; each row of `out` has one writer.
            unsafe {
                match out {
                    Output::Direct(out) => {
                        tile::copy_2d(out + start * k, k, source.input_acc + from * k, k, valid)
                    }
                    Output::Rounded(out) => {
                        tile::copy_2d(out + start * k, k, source.input + from * k, k, valid)
                    }
                }
            }
            continue;
        }
        let token = match tokens[s] {
            Some(token) => token,
            None => {
                let want = WaitCmp::Ge(ws.expected[s]);
                let from = source.signaller[s];
                *tokens[s].insert(p.wait_from(&ws.arrived, s, from, want, WaitSem::Acquire)?)
            }
        };
        let base = source.gathered.expect("reserved when peers send").ptr();
        let from = GlobalPtr::from(consume_token(base, token)) + start * k;
        // SAFETY: shard `s` landed before its acquired count; nobody writes `gathered` before
        // the next call's exchange; each row of `out` has one writer.
        unsafe {
            match out {
                Output::Direct(out) => tile::copy_2d(out + start * k, k, from, k, valid),
                Output::Rounded(out) => {
                    let mut acc = Tile::new(valid.0, k, <T::Acc as Element>::zero());
                    let mut rounded = Tile::new(valid.0, k, T::zero());
                    tile::load_2d(from, k, valid, <T::Acc as Element>::zero(), &mut acc);
                    acc.cast_into(&mut rounded);
                    tile::store_2d(out + start * k, k, &rounded, valid);
                }
            }
        }
    }
    Ok(())
}

/// The communication part, sending: this rank's rows copied into the `gathered` buffer of every
/// rank of its node (its own too, when tiles read the gathered rows), chunks spread over the
/// programs; and put to its stand-in on every other node, one program per target sending its
/// chunks in order. One signal per chunk.
fn push_rows<A: Element>(
    p: &crate::device::Program<'_>,
    gathered: &SymmBuf<A>,
    arrived: &SignalBuf,
    input: GlobalPtr<'_, A>,
    chunks: &Chunking<'_>,
    routes: &GatherRoutes,
) -> Result<()> {
    let me = p.rank();
    let (rows, k) = (chunks.rows, chunks.k);
    let count = chunks.count(me, false);
    // One communication lane per program: sub-core 0.
    for task in p.tasks(routes.local.len() * count) {
        let peer = routes.local[task / count];
        let (row, len) = chunks.chunk(me, task % count, false);
        let dst = symm_at(gathered, peer) + (rows.offset(me) + row) * k;
        // SAFETY: only this rank writes its shard's rows of a peer's `gathered` buffer, each chunk
        // once; the peer reads them only after acquiring the chunk count.
        unsafe { tile::copy_2d(dst, k, input + row * k, k, (len, k)) };
        let scope = if peer == me { Scope::Device } else { Scope::Peer };
        p.notify(arrived, me, peer, SignalOp::Add(1), scope, NotifySem::Release)?;
    }
    for target in p.tasks(routes.remote.len()) {
        let peer = routes.remote[target];
        for c in 0..chunks.count(me, true) {
            let (row, len) = chunks.chunk(me, c, true);
            let at = (rows.offset(me) + row) * k;
            let signal = Some((arrived, me, SignalOp::Add(1)));
            // SAFETY: as above, on the stand-in of another node; `input` stays unchanged until
            // the rank's quiet after the launch.
            unsafe {
                p.put_rows(gathered.ptr() + at, k, peer, input + row * k, k, (len, k), signal)?
            };
        }
    }
    Ok(())
}

/// The communication part, forwarding: each chunk of a shard of another node that this rank
/// receives for its node, as soon as it lands, copied into the `gathered` buffer of the other
/// ranks of the node, with its signal. One program per shard, in chunk order.
fn forward_rows<A: Element>(
    p: &crate::device::Program<'_>,
    gathered: &SymmBuf<A>,
    arrived: &SignalBuf,
    chunks: &Chunking<'_>,
    routes: &GatherRoutes,
    before: &[u64],
) -> Result<()> {
    let (rows, k) = (chunks.rows, chunks.k);
    for i in p.tasks(routes.forwards.len()) {
        let s = routes.forwards[i];
        for c in 0..chunks.count(s, true) {
            let want = WaitCmp::Ge(before[s] + c as u64 + 1);
            let token = p.wait_from(arrived, s, s, want, WaitSem::Acquire)?;
            let (row, len) = chunks.chunk(s, c, true);
            let at = (rows.offset(s) + row) * k;
            let from = GlobalPtr::from(consume_token(gathered.ptr(), token)) + at;
            for &peer in &routes.neighbours {
                // SAFETY: the chunk landed here (its signal was acquired); only this rank writes
                // shard `s`'s rows on its node's other ranks, each chunk once, and they read them
                // only after the chunk count.
                unsafe { tile::copy_2d(symm_at(gathered, peer) + at, k, from, k, (len, k)) };
                p.notify(arrived, s, peer, SignalOp::Add(1), Scope::Peer, NotifySem::Release)?;
            }
        }
    }
    Ok(())
}
