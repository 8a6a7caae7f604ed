//! [`LocalJob`]: this program re-executed as the ranks of a job on this host, for examples and
//! tests. No launcher of our own beyond this: real jobs use mpirun, torchrun or Slurm.

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::job_env::{
    JOB_ID_ENV, LAUNCH_ID_ENV, LAUNCHER_VARS, LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV, RANK_ENV,
    WORLD_SIZE_ENV,
};
use crate::{Error, Result};

/// How one rank's process ended, and what it printed.
///
/// # Examples
/// ```no_run
/// use dist_tensor::World;
/// for exit in World::spawn_local(2)? {
///     assert!(exit.success(), "rank {}: {}", exit.rank, exit.stderr_text());
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RankExit {
    /// The rank.
    pub rank: usize,
    /// Its process id (reaped: no such process is left).
    pub pid: u32,
    /// Its exit status.
    pub status: ExitStatus,
    /// Whether it was killed for running past the job's timeout.
    pub timed_out: bool,
    /// What it wrote to its standard output.
    pub stdout: Vec<u8>,
    /// What it wrote to its standard error.
    pub stderr: Vec<u8>,
}

impl RankExit {
    /// Whether the process exited with status 0 in time.
    pub fn success(&self) -> bool {
        self.status.success() && !self.timed_out
    }

    /// Its standard output as text.
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Its standard error as text.
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    /// How it ended, in words: `exited with status 0`, `killed by signal 9`, `timed out`.
    pub fn describe(&self) -> String {
        if self.timed_out {
            "timed out (killed)".into()
        } else if let Some(code) = self.status.code() {
            format!("exited with status {code}")
        } else {
            format!("killed by signal {}", self.status.signal().unwrap_or(0))
        }
    }
}

/// This program, re-executed as the `n` ranks of a job on this host: each child gets the
/// `DIST_TENSOR_*` variables (rank, world size, a fresh job id) and joins through
/// [`World::from_env`](crate::World::from_env). Children die with the thread that started them
/// (`PR_SET_PDEATHSIG`); [`LocalJob::run`] waits for every one, so none is left behind.
///
/// # Examples
/// ```no_run
/// use std::time::Duration;
/// use dist_tensor::World;
///
/// if World::launched() {
///     // A child: one rank.
///     let world = World::from_env()?;
///     world.run(|rank| rank.barrier_all().map(drop))?;
/// } else {
///     let exits = World::local_job(4).timeout(Duration::from_secs(60)).run()?;
///     assert!(exits.iter().all(|e| e.success()));
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LocalJob {
    ranks: usize,
    args: Option<Vec<OsString>>,
    envs: Vec<(OsString, OsString)>,
    timeout: Option<Duration>,
}

impl LocalJob {
    pub(crate) fn new(ranks: usize) -> LocalJob {
        LocalJob { ranks, args: None, envs: Vec::new(), timeout: None }
    }

