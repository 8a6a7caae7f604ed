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

use crate::collectives;
use crate::device::DeviceWorld;
use crate::device::capability;
use crate::device::capability::Op;
use crate::device::device_data;
use crate::device::host::plan::row_chunks;
use crate::device::host::routing;
use crate::device::to_world_device;
use crate::device::{LaunchMode, launch, tile};
use crate::device::{ascend, cuda};
use crate::shmem::{
    Call, GlobalPtr, GlobalPtrMut, NotifySem, OutputBlock, Rank, Scope, SignalBuf, SignalOp,
    SymmBuf, Token, WaitCmp, WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::{Element, Tensor, array_split, pool, split_offsets};
use crate::{Error, Result};

const OP: &str = "all_to_all";
const UNFUSED_OP: &str = "all_to_all_unfused";
const MPI_OP: &str = "all_to_all_unfused_mpi";
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
    /// The output blocks free on every rank (see `shmem::lent`).
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
        capability::dtype_problem(Op::AllToAll, rank.device(), T::DTYPE)
    };
    let free = rank.free_output_blocks();
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
    run(rank, x, scatter_dim, gather_dim, true)
}

/// `all_to_all` (or its unfused baseline) on any world: the one place it chooses its backend.
/// The agreement exchange (which carries the capability table's answer for the element type, so
/// that every rank fails together), then one `match` on the world's backend; the input moves to
/// the world's device once, here.
pub(crate) fn run<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
    fused: bool,
) -> Result<AllToAllOutput<T>> {
    // Its own name in the exchange for the unfused baseline, as in all_gather_matmul's.
    let op = if fused { OP } else { UNFUSED_OP };
    let layout = agree::<T>(op, rank, x.shape(), scatter_dim, gather_dim)
        .map_err(|e| dims_error(e, x.shape(), scatter_dim, gather_dim))?;
    let all_to_all_v = |send: Vec<T>, counts: &[usize], _: &[usize]| {
        let received = collectives::all_to_all_v_tensor(rank, &send, counts);
        pool::give(send);
        received
    };
    let ran = match rank.device_world() {
        DeviceWorld::Host if fused => rank.with_workspace(AllToAllWorkspace::<T>::new, |ws| {
            run_fused(rank, ws, &layout, x, scatter_dim, gather_dim)
        }),
        DeviceWorld::Ascend(world) if fused => {
            let npu = ascend::AscendRank { world, rank };
            on_npu(&npu, &layout, x, scatter_dim, gather_dim)
        }
        DeviceWorld::Host | DeviceWorld::Ascend(_) => {
            unfused_after(op, rank, &layout, x, scatter_dim, gather_dim, all_to_all_v)
        }
        DeviceWorld::Cuda(gpus) => {
            let on_device = to_world_device(rank, x.clone())?;
            let data = device_data(&on_device);
            let gathers = &layout.gathers;
            cuda::all_to_all(gpus, rank, data, scatter_dim, gather_dim, gathers, fused).map(|out| {
                AllToAllOutput {
                    output: Tensor::from_device_storage(out),
                    gather_counts: layout.gathers.clone(),
                    scatter_counts: layout.scatters.clone(),
                }
            })
        }
    };
    ran.inspect_err(|e| rank.fail_after_agreeing(e))
}

/// Reports a bad dimension as [`Error::DimOutOfRange`] on the rank that passed it.
fn dims_error(err: Error, shape: &[usize], scatter_dim: usize, gather_dim: usize) -> Error {
    match (&err, check_dims(shape, scatter_dim, gather_dim)) {
        (Error::InvalidArgument { .. }, Err(dims)) => dims,
        _ => err,
    }
}

/// The unfused baseline, as a CPU user would write it at best (numpy + MPI's steps): pack each
/// peer's piece contiguously, [`collectives::all_to_all_v_tensor`] (one copy, as MPI's
/// single-copy shared-memory transports), then unpack each received piece into its range of the
/// gather dimension. Packing and unpacking are blocked transposes: each is one strided 2-D block
/// copy per peer (whole runs of the inner dimensions, no per-element index arithmetic), with
/// streaming stores when the tensor is large, as the collective's own copies. Same results as
/// [`all_to_all`].
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
    run(rank, x, scatter_dim, gather_dim, false)
}

/// The unfused baseline as a user of MPI writes it: pack each peer's piece contiguous (a blocked
/// copy, the permute), `MPI_Alltoallv` (run by the proxy, see
/// [`World::from_env`](crate::World::from_env)), then unpack each received piece into its range
/// of the gather dimension (a blocked copy). Same results as [`all_to_all`].
///
/// # Errors
/// As [`all_to_all`]; [`Error::InvalidArgument`] in a world not joined by MPI (feature `mpi`,
/// started by mpirun), which has no MPI collective to run.
///
/// # Examples
/// ```
/// use dist_tensor::fused::all_to_all_unfused_mpi;
/// use dist_tensor::{Tensor, World};
/// let err = World::threads(1)?.run(|rank| {
///     let x = Tensor::<f32>::random(&[2, 3], 1);
///     Ok(all_to_all_unfused_mpi(rank, &x, 0, 1).unwrap_err())
/// })?;
/// assert!(err[0].to_string().contains("needs a world joined by MPI"), "{}", err[0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_to_all_unfused_mpi<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<AllToAllOutput<T>> {
    unfused_with(MPI_OP, rank, x, scatter_dim, gather_dim, |front, to, from| {
        let received = rank.mpi_all_to_all_v(front, to, from)?;
        Tensor::from_shape_vec(&[received.len()], received)
    })
}

