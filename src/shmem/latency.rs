//! Prompt wake-ups for the threads that only relay communication: the MPI proxy and the
//! data-parallel reducer.
//!
//! Such a thread sleeps most of the time and, when it wakes (a message arrived, a bucket is
//! ready), needs a core for microseconds. With the cores busy with the backward pass (4 ranks on
//! 2 cores), Linux's EEVDF scheduler let it wait for the running thread's slice (1.4 ms here) at
//! each wake-up, and a bucket's all-reduce takes several in turn: the buckets made little progress
//! during the pass. A short slice (EEVDF's per-task slice, Linux 6.12 and later: `sched_setattr`
//! with `sched_runtime` for a normal thread, no privilege needed) gives the thread an early
//! deadline, so it runs as soon as it wakes, for its short turn. The nice value and policy stay.
//!
//! Measured with `perf_report --mesh` on the throttled fake nodes (2 cores, 2x2 mesh, 2048
//! tokens; docs/results/2026-12-04-mesh-short-slices-zen4.md): the part of the dp averaging the backward pass leaves unhidden fell
//! from 74% to 85% of the averaging alone to 44% to 58%. [`SHORT_SLICE_ENV`] = `0` turns it off.
//!
//! [`SHORT_SLICE_ENV`]: crate::shmem::job_env::SHORT_SLICE_ENV

use crate::shmem::job_env::SHORT_SLICE_ENV;

/// The slice asked for: the shortest the kernel takes (0.1 ms).
pub(crate) const SLICE_NS: u64 = 100_000;

/// Whether the environment leaves short slices on (anything but `0` or `off`).
fn enabled(value: Option<&str>) -> bool {
    !matches!(value.map(str::trim), Some("0" | "off"))
}

/// Asks for a short slice for the calling thread, keeping its policy and nice value. Returns
/// whether the kernel took it (not on kernels before 6.12, nor outside Linux, nor when
/// [`SHORT_SLICE_ENV`](crate::shmem::job_env::SHORT_SLICE_ENV) turns it off): nothing depends on
/// it but how soon the thread runs.
pub(crate) fn prompt_wakeups() -> bool {
    if !enabled(std::env::var(SHORT_SLICE_ENV).ok().as_deref()) {
        return false;
    }
    short_slice()
}

#[cfg(target_os = "linux")]
fn short_slice() -> bool {
    /// `struct sched_attr` of `sched_setattr(2)` (its first version, 48 bytes).
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
    }
    // SAFETY: system calls about the calling thread only; `attr` lives through the call and
    // its size is the one passed in it.
    unsafe {
        let tid = libc::gettid();
        // getpriority returns -1 for nice -1 as for an error: errno tells them apart.
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        if nice == -1 && *libc::__errno_location() != 0 {
            return false;
        }
        let policy = libc::sched_getscheduler(0);
        if policy != libc::SCHED_OTHER && policy != libc::SCHED_BATCH {
            return false; // real-time or idle: not ours to change
        }
        let attr = SchedAttr {
            size: size_of::<SchedAttr>() as u32,
            policy: policy as u32,
            flags: 0,
            nice,
            priority: 0,
            runtime: SLICE_NS,
            deadline: 0,
            period: 0,
        };
        libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn short_slice() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_only_when_asked() {
        assert!(enabled(None));
        assert!(enabled(Some("1")));
        assert!(!enabled(Some("0")));
        assert!(!enabled(Some(" off ")));
    }

    /// On a kernel that takes it, the thread's slice is the one asked for and its nice value
    /// is kept (a thread at nice 3 stays there: the call must not reset it to 0).
    #[cfg(target_os = "linux")]
    #[test]
    fn the_slice_is_set_and_nice_kept() {
        std::thread::spawn(|| {
            // SAFETY: raising the calling thread's own nice value.
            let tid = unsafe { libc::gettid() } as libc::id_t;
            assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 3) }, 0);
            if !short_slice() {
                eprintln!("latency: this kernel takes no per-thread slice (before 6.12): skipped");
                return;
            }
            let sched = std::fs::read_to_string("/proc/thread-self/sched").unwrap();
            let slice: Option<u64> = sched
                .lines()
                .find(|l| l.starts_with("se.slice"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse().ok());
            if let Some(slice) = slice {
                assert_eq!(slice, SLICE_NS, "{sched}");
            }
            // SAFETY: reading the calling thread's nice value.
            assert_eq!(unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) }, 3);
        })
        .join()
        .unwrap();
    }
}
