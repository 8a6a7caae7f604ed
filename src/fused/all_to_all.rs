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
//! Each task adds one to the peer's signal for this source; once a source's count is complete,
//! its blocks are copied from the receive buffer into the output tensor. When the output is large
//! (`tile::STREAM_OUTPUT_BYTES`), every copy streams past the cache: nothing here reads the blocks
//! again before they would be evicted anyway.

use super::plan::row_chunks;
use crate::collectives;
use crate::device::ascend;
use crate::device::{LaunchMode, launch, tile};
use crate::shmem::{
    Call, GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, Token,
    WaitCmp, WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::{Element, Tensor, array_split, pool, split_offsets};
use crate::{Error, Result};

const OP: &str = "all_to_all";
const UNFUSED_OP: &str = "all_to_all_unfused";
/// The most dimensions a tensor may have here (metadata words are sized for them).
pub const MAX_DIMS: usize = 8;
/// Elements per copy task.
const CHUNK_ELEMS: usize = 64 * 1024;

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
fn agree<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    shape: &[usize],
    scatter_dim: usize,
    gather_dim: usize,
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
        rank.ascend().and_then(|_| ascend::check_dtype::<T>(op))
    };
    let mut words = vec![ndim as u64, scatter_dim as u64, gather_dim as u64];
    words.extend(shape.iter().take(MAX_DIMS).map(|&d| d as u64));
    let all = rank.exchange(Call::of::<T>(op), &words, problem, &[])?;
    all.agree(OP, 0, "number of dimensions")?;
    all.agree(OP, 1, "scatter dimension")?;
    all.agree(OP, 2, "gather dimension")?;
    for d in (0..ndim).filter(|&d| d != gather_dim) {
        all.agree(OP, 3 + d, &format!("size of dimension {d}"))?;
    }
    let (lo, hi) = (scatter_dim.min(gather_dim), scatter_dim.max(gather_dim));
    let gathers: Vec<usize> = all.iter().map(|w| w[3 + gather_dim] as usize).collect();
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
    let layout = agree::<T>(OP, rank, x.shape(), scatter_dim, gather_dim)
        .map_err(|e| dims_error(e, x.shape(), scatter_dim, gather_dim))?;
    if let Some(npu) = rank.ascend() {
        return on_npu(&npu, &layout, x, scatter_dim, gather_dim)
            .inspect_err(|e| rank.fail_after_agreeing(e));
    }
    rank.with_workspace(AllToAllWorkspace::<T>::new, |ws| {
        run_fused(rank, ws, &layout, x, scatter_dim, gather_dim)
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
    let layout = agree::<T>(UNFUSED_OP, rank, x.shape(), scatter_dim, gather_dim)
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

/// The fused all_to_all on this rank's NPU (`device::ascend`'s kernel of the same algorithm).
fn on_npu<T: Element>(
    npu: &ascend::AscendRank<'_>,
    layout: &Layout,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<AllToAllOutput<T>> {
    let npu_layout = ascend::launch::AllToAllLayout {
        a: layout.a,
        bm: layout.bm,
        c: layout.c,
        gather_first: layout.gather_first,
        scatter_len: layout.scatter_len,
        gathers: &layout.gathers,
        gather_offsets: &layout.gather_offsets,
        scatters: &layout.scatters,
        scatter_offsets: &layout.scatter_offsets,
    };
    let data = ascend::launch::all_to_all(npu, &npu_layout, x.as_slice())?;
    let mut out_shape = x.shape().to_vec();
    out_shape[gather_dim] = layout.gather_total();
    out_shape[scatter_dim] = layout.scatters[npu.rank.rank()];
    Ok(AllToAllOutput {
        output: Tensor::from_shape_vec(&out_shape, data)?,
        gather_counts: layout.gathers.clone(),
        scatter_counts: layout.scatters.clone(),
    })
}

fn run_fused<T: Element>(
    rank: &Rank<'_>,
    ws: &mut AllToAllWorkspace<T>,
    layout: &Layout,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<AllToAllOutput<T>> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let mut out_shape = x.shape().to_vec();
    out_shape[gather_dim] = layout.gather_total();
    out_shape[scatter_dim] = layout.scatters[me];
    let recv_len = (0..n).map(|r| layout.output_len(r)).max().unwrap_or(0);
    if n > 1 {
        rank.reserve_for("all_to_all receive", &mut ws.recv, recv_len)?;
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
    let recv_starts =
        split_offsets(&recv_order.iter().map(|&s| receives[s].1 * ab).collect::<Vec<_>>());

    // Every element is written below (own part, then each source's blocks).
    let mut output = Tensor::<T>::scratch(OP, &out_shape)?;
    let stream = output.len() * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
    let out_ptr = GlobalPtrMut::from_slice(output.as_mut_slice());
    let input = GlobalPtr::from_slice(x.as_slice());
    let ws = &*ws;
    let recv = ws.recv.as_ref();
    // SAFETY: each rank writes into a peer's receive buffer only the blocks that come from it,
    // before announcing them; a rank reads a source's blocks only after acquiring all of them; the
    // buffer is rewritten only after the next call's exchange. Every output block has one writer.
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
                if dst == me {
                    tile::copy_2d_maybe_streaming(
                        stream,
                        out_ptr + at,
                        block.dst_stride,
                        from,
                        block.src_stride,
                        (rows, block.cols),
                    );
                } else {
                    let to = symm_at(recv.expect("allocated for n > 1"), dst) + at;
                    tile::copy_2d_maybe_streaming(
                        stream,
                        to,
                        block.dst_stride,
                        from,
                        block.src_stride,
                        (rows, block.cols),
                    );
                    p.notify(
                        &ws.arrived,
                        me,
                        dst,
                        SignalOp::Add(1),
                        Scope::Peer,
                        NotifySem::Release,
                    )?;
                }
            }
            let mut tokens: Vec<Option<Token>> = vec![None; n];
            for t in p.tasks(*recv_starts.last().expect("total")) {
                let i = recv_starts.partition_point(|&s| s <= t) - 1;
                let src = recv_order[i];
                let (rows_per_task, per_ab) = receives[src];
                let within = t - recv_starts[i];
                let (ab_index, row_block) = (within / per_ab, within % per_ab);
                let block = layout.block(src, me, ab_index / layout.bm, ab_index % layout.bm);
                let row = row_block * rows_per_task;
                let rows = tile::valid_len(row, rows_per_task, block.rows);
                let token = match tokens[src] {
                    Some(token) => token,
                    None => {
                        let want = WaitCmp::Ge(ws.expected[src]);
                        *tokens[src].insert(p.wait_from(
                            &ws.arrived,
                            src,
                            src,
                            want,
                            WaitSem::Acquire,
                        )?)
                    }
                };
                let at = block.dst + row * block.dst_stride;
                let from = GlobalPtr::from(consume_token(recv.expect("n > 1").ptr(), token)) + at;
                tile::copy_2d_maybe_streaming(
                    stream,
                    out_ptr + at,
                    block.dst_stride,
                    from,
                    block.dst_stride,
                    (rows, block.cols),
                );
            }
            Ok(())
        })?;
    }
    Ok(AllToAllOutput {
        output,
        gather_counts: layout.gathers.clone(),
        scatter_counts: layout.scatters.clone(),
    })
}
