//! The crate's one error type.
//!
//! Every variant carries what went wrong, where (the op, the rank, the program) and why, so that a
//! message read in a log from an eight-rank run is enough to find the cause.

use std::sync::Arc;
use std::time::Duration;

mod checkpoint;

pub use checkpoint::{CheckpointError, CheckpointErrorKind};

/// Result of every fallible operation in the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `dist-tensor`, sectioned by topic.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- shapes and arguments -------------------------------------------------------------
    /// A shape and the number of elements given for it disagree, or a shape is otherwise unusable.
    #[error("{op}: invalid shape: {reason}")]
    InvalidShape {
        /// The operation that rejected the shape.
        op: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The inner dimensions of a product disagree.
    #[error(
        "{op}: inner dimensions disagree on rank {rank}: left is {left:?}{}, right is {right:?}",
        global_note(.left_global)
    )]
    InnerDimMismatch {
        /// The operation.
        op: &'static str,
        /// The rank that saw the mismatch (0 for local, single-rank calls).
        rank: usize,
        /// Shape of the left operand (the rank's local part, for a distributed op).
        left: Vec<usize>,
        /// Shape of the right operand.
        right: Vec<usize>,
        /// The global shape of the left operand, where it is a `DistTensor` (its local part is
        /// `left`): a user reads the mismatch against the shapes they wrote.
        left_global: Option<Vec<usize>>,
    },

    /// A dimension index is not smaller than the number of dimensions.
    #[error("{op}: dimension {dim} is out of range for a tensor of {ndim} dimensions")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// How many dimensions the tensor has.
        ndim: usize,
    },

    /// An argument is out of its allowed range (a root outside the world, a zero world, ...).
    #[error("{op}: invalid argument on rank {rank}: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// The rank that saw it.
        rank: usize,
        /// What is wrong.
        reason: String,
    },

    // ---- placements and agreement across ranks ------------------------------------------
    /// Ranks passed values to a collective call that must agree but do not.
    #[error("{op}: ranks disagree: rank {rank_a} has {value_a}, rank {rank_b} has {value_b}")]
    RanksDisagree {
        /// The operation.
        op: &'static str,
        /// First rank.
        rank_a: usize,
        /// What the first rank passed.
        value_a: String,
        /// Second rank.
        rank_b: usize,
        /// What the second rank passed.
        value_b: String,
    },

    /// An operation was called on a tensor whose placement it does not take.
    #[error("{op}: placement {placement} is not accepted here; expected {expected}")]
    UnsupportedPlacement {
        /// The operation.
        op: &'static str,
        /// The placement found.
        placement: String,
        /// What the operation takes.
        expected: String,
    },

    // ---- symmetric memory ----------------------------------------------------------------
    /// A symmetric allocation does not fit in what is left of the heap segment.
    #[error(
        "rank {rank}: symmetric memory exhausted: asked for {requested} bytes, the largest free \
         block is {largest_free} bytes ({free} free of {capacity}); a larger heap: \
         DIST_TENSOR_HEAP_BYTES or the world builder's heap_capacity"
    )]
    SymmetricMemoryExhausted {
        /// The rank whose segment is full (every rank is, as allocation is collective).
        rank: usize,
        /// Bytes requested.
        requested: usize,
        /// Largest contiguous free block, in bytes.
        largest_free: usize,
        /// All free bytes.
        free: usize,
        /// Segment capacity in bytes.
        capacity: usize,
    },

    /// Ranks made symmetric allocations in different orders or sizes.
    #[error(
        "symmetric allocation differs across ranks in call #{sequence}: rank {rank_a} allocated \
         {bytes_a} bytes for {purpose_a} at offset {offset_a}, rank {rank_b} {bytes_b} bytes for \
         {purpose_b} at offset {offset_b}"
    )]
    AllocationMismatch {
        /// The rank's collective call number (see [`Error::OpMismatch`]).
        sequence: u64,
        /// What the first rank allocated for, with the element type (`all_gather staging<f32>`).
        purpose_a: String,
        /// What the second rank allocated for.
        purpose_b: String,
        /// First rank.
        rank_a: usize,
        /// Its size.
        bytes_a: usize,
        /// Its offset.
        offset_a: usize,
        /// Second rank.
        rank_b: usize,
        /// Its size.
        bytes_b: usize,
        /// Its offset.
        offset_b: usize,
    },

    /// `symm_at` (or another pointer to a peer's memory) asked for a rank on another node of a
    /// world joined by MPI: no pointer to its memory exists in this process. Data reaches it
    /// through [`Rank::put_signal`](crate::Rank::put_signal).
    #[error(
        "{op}: rank {rank} has no pointer to rank {peer}'s memory: rank {peer} is on another \
         node (ask Rank::is_local first; move data there with put_signal)"
    )]
    PeerNotLocal {
        /// What asked for the pointer.
        op: &'static str,
        /// The rank that asked.
        rank: usize,
        /// The peer on another node.
        peer: usize,
    },

    /// Ranks are in different collective calls: different ops, element types or call numbers.
    /// Every collective call (an op, an allocation, a barrier) starts with an exchange that
    /// carries what the call is, so the ranks find out together and every one returns this.
    #[error(
        "ranks are in different collective calls: rank {rank_a} is in {call_a}, rank {rank_b} in {call_b}"
    )]
    OpMismatch {
        /// First rank (rank 0, or the lowest rank that disagrees with it).
        rank_a: usize,
        /// Its call, such as `all_gather<f32> #12`.
        call_a: String,
        /// Second rank.
        rank_b: usize,
        /// Its call.
        call_b: String,
    },

    // ---- memory ----------------------------------------------------------------------------
    /// A buffer the operation needs cannot be allocated: the machine cannot hold it, or its size
    /// does not fit in the address space.
    #[error("{op}: out of memory: cannot allocate {bytes} bytes ({what})")]
    OutOfMemory {
        /// The operation.
        op: &'static str,
        /// Bytes asked for (`usize::MAX` when the size itself overflows).
        bytes: usize,
        /// What the buffer is for, and the elements and shape asked for.
        what: String,
    },

    // ---- signals and the world -----------------------------------------------------------
    /// A wait did not see its value in time.
    #[error(
        "rank {rank}, program {program}: wait on signal {signal} timed out after {timeout:?}: \
         awaited {awaited}, saw {seen}"
    )]
    WaitTimeout {
        /// The waiting rank.
        rank: usize,
        /// The waiting program (`None` outside a kernel launch, printed as the rank's thread).
        program: ProgramLabel,
        /// Index of the signal in its signal buffer.
        signal: usize,
        /// The condition waited for, such as `== 3` or `>= 3`.
        awaited: String,
        /// The value last seen.
        seen: u64,
        /// How long it waited.
        timeout: Duration,
    },

    /// A collective call did not complete in time: some ranks never made it.
    #[error("rank {rank}: {call} timed out after {timeout:?}: {}", never_joined(missing))]
    CallTimeout {
        /// The waiting rank.
        rank: usize,
        /// The call, such as `all_gather<f32> #12`.
        call: String,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
        /// How long it waited.
        timeout: Duration,
    },

    /// Another rank (or program) failed first; this rank stopped waiting for it.
    #[error("rank {rank}: stopped because rank {failed_rank} failed first: {reason}")]
    PeerFailed {
        /// The rank that gave up.
        rank: usize,
        /// The rank that failed first.
        failed_rank: usize,
        /// What the failed rank said (its error or panic message).
        reason: String,
    },

    /// A peer left the world (returned from `run`, or its process ended) while this rank still
    /// waited for it: it will never send what this rank waits for.
    #[error("rank {rank}: rank {peer} {how} while rank {rank} waits {waiting}")]
    PeerGone {
        /// The rank that waited.
        rank: usize,
        /// The rank that left.
        peer: usize,
        /// How it left: `returned from run`, `exited with status 3`, `was killed by signal 9`.
        how: String,
        /// What this rank waited in: `in all_gather<f32> #12`, `on signal 3 (>= 5, saw 2)`.
        waiting: String,
    },

    /// A rank of a world failed (returned an error or panicked); the run as a whole failed.
    ///
    /// `source` is the failing rank's own error, typed (match on it, or downcast a user error
    /// carried by [`Error::User`]). It is `None` only where that error lives in another process
    /// (a process world's peer); `reason` always has its text.
    #[error("rank {rank} failed first: {reason}{}", others_failed(*rank, failed_ranks))]
    RankFailed {
        /// The rank that failed first.
        rank: usize,
        /// Its error or panic message.
        reason: String,
        /// Its error, typed, where this process holds it.
        #[source]
        source: Option<Arc<Error>>,
        /// Every rank that failed of its own (an error of its own or a panic, not only
        /// "stopped because another failed"), in rank order.
        failed_ranks: Vec<usize>,
    },

    /// A rank's closure panicked inside `run`.
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },

    /// A program of a kernel launch panicked.
    #[error("rank {rank}, program {program}: kernel panicked: {message}")]
    KernelPanicked {
        /// The rank.
        rank: usize,
        /// The program.
        program: ProgramLabel,
        /// The panic message.
        message: String,
    },

    /// The process's environment does not describe a rank of a job: a variable is missing, not a
    /// number, or inconsistent with another.
    #[error("{op}: bad environment: {reason}")]
    Environment {
        /// The operation (`World::from_env`).
        op: &'static str,
        /// What is missing or wrong, naming the variables.
        reason: String,
    },

    /// An MPI call failed (feature `mpi`): the communicator returns errors instead of aborting,
    /// and the proxy that made the call reports it with MPI's own message.
    #[error("rank {rank}: {call} failed: {message}")]
    Mpi {
        /// The rank whose proxy made the call.
        rank: usize,
        /// The MPI call, with what it was for.
        call: String,
        /// MPI's message for the error code (`MPI_Error_string`).
        message: String,
    },

    /// A peer of a process world's rendezvous (or of its shared control block) sent a value this
    /// process does not accept: the field and why. The peer is refused; nothing it sent is used.
    #[error("{op}: rank {rank}: job {job}: {peer} sent a bad {field}: {reason}")]
    BadPeerMessage {
        /// The operation (`World::from_env`).
        op: &'static str,
        /// The rank that received it.
        rank: usize,
        /// The job id of the rendezvous.
        job: String,
        /// Who sent it: `rank 0 (pid 123)`, `a process (pid 456)`.
        peer: String,
        /// The field: `world_size`, `capacity`, `segment tag`, ...
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },

    /// The process at the other end of a rendezvous is not one this rank may share memory with:
    /// it runs as another user (the kernel's `SO_PEERCRED` says so), or belongs to another launch
    /// that uses the same job id. Nothing was shared with it.
    #[error("{op}: rank {rank}: job {job}: refused pid {pid} (uid {uid}): {reason}")]
    ForeignPeer {
        /// The operation (`World::from_env`).
        op: &'static str,
        /// The rank that refused it.
        rank: usize,
        /// The job id of the rendezvous.
        job: String,
        /// The peer's process id, as the kernel reports it.
        pid: u32,
        /// The peer's user id, as the kernel reports it.
        uid: u32,
        /// Why it was refused.
        reason: String,
    },

    /// Setting up or joining a process world failed at the operating system.
    #[error("{op}: rank {rank}: {what}: {source}")]
    System {
        /// The operation.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// What was being done.
        what: String,
        /// The system's error.
        #[source]
        source: Arc<std::io::Error>,
    },

    // ---- checkpoints ---------------------------------------------------------------------
    /// A checkpoint or safetensors file that cannot be saved or loaded: the rank that found it,
    /// the file, the tensor and why (see [`checkpoint`](crate::checkpoint)).
    #[error(transparent)]
    Checkpoint(Box<CheckpointError>),

    // ---- user errors -----------------------------------------------------------------------
    /// An error of the user's own code inside [`World::run`](crate::World::run): `?` on an
    /// `std::io::Error` (and the other standard errors with a `From` here), or any error through
    /// [`Error::user`]. Kept typed: [`Error::downcast_ref`] gets it back.
    #[error("{0}")]
    User(#[source] Arc<dyn std::error::Error + Send + Sync + 'static>),

    // ---- devices ---------------------------------------------------------------------------
    /// A vendor library could not be opened.
    #[error("{library} not found; tried: {}", tried.join(", "))]
    LibraryNotFound {
        /// The library looked for.
        library: &'static str,
        /// Every path tried, each with the loader's reason.
        tried: Vec<String>,
    },

    /// A vendor library lacks a symbol the crate needs.
    #[error("symbol {symbol} missing from {library}")]
    SymbolMissing {
        /// The symbol.
        symbol: &'static str,
        /// The library searched.
        library: String,
    },

    /// A vendor call returned a failing status.
    #[error("{call} failed with status {code}: {message}")]
    DeviceStatus {
        /// The call.
        call: &'static str,
        /// The status code.
        code: i32,
        /// The vendor's own message.
        message: String,
    },

    /// A device kernel's source did not compile (`aclrtcCompileProg` on Ascend): the compiler's
    /// status and its own log.
    #[error(
        "{call} failed with status {code} for kernel {kernel} ({options}); compile log:\n{log}"
    )]
    KernelCompile {
        /// The compiler call that failed.
        call: &'static str,
        /// The kernel.
        kernel: &'static str,
        /// The compile options, as passed.
        options: String,
        /// The status code.
        code: i32,
        /// The compiler's log (empty when it gave none).
        log: String,
    },

    /// No device of the asked kind is present, or the operation cannot run on it yet.
    #[error("{op}: device {device} unavailable: {reason}")]
    DeviceUnavailable {
        /// The operation.
        op: &'static str,
        /// The device asked for.
        device: String,
        /// Why.
        reason: String,
    },

    // ---- autograd -----------------------------------------------------------------------
    /// [`gradcheck`](crate::autograd::gradcheck): a recorded gradient disagrees with central
    /// finite differences.
    #[error(
        "gradcheck: input {input}, element {index}: the backward pass gives {analytic:e}, finite          differences {numeric:e} (tolerance {tolerance:e})"
    )]
    GradientMismatch {
        /// Which input (its position in the list).
        input: usize,
        /// The flat index of the element.
        index: usize,
        /// The gradient the backward pass recorded.
        analytic: f64,
        /// The central difference.
        numeric: f64,
        /// The tolerance it missed.
        tolerance: f64,
    },
}

