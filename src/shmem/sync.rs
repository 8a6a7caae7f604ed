//! How waiting works on the host: spin briefly, then block until a notify or a failure wakes us.
//!
//! Every rank has one [`Parker`]. A waiter that has spun long enough registers itself and sleeps
//! on the parker's condition variable; a notifier that finds waiters registered on the target
//! rank wakes them. The registration count is read after the signal store and written before the
//! signal load, both sequentially consistent, so a wake-up is never lost: either the notifier
//! sees the waiter, or the waiter sees the signal.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::heap::lock;

/// Spins before a waiter yields, then yields before it blocks: short enough that a waiter on a
/// busy machine gives its core back quickly to the producer it waits for.
const SPIN_ROUNDS: u32 = 200;
const YIELD_ROUNDS: u32 = 20;
/// Longest single sleep: a bound on how late a waiter notices a deadline.
const MAX_SLEEP: Duration = Duration::from_millis(50);

#[derive(Default)]
pub(crate) struct Parker {
    waiters: AtomicUsize,
    mutex: Mutex<()>,
    cond: Condvar,
}

impl Parker {
    /// Wakes every waiter of this rank, if any is blocked. Call after the store it announces.
    pub(crate) fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _guard = lock(&self.mutex);
            self.cond.notify_all();
        }
    }

    /// Waits until `ready()` is true, `failed()` is true, or `deadline` passes; returns whether
    /// `ready()` held.
    pub(crate) fn wait_until(
        &self,
        deadline: Instant,
        mut ready: impl FnMut() -> bool,
        failed: impl Fn() -> bool,
    ) -> WaitOutcome {
        for round in 0..SPIN_ROUNDS + YIELD_ROUNDS {
            if ready() {
                return WaitOutcome::Ready;
            }
            if failed() {
                return WaitOutcome::Failed;
            }
            if round < SPIN_ROUNDS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let outcome = self.block(deadline, ready, failed);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        outcome
    }

    fn block(
        &self,
        deadline: Instant,
        mut ready: impl FnMut() -> bool,
        failed: impl Fn() -> bool,
    ) -> WaitOutcome {
        let mut guard = lock(&self.mutex);
        loop {
            fence(Ordering::SeqCst);
            if ready() {
                return WaitOutcome::Ready;
            }
            if failed() {
                return WaitOutcome::Failed;
            }
            let now = Instant::now();
            if now >= deadline {
                return WaitOutcome::TimedOut;
            }
            let sleep = (deadline - now).min(MAX_SLEEP);
            guard = self.cond.wait_timeout(guard, sleep).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitOutcome {
    Ready,
    Failed,
    TimedOut,
}

/// The first failure of a world: once set, every wait of every rank gives up.
#[derive(Default)]
pub(crate) struct Failure {
    failed: AtomicBool,
    first: Mutex<Option<(usize, String)>>,
}

impl Failure {
    pub(crate) fn is_set(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Records `rank`'s failure unless another came first; returns whether this one was first.
    pub(crate) fn set(&self, rank: usize, reason: String) -> bool {
        let mut first = lock(&self.first);
        let is_first = first.is_none();
        if is_first {
            *first = Some((rank, reason));
        }
        self.failed.store(true, Ordering::Release);
        is_first
    }

    /// The first failure: its rank and reason.
    pub(crate) fn first(&self) -> Option<(usize, String)> {
        lock(&self.first).clone()
    }
}
