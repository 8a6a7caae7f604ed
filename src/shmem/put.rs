//! Reaching any peer: [`Rank::is_local`] says which peers have a pointer here, and
//! [`Rank::put_signal`] moves data to any peer and then signals it (the shape of
//! `nvshmem_putmem_signal`).
//!
//! To a peer of this node a put is a copy through its pointer and a release notify, done by the
//! calling thread. To a peer on another node (a world joined by MPI) it is handed to the
//! process's proxy thread, which sends the rows and, once they are in the peer's memory, applies
//! the signal there: a waiter that sees the signal sees the data. Puts from one rank to one peer
//! are applied in the order they were made.

use std::sync::atomic::Ordering;

use super::buffer::{GlobalPtr, Readable, SymmPtr, Writable};
use super::signal::{self, SignalBuf, SignalOp};
use super::transport::Put;
use super::{Pod, Rank};
use crate::{Error, Result};

/// A signal of a put: signal `index` of `sig`, changed by `op`.
pub(crate) type PutSignal<'s> = Option<(&'s SignalBuf, usize, SignalOp)>;

/// A 2-D block: `rows` rows of `cols` elements.
pub(crate) type Shape = (usize, usize);

impl Rank<'_> {
    /// Whether `peer`'s memory is reachable by pointer from this rank: it is on this rank's node.
    /// Every peer is, in a world of threads or of processes of one host; in a world joined by MPI
    /// (feature `mpi`), the ranks of other nodes are not, and [`symm_at`](super::symm_at) on them
    /// fails with [`Error::PeerNotLocal`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let local = World::threads(3)?.run(|rank| Ok((0..3).all(|p| rank.is_local(p))))?;
    /// assert_eq!(local, vec![true; 3]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn is_local(&self, peer: usize) -> bool {
        self.world.heap.mapped(peer)
    }

    /// Number of nodes of the world: groups of ranks that share memory (one for a world of
    /// threads or of processes of one host).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// assert_eq!(World::threads(4)?.run(|rank| Ok(rank.num_nodes()))?, vec![1; 4]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn num_nodes(&self) -> usize {
        self.world.transport.nodes.count()
    }

    /// The node `rank` is on (nodes are numbered in the order of their lowest rank).
    ///
    /// # Panics
    /// If `rank` is not a rank of the world.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// assert_eq!(World::threads(2)?.run(|rank| Ok(rank.node_of(1)))?, vec![0, 0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    #[track_caller]
    pub fn node_of(&self, rank: usize) -> usize {
        self.world.transport.nodes.node_of(rank)
    }

    /// The ranks of `node`, in rank order.
    ///
    /// # Panics
    /// If `node` is not below [`Rank::num_nodes`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let ranks = World::threads(3)?.run(|rank| Ok(rank.node_ranks(0).to_vec()))?;
    /// assert_eq!(ranks[0], vec![0, 1, 2]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    #[track_caller]
    pub fn node_ranks(&self, node: usize) -> &[usize] {
        self.world.transport.nodes.ranks(node)
    }

    /// The rank of `node` that stands in for `rank` there: the one with `rank`'s index among the
    /// ranks of its own node (that index modulo the node's size, when nodes differ in size).
    /// Hierarchical ops send a rank's data once per other node, to its stand-in, which forwards
    /// it on its node.
    ///
    /// # Panics
    /// If `node` or `rank` is out of range.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// // One node: every rank stands in for itself.
    /// assert_eq!(World::threads(3)?.run(|rank| Ok(rank.stand_in(0, 2)))?, vec![2; 3]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    #[track_caller]
    pub fn stand_in(&self, node: usize, rank: usize) -> usize {
        self.world.transport.nodes.stand_in(node, rank)
    }

    /// Copies `len` elements from `src` into `peer`'s copy of the symmetric memory `dst` points
    /// at (`dst` is this rank's own pointer, such as `buf.ptr() + at`: the same offset is written
    /// on `peer`), then applies `op` to `peer`'s signal `signal.1` of `signal.0`. Ordered: a
    /// waiter on `peer` that sees the signal (with an acquire wait) sees the data. Returns once
    /// `src` may be changed again.
    ///
    /// To a peer of this node it copies through the pointer and notifies; to a peer on another
    /// node (a world joined by MPI) the process's proxy thread moves it.
    ///
    /// # Safety
    /// The tile operations' access contract (see [`device::tile`](crate::device::tile)): nobody
    /// reads or writes the destination on `peer` while the put writes it (a peer reads it after
    /// waiting for the signal), and nobody writes `src` meanwhile.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a peer outside the world, `len` past the end of `src` or
    /// `dst`, a `dst` that does not point into this rank's symmetric memory, or a signal out of
    /// range; [`Error::PeerFailed`] if the world fails while the data is in flight.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::{consume_token, GlobalPtr, SignalOp, WaitCmp, WaitSem};
    /// use dist_tensor::device::tile;
    /// use dist_tensor::World;
    ///
    /// let got = World::threads(2)?.run(|rank| {
    ///     let buf = rank.alloc::<f32>(4)?;
    ///     let sig = rank.alloc_signals(1)?;
    ///     let peer = 1 - rank.rank();
    ///     let mine = [rank.rank() as f32; 2];
    ///     // SAFETY: the peer reads the two elements only after the signal.
    ///     unsafe {
    ///         rank.put_signal(buf.ptr() + 2, peer, GlobalPtr::from_slice(&mine), 2, (&sig, 0), SignalOp::Add(1))?
    ///     };
    ///     let token = rank.wait(&sig, 0, WaitCmp::Ge(1), WaitSem::Acquire)?;
    ///     let mut out = [0.0f32; 2];
    ///     // SAFETY: the peer's put is complete (its signal was acquired).
    ///     unsafe { tile::load_1d(consume_token(buf.ptr() + 2, token), &mut out, 2, 0.0) };
    ///     let _ = rank.barrier_all()?; // no one frees `buf` while a peer may still write it
    ///     Ok(out[0])
    /// })?;
    /// assert_eq!(got, vec![1.0, 0.0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub unsafe fn put_signal<T: Pod>(
        &self,
        dst: SymmPtr<'_, T>,
        peer: usize,
        src: GlobalPtr<'_, T>,
        len: usize,
        signal: (&SignalBuf, usize),
        op: SignalOp,
    ) -> Result<()> {
        let signal = Some((signal.0, signal.1, op));
        // SAFETY: the caller's contract, for one row of `len` elements.
        unsafe { self.put_rows(dst, len, peer, src, len, (1, len), signal)? };
        self.quiet()
    }

    /// [`Rank::put_signal`] that returns at once: `src` must stay valid and unchanged until
    /// [`Rank::quiet`] returns. Several puts then travel at once.
    ///
    /// # Safety
    /// As [`Rank::put_signal`], and `src` stays valid and unchanged until [`Rank::quiet`].
    ///
    /// # Errors
    /// As [`Rank::put_signal`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::{GlobalPtr, SignalOp, WaitCmp, WaitSem};
    /// use dist_tensor::World;
    /// World::threads(3)?.run(|rank| {
    ///     let buf = rank.alloc::<u32>(3)?;
    ///     let sig = rank.alloc_signals(1)?;
    ///     let mine = [rank.rank() as u32];
    ///     for peer in 0..3 {
    ///         // SAFETY: each rank writes its own element; `mine` lives until quiet().
    ///         unsafe {
    ///             rank.put_signal_nbi(buf.ptr() + rank.rank(), peer, GlobalPtr::from_slice(&mine), 1, (&sig, 0), SignalOp::Add(1))?
    ///         };
    ///     }
    ///     rank.quiet()?;
    ///     let _token = rank.wait(&sig, 0, WaitCmp::Ge(3), WaitSem::Acquire)?;
    ///     let _ = rank.barrier_all()?;
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub unsafe fn put_signal_nbi<T: Pod>(
        &self,
        dst: SymmPtr<'_, T>,
        peer: usize,
        src: GlobalPtr<'_, T>,
        len: usize,
        signal: (&SignalBuf, usize),
        op: SignalOp,
    ) -> Result<()> {
        let signal = Some((signal.0, signal.1, op));
        // SAFETY: the caller's contract, for one row of `len` elements.
        unsafe { self.put_rows(dst, len, peer, src, len, (1, len), signal) }
    }

    /// Waits until every put this rank started has left its source (its `src` may be reused).
    /// A world of one node has nothing to wait for: its puts complete as they are made.
    ///
    /// # Errors
    /// [`Error::PeerFailed`] if the world fails meanwhile, [`Error::PeerGone`] if a peer that
    /// data is still going to leaves.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| rank.quiet())?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn quiet(&self) -> Result<()> {
        self.world.transport.quiet(self.world, self.rank)
    }

    /// A put of `shape` rows: from `src` (rows `src_stride` elements apart) to `peer`'s copy of
    /// `dst` (rows `dst_stride` apart), then `signal`. Returns at once for a peer on another
    /// node (see [`Rank::put_signal_nbi`]).
    ///
    /// # Safety
    /// As [`Rank::put_signal_nbi`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn put_rows<T: Pod>(
        &self,
        dst: SymmPtr<'_, T>,
        dst_stride: usize,
        peer: usize,
        src: GlobalPtr<'_, T>,
        src_stride: usize,
        (rows, cols): Shape,
        signal: PutSignal<'_>,
    ) -> Result<()> {
        const OP: &str = "put_signal";
        let (me, n) = (self.rank, self.num_ranks());
        let bad = |reason: String| Error::InvalidArgument { op: OP, rank: me, reason };
        if peer >= n {
            return Err(bad(format!("rank {peer} is outside a world of {n} ranks")));
        }
        if let Some((sig, index, _)) = signal {
            signal::check_signal(self.world, OP, me, sig, index)?;
        }
        let (dst_ptr, dst_len) = dst.raw_write();
        let (src_ptr, src_len) = src.raw_read();
        let extent = |stride: usize| {
            if rows == 0 || cols == 0 {
                Some(0)
            } else {
                (rows - 1).checked_mul(stride)?.checked_add(cols)
            }
        };
        let (dst_extent, src_extent) = (extent(dst_stride), extent(src_stride));
        if rows > 1 && (dst_stride < cols || src_stride < cols) {
            return Err(bad(format!(
                "rows of {cols} elements overlap at strides {dst_stride}/{src_stride}"
            )));
        }
        if dst_extent.is_none_or(|e| e > dst_len) || src_extent.is_none_or(|e| e > src_len) {
            return Err(bad(format!(
                "{rows} x {cols} elements do not fit the destination ({dst_len} elements) or the \
                 source ({src_len})"
            )));
        }
        let heap = &self.world.heap;
        let base = heap.base(me) as usize;
        let offset = (dst_ptr as usize).wrapping_sub(base);
        let size = size_of::<T>();
        if (dst_ptr as usize) < base || offset + dst_extent.unwrap_or(0) * size > heap.capacity() {
            return Err(bad(
                "the destination does not point into this rank's symmetric memory".into()
            ));
        }
        if heap.mapped(peer) {
            let to = heap.base(peer).wrapping_add(offset) as *mut T;
            for row in 0..if cols == 0 { 0 } else { rows } {
                // SAFETY: both blocks are inside their memory (checked above); the caller's
                // contract keeps anyone else off them. `copy` allows a put to oneself to overlap.
                unsafe {
                    std::ptr::copy(src_ptr.add(row * src_stride), to.add(row * dst_stride), cols)
                };
            }
            if let Some((sig, index, op)) = signal {
                let cell = signal::cell(heap, peer, sig.cell_offset(index));
                signal::apply(cell, op, Ordering::Release);
            }
            return Ok(());
        }
        let put = Put {
            peer,
            dst_offset: offset,
            dst_stride: dst_stride * size,
            src: src_ptr.cast(),
            src_stride: src_stride * size,
            rows: if cols == 0 { 0 } else { rows },
            row_bytes: cols * size,
            signal: signal.map(|(sig, index, op)| (sig.cell_offset(index), op)),
        };
        self.world.transport.put(self.world, &put)
    }
}