fn others_failed(first: usize, failed: &[usize]) -> String {
    if failed.iter().all(|&r| r == first) {
        String::new()
    } else {
        let list = rank_list(failed);
        format!(" (ranks that failed: {})", &list[1..list.len() - 1])
    }
}

fn never_joined(missing: &[usize]) -> String {
    if missing.is_empty() {
        // Every rank had posted its call, but not every arrival came: a rank stopped (or was
        // stopped) between the two.
        "every rank had posted the call, but not all arrived in it (a rank stopped on its way)"
            .into()
    } else {
        format!("ranks {} never joined it", rank_list(missing))
    }
}

/// Ranks for a message, `[1, 2, 5]`: a long list (a world of millions) shows its first ranks and
/// how many more, so that a message stays short.
pub(crate) fn rank_list(ranks: &[usize]) -> String {
    const SHOWN: usize = 16;
    let list: Vec<String> = ranks.iter().take(SHOWN).map(|r| r.to_string()).collect();
    if ranks.len() <= SHOWN {
        format!("[{}]", list.join(", "))
    } else {
        format!(
            "[{}, ... and {} more ({} in all)]",
            list.join(", "),
            ranks.len() - SHOWN,
            ranks.len()
        )
    }
}

/// ` (local part of a global [..])`, or nothing: the global shape beside a local one.
fn global_note(global: &Option<Vec<usize>>) -> String {
    match global {
        Some(g) => format!(" (local part of a global {g:?})"),
        None => String::new(),
    }
}

