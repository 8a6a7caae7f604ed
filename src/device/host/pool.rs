//! Resident program threads: one pool per rank, kept between launches.
//!
//! Spawning a thread per program on every launch can cost more than a small collective's whole
//! data movement. The pool keeps its threads parked
//! between launches; a launch wakes as many as it needs. Every instance of a launch runs on its own
//! thread at once, as the execution model requires (programs spin-wait on each other).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::shmem::{Rank, Workspace};
use crate::{Error, Result};

/// A launch's body, called with the instance index `1..instances` on the pool's threads.
type Job = dyn Fn(usize) + Sync;

/// A type-erased pointer to the current launch's job. Valid from the moment a launch publishes it
/// until every worker has reported back: [`ProgramPool::run`] does not return before then.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);

// SAFETY: the pointee is `Sync`, and `run` keeps it alive while workers may use it.
unsafe impl Send for JobPtr {}

/// Spin rounds before a thread that waits for the pool sleeps: back-to-back launches (a
/// collective is several) then find their threads awake, without keeping an idle core busy for
/// long.
const SPIN_ROUNDS: u32 = 100;
const YIELD_ROUNDS: u32 = 100;

struct State {
    job: Option<JobPtr>,
    instances: usize,
    shutdown: bool,
}

struct Shared {
    /// Bumped (under the state lock) when a launch publishes a job or the pool shuts down.
    generation: AtomicU64,
    /// Workers of the current launch that have not finished yet.
    remaining: AtomicUsize,
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

/// Spins, then yields, until `ready()`; returns whether it became true.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    for round in 0..SPIN_ROUNDS + YIELD_ROUNDS {
        if ready() {
            return true;
        }
        if round < SPIN_ROUNDS {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    ready()
}

/// One rank's resident program threads.
pub(crate) struct ProgramPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    rank: usize,
}

impl Workspace for ProgramPool {
    fn symmetric_bytes(&self) -> usize {
        0
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ProgramPool {
    pub(crate) fn new(rank: &Rank<'_>) -> Result<Self> {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            remaining: AtomicUsize::new(0),
            state: Mutex::new(State { job: None, instances: 0, shutdown: false }),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        Ok(ProgramPool { shared, workers: Vec::new(), rank: rank.rank() })
    }

    /// Runs `job(i)` for every `i` in `0..instances` at once: 0 on the calling thread, the others
    /// on resident threads. Returns when all have returned. `job` must not panic (callers catch
    /// panics inside it).
    pub(crate) fn run(&mut self, instances: usize, job: &(dyn Fn(usize) + Sync)) -> Result<()> {
        while self.workers.len() + 1 < instances {
            let index = self.workers.len() + 1;
            let shared = self.shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("rank-{}/instance-{index}", self.rank))
                .spawn(move || worker(&shared, index))
                .map_err(|e| Error::System {
                    op: "launch",
                    rank: self.rank,
                    what: format!("cannot start program thread {index} of {instances}"),
                    source: std::sync::Arc::new(e),
                })?;
            self.workers.push(handle);
        }
        // SAFETY: only the lifetime is erased; the job outlives its use, as `JobPtr` says.
        let erased: JobPtr = JobPtr(unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Job>(job)
        });
        let shared = &*self.shared;
        {
            let mut state = lock(&shared.state);
            state.job = Some(erased);
            state.instances = instances;
            shared.remaining.store(instances.saturating_sub(1), Ordering::Relaxed);
            shared.generation.fetch_add(1, Ordering::Release);
        }
        shared.work.notify_all();
        // Waits for the workers when it goes out of scope, even if `job(0)` unwinds: the job they
        // run lives on this stack frame.
        let _join = JoinOnDrop(shared);
        if instances > 0 {
            job(0);
        }
        Ok(())
    }
}

/// Waits until every worker of the current launch has reported back.
struct JoinOnDrop<'a>(&'a Shared);

impl Drop for JoinOnDrop<'_> {
    fn drop(&mut self) {
        let shared = self.0;
        if !spin_until(|| shared.remaining.load(Ordering::Acquire) == 0) {
            let mut state = lock(&shared.state);
            while shared.remaining.load(Ordering::Acquire) > 0 {
                state = shared.done.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        }
        lock(&shared.state).job = None;
    }
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0;
    loop {
        spin_until(|| shared.generation.load(Ordering::Acquire) != seen);
        let job = {
            let mut state = lock(&shared.state);
            while shared.generation.load(Ordering::Acquire) == seen && !state.shutdown {
                state = shared.work.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.shutdown {
                return;
            }
            seen = shared.generation.load(Ordering::Acquire);
            if index >= state.instances {
                continue;
            }
            state.job.expect("a launch publishes its job with its generation")
        };
        // SAFETY: the launch that published this job waits for this worker's report below. A
        // panic is caught so that the report is always made (the job itself catches its
        // kernel's panics; this is the last line of defence).
        let _ =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*job.0)(index) }));
        if shared.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _state = lock(&shared.state);
            shared.done.notify_one();
        }
    }
}

impl Drop for ProgramPool {
    fn drop(&mut self) {
        {
            let mut state = lock(&self.shared.state);
            state.shutdown = true;
            self.shared.generation.fetch_add(1, Ordering::Release);
        }
        self.shared.work.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
