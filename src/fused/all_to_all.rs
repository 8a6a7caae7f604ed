//! The sequence-parallel all_to_all (Ulysses): a tensor sharded on one dimension becomes the same
//! tensor sharded on another, in one tiled copy kernel with no permute copies.
//!
//! For `[B, s_r, H, D]` sharded on the sequence (dim 1), `all_to_all(2, 1)` gives every rank all
//! of the sequence for its heads, `[B, S, h_r, D]`, and `all_to_all(1, 2)` goes back. In general
//! the input is sharded on `gather_dim` (sizes may differ between ranks) and the result is sharded
//! on `scatter_dim`, split as `numpy.array_split` splits it.
//!
//! On the host this is one tiled copy kernel (see `device::host::all_to_all`): every block goes
//! straight from the input to its place in the peer's output, in symmetric memory.

use crate::collectives;
use crate::device::DeviceWorld;
use crate::device::capability;
use crate::device::capability::Op;
use crate::device::device_data;
use crate::device::host::all_to_all::Layout;
use crate::device::tile;
use crate::device::to_world_device;
use crate::device::{ascend, cuda, host};
use crate::shmem::{Call, GlobalPtr, GlobalPtrMut, Rank};
use crate::tensor::{Element, Tensor, array_split, pool, split_offsets};
use crate::{Error, Result};

const OP: &str = "all_to_all";
const UNFUSED_OP: &str = "all_to_all_unfused";
const MPI_OP: &str = "all_to_all_unfused_mpi";
/// The most dimensions a tensor may have here (metadata words are sized for them).
pub const MAX_DIMS: usize = 8;

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
        DeviceWorld::Host if fused => {
            host::all_to_all::all_to_all(rank, &layout, x, scatter_dim, gather_dim).map(|output| {
                AllToAllOutput {
                    output,
                    gather_counts: layout.gathers.clone(),
                    scatter_counts: layout.scatters.clone(),
                }
            })
        }
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
