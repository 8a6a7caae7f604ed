//! How waiting works: spin briefly, then block on a process-shared futex until a notify, a
//! failure, a peer leaving, or the deadline.
//!
//! Every signal is a [`Cell`]: a 64-bit value and, beside it, a 32-bit doorbell and a count of the
//! threads sleeping on it. A waiter that has spun long enough registers in the cell's count,
//! reads the doorbell, checks the value, and sleeps on the doorbell's futex. A notifier stores the
//! value, and only if the cell has sleepers rings its doorbell and wakes them (a notify of a cell
//! nobody sleeps on costs no system call). The count is written before the value is read and read
//! after the value is stored, both sequentially consistent, so a wake-up is never lost.
//!
//! The futexes are process-shared (no `FUTEX_PRIVATE_FLAG`), so the same code wakes a thread of
//! this process or of another that maps the same memory. A sleeping waiter also wakes up on its
//! own every few milliseconds to look at the world: a failure, a rank that left, its deadline,
//! and (in a process world) whether a peer process died.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};
use std::time::{Duration, Instant};

use rustix::thread::futex;

use super::control::Control;

/// Spins before a waiter yields, then yields before it blocks: short enough that a waiter on a
/// busy machine gives its core back quickly to the producer it waits for.
const SPIN_ROUNDS: u32 = 200;
const YIELD_ROUNDS: u32 = 20;
/// First and longest sleep between looks at the world while blocked: a bound on how late a
/// waiter notices a failure, a peer that left, or its deadline.
const FIRST_TICK: Duration = Duration::from_millis(1);
const MAX_TICK: Duration = Duration::from_millis(16);
/// In a world with ranks on other nodes, how long a waiter goes on waiting after it found a rank
/// it needs gone: that rank's last puts and the news of its leaving travel different ways (its
/// puts may be relayed by another process of its node), so the news can arrive first. CI saw
/// "rank 3 dropped its world while rank 1 waits on signal 3 (awaited >= 60, saw 58)" after the
/// last collective of a job that was correct. The fault tests' bound over MPI is 2 s.
const REMOTE_GRACE: Duration = Duration::from_millis(300);

/// A signal: the value, and the doorbell its waiters sleep on. Lives in symmetric memory, one
/// per 64-byte line.
#[repr(C)]
pub(crate) struct Cell {
    pub(crate) value: AtomicU64,
    doorbell: AtomicU32,
    sleepers: AtomicU32,
}

impl Cell {
    /// A signal of value zero outside any heap (a counter in process memory that threads wait on).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
    pub(crate) const fn new() -> Cell {
        Cell { value: AtomicU64::new(0), doorbell: AtomicU32::new(0), sleepers: AtomicU32::new(0) }
    }

    /// Wakes the threads sleeping on this cell, if any. Call after the store it announces.
    pub(crate) fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.doorbell.fetch_add(1, Ordering::SeqCst);
            // Every sleeper: the kernel takes the count as a signed int, so u32::MAX would be -1
            // and wake one only (the others slept to their next tick, 1 to 16 ms). A failed wake
            // only costs the waiter its next tick.
            let _ = futex::wake(&self.doorbell, futex::Flags::empty(), i32::MAX as u32);
        }
    }
}

/// How a wait ended.
#[derive(Debug)]
pub(crate) enum WaitOutcome<E> {
    Ready,
    /// Some rank failed (the control block's flag is set).
    Failed,
    /// What `gone` reported: a rank this wait needs has left.
    Gone(E),
    TimedOut,
}

/// What a waiter looks at besides its condition.
pub(crate) struct Watch<'a> {
    pub(crate) control: &'a Control,
    pub(crate) deadline: Option<Instant>,
    /// Called on every tick while blocked (a process world looks for dead peers here).
    pub(crate) on_tick: Option<&'a (dyn Fn(&Control) + Send + Sync)>,
    /// Counts the threads blocked in a wait, for a proxy that moves data from other nodes: it
    /// polls hard while anyone waits.
    pub(crate) blocked: Option<&'a AtomicUsize>,
}

/// Waits on `cell` until `ready()`, a failure, `gone()` reporting a reason (asked whenever a rank
/// has left the running state since the last look), or the deadline.
pub(crate) fn wait_until<E>(
    watch: &Watch<'_>,
    cell: &Cell,
    ready: impl FnMut() -> bool,
    gone: impl FnMut() -> Option<E>,
) -> WaitOutcome<E> {
    wait_until_checked(watch, cell, ready, gone, || None)
}

