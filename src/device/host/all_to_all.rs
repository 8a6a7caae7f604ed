//! all_to_all's tile kernel on the host (the op, its agreement and its unfused baselines:
//! [`crate::fused::all_to_all`]).
//!
//! The kernel (vector-only) sees the tensor as five dimensions `[A, X, Bm, Y, C]`, the two named
//! dimensions being `X` and `Y`: for each (peer, a, b) what goes to the peer is a 2-D block of
//! rows with contiguous runs, so a task is one `copy_2d` of a row block, straight from the input
//! into the peer's symmetric receive buffer, laid out as the peer's output (tasks flattened over
//! peer, a, b and row block; peers rotated). The rank's own part goes straight to its output.
//! Each task adds one to the peer's signal for this source. Where the gather dimension comes
//! first and the blocks go straight to the peers' outputs (Ulysses' `all_to_all(2, 1)` within a
//! node), a task is instead a block of whole input rows, each row split between the peers as it
//! is read: the input is read front to back rather than in strided runs of 1/n of a row, and
//! each peer counts every task of this rank (one add per program at its end). Where the node's
//! ranks outnumber its cores, each rank copies with one program, not one per vector sub-core.
//!
//! The output tensor lives in the symmetric heap, in a block the rank lends it
//! (`shmem::lent`: taken only when every rank has its copy free, a mask in the call's exchange),
//! so the peer's block of the output is its final place and every element is copied once: the
//! rank only waits for every source's count. When no block can be had (the rank's output blocks
//! at their limit, the heap full), the blocks go into a symmetric receive buffer instead and are
//! copied from there into an output in ordinary memory once a source's count is complete: two
//! copies. A peer on another node (a world joined by MPI) gets its blocks through the proxy
//! instead: one strided put per task, straight from the input into its receive buffer, carrying
//! the task's signal (each block crosses once; the output is in ordinary memory, as the peers'
//! blocks of it are not). When the output is large (`tile::STREAM_OUTPUT_BYTES`), every copy
//! streams past the cache: nothing here reads the blocks again before they would be evicted
//! anyway.

use crate::Result;

const OP: &str = "all_to_all";
use crate::device::host::plan::row_chunks;
use crate::device::host::routing;
use crate::device::{LaunchMode, launch, tile};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, OutputBlock, Rank, Scope, SignalBuf, SignalOp, SymmBuf,
    Token, WaitCmp, WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::{Element, Tensor, split_offsets};

/// Elements per copy task.
const CHUNK_ELEMS: usize = 64 * 1024;

/// The tile kernel: `x` resharded from `gather_dim` to `scatter_dim` as the agreed `layout`
/// says; returns this rank's output. The kernel's receive buffer and signals are kept in a
/// workspace of the rank's between calls.
pub(crate) fn all_to_all<T: Element>(
    rank: &Rank<'_>,
    layout: &Layout,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<Tensor<T>> {
    rank.with_workspace(AllToAllWorkspace::<T>::new, |ws| {
        run_fused(rank, ws, layout, x, scatter_dim, gather_dim)
    })
}

struct AllToAllWorkspace<T: Element> {
    /// The receive buffer of the two-copy path.
    recv: Option<SymmBuf<T>>,
    arrived: SignalBuf,
    expected: Vec<u64>,
}

impl<T: Element> Workspace for AllToAllWorkspace<T> {
    fn symmetric_bytes(&self) -> usize {
        self.arrived.len() * 64 + self.recv.as_ref().map_or(0, |r| r.len() * size_of::<T>())
    }
}

impl<T: Element> AllToAllWorkspace<T> {
    fn new(rank: &Rank<'_>) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(AllToAllWorkspace {
            recv: None,
            arrived: rank.alloc_signals_for("all_to_all arrived", n)?,
            expected: vec![0; n],
        })
    }
}

/// The tensor as `[A, X, Bm, Y, C]`, with the scatter and gather dimensions as `X` and `Y`.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    pub(crate) a: usize,
    pub(crate) bm: usize,
    pub(crate) c: usize,
    /// Whether the gather dimension comes first (`X`); else the scatter dimension does.
    pub(crate) gather_first: bool,
    /// Full size of the scatter dimension.
    pub(crate) scatter_len: usize,
    pub(crate) gathers: Vec<usize>,
    pub(crate) gather_offsets: Vec<usize>,
    pub(crate) scatters: Vec<usize>,
    pub(crate) scatter_offsets: Vec<usize>,
    /// The output blocks free on every rank (see `shmem::lent`).
    pub(crate) free_everywhere: u64,
}

