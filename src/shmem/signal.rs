//! Signals in the symmetric heap: `notify` a peer's signal, `wait` on one's own, get a token.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::heap::Heap;
use super::sync::{Cell, WaitOutcome, wait_until};
use super::world::WorldShared;
use crate::error::ProgramLabel;
use crate::{Error, Result};

/// Bytes between two signals: one cache line each (the value and its doorbell), so signals
/// written by different peers never share a line.
pub(crate) const SIGNAL_STRIDE: usize = 64;

/// Proof that a wait or barrier completed. Symmetric memory becomes readable only by passing a
/// token to [`consume_token`](crate::shmem::consume_token) (rule 3).
///
/// A token proves that some wait or barrier completed on this rank; it is not tied to a particular
/// signal or buffer (as in the seed, where `consume_token` only adds a dependency edge): the types
/// make reading symmetric memory without any synchronization fail to compile, and leave choosing
/// the right wait to the kernel. Tokens come only from waits and barriers:
/// ```compile_fail,E0451
/// use dist_tensor::shmem::{Token};
/// fn needs_token(t: Token) {}
/// needs_token(Token { _private: () }); // tokens come only from waits and barriers
/// ```
#[must_use = "a wait's token must be passed to consume_token before reading what it guards"]
#[derive(Debug, Clone, Copy)]
pub struct Token {
    _private: (),
}

impl Token {
    pub(crate) fn new() -> Self {
        Token { _private: () }
    }
}

/// What a notify does to the signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalOp {
    /// Store the value.
    Set(u64),
    /// Add the value (atomically).
    Add(u64),
}

/// Whose signal a notify reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The calling rank's own device: the target must be the calling rank.
    Device,
    /// Any rank of the world.
    Peer,
}

/// Memory ordering of a notify.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifySem {
    /// Writes before the notify are visible to a waiter that acquires it.
    Release,
    /// Orders nothing: the signal alone.
    Relaxed,
}

/// Memory ordering of a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitSem {
    /// Reads after the wait see what the notifier wrote before a release notify.
    Acquire,
    /// Orders nothing.
    Relaxed,
}

/// The condition a wait waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitCmp {
    /// The signal equals the value.
    Eq(u64),
    /// The signal is at least the value (what epoch-counted signals use).
    Ge(u64),
}

impl WaitCmp {
    fn holds(self, seen: u64) -> bool {
        match self {
            WaitCmp::Eq(v) => seen == v,
            WaitCmp::Ge(v) => seen >= v,
        }
    }
}

impl std::fmt::Display for WaitCmp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitCmp::Eq(v) => write!(f, "== {v}"),
            WaitCmp::Ge(v) => write!(f, ">= {v}"),
        }
    }
}

/// A symmetric array of 64-bit signals, zero when allocated. Made by
/// [`Rank::alloc_signals`](crate::Rank::alloc_signals).
///
/// # Examples
/// ```
/// use dist_tensor::World;
/// World::threads(2)?.run(|rank| {
///     let sigs = rank.alloc_signals(3)?;
///     assert_eq!(sigs.len(), 3);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct SignalBuf {
    heap: Arc<Heap>,
    owner: usize,
    offset: usize,
    len: usize,
}

impl SignalBuf {
    pub(crate) fn new(heap: Arc<Heap>, owner: usize, offset: usize, len: usize) -> Self {
        SignalBuf { heap, owner, offset, len }
    }

    /// Number of signals.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     assert_eq!(rank.alloc_signals(5)?.len(), 5);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::threads(1)?.run(|rank| {
    ///     assert!(rank.alloc_signals(0)?.is_empty());
    ///     assert!(!rank.alloc_signals(1)?.is_empty());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn bytes(len: usize) -> usize {
        len * SIGNAL_STRIDE
    }

    /// Byte offset of signal `index` in every rank's segment.
    pub(crate) fn cell_offset(&self, index: usize) -> usize {
        self.offset + index * SIGNAL_STRIDE
    }

    /// Signal `index` in `rank`'s segment.
    fn cell(&self, rank: usize, index: usize) -> &Cell {
        cell(&self.heap, rank, self.offset + index * SIGNAL_STRIDE)
    }
}

impl Drop for SignalBuf {
    fn drop(&mut self) {
        self.heap.free(self.owner, self.offset, Self::bytes(self.len));
    }
}

impl std::fmt::Debug for SignalBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignalBuf")
            .field("rank", &self.owner)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// The signal at byte `offset` of `rank`'s segment.
pub(crate) fn cell(heap: &Heap, rank: usize, offset: usize) -> &Cell {
    assert!(
        offset + size_of::<Cell>() <= heap.capacity(),
        "signal at byte {offset} outside the heap segment"
    );
    // SAFETY: the offset is inside the segment and 8-byte aligned (signal blocks are ALIGNed and
    // strided by 64 bytes); signals are only ever accessed atomically.
    unsafe { &*(heap.base(rank).add(offset) as *const Cell) }
}

/// Who is expected to satisfy a wait: a wait whose sender has left fails at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Awaited {
    /// Rank `p` sends it (every wait inside the crate's own ops knows its sender).
    Peer(usize),
    /// Unknown (a user's wait): it fails once every other rank has left.
    Anyone,
}