/// The unfused baseline, with `exchange` as the collective: it gets the packed pieces (its own
/// buffer), what goes to each rank and what comes from each rank (elements), and returns what
/// came, in rank order.
pub(crate) fn unfused_with<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
    exchange: impl FnOnce(Vec<T>, &[usize], &[usize]) -> Result<Tensor<T>>,
) -> Result<AllToAllOutput<T>> {
    let layout = agree::<T>(op, rank, x.shape(), scatter_dim, gather_dim)
        .map_err(|e| dims_error(e, x.shape(), scatter_dim, gather_dim))?;
    unfused_after(op, rank, &layout, x, scatter_dim, gather_dim, exchange)
}

/// The unfused baseline after the agreement on `l`.
fn unfused_after<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    l: &Layout,
    x: &Tensor<T>,
    scatter_dim: usize,
    gather_dim: usize,
    exchange: impl FnOnce(Vec<T>, &[usize], &[usize]) -> Result<Tensor<T>>,
) -> Result<AllToAllOutput<T>> {
    let (me, n) = (rank.rank(), rank.num_ranks());
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
    let mut send = pool::take::<T>(op, x.len()).inspect_err(|e| rank.fail_after_agreeing(e))?;
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
    // Unpack: each source's piece into its range of the gather dimension.
    let gather_along_x = l.gather_first;
    let (x_out, y_out) = if gather_along_x {
        (l.gather_total(), l.scatters[me])
    } else {
        (l.scatters[me], l.gather_total())
    };
    let piece =
        |src: usize| block(gather_along_x, x_out, y_out, l.gather_offsets[src], l.gathers[src]);
    let from: Vec<usize> = (0..n).map(|src| piece(src).0 * piece(src).1).collect();
    let received = exchange(send, &counts, &from)?;
    let mut out_shape = x.shape().to_vec();
    out_shape[gather_dim] = l.gather_total();
    out_shape[scatter_dim] = l.scatters[me];
    let mut output = Tensor::<T>::scratch(op, &out_shape)?;
    {
        let (pieces, out) = (
            GlobalPtr::from_slice(received.as_slice()),
            GlobalPtrMut::from_slice(output.as_mut_slice()),
        );
        let mut from = 0;
        for src in 0..n {
            let (rows, cols, stride, at) = piece(src);
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
    drop(received);
    Ok(AllToAllOutput {
        output,
        gather_counts: l.gathers.clone(),
        scatter_counts: l.scatters.clone(),
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
    Ok(AllToAllOutput {
        output,
        gather_counts: layout.gathers.clone(),
        scatter_counts: layout.scatters.clone(),
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::World;
    use crate::shmem::MAX_OUTPUT_BLOCKS;

    /// This rank's heads of the whole `[B, S, H, D]` tensor: what `all_to_all(2, 1)` returns.
    fn heads(x: &Tensor<f32>, me: usize, n: usize) -> Tensor<f32> {
        let split = array_split(x.shape()[2], n);
        let h0: usize = split[..me].iter().sum();
        let v = x.view();
        Tensor::from_array(v.slice_axis(ndarray::Axis(2), (h0..h0 + split[me]).into()).to_owned())
    }

    /// This rank's part of the sequence: the input of `all_to_all(2, 1)`.
    fn shard(x: &Tensor<f32>, me: usize, n: usize) -> Tensor<f32> {
        let split = array_split(x.shape()[1], n);
        let s0: usize = split[..me].iter().sum();
        let v = x.view();
        Tensor::from_array(v.slice_axis(ndarray::Axis(1), (s0..s0 + split[me]).into()).to_owned())
    }

    fn inputs(count: usize) -> Vec<Tensor<f32>> {
        (0..count as u64).map(|s| Tensor::random(&[2, 7, 5, 3], s + 1)).collect()
    }

    /// Outputs live in lent blocks: one held on some ranks only keeps its values while later
    /// calls run (they take other blocks), a block comes back once free everywhere (no new
    /// allocation), and past MAX_OUTPUT_BLOCKS live outputs the two-copy path gives the same
    /// values. (Fails when a held block counts as free: rank 0's first output is overwritten;
    /// and when a rank takes a block on its own mask instead of the agreed one: the ranks then
    /// disagree, and time out.)
    #[test]
    fn outputs_held_on_some_ranks_keep_their_values() {
        for n in [2, 3] {
            let xs = inputs(MAX_OUTPUT_BLOCKS + 4);
            let outs = World::threads(n)
                .unwrap()
                .run(|rank| {
                    let (me, n) = (rank.rank(), rank.num_ranks());
                    let call = |x: &Tensor<f32>| all_to_all(rank, &shard(x, me, n), 2, 1);
                    let first = call(&xs[0])?.output;
                    assert!(first.is_lent());
                    // Rank 0 keeps the first output; the others drop theirs.
                    let first = (me == 0).then_some(first);
                    let second = call(&xs[1])?.output;
                    assert_eq!(second, heads(&xs[1], me, n));
                    if let Some(first) = &first {
                        assert_eq!(*first, heads(&xs[0], me, n), "a held output was overwritten");
                    }
                    drop(second);
                    let before = rank.workspace_bytes();
                    let third = call(&xs[2])?.output;
                    assert!(third.is_lent());
                    assert_eq!(third, heads(&xs[2], me, n));
                    assert_eq!(rank.workspace_bytes(), before, "a block free everywhere is reused");
                    // Many alive at once: lent up to the limit, then the two-copy path.
                    let alive: Vec<Tensor<f32>> =
                        xs[3..].iter().map(|x| call(x).map(|o| o.output)).collect::<Result<_>>()?;
                    assert!(
                        alive.iter().any(|t| t.is_lent()) && alive.iter().any(|t| !t.is_lent())
                    );
                    for (x, out) in xs[3..].iter().zip(&alive) {
                        assert_eq!(*out, heads(x, me, n));
                    }
                    if let Some(first) = &first {
                        assert_eq!(*first, heads(&xs[0], me, n), "a held output was overwritten");
                    }
                    drop((third, alive));
                    Ok(first)
                })
                .unwrap();
            // The held output outlives its world, and reads, clones and converts as any tensor.
            let first = outs.into_iter().next().unwrap().unwrap();
            let want = heads(&xs[0], 0, n);
            assert!(first.is_lent());
            assert_eq!(first, want);
            assert_eq!(format!("{first}"), format!("{want}"));
            assert_eq!(first.view(), want.view());
            assert_eq!(first.to_array(), want.to_array());
            let flat = first.reshape(&[first.len()]).unwrap();
            assert!(flat.is_lent(), "a reshape shares the block");
            assert_eq!(flat.as_slice(), want.as_slice());
            // Copy on write: a clone keeps its values when the original is written.
            let mut written = first.clone();
            written.as_mut_slice()[0] = 42.0;
            assert!(!written.is_lent(), "a shared block is copied before a write");
            assert_eq!(first, want);
            assert_eq!(written.as_slice()[1..], want.as_slice()[1..]);
            drop(flat);
            // The only holder writes in place.
            let mut only = first.clone();
            drop(first);
            only.view_mut()[[0, 0, 0, 0]] = 7.0;
            assert!(only.is_lent(), "the only holder writes in place");
            assert_eq!(only.as_slice()[0], 7.0);
            assert_eq!(only.into_array().as_slice().unwrap()[1..], want.as_slice()[1..]);
        }
    }

    /// `release_workspaces` frees the blocks free everywhere and keeps one a rank still holds,
    /// so that every rank's heap stays alike: later allocations agree, and once the tensor is
    /// dropped a second release frees its block too.
    #[test]
    fn a_release_keeps_the_blocks_a_tensor_still_holds() {
        let xs = inputs(3);
        let world = World::threads(2).unwrap();
        world
            .run(|rank| {
                let (me, n) = (rank.rank(), rank.num_ranks());
                let call = |x: &Tensor<f32>| all_to_all(rank, &shard(x, me, n), 2, 1);
                let held = call(&xs[0])?.output;
                let held = (me == 1).then_some(held);
                drop(call(&xs[1])?.output);
                rank.release_workspaces()?;
                // Rank 1's block stays on both ranks; allocations after it agree.
                let block = 4096; // size_class of the outputs here
                assert_eq!(rank.workspace_bytes(), block);
                let buf = rank.alloc::<f32>(1000)?;
                let again = call(&xs[2])?.output;
                assert_eq!(again, heads(&xs[2], me, n));
                if let Some(held) = &held {
                    assert_eq!(*held, heads(&xs[0], me, n));
                }
                drop((held, again, buf));
                rank.release_workspaces()?;
                assert_eq!(rank.workspace_bytes(), 0);
                Ok(())
            })
            .unwrap();
    }

    /// A heap too small for an output block: the two-copy path, the same values.
    #[test]
    fn without_room_for_a_block_the_output_is_copied_twice() {
        // A 160 KiB output per rank: more than the half of the heap that blocks may take.
        let x = Tensor::<f32>::random(&[1, 80, 16, 64], 3);
        let outs = World::builder(2)
            .heap_capacity(256 << 10)
            .build()
            .unwrap()
            .run(|rank| {
                let (me, n) = (rank.rank(), rank.num_ranks());
                let out = all_to_all(rank, &shard(&x, me, n), 2, 1)?.output;
                assert_eq!(out, heads(&x, me, n));
                Ok(out.is_lent())
            })
            .unwrap();
        assert_eq!(outs, vec![false, false]);
    }
}