/// One 2-D block copy: `rows` rows of `cols` elements, at `src` (row stride `src_stride`) and
/// `dst` (row stride `dst_stride`).
#[derive(Debug, Clone, Copy)]
struct Block {
    src: usize,
    src_stride: usize,
    dst: usize,
    dst_stride: usize,
    rows: usize,
    cols: usize,
}

impl Layout {
    /// Elements of rank `r`'s output.
    fn output_len(&self, r: usize) -> usize {
        self.a * self.bm * self.c * self.gather_total() * self.scatters[r]
    }

    /// The full size of the gather dimension.
    pub(crate) fn gather_total(&self) -> usize {
        *self.gather_offsets.last().expect("offsets end with the total")
    }

    /// The block that rank `src` sends to rank `dst` for one `(a, b)`, with input offsets in
    /// `src`'s input and output offsets in `dst`'s output.
    fn block(&self, src: usize, dst: usize, a: usize, b: usize) -> Block {
        let (bm, c, g_total) = (self.bm, self.c, self.gather_total());
        let (g, g_off) = (self.gathers[src], self.gather_offsets[src]);
        let (s, s_off) = (self.scatters[dst], self.scatter_offsets[dst]);
        if self.gather_first {
            // in: [A, g, Bm, Y, C]; out: [A, G, Bm, s, C]; rows over g, runs of s*C.
            let y = self.scatter_len;
            Block {
                src: ((a * g) * bm + b) * y * c + s_off * c,
                src_stride: bm * y * c,
                dst: ((a * g_total + g_off) * bm + b) * s * c,
                dst_stride: bm * s * c,
                rows: g,
                cols: s * c,
            }
        } else {
            // in: [A, X, Bm, g, C]; out: [A, s, Bm, G, C]; rows over s, runs of g*C.
            let x = self.scatter_len;
            Block {
                src: ((a * x + s_off) * bm + b) * g * c,
                src_stride: bm * g * c,
                dst: ((a * s) * bm + b) * g_total * c + g_off * c,
                dst_stride: bm * g_total * c,
                rows: s,
                cols: g * c,
            }
        }
    }
}