    /// The children's arguments (default: this process's own; inside a `#[test]` of a cargo test
    /// binary, that test alone, so that each child re-runs only it).
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args = Some(args.into_iter().map(Into::into).collect());
        self
    }

    /// One more environment variable for every child.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// Kills every child still running after `timeout` (they are then reported as timed out):
    /// a hang fails instead of lasting for ever.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Starts the ranks and waits for all of them; returns how each ended, in rank order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero ranks; [`Error::System`] when a child cannot be started
    /// (the ones already started are killed and reaped first).
    pub fn run(self) -> Result<Vec<RankExit>> {
        let n = self.ranks;
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: "World::spawn_local",
                rank: 0,
                reason: "a job needs at least one rank".into(),
            });
        }
        let system = |rank: usize, what: &str, e: std::io::Error| Error::System {
            op: "World::spawn_local",
            rank,
            what: what.into(),
            source: Arc::new(e),
        };
        let exe = std::env::current_exe().map_err(|e| system(0, "finding this program", e))?;
        let args = self.args.unwrap_or_else(default_args);
        let job_id = fresh_job_id();
        let launch_id = format!("{:016x}", random_word());
        let parent = rustix::process::getpid();
        let mut children: Vec<(Child, Reader, Reader)> = Vec::with_capacity(n);
        for rank in 0..n {
            let mut command = Command::new(&exe);
            command.args(&args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            for var in LAUNCHER_VARS {
                command.env_remove(var);
            }
            command
                .env(RANK_ENV, rank.to_string())
                .env(WORLD_SIZE_ENV, n.to_string())
                .env(LOCAL_RANK_ENV, rank.to_string())
                .env(LOCAL_WORLD_SIZE_ENV, n.to_string())
                .env(JOB_ID_ENV, &job_id)
                .env(LAUNCH_ID_ENV, &launch_id)
                .envs(self.envs.iter().map(|(k, v)| (k, v)));
            // SAFETY: the closure runs in the child between fork and exec and makes only raw
            // system calls (prctl, getppid), which are async-signal-safe.
            unsafe {
                command.pre_exec(move || {
                    // Die with the parent; and if it is already gone, do not start at all.
                    rustix::process::set_parent_process_death_signal(Some(
                        rustix::process::Signal::KILL,
                    ))?;
                    if rustix::process::getppid() != Some(parent) {
                        return Err(std::io::Error::other("the parent is gone"));
                    }
                    Ok(())
                })
            };
            match command.spawn() {
                Ok(mut child) => {
                    let out = Reader::start(child.stdout.take());
                    let err = Reader::start(child.stderr.take());
                    children.push((child, out, err));
                }
                Err(e) => {
                    for (child, _, _) in &mut children {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                    return Err(system(rank, "starting the rank's process", e));
                }
            }
        }
        let deadline = self.timeout.and_then(|t| Instant::now().checked_add(t));
        let mut statuses: Vec<Option<(ExitStatus, bool)>> = vec![None; n];
        while statuses.iter().any(Option::is_none) {
            let late = deadline.is_some_and(|d| Instant::now() >= d);
            for (rank, (child, _, _)) in children.iter_mut().enumerate() {
                if statuses[rank].is_some() {
                    continue;
                }
                if late {
                    let _ = child.kill();
                    let status = child.wait().map_err(|e| system(rank, "reaping the rank", e))?;
                    statuses[rank] = Some((status, true));
                } else if let Some(status) =
                    child.try_wait().map_err(|e| system(rank, "waiting for the rank", e))?
                {
                    statuses[rank] = Some((status, false));
                }
            }
            if statuses.iter().any(Option::is_none) {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        Ok(children
            .into_iter()
            .zip(statuses)
            .enumerate()
            .map(|(rank, ((child, out, err), status))| {
                let (status, timed_out) = status.expect("every rank ended");
                RankExit {
                    rank,
                    pid: child.id(),
                    status,
                    timed_out,
                    stdout: out.finish(),
                    stderr: err.finish(),
                }
            })
            .collect())
    }
}

/// The children's arguments by default: this process's own; but inside a test of a libtest
/// harness (a test binary of `target/*/deps`, whose test threads are named after their tests),
/// that test alone, so that each child re-runs only the test that started it, not the suite.
fn default_args() -> Vec<OsString> {
    let thread = std::thread::current();
    match thread.name() {
        Some(test) if test != "main" && in_test_binary() => {
            [test, "--exact", "--nocapture", "--test-threads=1", "-q"]
                .iter()
                .map(OsString::from)
                .collect()
        }
        _ => std::env::args_os().skip(1).collect(),
    }
}

/// Whether this program is a test binary cargo built: `target/<profile>/deps/<name>-<hash>`.
fn in_test_binary() -> bool {
    let Ok(exe) = std::env::current_exe() else { return false };
    let in_deps = exe.parent().and_then(|d| d.file_name()).is_some_and(|d| d == "deps");
    let hashed = exe.file_name().and_then(|f| f.to_str()).is_some_and(|f| {
        f.rsplit_once('-')
            .is_some_and(|(_, h)| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
    });
    in_deps && hashed
}

/// Reads a child's pipe to its end on a thread of its own (so that a full pipe never blocks the
/// child).
struct Reader(Option<JoinHandle<Vec<u8>>>);

impl Reader {
    fn start(pipe: Option<impl Read + Send + 'static>) -> Reader {
        Reader(pipe.map(|mut pipe| {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                let _ = pipe.read_to_end(&mut bytes);
                bytes
            })
        }))
    }

    fn finish(self) -> Vec<u8> {
        self.0.and_then(|h| h.join().ok()).unwrap_or_default()
    }
}

/// A job id no other job on this host has, and no other user can guess before it is bound: this
/// process, a counter, the time and 64 random bits.
fn fresh_job_id() -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "spawn-{}-{}-{nanos}-{:016x}",
        std::process::id(),
        COUNT.fetch_add(1, Ordering::Relaxed),
        random_word()
    )
}

/// 64 random bits from the kernel (`/dev/urandom`); should it be unreadable, the time and a
/// stack address, which still differ between launches.
fn random_word() -> u64 {
    let mut bytes = [0u8; 8];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).is_ok() {
        return u64::from_le_bytes(bytes);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (&bytes as *const _ as u64).rotate_left(32)
}
