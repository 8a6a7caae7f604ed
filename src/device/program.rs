//! [`Program`]: what one program of a launch knows about itself, and what it can do.

use std::iter::StepBy;
use std::ops::Range;

use crate::Result;
use crate::error::ProgramLabel;
use crate::shmem::{NotifySem, Rank, Scope, SignalBuf, SignalOp, Token, WaitCmp, WaitSem};

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
    pub fn program_id(&self) -> usize {
        self.program_id
    }

    /// Programs in the grid (`tl.num_programs(0)`).
    pub fn num_programs(&self) -> usize {
        self.num_programs
    }

    /// The vector sub-core this instance runs on (`sub_vec_id()`); 0 in vector-only launches.
    pub fn sub_vec_id(&self) -> usize {
        self.sub_vec_id
    }

    /// Vector sub-cores per program (`sub_vec_num()`); 1 in vector-only launches.
    pub fn sub_vec_num(&self) -> usize {
        self.sub_vec_num
    }

    /// The rank this program runs on.
    pub fn rank(&self) -> usize {
        self.rank.rank()
    }

    /// Ranks in the world.
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
    pub fn wait(&self, sig: &SignalBuf, index: usize, cmp: WaitCmp, sem: WaitSem) -> Result<Token> {
        self.rank.wait_labeled(self.label(), sig, index, cmp, sem)
    }

    /// Notifies `peer`'s signal `index` of `sig` (`dl.notify`); see [`Rank::notify`].
    ///
    /// # Errors
    /// As [`Rank::notify`].
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