fn run_fused<T: Element>(
    rank: &Rank<'_>,
    ws: &mut AllToAllWorkspace<T>,
    layout: &Layout,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<Tensor<T>> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let mut out_shape = x.shape().to_vec();
    out_shape[gather_dim] = layout.gather_total();
    out_shape[scatter_dim] = layout.scatters[me];
    let out_len = (0..n).map(|r| layout.output_len(r)).max().unwrap_or(0);
    // One copy into the peers' output blocks, or two through the receive buffer: the same
    // choice on every rank (agreed sizes and masks, the world's nodes). Across nodes, through
    // the receive buffer: a peer's output block has no pointer here.
    let block: Option<OutputBlock> = if n > 1 && out_len > 0 && rank.num_nodes() == 1 {
        rank.output_block(layout.free_everywhere, out_len * size_of::<T>())?
    } else {
        None
    };
    if n > 1 && block.is_none() {
        rank.reserve_for("all_to_all receive", &mut ws.recv, out_len)?;
    }
    // Tasks: (peer i, a, b, row block), peers rotated; the same plan on every rank.
    let plan = |src: usize, dst: usize| {
        let block = layout.block(src, dst, 0, 0);
        let chunk = routing::chunk_elems(rank, src, dst, CHUNK_ELEMS);
        let rows_per_task = row_chunks(block.cols, chunk);
        let per_ab = if block.cols == 0 { 0 } else { block.rows.div_ceil(rows_per_task) };
        (rows_per_task, per_ab)
    };
    let ab = layout.a * layout.bm;
    // Row-major sends where the gather dimension comes first and every block goes straight to
    // its place: a task is a block of whole input rows, each row split between the peers as it
    // is read, so that the input is read front to back. Peer-major tasks read each peer's part
    // of every row in turn: strided reads (runs of 1/n of a row), which cost 1.3 to 1.5 times
    // the contiguous copy on a Zen 4 where the row-major order costs 1.1 to 1.3 (a probe,
    // B=1 S=8192 H=32 D=128, worlds 2 and 4). The same choice on every rank (agreed layout
    // and block).
    let row_major = block.is_some() && layout.gather_first;
    let row_major_rows = row_chunks(layout.scatter_len * layout.c, CHUNK_ELEMS);
    let row_major_tasks = |src: usize| layout.gathers[src].div_ceil(row_major_rows) * ab;
    let sends: Vec<(usize, usize)> = (0..n).map(|i| plan(me, (me + i) % n)).collect();
    let send_starts = split_offsets(&sends.iter().map(|&(_, per)| per * ab).collect::<Vec<_>>());
    for src in (0..n).filter(|&s| s != me) {
        ws.expected[src] +=
            if row_major { row_major_tasks(src) } else { plan(src, me).1 * ab } as u64;
    }
    let receives: Vec<(usize, usize)> = (0..n).map(|s| plan(s, me)).collect();
    let recv_order: Vec<usize> = (1..n).map(|i| (me + i) % n).collect();
    // Receive tasks: with an output block, one wait per source; else one copy per row block.
    let recv_tasks: Vec<usize> =
        recv_order.iter().map(|&s| if block.is_some() { 1 } else { receives[s].1 * ab }).collect();
    let recv_starts = split_offsets(&recv_tasks);

    // Every element is written below (own part, then each source's blocks), into the output
    // block or, on the two-copy path, an output in ordinary memory.
    let mut host_output = match block {
        Some(_) => None,
        None => Some(Tensor::<T>::scratch(OP, &out_shape)?),
    };
    let stream = out_len * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
    let host_ptr = host_output.as_mut().map(|t| GlobalPtrMut::from_slice(t.as_mut_slice()));
    let input = GlobalPtr::from_slice(x.as_slice());
    let (arrived, expected) = (&ws.arrived, &ws.expected);
    let recv = ws.recv.as_ref();
    let block_buf = block.as_ref().map(|b| b.buf());
    // SAFETY: each rank writes into a peer's output block (or receive buffer) only the blocks
    // that come from it, before announcing them; a rank hands its output block out (or reads its
    // receive buffer) only after acquiring every source's blocks. A receive buffer is rewritten
    // only after the next call's exchange, an output block only in a call where every rank has
    // it free (no tensor holds it). Every element of the output has one writer.
    unsafe {
        launch(rank, LaunchMode::VectorOnly, copying_programs(rank), |p| {
            // A program's tasks for one peer are consecutive: it tells the peer once, how many
            // it sent, when it moves on (the peer waits for every task of this rank anyway).
            if let (true, Some(buf)) = (row_major, block_buf) {
                send_row_major(p, layout, buf, input, row_major_rows, stream, arrived)?;
            } else {
                let mut sent: Option<(usize, u64)> = None;
                let tell = |sent: Option<(usize, u64)>| match sent {
                    Some((dst, count)) if dst != me => p.notify(
                        arrived,
                        me,
                        dst,
                        SignalOp::Add(count),
                        Scope::Peer,
                        NotifySem::Release,
                    ),
                    _ => Ok(()),
                };
                for t in p.tasks(*send_starts.last().expect("total")) {
                    let i = send_starts.partition_point(|&s| s <= t) - 1;
                    let dst = (me + i) % n;
                    let (rows_per_task, per_ab) = sends[i];
                    let within = t - send_starts[i];
                    let (ab_index, row_block) = (within / per_ab, within % per_ab);
                    let block = layout.block(me, dst, ab_index / layout.bm, ab_index % layout.bm);
                    let row = row_block * rows_per_task;
                    let rows = tile::valid_len(row, rows_per_task, block.rows);
                    let from = input + (block.src + row * block.src_stride);
                    let at = block.dst + row * block.dst_stride;
                    let (dst_stride, src_stride) = (block.dst_stride, block.src_stride);
                    let valid = (rows, block.cols);
                    match (block_buf, host_ptr) {
                        (Some(buf), _) => {
                            let to = symm_at(buf, dst).cast::<T>() + at;
                            tile::copy_2d_maybe_streaming(
                                stream, to, dst_stride, from, src_stride, valid,
                            );
                        }
                        (None, Some(out)) if dst == me => tile::copy_2d_maybe_streaming(
                            stream,
                            out + at,
                            dst_stride,
                            from,
                            src_stride,
                            valid,
                        ),
                        (None, _) if !p.is_local(dst) => {
                            // Through the proxy: the put carries its own signal.
                            tell(sent.take())?;
                            let recv = recv.expect("allocated for n > 1");
                            let signal = Some((arrived, me, SignalOp::Add(1)));
                            p.put_rows(
                                recv.ptr() + at,
                                dst_stride,
                                dst,
                                from,
                                src_stride,
                                valid,
                                signal,
                            )?;
                            continue;
                        }
                        (None, _) => {
                            let to = symm_at(recv.expect("allocated for n > 1"), dst) + at;
                            tile::copy_2d_maybe_streaming(
                                stream, to, dst_stride, from, src_stride, valid,
                            );
                        }
                    }
                    match &mut sent {
                        Some((to, count)) if *to == dst => *count += 1,
                        _ => tell(sent.replace((dst, 1)))?,
                    }
                }
                tell(sent)?;
            }
            let mut tokens: Vec<Option<Token>> = vec![None; n];
            for t in p.tasks(*recv_starts.last().expect("total")) {
                let i = recv_starts.partition_point(|&s| s <= t) - 1;
                let src = recv_order[i];
                let token = match tokens[src] {
                    Some(token) => token,
                    None => {
                        let want = WaitCmp::Ge(expected[src]);
                        *tokens[src].insert(p.wait_from(
                            arrived,
                            src,
                            src,
                            want,
                            WaitSem::Acquire,
                        )?)
                    }
                };
                let (Some(out), Some(recv)) = (host_ptr, recv) else {
                    // One copy: the source's blocks are in place; the wait was all.
                    continue;
                };
                let (rows_per_task, per_ab) = receives[src];
                let within = t - recv_starts[i];
                let (ab_index, row_block) = (within / per_ab, within % per_ab);
                let block = layout.block(src, me, ab_index / layout.bm, ab_index % layout.bm);
                let row = row_block * rows_per_task;
                let rows = tile::valid_len(row, rows_per_task, block.rows);
                let at = block.dst + row * block.dst_stride;
                let from = GlobalPtr::from(consume_token(recv.ptr(), token)) + at;
                tile::copy_2d_maybe_streaming(
                    stream,
                    out + at,
                    block.dst_stride,
                    from,
                    block.dst_stride,
                    (rows, block.cols),
                );
            }
            Ok(())
        })?;
    }
    rank.quiet()?; // blocks put to other nodes have left the input
    let output = match (host_output, block) {
        (Some(output), _) => output,
        (None, Some(block)) => Tensor::lent(block.lend(), &out_shape),
        (None, None) => unreachable!("an output block or an output in ordinary memory"),
    };
    Ok(output)
}