pub(crate) fn check_signal(
    world: &WorldShared,
    op: &'static str,
    rank: usize,
    sig: &SignalBuf,
    index: usize,
) -> Result<()> {
    if !Arc::ptr_eq(&sig.heap, &world.heap) {
        return Err(Error::InvalidArgument {
            op,
            rank,
            reason: "the signal buffer belongs to another world".into(),
        });
    }
    if index >= sig.len {
        return Err(Error::InvalidArgument {
            op,
            rank,
            reason: format!("signal index {index} is out of range for {} signals", sig.len),
        });
    }
    Ok(())
}

/// Notifies signal `index` of `peer`'s copy of `sig`, from `rank`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn notify(
    world: &WorldShared,
    rank: usize,
    sig: &SignalBuf,
    index: usize,
    peer: usize,
    op: SignalOp,
    scope: Scope,
    sem: NotifySem,
) -> Result<()> {
    check_signal(world, "notify", rank, sig, index)?;
    if peer >= world.num_ranks() || (scope == Scope::Device && peer != rank) {
        return Err(Error::InvalidArgument {
            op: "notify",
            rank,
            reason: format!(
                "cannot notify rank {peer} with scope {scope:?} in a world of {} ranks",
                world.num_ranks()
            ),
        });
    }
    if !world.heap.mapped(peer) {
        // A peer on another node: the proxy applies the signal there, after every transfer this
        // process handed it for that peer before (so a release notify orders what came first).
        let put = super::transport::Put::signal_only(peer, sig.cell_offset(index), op);
        return world.transport.put(world, &put);
    }
    let order = match sem {
        NotifySem::Release => Ordering::Release,
        NotifySem::Relaxed => Ordering::Relaxed,
    };
    let target = sig.cell(peer, index);
    apply(target, op, order);
    Ok(())
}

/// Applies `op` to `cell` with `order`, then wakes its sleepers.
pub(crate) fn apply(cell: &Cell, op: SignalOp, order: Ordering) {
    match op {
        SignalOp::Set(v) => cell.value.store(v, order),
        SignalOp::Add(v) => {
            cell.value.fetch_add(v, order);
        }
    }
    cell.ring();
}

/// Waits, on `rank`, until its signal `index` of `sig` meets `cmp`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn wait(
    world: &WorldShared,
    rank: usize,
    program: ProgramLabel,
    sig: &SignalBuf,
    index: usize,
    cmp: WaitCmp,
    sem: WaitSem,
    awaited: Awaited,
) -> Result<Token> {
    check_signal(world, "wait", rank, sig, index)?;
    if let Awaited::Peer(peer) = awaited
        && peer >= world.num_ranks()
    {
        return Err(Error::InvalidArgument {
            op: "wait",
            rank,
            reason: format!("rank {peer} is outside a world of {} ranks", world.num_ranks()),
        });
    }
    wait_cell(world, rank, program, sig.cell(rank, index), index, cmp, sem, awaited)
}

/// Waits on one signal cell of `rank`'s own segment.
#[allow(clippy::too_many_arguments)]
pub(crate) fn wait_cell(
    world: &WorldShared,
    rank: usize,
    program: ProgramLabel,
    cell: &Cell,
    index: usize,
    cmp: WaitCmp,
    sem: WaitSem,
    awaited: Awaited,
) -> Result<Token> {
    let order = match sem {
        WaitSem::Acquire => Ordering::Acquire,
        WaitSem::Relaxed => Ordering::Relaxed,
    };
    let control = &world.control;
    let n = world.num_ranks();
    let waiting = || {
        let seen = cell.value.load(Ordering::Relaxed);
        format!("on signal {index} (awaited {cmp}, saw {seen}) in program {program}")
    };
    let left = |p: usize| p != rank && control.has_left(p, rank);
    let outcome = wait_until(
        &world.watch(),
        cell,
        || cmp.holds(cell.value.load(order)),
        || {
            let peer = match awaited {
                Awaited::Peer(p) => Some(p).filter(|&p| left(p)),
                Awaited::Anyone if n > 1 && (0..n).all(|p| p == rank || left(p)) => {
                    (0..n).find(|&p| p != rank)
                }
                Awaited::Anyone => None,
            }?;
            Some(Error::PeerGone { rank, peer, how: control.how_left(peer), waiting: waiting() })
        },
    );
    match outcome {
        WaitOutcome::Ready => Ok(Token::new()),
        WaitOutcome::Failed => Err(world.peer_failed(rank)),
        WaitOutcome::Gone(err) => Err(err),
        // A peer process that is stopped is the cause to name, not the signal.
        WaitOutcome::TimedOut => {
            Err(match super::process::stopped_peer(control, rank, n, |p| world.heap.mapped(p)) {
                Some((peer, pid)) => Error::PeerGone {
                    rank,
                    peer,
                    how: format!(
                        "is stopped (pid {pid}: SIGSTOP or a debugger) and sent nothing for {:?}",
                        world.wait_timeout
                    ),
                    waiting: waiting(),
                },
                None => Error::WaitTimeout {
                    rank,
                    program,
                    signal: index,
                    awaited: cmp.to_string(),
                    seen: cell.value.load(Ordering::Relaxed),
                    timeout: world.wait_timeout,
                },
            })
        }
    }
}
