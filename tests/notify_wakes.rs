//! How soon a notify wakes a waiter that has stopped spinning and blocked: the notify itself must
//! wake it, not a periodic re-check.
//!
//! Its own test binary, so that the spinning ranks of other tests do not compete for the cores
//! while it measures. The bound is generous for a busy shared machine (a wake-up takes tens of
//! microseconds on an idle one), and each measurement takes the median of several trials and is
//! tried up to three times; a waiter that only notices the signal on a timer re-checking every
//! 50 ms would still miss it by about 40 ms in every trial.

use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use dist_tensor::World;
use dist_tensor::device::{LaunchMode, launch};
use dist_tensor::shmem::{NotifySem, Scope, SignalOp, WaitCmp, WaitSem};

/// How long the waiter waits before the notify: long past any spinning or yielding.
const BLOCKED_FOR: Duration = Duration::from_millis(10);
/// The median wake-up latency allowed.
const BOUND: Duration = Duration::from_millis(20);
const TRIALS: u64 = 9;
const ATTEMPTS: usize = 3;

/// Who waits and who notifies: the host code of a rank, or a program of a kernel launch.
#[derive(Debug, Clone, Copy)]
enum Side {
    Host,
    Kernel,
}

/// `TRIALS` times: rank 1 waits for signal 0 while rank 0 sleeps `BLOCKED_FOR`, then notes the
/// time and notifies; rank 1 notes when its wait returns. Returns the median of the differences.
fn median_wake_latency(world: &World, side: Side) -> Duration {
    let sent = Mutex::new(Vec::new());
    // The trials are paced by a barrier of the standard library: the world's own barrier wakes
    // the peers it reaches, which would wake the waiter on the notifier's behalf.
    let pace = Barrier::new(2);
    let woke = world
        .run(|rank| {
            let sigs = rank.alloc_signals(1)?;
            let mut woke = Vec::new();
            for trial in 1..=TRIALS {
                pace.wait();
                if rank.rank() == 0 {
                    std::thread::sleep(BLOCKED_FOR);
                    sent.lock().unwrap().push(Instant::now());
                }
                let (notifier, me) = (rank.rank() == 0, rank.rank());
                let cmp = WaitCmp::Ge(trial);
                let (op, scope, sem) = (SignalOp::Set(trial), Scope::Peer, NotifySem::Release);
                match side {
                    Side::Host if notifier => rank.notify(&sigs, 0, 1, op, scope, sem)?,
                    Side::Host => {
                        let _ = rank.wait(&sigs, 0, cmp, WaitSem::Acquire)?;
                    }
                    Side::Kernel => launch(rank, LaunchMode::VectorOnly, 1, |p| {
                        if notifier {
                            p.notify(&sigs, 0, 1, op, scope, sem)
                        } else {
                            p.wait(&sigs, 0, cmp, WaitSem::Acquire).map(drop)
                        }
                    })?,
                }
                if me == 1 {
                    woke.push(Instant::now());
                }
            }
            pace.wait();
            Ok(woke)
        })
        .unwrap_or_else(|e| panic!("{side:?}: {e}"));
    let sent = sent.into_inner().unwrap();
    assert_eq!((sent.len(), woke[1].len()), (TRIALS as usize, TRIALS as usize));
    let mut latencies: Vec<Duration> =
        sent.iter().zip(&woke[1]).map(|(s, w)| w.saturating_duration_since(*s)).collect();
    latencies.sort();
    latencies[latencies.len() / 2]
}

fn check(side: Side) {
    let world = World::threads(2).unwrap();
    let mut medians = Vec::new();
    for _ in 0..ATTEMPTS {
        let median = median_wake_latency(&world, side);
        if median < BOUND {
            return;
        }
        medians.push(median);
    }
    panic!(
        "{side:?}: a notify woke a waiter blocked for {BLOCKED_FOR:?} only after {medians:?} \
         (the medians of {ATTEMPTS} attempts of {TRIALS} trials), want under {BOUND:?}: the \
         waiter is not woken by the notify"
    );
}

#[test]
fn a_notify_wakes_a_blocked_host_waiter_at_once() {
    check(Side::Host);
}

#[test]
fn a_notify_wakes_a_blocked_kernel_program_at_once() {
    check(Side::Kernel);
}
