//! The crate's one error type.
//!
//! Every variant carries what went wrong, where (the op, the rank, the program) and why, so that a
//! message read in a log from an eight-rank run is enough to find the cause.

use std::time::Duration;

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
    #[error("{op}: inner dimensions disagree on rank {rank}: left is {left:?}, right is {right:?}")]
    InnerDimMismatch {
        /// The operation.
        op: &'static str,
        /// The rank that saw the mismatch (0 for local, single-rank calls).
        rank: usize,
        /// Shape of the left operand.
        left: Vec<usize>,
        /// Shape of the right operand.
        right: Vec<usize>,
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
         block is {largest_free} bytes ({free} free of {capacity})"
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
        "symmetric allocation #{sequence} differs across ranks: rank {rank_a} got {bytes_a} bytes \
         at offset {offset_a}, rank {rank_b} got {bytes_b} bytes at offset {offset_b}"
    )]
    AllocationMismatch {
        /// Index of the allocation in the collective sequence.
        sequence: u64,
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

    /// Another rank (or program) failed first; this rank stopped waiting for it.
    #[error("rank {rank}: stopped because rank {failed_rank} failed first")]
    PeerFailed {
        /// The rank that gave up.
        rank: usize,
        /// The rank that failed first.
        failed_rank: usize,
    },

    /// A rank of a world failed (returned an error or panicked); the run as a whole failed.
    #[error("rank {rank} failed first: {reason}")]
    RankFailed {
        /// The rank that failed first.
        rank: usize,
        /// Its error or panic message.
        reason: String,
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
