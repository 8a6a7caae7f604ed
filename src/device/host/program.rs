//! [`Program`]: what one program of a launch knows about itself, and what it can do.

use std::iter::StepBy;
use std::ops::Range;

use crate::Result;
use crate::error::ProgramLabel;
use crate::shmem::{
    Awaited, GlobalPtr, NotifySem, Pod, PutSignal, Rank, Scope, Shape, SignalBuf, SignalOp,
    SymmPtr, Token, WaitCmp, WaitSem,
};

/// One program of a kernel launch: `program_id` of `num_programs`, running on vector sub-core
/// `sub_vec_id` of `sub_vec_num`, on rank `rank` of `num_ranks`.
///
/// # Examples
/// ```
/// use std::sync::Mutex;
/// use dist_tensor::device::{launch, LaunchMode};
/// use dist_tensor::World;
///
/// let seen = Mutex::new(Vec::new());
/// World::threads(1)?.run(|rank| {
///     launch(rank, LaunchMode::Mix, 2, |p| {
///         seen.lock().unwrap().push((p.program_id(), p.sub_vec_id(), p.sub_vec_num()));
///         Ok(())
///     })
/// })?;
/// let mut seen = seen.into_inner().unwrap();
/// seen.sort();
/// let sub = seen[0].2;
/// assert_eq!(seen.len(), 2 * sub);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Program<'a> {
    pub(crate) rank: &'a Rank<'a>,
    pub(crate) program_id: usize,
    pub(crate) num_programs: usize,
    pub(crate) sub_vec_id: usize,
    pub(crate) sub_vec_num: usize,
}

