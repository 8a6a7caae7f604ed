//! A world of processes whose ranks run on a device: the device world each process joins after
//! the host rendezvous (opened by the backend, e.g. `device::cuda::process`), and the thread
//! that carries the host side's failures (a dead peer found by its pid, a rank's error or panic
//! recorded in the control block) to the words every device kernel's waits read.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::control::{Control, RankState, describe_status};
use super::job_env::JobEnv;
use super::world::WorldShared;
use crate::Result;
use crate::shmem::device_runtime::OpenProcessDevice;

/// How often the watch thread carries host failures to the devices.
const WATCH_EVERY: Duration = Duration::from_millis(1);

/// What a process of the world must know to join the GPU world.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the GPU backend
pub(crate) struct ProcessJob<'a> {
    pub(crate) job_id: &'a str,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    /// Rank on this host: the GPU is `local_rank % device_count` (of the visible devices).
    pub(crate) local_rank: usize,
    /// Each rank's pid, as the host rendezvous recorded it.
    pub(crate) pids: Vec<u32>,
    pub(crate) wait_timeout: Duration,
    pub(crate) join_timeout: Duration,
    /// Whether the host world has failed meanwhile (then waiting for the others is pointless):
    /// the failed rank and what it said.
    pub(crate) failed: &'a (dyn Fn() -> Option<(usize, String)> + Sync),
}

/// Puts `shared`, this process's rank of the world `env` describes, on its device, as `open`
/// (the backend's) opens it.
pub(crate) fn attach_device(
    shared: &mut WorldShared,
    env: &JobEnv,
    join_timeout: Duration,
    open: OpenProcessDevice,
) -> Result<()> {
    let control = &shared.control;
    let n = env.world_size;
    let pids = (0..n).map(|r| control.pid(r).load(std::sync::atomic::Ordering::Acquire)).collect();
    let failed = || if control.failed() { control.first_failure() } else { None };
    let job = ProcessJob {
        job_id: &env.job_id,
        rank: env.rank,
        world_size: n,
        local_rank: env.local_rank,
        pids,
        wait_timeout: shared.wait_timeout,
        join_timeout,
        failed: &failed,
    };
    let device = match open(&job) {
        Ok(device) => device,
        Err(e) => {
            // The others stop waiting for this rank at once, with its reason.
            control.fail(env.rank, &format!("rank {} could not open its device: {e}", env.rank));
            return Err(e);
        }
    };
    shared.device = Some(device);
    Ok(())
}

/// Starts the thread that carries host failures to the device kernels of `shared`'s world (if
/// its device asks for it): it looks for dead peers (the world's pid watch), and once the control
/// block says the world failed, it tells the device (which raises the abort word every wait of
/// every kernel reads), with the failed rank and its reason. It ends when the world goes.
pub(crate) fn watch_device(shared: &Arc<WorldShared>) {
    if !shared.device.as_ref().is_some_and(|d| d.watches_host_failures()) {
        return;
    }
    let weak: Weak<WorldShared> = Arc::downgrade(shared);
    let mut exiting = Exiting::new(shared.num_ranks());
    let spawned =
        std::thread::Builder::new().name("dist-tensor device watch".into()).spawn(move || {
            loop {
                let Some(shared) = weak.upgrade() else { return };
                if let Some(tick) = &shared.on_tick {
                    tick(&shared.control);
                }
                exiting.check(&shared.control);
                if let Some(device) = &shared.device
                    && shared.control.failed()
                    && let Some((rank, reason)) = shared.control.first_failure()
                {
                    device.failed(rank, &reason);
                    return; // a failed world stays failed: nothing more to carry
                }
                drop(shared);
                std::thread::sleep(WATCH_EVERY);
            }
        });
    if let Err(e) = spawned {
        // Without the thread, kernels still end at their wait timeout; say why it is slower.
        eprintln!(
            "dist-tensor: no device watch thread ({e}): a dead peer ends waits at the timeout"
        );
    }
}

/// The kernel's flag of a task that has begun to exit (`PF_EXITING`, include/linux/sched.h),
/// field 9 of `/proc/<pid>/stat`.
const PF_EXITING: u64 = 0x4;

/// Finds peers whose process has begun to exit while their rank runs (killed, or exited inside
/// `run`), before the process is gone. A process that had GPU work queued leaves only once the
/// driver has torn down its GPU context, which can take as long as the work it left queued, and
/// only then does the pid watch (a pidfd) see it gone: meanwhile the work it left could even
/// complete a barrier with the survivors, as if the rank were still there. The task's
/// `PF_EXITING` flag is set at once, at the start of the exit.
struct Exiting {
    /// By rank: `/proc/<pid>/stat` of its process, opened once (the file stays that process's
    /// after its pid is reused), `None` until its pid is known, and for this process.
    stats: Vec<Option<std::fs::File>>,
    /// Whether rank `r`'s pid was looked at (its file opened, or found to be this process).
    opened: Vec<bool>,
}

impl Exiting {
    fn new(n: usize) -> Exiting {
        Exiting { stats: (0..n).map(|_| None).collect(), opened: vec![false; n] }
    }

    /// Marks every running rank whose process is exiting as died, which fails the world naming
    /// it (as the pid watch does once the process is gone).
    fn check(&mut self, control: &Control) {
        for rank in 0..self.stats.len() {
            if !self.opened[rank] {
                let pid = control.pid(rank).load(std::sync::atomic::Ordering::Acquire);
                if pid == 0 {
                    continue;
                }
                self.opened[rank] = true;
                if pid != std::process::id() {
                    self.stats[rank] = std::fs::File::open(format!("/proc/{pid}/stat")).ok();
                }
            }
            let Some(stat) = &self.stats[rank] else { continue };
            if control.state(rank) != RankState::Running || !is_exiting(stat) {
                continue;
            }
            if control.mark_died(rank, -1) == Some(RankState::Running) {
                control.fail(rank, &format!("rank {rank} {}", describe_status(-1)));
            }
        }
    }
}

/// Whether the process whose `/proc/<pid>/stat` this is has begun to exit (false once it is
/// gone: the file then reads nothing).
fn is_exiting(stat: &std::fs::File) -> bool {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 512];
    let Ok(len) = stat.read_at(&mut buf, 0) else { return false };
    stat_flags(&buf[..len]).is_some_and(|flags| flags & PF_EXITING != 0)
}

/// Field 9 (flags) of a `/proc/<pid>/stat` line: the seventh after the command, which may hold
/// spaces and parentheses, so counted from the last `)`.
fn stat_flags(line: &[u8]) -> Option<u64> {
    let after = line.iter().rposition(|&b| b == b')')? + 1;
    let rest = std::str::from_utf8(&line[after..]).ok()?;
    rest.split_ascii_whitespace().nth(6)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flags_of_a_stat_line_are_read_after_the_command() {
        let line = b"4242 (a (b) c) S 1 4242 4242 0 -1 4194564 120 0 0 0 1 2 0 0 20 0 1 0 5\n";
        assert_eq!(stat_flags(line), Some(4_194_564));
        assert_eq!(stat_flags(line).map(|f| f & PF_EXITING != 0), Some(true));
        assert_eq!(stat_flags(b"4242 (x) R 1 2 3 0 -1 4194560 0"), Some(4_194_560));
        assert_eq!(stat_flags(b"garbage"), None);
        // This process is running, not exiting.
        let own = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(!is_exiting(&own));
    }
}
