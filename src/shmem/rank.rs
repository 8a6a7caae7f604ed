//! [`Rank`]: one rank's handle inside [`World::run`](crate::World::run).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::buffer::SymmBuf;
use super::exchange::Call;
use super::heap::lock;
use super::signal::{
    self, Awaited, NotifySem, Scope, SignalBuf, SignalOp, Token, WaitCmp, WaitSem,
};
use super::signal::{SIGNAL_STRIDE, cell};
use super::world::{Workspace, WorldShared};
use crate::error::ProgramLabel;
use crate::shmem::topology::Topology;
use crate::tensor::Pod;
use crate::{Error, Result};

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
    pub(crate) world: &'w WorldShared,
    pub(crate) rank: usize,
}

impl<'w> Rank<'w> {
    pub(crate) fn new(world: &'w WorldShared, rank: usize) -> Self {
        Rank { world, rank }
    }

    /// Where this rank's world runs its kernels: what every op's dispatch matches on.
    pub(crate) fn device_runtime(&self) -> Option<&'w dyn super::device_runtime::DeviceRuntime> {
        self.world.device.as_deref()
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

    /// Where this rank's tensors live and its ops run: [`Device::Cuda`](crate::Device::Cuda) with
    /// its GPU in a world made by [`World::cuda`](crate::World::cuda),
    /// [`Device::Ascend`](crate::Device::Ascend) with its NPU in one made by
    /// [`World::ascend`](crate::World::ascend), [`Device::Host`](crate::Device::Host) otherwise.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Device, World};
    /// let devices = World::threads(2)?.run(|rank| Ok(rank.device()))?;
    /// assert_eq!(devices, vec![Device::Host; 2]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn device(&self) -> crate::Device {
        self.world.device.as_ref().map_or(crate::tensor::Device::Host, |d| d.device_of(self.rank))
    }

    /// Where this rank's tensors live (its GPU in a CUDA world, the host otherwise): what the
    /// ops move their inputs to, once, at their entry.
    pub(crate) fn tensor_device(&self) -> crate::Device {
        self.world
            .device
            .as_ref()
            .map_or(crate::tensor::Device::Host, |d| d.tensor_device(self.rank))
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
        self.alloc_for("Rank::alloc", len)
    }

    /// [`Rank::alloc`] for `purpose`, which the allocation's exchange carries with the element
    /// type: ranks that allocate for different purposes fail together, naming both.
    pub(crate) fn alloc_for<T: Pod>(
        &self,
        purpose: &'static str,
        len: usize,
    ) -> Result<SymmBuf<T>> {
        let call = Call::of_pod::<T>(purpose);
        let offset = self.alloc_bytes(call, len, size_of::<T>(), |_| {})?;
        Ok(SymmBuf::new(self.world.heap.clone(), self.rank, offset, len))
    }

    /// A symmetric allocation of `len` items of `size` bytes: allocates on this rank, runs
    /// `init` on the block's offset, then exchanges (size, offset) with every rank and checks
    /// they agree. The exchange is the barrier that keeps peers from writing into the block
    /// before every rank has it. Any rank's failure (exhausted, overflow) fails all of them.
    fn alloc_bytes(
        &self,
        call: Call,
        len: usize,
        size: usize,
        init: impl FnOnce(usize),
    ) -> Result<usize> {
        let heap = &self.world.heap;
        let (bytes, mut problem) = match len.checked_mul(size) {
            Some(bytes) => (bytes, None),
            None => (
                usize::MAX,
                Some(format!("{len} items of {size} bytes overflow the address space")),
            ),
        };
        let mut own_error = None;
        let mut words = vec![bytes as u64, u64::MAX];
        let offset = if problem.is_none() {
            match heap.alloc(self.rank, bytes) {
                Ok(offset) => {
                    init(offset);
                    words[1] = offset as u64;
                    Some(offset)
                }
                Err(err) => {
                    // Exhaustion is no invalid argument: the rank says what it has left, and
                    // every rank reports it as what it is, naming this rank.
                    if let Error::SymmetricMemoryExhausted {
                        largest_free, free, capacity, ..
                    } = &err
                    {
                        words.extend([*largest_free as u64, *free as u64, *capacity as u64]);
                    } else {
                        problem = Some(err.to_string());
                    }
                    own_error = Some(err);
                    None
                }
            }
        } else {
            None
        };
        let free = || {
            if let Some(offset) = offset {
                heap.free(self.rank, offset, bytes);
            }
        };
        let all = match self.exchange(call, &words, problem, &[]) {
            Ok(all) => all,
            Err(err) => {
                free();
                // This rank's own exhaustion keeps its type (and what is left) on this rank.
                return Err(match (own_error, &err) {
                    (Some(own), Error::InvalidArgument { rank, .. }) if *rank == self.rank => own,
                    _ => err,
                });
            }
        };
        if let Some(bad) = (0..all.len()).find(|&r| all[r].len() == 5 && all[r][1] == u64::MAX) {
            free();
            if bad == self.rank
                && let Some(own) = own_error
            {
                return Err(own);
            }
            let w = &all[bad];
            let size = |i: usize| usize::try_from(w[i]).unwrap_or(usize::MAX);
            return Err(Error::SymmetricMemoryExhausted {
                rank: bad,
                requested: size(0),
                largest_free: size(2),
                free: size(3),
                capacity: size(4),
            });
        }
        if let Some(bad) = (1..all.len()).find(|&r| all[r] != all[0]) {
            free();
            let purpose = format!("{}<{}>", call.op, call.dtype);
            return Err(Error::AllocationMismatch {
                sequence: lock(&self.world.local[self.rank].calls).seq,
                purpose_a: purpose.clone(),
                purpose_b: purpose,
                rank_a: 0,
                bytes_a: all[0][0] as usize,
                offset_a: all[0][1] as usize,
                rank_b: bad,
                bytes_b: all[bad][0] as usize,
                offset_b: all[bad][1] as usize,
            });
        }
        Ok(offset.expect("every rank allocated, this one too"))
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
        self.reserve_for("Rank::reserve", buf, len)
    }

    /// [`Rank::reserve`] for `purpose` (see [`Rank::alloc_for`]).
    pub(crate) fn reserve_for<T: Pod>(
        &self,
        purpose: &'static str,
        buf: &mut Option<SymmBuf<T>>,
        len: usize,
    ) -> Result<()> {
        let old = buf.as_ref().map_or(0, |b| b.len());
        if buf.is_some() && old >= len {
            return Ok(());
        }
        *buf = None; // freed first, so the heap can reuse its space
        *buf = Some(self.alloc_for(purpose, len.max(old.saturating_add(old / 2)))?);
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
        self.alloc_signals_for("Rank::alloc_signals", len)
    }

    /// [`Rank::alloc_signals`] for `purpose` (see [`Rank::alloc_for`]).
    pub(crate) fn alloc_signals_for(&self, purpose: &'static str, len: usize) -> Result<SignalBuf> {
        let heap = &self.world.heap;
        let zero = |offset: usize| {
            for i in 0..len {
                cell(heap, self.rank, offset + i * SIGNAL_STRIDE).value.store(0, Ordering::Relaxed);
            }
        };
        let call = Call { op: purpose, dtype: "signal" };
        let offset = self.alloc_bytes(call, len, SIGNAL_STRIDE, zero)?;
        Ok(SignalBuf::new(heap.clone(), self.rank, offset, len))
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
    /// as another rank fails; [`Error::PeerGone`](crate::Error::PeerGone) as soon as every other
    /// rank has left `run` (this wait does not know which rank would signal it; the waits inside
    /// the crate's own ops do, and end as soon as that one leaves).
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
        self.wait_labeled(ProgramLabel::Host, sig, index, cmp, sem, Awaited::Anyone)
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
        let taken = lock(&self.world.local[self.rank].workspaces).insert(key, None);
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
                    lock(&self.world.local[self.rank].workspaces).remove(&key);
                    return Err(err);
                }
            },
        };
        let result = f(&mut ws);
        lock(&self.world.local[self.rank].workspaces).insert(key, Some(ws));
        result
    }

    /// Bytes of symmetric memory this rank's workspaces hold, with the blocks they lend to
    /// output tensors.
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
        lock(&self.world.local[self.rank].workspaces)
            .values()
            .flatten()
            .map(|w| w.symmetric_bytes())
            .sum::<usize>()
            + self.output_block_bytes()
    }

    /// Frees every workspace of this rank, and the blocks lent to output tensors that no tensor
    /// holds on any rank (one that a tensor still holds stays until a later call or release
    /// finds it free). Collective: every rank must call it at the same point, so that the
    /// allocations that follow stay symmetric.
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
        // The same exchange agrees on the output blocks that no tensor holds on any rank: those
        // go too (a block a tensor still holds stays until a later call or release finds it free
        // everywhere, so that the heaps stay alike).
        let mask = self.free_output_blocks();
        let all = self.exchange(Call::untyped("release_workspaces"), &[mask], None, &[])?;
        lock(&self.world.local[self.rank].workspaces).clear();
        self.free_idle_output_blocks(all.iter().fold(u64::MAX, |m, w| m & w[0]));
        Ok(())
    }

    pub(crate) fn wait_labeled(
        &self,
        program: ProgramLabel,
        sig: &SignalBuf,
        index: usize,
        cmp: WaitCmp,
        sem: WaitSem,
        awaited: Awaited,
    ) -> Result<Token> {
        signal::wait(self.world, self.rank, program, sig, index, cmp, sem, awaited)
    }

    /// A barrier is an exchange of no words: it meets every other collective call, so a rank in
    /// a barrier while another is in a collective op fails both with [`Error::OpMismatch`].
    pub(crate) fn barrier_labeled(&self, _program: ProgramLabel) -> Result<Token> {
        self.exchange(Call::untyped("barrier_all"), &[], None, &[])?;
        Ok(Token::new())
    }

    /// Records `err` as this rank's failure so that every other rank stops waiting.
    pub(crate) fn fail_with(&self, err: &crate::Error) {
        self.world.fail_with(self.rank, err);
    }

    /// For an error after every rank agreed to a call (a buffer that cannot be allocated here, a
    /// kernel that failed): the peers are committed to the call and would wait for this rank's
    /// part, so the world fails and they stop at once.
    pub(crate) fn fail_after_agreeing(&self, err: &crate::Error) {
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

// `Tensor::to_rank` lives with the runtime, so that `tensor` knows nothing of ranks or worlds.
impl<T: crate::tensor::Element> crate::tensor::Tensor<T> {
    /// A copy on `rank`'s device (its GPU in a GPU world, the host otherwise); waiting for it
    /// reports the world's failure instead of hanging.
    ///
    /// # Errors
    /// As [`Tensor::to_device`](crate::tensor::Tensor::to_device).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Device, Tensor, World};
    /// let t = Tensor::<f32>::random(&[2, 2], 1);
    /// let back = World::threads(1)?.run(|rank| t.to_rank(rank))?;
    /// assert_eq!(back[0].device(), Device::Host);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn to_rank(&self, rank: &Rank<'_>) -> Result<crate::tensor::Tensor<T>> {
        self.to_device_in(rank.tensor_device(), rank.cuda_world().map(|w| (w, rank.rank())))
    }
}
