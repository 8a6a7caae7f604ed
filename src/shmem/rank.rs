//! [`Rank`]: one rank's handle inside [`World::run`](crate::World::run).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::buffer::SymmBuf;
use super::heap::lock;
use super::signal::{self, NotifySem, Scope, SignalBuf, SignalOp, Token, WaitCmp, WaitSem};
use super::signal::{SIGNAL_STRIDE, cell};
use super::world::{Workspace, WorldShared};
use crate::Result;
use crate::device::Topology;
use crate::error::ProgramLabel;
use crate::tensor::Pod;

/// One rank of a running [`World`](crate::World): who it is, its symmetric heap, its signals.
///
/// # Examples
/// ```
/// use dist_tensor::World;
/// let sizes = World::threads(2)?.run(|rank| Ok(rank.num_ranks()))?;
/// assert_eq!(sizes, vec![2, 2]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Rank<'w> {
    world: &'w WorldShared,
    rank: usize,
}

impl<'w> Rank<'w> {
    pub(crate) fn new(world: &'w WorldShared, rank: usize) -> Self {
        Rank { world, rank }
    }

    /// Where this rank's kernels run.
    pub(crate) fn backend(&self) -> &'w crate::device::Backend {
        &self.world.backend
    }

    /// This rank's index, `0..num_ranks()`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let ids = World::threads(3)?.run(|rank| Ok(rank.rank()))?;
    /// assert_eq!(ids, vec![0, 1, 2]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the world.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let sizes = World::threads(4)?.run(|rank| Ok(rank.num_ranks()))?;
    /// assert_eq!(sizes, vec![4; 4]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn num_ranks(&self) -> usize {
        self.world.num_ranks()
    }

    /// The topology of this rank's device.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::Topology, World};
    /// let world = World::builder(2).topology(Topology::ascend_910b()).build()?;
    /// let cores = world.run(|rank| Ok(rank.topology().aicore_num()))?;
    /// assert_eq!(cores, vec![24, 24]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topology(&self) -> &Topology {
        &self.world.topology
    }

    /// How long waits give a peer before reporting a timeout.
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::World;
    /// let world = World::builder(2).wait_timeout(Duration::from_secs(2)).build()?;
    /// let seen = world.run(|rank| Ok(rank.wait_timeout()))?;
    /// assert_eq!(seen, vec![Duration::from_secs(2); 2]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn wait_timeout(&self) -> Duration {
        self.world.wait_timeout
    }

    /// Bytes still free in this rank's heap segment.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::builder(1).heap_capacity(1 << 20).build()?.run(|rank| {
    ///     let before = rank.heap_free_bytes();
    ///     let _buf = rank.alloc::<f32>(1024)?;
    ///     assert_eq!(rank.heap_free_bytes(), before - 4096);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn heap_free_bytes(&self) -> usize {
        self.world.heap.free_bytes(self.rank)
    }

    /// Allocates `len` elements of symmetric memory: collective, every rank must call it in the
    /// same order with the same length, and all get the same offset. Ends with a barrier, so no
    /// peer writes into the buffer before every rank has it.
    ///
    /// The contents are whatever the memory held before (zero when fresh).
    ///
    /// # Errors
    /// [`Error::SymmetricMemoryExhausted`](crate::Error::SymmetricMemoryExhausted) when it does not
    /// fit, [`Error::AllocationMismatch`](crate::Error::AllocationMismatch) when ranks disagree.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let err = World::builder(2).heap_capacity(1 << 20).build()?
    ///     .run(|rank| rank.alloc::<f64>(1 << 20).map(|_| ()))
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("symmetric memory exhausted"), "{err}");
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<SymmBuf<T>> {
        let bytes = self.bytes_of(len, size_of::<T>())?;
        let offset = self.world.heap.alloc(self.rank, bytes)?;
        let buf = SymmBuf::new(self.world.heap.clone(), self.rank, offset, len);
        let _ = self.barrier_all()?;
        Ok(buf)
    }

    /// Makes `buf` hold at least `len` elements: keeps it if it does, else frees it and allocates
    /// one 1.5 times as large as before (or `len`, if more), so that a slowly growing size does
    /// not reallocate on every call. Collective, like [`Rank::alloc`]: every rank passes the
    /// same `len` and the same kind of `buf`.
    ///
    /// # Errors
    /// As [`Rank::alloc`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let mut buf = None;
    ///     rank.reserve::<f32>(&mut buf, 100)?;
    ///     rank.reserve::<f32>(&mut buf, 120)?; // grows to 150
    ///     assert_eq!(buf.as_ref().map(|b| b.len()), Some(150));
    ///     rank.reserve::<f32>(&mut buf, 140)?; // fits: kept
    ///     assert_eq!(buf.map(|b| b.len()), Some(150));
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn reserve<T: Pod>(&self, buf: &mut Option<SymmBuf<T>>, len: usize) -> Result<()> {
        let old = buf.as_ref().map_or(0, |b| b.len());
        if buf.is_some() && old >= len {
            return Ok(());
        }
        *buf = None; // freed first, so the heap can reuse its space
        *buf = Some(self.alloc(len.max(old + old / 2))?);
        Ok(())
    }

    /// Allocates `len` signals, all zero: collective, like [`Rank::alloc`].
    ///
    /// # Errors
    /// As [`Rank::alloc`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::{WaitCmp, WaitSem};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let sigs = rank.alloc_signals(4)?;
    ///     assert_eq!(sigs.len(), 4);
    ///     let _t = rank.wait(&sigs, 3, WaitCmp::Eq(0), WaitSem::Relaxed)?; // all zero
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn alloc_signals(&self, len: usize) -> Result<SignalBuf> {
        let bytes = self.bytes_of(len, SIGNAL_STRIDE)?;
        let offset = self.world.heap.alloc(self.rank, bytes)?;
        for i in 0..len {
            cell(&self.world.heap, self.rank, offset + i * SIGNAL_STRIDE)
                .store(0, Ordering::Relaxed);
        }
        let sigs = SignalBuf::new(self.world.heap.clone(), self.rank, offset, len);
        let _ = self.barrier_all()?;
        Ok(sigs)
    }

    /// `len` items of `size` bytes, or an error if that does not fit in a `usize`.
    fn bytes_of(&self, len: usize, size: usize) -> Result<usize> {
        len.checked_mul(size).ok_or_else(|| crate::Error::InvalidArgument {
            op: "Rank::alloc",
            rank: self.rank,
            reason: format!("{len} items of {size} bytes overflow the address space"),
        })
    }

    /// Waits until every rank has reached this barrier. Everything each rank wrote before it is
    /// visible to every rank after it; the token makes symmetric memory readable.
    ///
    /// # Errors
    /// [`Error::PeerFailed`](crate::Error::PeerFailed) if another rank failed,
    /// [`Error::WaitTimeout`](crate::Error::WaitTimeout) if a rank never arrives.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::threads(4)?.run(|rank| {
    ///     for _ in 0..10 {
    ///         let _token = rank.barrier_all()?;
    ///     }
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn barrier_all(&self) -> Result<Token> {
        self.barrier_labeled(ProgramLabel::Host)
    }

    /// Notifies signal `index` of `peer`'s copy of `sig`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an index or peer out of range,
    /// a `Scope::Device` notify of another rank, or a signal buffer of another world.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::{NotifySem, Scope, SignalOp, WaitCmp, WaitSem};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let sigs = rank.alloc_signals(1)?;
    ///     let peer = 1 - rank.rank();
    ///     rank.notify(&sigs, 0, peer, SignalOp::Add(5), Scope::Peer, NotifySem::Release)?;
    ///     let _t = rank.wait(&sigs, 0, WaitCmp::Ge(5), WaitSem::Acquire)?;
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn notify(
        &self,
        sig: &SignalBuf,
        index: usize,
        peer: usize,
        op: SignalOp,
        scope: Scope,
        sem: NotifySem,
    ) -> Result<()> {
        signal::notify(self.world, self.rank, sig, index, peer, op, scope, sem)
    }

    /// Waits until this rank's signal `index` of `sig` meets `cmp`: spins briefly, then blocks.
    ///
    /// # Errors
    /// [`Error::WaitTimeout`](crate::Error::WaitTimeout) naming the rank, signal, awaited and seen
    /// value after [`Rank::wait_timeout`]; [`Error::PeerFailed`](crate::Error::PeerFailed) as soon
    /// as another rank fails.
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::shmem::{WaitCmp, WaitSem};
    /// use dist_tensor::World;
    /// let world = World::builder(1).wait_timeout(Duration::from_millis(10)).build()?;
    /// let err = world.run(|rank| {
    ///     let sigs = rank.alloc_signals(2)?;
    ///     rank.wait(&sigs, 1, WaitCmp::Eq(7), WaitSem::Acquire).map(|_| ())
    /// }).unwrap_err();
    /// assert!(err.to_string().contains("signal 1 timed out"), "{err}");
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn wait(&self, sig: &SignalBuf, index: usize, cmp: WaitCmp, sem: WaitSem) -> Result<Token> {
        self.wait_labeled(ProgramLabel::Host, sig, index, cmp, sem)
    }

    /// Runs `f` on this rank's workspace of type `W`, made by `init` on first use and kept for
    /// later calls and later runs of the world. Collective when `init` allocates.
    ///
    /// # Errors
    /// Whatever `init` or `f` returns.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::{SymmBuf, Workspace};
    /// use dist_tensor::World;
    ///
    /// struct Scratch(SymmBuf<f32>);
    /// impl Workspace for Scratch {
    ///     fn symmetric_bytes(&self) -> usize { self.0.len() * 4 }
    /// }
    ///
    /// let world = World::threads(2)?;
    /// for _ in 0..2 {
    ///     world.run(|rank| rank.with_workspace(|r| Ok(Scratch(r.alloc(256)?)), |_s| Ok(())))?;
    /// }
    /// assert_eq!(world.workspace_bytes(), vec![1024, 1024]); // allocated once, kept
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn with_workspace<W: Workspace, R>(
        &self,
        init: impl FnOnce(&Rank<'_>) -> Result<W>,
        f: impl FnOnce(&mut W) -> Result<R>,
    ) -> Result<R> {
        let key = std::any::TypeId::of::<W>();
        // Taken out while in use; the entry stays, empty, so that a second user of the same
        // workspace on this rank (a collective called from two threads of one rank, or from
        // inside another) is an error rather than a one-rank collective allocation.
        let taken = lock(&self.world.workspaces[self.rank]).insert(key, None);
        let mut ws: Box<W> = match taken {
            Some(Some(boxed)) => {
                let any: Box<dyn std::any::Any> = boxed;
                any.downcast().expect("workspaces are keyed by their type")
            }
            Some(None) => {
                return Err(crate::Error::InvalidArgument {
                    op: "Rank::with_workspace",
                    rank: self.rank,
                    reason: format!(
                        "{} is already in use on this rank: collectives and fused ops of one rank \
                         must be called one at a time, from the rank's own thread",
                        std::any::type_name::<W>()
                    ),
                });
            }
            None => match init(self) {
                Ok(ws) => Box::new(ws),
                Err(err) => {
                    lock(&self.world.workspaces[self.rank]).remove(&key);
                    return Err(err);
                }
            },
        };
        let result = f(&mut ws);
        lock(&self.world.workspaces[self.rank]).insert(key, Some(ws));
        result
    }

    /// Bytes of symmetric memory this rank's workspaces hold.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{collectives, World};
    /// World::threads(2)?.run(|rank| {
    ///     assert_eq!(rank.workspace_bytes(), 0);
    ///     assert_eq!(collectives::all_reduce(rank, &[1.0f32])?, vec![2.0]);
    ///     assert!(rank.workspace_bytes() > 0); // the collective keeps its buffers
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn workspace_bytes(&self) -> usize {
        lock(&self.world.workspaces[self.rank])
            .values()
            .flatten()
            .map(|w| w.symmetric_bytes())
            .sum()
    }

    /// Frees every workspace of this rank. Collective: every rank must call it at the same point,
    /// so that the allocations that follow stay symmetric.
    ///
    /// # Errors
    /// As [`Rank::barrier_all`]: it waits until every rank has released its own.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     rank.release_workspaces()?;
    ///     assert_eq!(rank.workspace_bytes(), 0);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn release_workspaces(&self) -> Result<()> {
        // Peers may still read this rank's buffers from the last call: wait until all are here.
        let _ = self.barrier_all()?;
        lock(&self.world.workspaces[self.rank]).clear();
        Ok(())
    }

    pub(crate) fn wait_labeled(
        &self,
        program: ProgramLabel,
        sig: &SignalBuf,
        index: usize,
        cmp: WaitCmp,
        sem: WaitSem,
    ) -> Result<Token> {
        signal::wait(self.world, self.rank, program, sig, index, cmp, sem)
    }

    pub(crate) fn barrier_labeled(&self, program: ProgramLabel) -> Result<Token> {
        let (world, me, n) = (self.world, self.rank, self.num_ranks());
        let epoch = world.barrier_epochs[me].fetch_add(1, Ordering::Relaxed) + 1;
        // Rotated by rank, so the ranks do not all write to the same peer at once.
        for i in 1..n {
            let peer = (me + i) % n;
            cell(&world.heap, peer, me * SIGNAL_STRIDE).store(epoch, Ordering::Release);
            world.parkers[peer].wake();
        }
        for i in 1..n {
            let peer = (me + i) % n;
            let slot = cell(&world.heap, me, peer * SIGNAL_STRIDE);
            let _ = signal::wait_cell(
                world,
                me,
                program,
                slot,
                peer,
                WaitCmp::Ge(epoch),
                WaitSem::Acquire,
            )?;
        }
        Ok(Token::new())
    }

    /// Records `err` as this rank's failure so that every other rank stops waiting.
    pub(crate) fn fail_with(&self, err: &crate::Error) {
        self.world.fail_with(self.rank, err);
    }
}

impl std::fmt::Debug for Rank<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rank")
            .field("rank", &self.rank)
            .field("num_ranks", &self.num_ranks())
            .finish()
    }
}