impl Error {
    /// Wraps any error of the user's own code, so that `?` can carry it out of
    /// [`World::run`](crate::World::run) and [`Error::downcast_ref`] can get it back.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Error, World};
    ///
    /// #[derive(Debug)]
    /// struct NoCheckpoint(u32);
    /// impl std::fmt::Display for NoCheckpoint {
    ///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    ///         write!(f, "no checkpoint {}", self.0)
    ///     }
    /// }
    /// impl std::error::Error for NoCheckpoint {}
    ///
    /// let err = World::threads(2)?
    ///     .run(|rank| if rank.rank() == 1 { Err(Error::user(NoCheckpoint(7))) } else { Ok(()) })
    ///     .unwrap_err();
    /// assert_eq!(err.downcast_ref::<NoCheckpoint>().map(|e| e.0), Some(7));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn user(err: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Error {
        let boxed = err.into();
        match boxed.downcast::<Error>() {
            Ok(ours) => *ours,
            Err(other) => Error::User(Arc::from(other)),
        }
    }

    /// The failing rank's own error inside a [`Error::RankFailed`] (or this error itself
    /// otherwise): what to match on after [`World::run`](crate::World::run).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Error, Tensor, World};
    ///
    /// let err = World::threads(2)?
    ///     .run(|_rank| Tensor::<f32>::zeros(&[2, 3]).matmul(&Tensor::zeros(&[2, 3])).map(drop))
    ///     .unwrap_err();
    /// assert!(matches!(err, Error::RankFailed { .. }));
    /// assert!(matches!(err.rank_error(), Error::InnerDimMismatch { .. }), "{err}");
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn rank_error(&self) -> &Error {
        match self {
            Error::RankFailed { source: Some(inner), .. } => inner.rank_error(),
            other => other,
        }
    }

    /// The user's error of type `E` this error carries (directly, inside [`Error::User`], or as
    /// the failing rank's error of a [`Error::RankFailed`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Error, World};
    ///
    /// let err = World::threads(2)?
    ///     .run(|rank| {
    ///         if rank.rank() == 0 {
    ///             std::fs::read("/no/such/file")?; // ? on an io::Error inside run
    ///         }
    ///         rank.barrier_all().map(drop)
    ///     })
    ///     .unwrap_err();
    /// let io = err.downcast_ref::<std::io::Error>().expect("rank 0's io::Error, typed");
    /// assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    /// assert!(matches!(err, Error::RankFailed { rank: 0, .. }), "{err}");
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self.rank_error() {
            Error::User(inner) => inner.downcast_ref::<E>(),
            Error::System { source, .. } => (&**source as &dyn std::error::Error).downcast_ref(),
            other => (other as &dyn std::error::Error).downcast_ref::<E>(),
        }
    }
}