/// [`wait_until`], also asking `stuck` on every tick while blocked whether the wait can never
/// end (the exchange looks for ranks blocked in calls that wait on each other, see `crossed`):
/// its reason ends the wait as `gone`'s does.
pub(crate) fn wait_until_checked<E>(
    watch: &Watch<'_>,
    cell: &Cell,
    mut ready: impl FnMut() -> bool,
    mut gone: impl FnMut() -> Option<E>,
    mut stuck: impl FnMut() -> Option<E>,
) -> WaitOutcome<E> {
    let control = watch.control;
    for round in 0..SPIN_ROUNDS + YIELD_ROUNDS {
        if ready() {
            return WaitOutcome::Ready;
        }
        if control.failed() {
            return WaitOutcome::Failed;
        }
        if round < SPIN_ROUNDS {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    cell.sleepers.fetch_add(1, Ordering::SeqCst);
    if let Some(blocked) = watch.blocked {
        blocked.fetch_add(1, Ordering::SeqCst);
    }
    let outcome = block(watch, cell, &mut ready, &mut gone, &mut stuck);
    if let Some(blocked) = watch.blocked {
        blocked.fetch_sub(1, Ordering::SeqCst);
    }
    cell.sleepers.fetch_sub(1, Ordering::SeqCst);
    outcome
}

fn block<E>(
    watch: &Watch<'_>,
    cell: &Cell,
    ready: &mut impl FnMut() -> bool,
    gone: &mut impl FnMut() -> Option<E>,
    stuck: &mut impl FnMut() -> Option<E>,
) -> WaitOutcome<E> {
    let control = watch.control;
    let mut seen_exits = None;
    let mut tick = FIRST_TICK;
    // Set (in a world with other nodes) when a needed rank was found gone: until when to wait
    // for its last puts, and what to report then.
    let mut gone_at: Option<(Instant, E)> = None;
    loop {
        let ring = cell.doorbell.load(Ordering::SeqCst);
        // Exits first: a rank publishes its exit after every signal it sent, so a waiter that
        // sees the exit and then finds its condition unmet knows the signal will never come.
        let exits = control.exits();
        if ready() {
            return WaitOutcome::Ready;
        }
        if control.failed() {
            return WaitOutcome::Failed;
        }
        if gone_at.is_none() && seen_exits != Some(exits) {
            seen_exits = Some(exits);
            if let Some(reason) = gone() {
                // `gone` acquired the leaver's state, published after every signal it sent:
                // look once more, so that a signal sent just before leaving is not missed.
                if ready() {
                    return WaitOutcome::Ready;
                }
                if watch.blocked.is_none() {
                    return WaitOutcome::Gone(reason);
                }
                gone_at = Some((Instant::now() + REMOTE_GRACE, reason));
            }
        }
        let mut sleep = tick;
        if let Some((until, _)) = &gone_at {
            let now = Instant::now();
            if now >= *until {
                let (_, reason) = gone_at.take().expect("set");
                return WaitOutcome::Gone(reason);
            }
            sleep = sleep.min(*until - now);
        }
        if let Some(deadline) = watch.deadline {
            let now = Instant::now();
            if now >= deadline {
                return WaitOutcome::TimedOut;
            }
            sleep = sleep.min(deadline - now);
        }
        let timeout = rustix::time::Timespec {
            tv_sec: sleep.as_secs() as i64,
            tv_nsec: sleep.subsec_nanos() as i64,
        };
        // Returns at once if the doorbell rang since it was read; errors (EAGAIN, EINTR,
        // ETIMEDOUT) all mean "look again".
        let _ = futex::wait(&cell.doorbell, futex::Flags::empty(), ring, Some(&timeout));
        if let Some(on_tick) = watch.on_tick {
            on_tick(control);
        }
        if gone_at.is_none()
            && !control.failed()
            && let Some(reason) = stuck()
        {
            if ready() {
                return WaitOutcome::Ready;
            }
            return WaitOutcome::Gone(reason);
        }
        tick = (tick * 2).min(MAX_TICK);
    }
}

/// The deadline `timeout` from now, or none if that is past what an `Instant` can hold.
pub(crate) fn deadline_after(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}
