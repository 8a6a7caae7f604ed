//! The sequence-parallel all_to_all (Ulysses): a tensor sharded on one dimension becomes the same
//! tensor sharded on another, in one tiled copy kernel with no permute copies.
//!
//! For `[B, s_r, H, D]` sharded on the sequence (dim 1), `all_to_all(2, 1)` gives every rank all
//! of the sequence for its heads, `[B, S, h_r, D]`, and `all_to_all(1, 2)` goes back. In general
//! the input is sharded on `gather_dim` (sizes may differ between ranks) and the result is sharded
//! on `scatter_dim`, split as `numpy.array_split` splits it.
//!
//! The kernel (vector-only) sees the tensor as five dimensions `[A, X, Bm, Y, C]`, the two named
//! dimensions being `X` and `Y`: for each (peer, a, b) what goes to the peer is a 2-D block of
//! rows with contiguous runs, so a task is one `copy_2d` of a row block, straight from the input
//! into the peer's symmetric receive buffer, laid out as the peer's output (tasks flattened over
//! peer, a, b and row block; peers rotated). The rank's own part goes straight to its output.
//! Each task adds one to the peer's signal for this source.
//!
//! The output tensor lives in the symmetric heap, so the peer's block is its final place: every
//! element is copied once. The heap blocks are the workspace's, lent to output tensors: a call
//! takes a block that every rank has free (no tensor holds it), found by a bit mask in the shape
//! exchange, or allocates a new one on every rank (at most [`MAX_OUTPUT_BLOCKS`]). When none can
//! be had (that many outputs alive, or the heap full) the blocks go through a symmetric receive
//! buffer and are copied from there into an output in ordinary memory once a source's count is
//! complete: two copies. When the output is large (`tile::STREAM_OUTPUT_BYTES`), every copy
//! streams past the cache: nothing here reads the blocks again before they would be evicted
//! anyway.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::plan::row_chunks;
use crate::collectives;
use crate::device::{LaunchMode, launch, tile};
use crate::shmem::{
    Call, GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, Token,
    WaitCmp, WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::{Element, SymmetricBlock, Tensor, array_split, pool, split_offsets};
use crate::{Error, Result};

const OP: &str = "all_to_all";
const UNFUSED_OP: &str = "all_to_all_unfused";
/// The most dimensions a tensor may have here (metadata words are sized for them).
pub const MAX_DIMS: usize = 8;
/// Elements per copy task.
const CHUNK_ELEMS: usize = 64 * 1024;
/// The most symmetric-heap output blocks one rank's workspace lends out (per element type).
pub const MAX_OUTPUT_BLOCKS: usize = 8;

/// The result of an all_to_all: this rank's new shard, and how both dimensions are split.
#[derive(Debug, Clone, PartialEq)]
pub struct AllToAllOutput<T: Element> {
    /// This rank's shard of the result (sharded on the scatter dimension).
    pub output: Tensor<T>,
    /// Each rank's size along the gather dimension, before the exchange.
    pub gather_counts: Vec<usize>,
    /// Each rank's size along the scatter dimension, after it.
    pub scatter_counts: Vec<usize>,
}

struct AllToAllWorkspace<T: Element> {
    /// The receive buffer of the two-copy path.
    recv: Option<SymmBuf<T>>,
    arrived: SignalBuf,
    expected: Vec<u64>,
}

/// Symmetric blocks lent to output tensors; block `i` has the same length on every rank. A
/// workspace of its own, which costs nothing to create: its free mask is read before the shape
/// exchange, and creating the main workspace (collective allocations) waits until after it.
struct OutputBlocks<T: Element> {
    blocks: Vec<OutputBlock<T>>,
}

impl<T: Element> OutputBlocks<T> {
    fn new(_: &Rank<'_>) -> Result<Self> {
        Ok(OutputBlocks { blocks: Vec::new() })
    }

    /// Which blocks this rank has free (no tensor holds them), as a bit mask.
    fn free_mask(&self) -> u64 {
        self.blocks
            .iter()
            .enumerate()
            .filter(|(_, o)| !o.lent.load(Ordering::Acquire))
            .fold(0, |mask, (i, _)| mask | 1 << i)
    }
}

impl<T: Element> Workspace for OutputBlocks<T> {
    fn symmetric_bytes(&self) -> usize {
        self.blocks.iter().map(|o| o.buf.len() * size_of::<T>()).sum()
    }
}

struct OutputBlock<T: Element> {
    buf: Arc<SymmBuf<T>>,
    /// Whether a tensor holds the block now.
    lent: Arc<AtomicBool>,
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
struct Layout {
    a: usize,
    bm: usize,
    c: usize,
    /// Whether the gather dimension comes first (`X`); else the scatter dimension does.
    gather_first: bool,
    /// Full size of the scatter dimension.
    scatter_len: usize,
    gathers: Vec<usize>,
    gather_offsets: Vec<usize>,
    scatters: Vec<usize>,
    scatter_offsets: Vec<usize>,
    /// The output blocks free on every rank, as a bit mask.
    free_everywhere: u64,
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

    fn gather_total(&self) -> usize {
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

/// Exchanges shapes and checks them on every rank.
/// `free` is this rank's mask of free output blocks (see [`OutputBlocks`]).
fn agree<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    shape: &[usize],
    (scatter_dim, gather_dim): (usize, usize),
    free: u64,
) -> Result<Layout> {
    let ndim = shape.len();
    let problem = if ndim > MAX_DIMS {
        Some(format!("{ndim} dimensions; at most {MAX_DIMS}"))
    } else if scatter_dim >= ndim || gather_dim >= ndim {
        Some(format!(
            "dimension {} is out of range for a tensor of {ndim} dimensions",
            scatter_dim.max(gather_dim)
        ))
    } else if scatter_dim == gather_dim {
        Some(format!("scatter and gather dimension are both {scatter_dim}"))
    } else {
        None
    };
    let mut words = vec![ndim as u64, scatter_dim as u64, gather_dim as u64, free];
    words.extend(shape.iter().take(MAX_DIMS).map(|&d| d as u64));
    let all = rank.exchange(Call::of::<T>(op), &words, problem, &[])?;
    all.agree(OP, 0, "number of dimensions")?;
    all.agree(OP, 1, "scatter dimension")?;
    all.agree(OP, 2, "gather dimension")?;
    for d in (0..ndim).filter(|&d| d != gather_dim) {
        all.agree(OP, 4 + d, &format!("size of dimension {d}"))?;
    }
    let (lo, hi) = (scatter_dim.min(gather_dim), scatter_dim.max(gather_dim));
    let gathers: Vec<usize> = all.iter().map(|w| w[4 + gather_dim] as usize).collect();
    let scatters = array_split(shape[scatter_dim], rank.num_ranks());
    Ok(Layout {
        a: shape[..lo].iter().product(),
        bm: shape[lo + 1..hi].iter().product(),
        c: shape[hi + 1..].iter().product(),
        gather_first: gather_dim < scatter_dim,
        scatter_len: shape[scatter_dim],
        gather_offsets: split_offsets(&gathers),
        gathers,
        scatter_offsets: split_offsets(&scatters),
        scatters,
        free_everywhere: all.iter().fold(u64::MAX, |mask, w| mask & w[3]),
    })
}

fn check_dims(shape: &[usize], scatter_dim: usize, gather_dim: usize) -> Result<()> {
    for dim in [scatter_dim, gather_dim] {
        if dim >= shape.len() {
            return Err(Error::DimOutOfRange { op: OP, dim, ndim: shape.len() });
        }
    }
    Ok(())
}

/// Reshards `x` from `gather_dim` to `scatter_dim`: `x` is this rank's shard along `gather_dim`;
/// the result is this rank's piece of the whole tensor along `scatter_dim`. Collective.
///
/// # Errors
/// On every rank: [`Error::InvalidArgument`] for dimensions out of range or equal (naming the
/// rank), [`Error::RanksDisagree`] for shapes that differ other than along `gather_dim`; and as
/// every collective.
///
/// # Examples
/// ```
/// use dist_tensor::fused::all_to_all;
/// use dist_tensor::{Tensor, World};
///
/// // [S = 2 rows (one per rank), H = 2 heads] -> each rank: all rows of one head.
/// let outs = World::threads(2)?.run(|rank| {
///     let r = rank.rank() as f32;
///     let x = Tensor::from_shape_vec(&[1, 2], vec![r * 10.0, r * 10.0 + 1.0])?;
///     Ok(all_to_all(rank, &x, 1, 0)?.output)
/// })?;
/// assert_eq!(outs[0].as_slice(), &[0.0, 10.0]);
/// assert_eq!(outs[1].as_slice(), &[1.0, 11.0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_to_all<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<AllToAllOutput<T>> {
    let free = rank.with_workspace(OutputBlocks::<T>::new, |b| Ok(b.free_mask()))?;
    let layout = agree::<T>(OP, rank, x.shape(), (scatter_dim, gather_dim), free)
        .map_err(|e| dims_error(e, x.shape(), scatter_dim, gather_dim))?;
    rank.with_workspace(AllToAllWorkspace::<T>::new, |ws| {
        rank.with_workspace(OutputBlocks::<T>::new, |blocks| {
            run_fused(rank, ws, blocks, &layout, x, scatter_dim, gather_dim)
        })
    })
    .inspect_err(|e| rank.fail_after_agreeing(e))
}

/// Reports a bad dimension as [`Error::DimOutOfRange`] on the rank that passed it.
fn dims_error(err: Error, shape: &[usize], scatter_dim: usize, gather_dim: usize) -> Error {
    match (&err, check_dims(shape, scatter_dim, gather_dim)) {
        (Error::InvalidArgument { .. }, Err(dims)) => dims,
        _ => err,
    }
}

/// The unfused baseline, as a CPU user would write it at best (numpy + MPI's steps): pack each
/// peer's piece contiguously, [`collectives::all_to_all_v`], then unpack each received piece into
/// its range of the gather dimension. Packing and unpacking are blocked transposes: each is one
/// strided 2-D block copy per peer (whole runs of the inner dimensions, no per-element index
/// arithmetic), with streaming stores when the tensor is large, as the collective's own copies.
/// Same results as [`all_to_all`].
///
/// # Errors
/// As [`all_to_all`].
///
/// # Examples
/// ```
/// use dist_tensor::fused::{all_to_all, all_to_all_unfused};
/// use dist_tensor::{Tensor, World};
/// World::threads(3)?.run(|rank| {
///     let x = Tensor::<f32>::random(&[2, 3 + rank.rank(), 5, 4], rank.rank() as u64);
///     assert_eq!(all_to_all(rank, &x, 2, 1)?, all_to_all_unfused(rank, &x, 2, 1)?);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_to_all_unfused<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<AllToAllOutput<T>> {
    // Its own name in the exchange, as in all_gather_matmul's unfused baseline.
    let layout = agree::<T>(UNFUSED_OP, rank, x.shape(), (scatter_dim, gather_dim), 0)
        .map_err(|e| dims_error(e, x.shape(), scatter_dim, gather_dim))?;
    let (me, n) = (rank.rank(), rank.num_ranks());
    let l = &layout;
    let stream = x.len() * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
    // The tensor as [A, X, Bm, Y, C]; the scatter dimension is X or Y, the gather one the other.
    // A piece is a range along X (one run of all the rest per a) or along Y (one run of that
    // range times C per (a, x, b)): either way one 2-D block.
    let block = |along_x: bool, x_len: usize, y_len: usize, lo: usize, len: usize| {
        if along_x {
            let row = l.bm * y_len * l.c;
            // (rows, cols, stride of the whole, offset of the piece in the whole)
            (l.a, len * row, x_len * row, lo * row)
        } else {
            (l.a * x_len * l.bm, len * l.c, y_len * l.c, lo * l.c)
        }
    };

    // Pack: each peer's piece, contiguous, in rank order.
    let scatter_along_x = !l.gather_first;
    let (x_in, y_in) = if scatter_along_x {
        (l.scatter_len, l.gathers[me])
    } else {
        (l.gathers[me], l.scatter_len)
    };
    let counts: Vec<usize> =
        l.scatters.iter().map(|&s| x.len() / l.scatter_len.max(1) * s).collect();
    let send_offsets = split_offsets(&counts);
    // A failure here leaves the peers committed to the exchange: fail the world so they stop.
    let mut send =
        pool::take::<T>(UNFUSED_OP, x.len()).inspect_err(|e| rank.fail_after_agreeing(e))?;
    {
        let (input, packed) =
            (GlobalPtr::from_slice(x.as_slice()), GlobalPtrMut::from_slice(&mut send));
        for (r, &start) in send_offsets[..n].iter().enumerate() {
            let (rows, cols, stride, at) =
                block(scatter_along_x, x_in, y_in, l.scatter_offsets[r], l.scatters[r]);
            if rows * cols == 0 {
                continue;
            }
            // SAFETY: the block is inside the input and inside peer r's part of `send`, which
            // this thread alone owns.
            unsafe {
                tile::copy_2d_maybe_streaming(
                    stream,
                    packed + start,
                    cols,
                    input + at,
                    stride,
                    (rows, cols),
                )
            };
        }
    }
    let received = collectives::all_to_all_v(rank, &send, &counts)?;
    pool::give(send);

    // Unpack: each source's piece into its range of the gather dimension.
    let mut out_shape = x.shape().to_vec();
    out_shape[gather_dim] = l.gather_total();
    out_shape[scatter_dim] = l.scatters[me];
    let mut output = Tensor::<T>::scratch(UNFUSED_OP, &out_shape)?;
    {
        let gather_along_x = l.gather_first;
        let (x_out, y_out) = if gather_along_x {
            (l.gather_total(), l.scatters[me])
        } else {
            (l.scatters[me], l.gather_total())
        };
        let (pieces, out) =
            (GlobalPtr::from_slice(&received), GlobalPtrMut::from_slice(output.as_mut_slice()));
        let mut from = 0;
        for src in 0..n {
            let (rows, cols, stride, at) =
                block(gather_along_x, x_out, y_out, l.gather_offsets[src], l.gathers[src]);
            if rows * cols == 0 {
                continue;
            }
            // SAFETY: the piece is inside `received` and its block inside the output, which
            // this thread alone owns.
            unsafe {
                tile::copy_2d_maybe_streaming(
                    stream,
                    out + at,
                    stride,
                    pieces + from,
                    cols,
                    (rows, cols),
                )
            };
            from += rows * cols;
        }
    }
    pool::give(received);
    Ok(AllToAllOutput {
        output,
        gather_counts: layout.gathers.clone(),
        scatter_counts: layout.scatters.clone(),
    })
}

/// Picks the output block every rank has free and large enough, or allocates one on every rank;
/// `None` when there are already [`MAX_OUTPUT_BLOCKS`] or the heap has no room (the same answer
/// on every rank: the decision depends only on agreed values and collective allocations).
fn output_block<T: Element>(
    rank: &Rank<'_>,
    ws: &mut OutputBlocks<T>,
    free_everywhere: u64,
    len: usize,
) -> Option<usize> {
    let usable =
        |(i, o): &(usize, &OutputBlock<T>)| free_everywhere >> i & 1 == 1 && o.buf.len() >= len;
    if let Some((i, _)) = ws.blocks.iter().enumerate().find(usable) {
        return Some(i);
    }
    if ws.blocks.len() >= MAX_OUTPUT_BLOCKS {
        return None;
    }
    let buf = rank.alloc::<T>(len).ok()?;
    ws.blocks.push(OutputBlock { buf: Arc::new(buf), lent: Arc::new(AtomicBool::new(false)) });
    Some(ws.blocks.len() - 1)
}

#[allow(clippy::too_many_arguments)]
fn run_fused<T: Element>(
    rank: &Rank<'_>,
    ws: &mut AllToAllWorkspace<T>,
    blocks: &mut OutputBlocks<T>,
    layout: &Layout,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<AllToAllOutput<T>> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let mut out_shape = x.shape().to_vec();
    out_shape[gather_dim] = layout.gather_total();
    out_shape[scatter_dim] = layout.scatters[me];
    let out_len = (0..n).map(|r| layout.output_len(r)).max().unwrap_or(0);
    // One copy into peers' output blocks, or two through the receive buffer.
    let direct = if n > 1 && out_len > 0 {
        output_block(rank, blocks, layout.free_everywhere, out_len)
    } else {
        None
    };
    if n > 1 && direct.is_none() {
        rank.reserve_for("all_to_all receive", &mut ws.recv, out_len)?;
    }
    // Tasks: (peer i, a, b, row block), peers rotated; the same plan on every rank.
    let plan = |src: usize, dst: usize| {
        let block = layout.block(src, dst, 0, 0);
        let rows_per_task = row_chunks(block.cols, CHUNK_ELEMS);
        let per_ab = if block.cols == 0 { 0 } else { block.rows.div_ceil(rows_per_task) };
        (rows_per_task, per_ab)
    };
    let ab = layout.a * layout.bm;
    let sends: Vec<(usize, usize)> = (0..n).map(|i| plan(me, (me + i) % n)).collect();
    let send_starts = split_offsets(&sends.iter().map(|&(_, per)| per * ab).collect::<Vec<_>>());
    for src in (0..n).filter(|&s| s != me) {
        ws.expected[src] += (plan(src, me).1 * ab) as u64;
    }
    let receives: Vec<(usize, usize)> = (0..n).map(|s| plan(s, me)).collect();
    let recv_order: Vec<usize> = (1..n).map(|i| (me + i) % n).collect();
    let recv_starts = split_offsets(
        &recv_order
            .iter()
            .map(|&s| if direct.is_some() { 1 } else { receives[s].1 * ab })
            .collect::<Vec<_>>(),
    );

    // Every element is written below (own part, then each source's blocks).
    let mut host_output = match direct {
        Some(_) => None,
        None => Some(Tensor::<T>::scratch(OP, &out_shape)?),
    };
    let direct_buf = direct.map(|i| &*blocks.blocks[i].buf);
    // This rank's own output: ordinary memory, or its own block (lent to no tensor until the one
    // made below; peers write into it only the blocks that come from them).
    let host_ptr = host_output.as_mut().map(|t| GlobalPtrMut::from_slice(t.as_mut_slice()));
    let own_block = direct_buf.map(|buf| buf.ptr());
    let stream = out_len * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
    let input = GlobalPtr::from_slice(x.as_slice());
    let (arrived, expected) = (&ws.arrived, &ws.expected);
    let recv = ws.recv.as_ref();
    // SAFETY: each rank writes into a peer's output block (or receive buffer) only the blocks
    // that come from it, before announcing them; a rank reads (or hands out) a source's blocks
    // only after acquiring all of them; a block is rewritten only after the next call's
    // exchange, and an output block only once every rank has it free. Every output block has one
    // writer.
    unsafe {
        launch(rank, LaunchMode::VectorOnly, rank.topology().aivector_core_num(), |p| {
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
                let valid = (rows, block.cols);
                if dst == me {
                    let (dst_stride, src_stride) = (block.dst_stride, block.src_stride);
                    match (host_ptr, own_block) {
                        (Some(out), _) => tile::copy_2d_maybe_streaming(
                            stream,
                            out + at,
                            dst_stride,
                            from,
                            src_stride,
                            valid,
                        ),
                        (None, Some(out)) => tile::copy_2d_maybe_streaming(
                            stream,
                            out + at,
                            dst_stride,
                            from,
                            src_stride,
                            valid,
                        ),
                        (None, None) => unreachable!("one output or the other"),
                    }
                    continue;
                }
                let to = symm_at(direct_buf.or(recv).expect("a block for n > 1"), dst) + at;
                tile::copy_2d_maybe_streaming(
                    stream,
                    to,
                    block.dst_stride,
                    from,
                    block.src_stride,
                    valid,
                );
                p.notify(arrived, me, dst, SignalOp::Add(1), Scope::Peer, NotifySem::Release)?;
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
                let Some(recv) = recv.filter(|_| direct.is_none()) else {
                    // One copy: the blocks are in place; the wait was all.
                    let _ = consume_token(direct_buf.expect("direct").ptr(), token);
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
                    host_ptr.expect("the two-copy path has a host output") + at,
                    block.dst_stride,
                    from,
                    block.dst_stride,
                    (rows, block.cols),
                );
            }
            Ok(())
        })?;
    }
    let output = match (host_output, direct) {
        (Some(t), _) => t,
        (None, Some(i)) => {
            let o = &blocks.blocks[i];
            Tensor::symmetric(SymmetricBlock::lend(o.buf.clone(), o.lent.clone(), &out_shape))
        }
        (None, None) => unreachable!("one output or the other"),
    };
    Ok(AllToAllOutput {
        output,
        gather_counts: layout.gathers.clone(),
        scatter_counts: layout.scatters.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::World;

    /// The whole tensor on every rank, for checking a rank's output against.
    fn expected(x: &Tensor<f32>, me: usize, n: usize) -> Tensor<f32> {
        // [B, S, H, D] -> this rank's heads, all of the sequence.
        let heads = array_split(x.shape()[2], n);
        let h0: usize = heads[..me].iter().sum();
        let v = x.view();
        let part = v.slice_axis(ndarray::Axis(2), (h0..h0 + heads[me]).into());
        Tensor::from_array(part.to_owned())
    }

    fn shard(x: &Tensor<f32>, me: usize, n: usize) -> Tensor<f32> {
        let rows = array_split(x.shape()[1], n);
        let s0: usize = rows[..me].iter().sum();
        let v = x.view();
        Tensor::from_array(v.slice_axis(ndarray::Axis(1), (s0..s0 + rows[me]).into()).to_owned())
    }

    /// Outputs live in lent symmetric blocks: one held on some ranks only keeps its values while
    /// later calls run (they take other blocks), blocks are reused once free everywhere, and past
    /// MAX_OUTPUT_BLOCKS live outputs the two-copy path still gives the right values.
    #[test]
    fn outputs_held_on_some_ranks_keep_their_values() {
        for n in [2, 3] {
            let inputs: Vec<Tensor<f32>> = (0..MAX_OUTPUT_BLOCKS as u64 + 3)
                .map(|s| Tensor::random(&[2, 7, 5, 3], s))
                .collect();
            let outs = World::threads(n)
                .unwrap()
                .run(|rank| {
                    let (me, n) = (rank.rank(), rank.num_ranks());
                    let call = |x: &Tensor<f32>| all_to_all(rank, &shard(x, me, n), 2, 1);
                    // Rank 0 holds the first output; the others drop theirs.
                    let first = call(&inputs[0])?.output;
                    let first = if me == 0 { Some(first) } else { None };
                    let second = call(&inputs[1])?.output;
                    assert_eq!(second, expected(&inputs[1], me, n));
                    drop(second);
                    let before = rank.workspace_bytes();
                    // Free everywhere again: the same block, no new allocation.
                    let third = call(&inputs[2])?.output;
                    assert_eq!(third, expected(&inputs[2], me, n));
                    assert_eq!(rank.workspace_bytes(), before, "a free block is reused");
                    // Many alive at once: past the limit, the two-copy path.
                    let alive: Vec<Tensor<f32>> = inputs[3..]
                        .iter()
                        .map(|x| call(x).map(|o| o.output))
                        .collect::<Result<_>>()?;
                    for (x, out) in inputs[3..].iter().zip(&alive) {
                        assert_eq!(*out, expected(x, me, n));
                    }
                    if let Some(first) = &first {
                        assert_eq!(*first, expected(&inputs[0], me, n), "overwritten");
                    }
                    Ok(first)
                })
                .unwrap();
            // A symmetric output outlives its world, and reads, clones and converts as any tensor.
            let first = outs.into_iter().next().unwrap().unwrap();
            let want = expected(&inputs[0], 0, n);
            assert_eq!(first.clone(), want);
            assert_eq!(first.view(), want.view());
            assert_eq!(first.reshape(&[first.len()]).unwrap().as_slice(), want.as_slice());
            let mut first = first;
            first.as_mut_slice()[0] = 42.0;
            assert_eq!(first.view()[[0, 0, 0, 0]], 42.0);
            assert_eq!(first.into_array().as_slice().unwrap()[1..], want.as_slice()[1..]);
        }
    }
}