macro_rules! user_errors {
    ($($ty:ty),* $(,)?) => {
        $(
            impl From<$ty> for Error {
                /// Carries the error as [`Error::User`], so that `?` works on it inside `run`.
                fn from(err: $ty) -> Self {
                    Error::User(Arc::new(err))
                }
            }
        )*
    };
}

user_errors!(
    std::io::Error,
    std::fmt::Error,
    std::num::ParseIntError,
    std::num::ParseFloatError,
    std::num::TryFromIntError,
    std::str::Utf8Error,
    std::string::FromUtf8Error,
    std::env::VarError,
    ndarray::ShapeError,
);

impl From<Box<dyn std::error::Error + Send + Sync + 'static>> for Error {
    /// Carries the error as [`Error::User`] (or as itself, if it is one of ours).
    fn from(err: Box<dyn std::error::Error + Send + Sync + 'static>) -> Self {
        Error::user(err)
    }
}

/// Which program of a launch something happened in, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgramLabel {
    /// Outside any kernel: the rank's own thread.
    Host,
    /// A program of a kernel launch.
    Program {
        /// `program_id`.
        id: usize,
        /// `sub_vec_id`.
        sub_vec: usize,
    },
}

impl std::fmt::Display for ProgramLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProgramLabel::Host => write!(f, "host"),
            ProgramLabel::Program { id, sub_vec } => write!(f, "{id} (sub_vec {sub_vec})"),
        }
    }
}
