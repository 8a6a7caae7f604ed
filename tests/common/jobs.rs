//! Jobs of processes for the tests that re-execute their own test binary as the ranks of a job
//! (`World::local_job`, the test's own name as the filter): in a child `World::launched()` is
//! true and the test body is one rank, which prints `RESULT <text>` or `ERROR <error>`; the test
//! itself starts the job, bounds every child by a timeout (a hang fails the test, it does not
//! hang CI) and reads what each rank printed.

use std::io::Read;
use std::thread::JoinHandle;
use std::time::Duration;

use dist_tensor::World;
use dist_tensor::shmem::RankExit;

/// Every child is killed past this: a hang fails the test.
pub const CHILD_TIMEOUT: Duration = Duration::from_secs(120);

/// The arguments that run only test `name` of this binary, its output not captured.
pub fn test_args(name: &str) -> [&str; 5] {
    [name, "--exact", "--nocapture", "--test-threads=1", "-q"]
}

/// In a rank (a child of [`run_job`]): joins the job, runs `body`, prints `RESULT <text>` or
/// `ERROR <error>`, and returns true. In the test itself: returns false.
pub fn in_rank(body: impl FnOnce(World) -> dist_tensor::Result<String>) -> bool {
    if !World::launched() {
        return false;
    }
    match World::from_env().and_then(body) {
        Ok(text) => println!("RESULT {text}"),
        Err(err) => println!("ERROR {err}"),
    }
    true
}

/// Runs test `name` as `n` ranks with extra `env`; checks that no rank hung and that no process
/// of the job is left.
pub fn run_job(name: &str, n: usize, env: &[(&str, &str)]) -> Vec<RankExit> {
    let mut job = World::local_job(n).args(test_args(name)).timeout(CHILD_TIMEOUT);
    for (key, value) in env {
        job = job.env(key, value);
    }
    let exits = job.run().unwrap();
    for exit in &exits {
        assert!(!exit.timed_out, "rank {} hung: {}", exit.rank, exit.stderr_text());
        assert!(
            !std::path::Path::new(&format!("/proc/{}", exit.pid)).exists(),
            "rank {}'s process {} is left",
            exit.rank,
            exit.pid
        );
    }
    exits
}

/// What rank `exit` printed after `tag` (`RESULT` or `ERROR`).
pub fn printed(exit: &RankExit, tag: &str) -> Option<String> {
    let prefix = format!("{tag} ");
    exit.stdout_text().lines().find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
}

/// What rank `exit` printed as its `RESULT`; panics, with everything it printed, if nothing.
pub fn result(exit: &RankExit) -> String {
    printed(exit, "RESULT").unwrap_or_else(|| {
        panic!(
            "rank {} ({}) printed no result:\n{}\n{}",
            exit.rank,
            exit.describe(),
            exit.stdout_text(),
            exit.stderr_text()
        )
    })
}

/// Reads `pipe` (a child's stdout or stderr) to its end on a thread of its own, so that a full
/// pipe never blocks the child while the test waits for it: join the thread for the text.
pub fn read_on_thread(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        s
    })
}

/// Ends this process with SIGKILL, as a rank that dies without a word: a fault the tests inject.
pub fn kill_self() -> ! {
    let me = rustix::process::getpid();
    rustix::process::kill_process(me, rustix::process::Signal::KILL).unwrap();
    unreachable!("killed")
}