impl<'a> Program<'a> {
    /// This program's index in the grid (`tl.program_id(0)`).
    ///
    /// # Examples
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::World;
    /// let sum = AtomicUsize::new(0);
    /// World::threads(1)?.run(|rank| launch(rank, LaunchMode::VectorOnly, 4, |p| {
    ///     sum.fetch_add(p.program_id(), Ordering::Relaxed);
    ///     Ok(())
    /// }))?;
    /// assert_eq!(sum.into_inner(), 0 + 1 + 2 + 3);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn program_id(&self) -> usize {
        self.program_id
    }

    /// Programs in the grid (`tl.num_programs(0)`).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::World;
    /// World::threads(1)?.run(|rank| launch(rank, LaunchMode::VectorOnly, 5, |p| {
    ///     assert_eq!(p.num_programs(), 5);
    ///     Ok(())
    /// }))?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn num_programs(&self) -> usize {
        self.num_programs
    }

    /// The vector sub-core this instance runs on (`sub_vec_id()`); 0 in vector-only launches.
    ///
    /// # Examples
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use dist_tensor::device::{launch, LaunchMode, Topology};
    /// use dist_tensor::World;
    /// let sum = AtomicUsize::new(0);
    /// let world = World::builder(1).topology(Topology::new(1, 2)?).build()?;
    /// world.run(|rank| launch(rank, LaunchMode::Mix, 1, |p| {
    ///     sum.fetch_add(p.sub_vec_id(), Ordering::Relaxed);
    ///     Ok(())
    /// }))?;
    /// assert_eq!(sum.into_inner(), 0 + 1); // one instance per sub-core
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn sub_vec_id(&self) -> usize {
        self.sub_vec_id
    }

    /// Vector sub-cores per program (`sub_vec_num()`); 1 in vector-only launches.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode, Topology};
    /// use dist_tensor::World;
    /// let world = World::builder(1).topology(Topology::ascend_910b()).build()?;
    /// world.run(|rank| {
    ///     launch(rank, LaunchMode::Mix, 1, |p| { assert_eq!(p.sub_vec_num(), 2); Ok(()) })?;
    ///     launch(rank, LaunchMode::VectorOnly, 1, |p| { assert_eq!(p.sub_vec_num(), 1); Ok(()) })
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn sub_vec_num(&self) -> usize {
        self.sub_vec_num
    }

    /// The rank this program runs on.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| launch(rank, LaunchMode::VectorOnly, 2, |p| {
    ///     assert_eq!(p.rank(), rank.rank());
    ///     Ok(())
    /// }))?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn rank(&self) -> usize {
        self.rank.rank()
    }

    /// Ranks in the world.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::World;
    /// World::threads(3)?.run(|rank| launch(rank, LaunchMode::VectorOnly, 1, |p| {
    ///     assert_eq!(p.num_ranks(), 3);
    ///     Ok(())
    /// }))?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn num_ranks(&self) -> usize {
        self.rank.num_ranks()
    }

    /// The grid-stride task loop: `program_id, program_id + num_programs, ...` below `total`.
    ///
    /// # Examples
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::World;
    ///
    /// let done = AtomicUsize::new(0);
    /// World::threads(1)?.run(|rank| {
    ///     launch(rank, LaunchMode::VectorOnly, 3, |p| {
    ///         for _task in p.tasks(10) {
    ///             done.fetch_add(1, Ordering::Relaxed);
    ///         }
    ///         Ok(())
    ///     })
    /// })?;
    /// assert_eq!(done.into_inner(), 10);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn tasks(&self, total: usize) -> StepBy<Range<usize>> {
        (self.program_id.min(total)..total).step_by(self.num_programs)
    }

    /// The grid-stride loop over `total` tasks shared by the programs' instances on sub-cores
    /// `first_sub_vec..sub_vec_num` only (for example the compute part, when sub-core 0
    /// communicates). Empty on the other sub-cores.
    ///
    /// # Examples
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use dist_tensor::device::{launch, LaunchMode, Topology};
    /// use dist_tensor::World;
    /// let done = AtomicUsize::new(0);
    /// let world = World::builder(1).topology(Topology::new(1, 2)?).build()?;
    /// world.run(|rank| launch(rank, LaunchMode::Mix, 2, |p| {
    ///     let mine = p.tasks_on_sub_vecs(1, 10).count();
    ///     assert!(p.sub_vec_id() == 1 || mine == 0); // sub-core 0 gets none
    ///     done.fetch_add(mine, Ordering::Relaxed);
    ///     Ok(())
    /// }))?;
    /// assert_eq!(done.into_inner(), 10);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn tasks_on_sub_vecs(&self, first_sub_vec: usize, total: usize) -> StepBy<Range<usize>> {
        if self.sub_vec_id < first_sub_vec {
            return (0..0).step_by(1);
        }
        let lanes = self.sub_vec_num - first_sub_vec;
        let me = self.program_id * lanes + (self.sub_vec_id - first_sub_vec);
        (me.min(total)..total).step_by(self.num_programs * lanes)
    }

    /// Waits on this rank's signal `index` of `sig` (`dl.wait`); see [`Rank::wait`].
    ///
    /// # Errors
    /// As [`Rank::wait`], naming this program.
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::shmem::{WaitCmp, WaitSem};
    /// use dist_tensor::World;
    /// let world = World::builder(1).wait_timeout(Duration::from_millis(10)).build()?;
    /// let err = world.run(|rank| {
    ///     let sigs = rank.alloc_signals(1)?;
    ///     launch(rank, LaunchMode::VectorOnly, 1, |p| {
    ///         p.wait(&sigs, 0, WaitCmp::Eq(1), WaitSem::Acquire).map(drop) // nobody notifies
    ///     })
    /// }).unwrap_err();
    /// assert!(err.to_string().contains("program 0 (sub_vec 0): wait on signal 0"), "{err}");
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn wait(&self, sig: &SignalBuf, index: usize, cmp: WaitCmp, sem: WaitSem) -> Result<Token> {
        self.rank.wait_labeled(self.label(), sig, index, cmp, sem, Awaited::Anyone)
    }

    /// [`Program::wait`] for a signal that rank `from` sends: if `from` leaves `run` (or its
    /// process ends) before sending it, the wait fails at once naming it. Every wait of the
    /// crate's own kernels names its sender.
    pub(crate) fn wait_from(
        &self,
        sig: &SignalBuf,
        index: usize,
        from: usize,
        cmp: WaitCmp,
        sem: WaitSem,
    ) -> Result<Token> {
        self.rank.wait_labeled(self.label(), sig, index, cmp, sem, Awaited::Peer(from))
    }

    /// Notifies `peer`'s signal `index` of `sig` (`dl.notify`); see [`Rank::notify`].
    ///
    /// # Errors
    /// As [`Rank::notify`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::shmem::{NotifySem, Scope, SignalOp, WaitCmp, WaitSem};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let sigs = rank.alloc_signals(1)?;
    ///     launch(rank, LaunchMode::VectorOnly, 4, |p| {
    ///         let peer = (p.rank() + 1) % p.num_ranks();
    ///         p.notify(&sigs, 0, peer, SignalOp::Add(1), Scope::Peer, NotifySem::Release)
    ///     })?;
    ///     // One add from each of the peer's 4 programs.
    ///     assert!(rank.wait(&sigs, 0, WaitCmp::Eq(4), WaitSem::Acquire).is_ok());
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
        self.rank.notify(sig, index, peer, op, scope, sem)
    }

    /// [`Rank::put_signal`] from this program: data to any peer, then its signal.
    ///
    /// # Safety
    /// As [`Rank::put_signal`].
    ///
    /// # Errors
    /// As [`Rank::put_signal`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::shmem::{GlobalPtr, SignalOp, WaitCmp, WaitSem};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let buf = rank.alloc::<f64>(2)?;
    ///     let sig = rank.alloc_signals(1)?;
    ///     let mine = [rank.rank() as f64];
    ///     launch(rank, LaunchMode::VectorOnly, 1, |p| {
    ///         let peer = 1 - p.rank();
    ///         // SAFETY: each rank writes its own element of the peer's buffer.
    ///         unsafe { p.put_signal(buf.ptr() + p.rank(), peer, GlobalPtr::from_slice(&mine), 1, (&sig, 0), SignalOp::Add(1)) }
    ///     })?;
    ///     let _token = rank.wait(&sig, 0, WaitCmp::Ge(1), WaitSem::Acquire)?;
    ///     let _ = rank.barrier_all()?;
    ///     Ok(())
    /// })?;
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
        // SAFETY: the caller's contract.
        unsafe { self.rank.put_signal(dst, peer, src, len, signal, op) }
    }

    /// [`Rank::put_signal_nbi`] from this program: returns at once; `src` must stay unchanged
    /// until [`Program::quiet`] (or the rank's [`Rank::quiet`]).
    ///
    /// # Safety
    /// As [`Rank::put_signal_nbi`].
    ///
    /// # Errors
    /// As [`Rank::put_signal`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::shmem::{GlobalPtr, SignalOp, WaitCmp, WaitSem};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let buf = rank.alloc::<u8>(2)?;
    ///     let sig = rank.alloc_signals(1)?;
    ///     let mine = [rank.rank() as u8];
    ///     launch(rank, LaunchMode::VectorOnly, 1, |p| {
    ///         // SAFETY: each rank writes its own byte; `mine` outlives quiet().
    ///         unsafe { p.put_signal_nbi(buf.ptr() + p.rank(), 1 - p.rank(), GlobalPtr::from_slice(&mine), 1, (&sig, 0), SignalOp::Add(1))? };
    ///         p.quiet()
    ///     })?;
    ///     let _token = rank.wait(&sig, 0, WaitCmp::Ge(1), WaitSem::Acquire)?;
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
        // SAFETY: the caller's contract.
        unsafe { self.rank.put_signal_nbi(dst, peer, src, len, signal, op) }
    }

    /// A 2-D put (see `Rank::put_rows`): returns at once for a peer on another node.
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
        shape: Shape,
        signal: PutSignal<'_>,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.rank.put_rows(dst, dst_stride, peer, src, src_stride, shape, signal) }
    }

    /// [`Rank::quiet`]: waits until every put of this rank has left its source.
    ///
    /// # Errors
    /// As [`Rank::quiet`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::World;
    /// World::threads(1)?.run(|rank| launch(rank, LaunchMode::VectorOnly, 2, |p| p.quiet()))?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn quiet(&self) -> Result<()> {
        self.rank.quiet()
    }

    /// [`Rank::is_local`]: whether `peer`'s memory is reachable by pointer.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{launch, LaunchMode};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     launch(rank, LaunchMode::VectorOnly, 1, |p| {
    ///         assert!(p.is_local(1 - p.rank()));
    ///         Ok(())
    ///     })
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn is_local(&self, peer: usize) -> bool {
        self.rank.is_local(peer)
    }

    pub(crate) fn label(&self) -> ProgramLabel {
        ProgramLabel::Program { id: self.program_id, sub_vec: self.sub_vec_id }
    }
}

impl std::fmt::Debug for Program<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Program")
            .field("rank", &self.rank())
            .field("program_id", &self.program_id)
            .field("num_programs", &self.num_programs)
            .field("sub_vec_id", &self.sub_vec_id)
            .field("sub_vec_num", &self.sub_vec_num)
            .finish()
    }
}