/// Programs that copy for this rank: one per vector sub-core, or one per AI core where the ranks
/// of this node outnumber its cores (4 ranks on 2 cores), where more threads only take turns on
/// the same cores: on a Zen 4 with 2 cores (a probe, B=1 S=8192 H=32 D=128), one program per
/// rank ran world 4 in 0.75 to 0.9 of the time of two, while at world 2 two ran in 0.9 of one.
/// Ranks may differ here: what a peer waits for counts tasks, not programs.
fn copying_programs(rank: &Rank<'_>) -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let node = rank.node_of(rank.rank());
    let here = (0..rank.num_ranks()).filter(|&r| rank.node_of(r) == node).count();
    let topology = rank.topology();
    if here > cores { topology.aicore_num() } else { topology.aivector_core_num() }
}

/// The row-major sends of [`run_fused`]: tasks of `rows_per_task` whole input rows per `(a, b)`
/// (gather dimension first), each row split between the peers' output blocks in `buf` as it is
/// read; then each peer is told how many tasks this program sent (one count per task, whatever
/// the peer's share of it, as the peer expects).
///
/// # Safety
/// As the kernel of [`run_fused`]: the peers' blocks written here are this rank's alone to write
/// in this call, and nobody reads them before the count arrives.
#[allow(clippy::too_many_arguments)]
unsafe fn send_row_major<T: Element>(
    p: &crate::device::Program<'_>,
    layout: &Layout,
    buf: &SymmBuf<u8>,
    input: GlobalPtr<'_, T>,
    rows_per_task: usize,
    stream: bool,
    arrived: &SignalBuf,
) -> Result<()> {
    let (me, n) = (p.rank(), p.num_ranks());
    let my_rows = layout.gathers[me];
    let per_ab = my_rows.div_ceil(rows_per_task);
    let mut done = 0u64;
    for t in p.tasks(per_ab * layout.a * layout.bm) {
        let (ab_index, row_block) = (t / per_ab, t % per_ab);
        let (a, b) = (ab_index / layout.bm, ab_index % layout.bm);
        // Peers rotated, as the peer-major tasks: not every rank writes to rank 0 first.
        let blocks: Vec<(usize, Block)> =
            (0..n).map(|i| (me + i) % n).map(|dst| (dst, layout.block(me, dst, a, b))).collect();
        let row = row_block * rows_per_task;
        for r in row..row + tile::valid_len(row, rows_per_task, my_rows) {
            for &(dst, block) in blocks.iter().filter(|(_, block)| block.cols > 0) {
                let to = symm_at(buf, dst).cast::<T>() + (block.dst + r * block.dst_stride);
                let from = input + (block.src + r * block.src_stride);
                // SAFETY: the row's piece is inside the input and inside dst's output block
                // (`Layout::block`), which this rank alone writes there (the caller's contract).
                unsafe { tile::copy_row_unfenced(stream, to, from, block.cols) };
            }
        }
        done += 1;
    }
    tile::stream_fence();
    if done > 0 {
        for dst in (1..n).map(|i| (me + i) % n) {
            p.notify(arrived, me, dst, SignalOp::Add(done), Scope::Peer, NotifySem::Release)?;
        }
    }
    Ok(())
}
