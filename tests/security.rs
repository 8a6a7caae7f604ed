//! The rendezvous of a process world, attacked as a local user would: with a second process (as
//! another user where the test can create one, as root with `useradd`; otherwise that part is
//! skipped and says why), through the public API and the raw protocol.
//!
//! Every test re-executes this binary: the victims are the ranks of a job (launched with the
//! variables of our own launcher, torchrun, mpirun or Slurm), the attacker is a process of its
//! own. What must hold: every attack is refused or detected; the victim job either completes
//! with correct results or fails cleanly naming the cause, never `Ok` on wrong data.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dist_tensor::collectives;
use dist_tensor::shmem::job_env::{JOB_ID_ENV, JOIN_TIMEOUT_ENV, LAUNCH_ID_ENV};
use dist_tensor::shmem::{WAIT_TIMEOUT_ENV, WaitCmp, WaitSem};
use dist_tensor::{Tensor, World};

mod common;

const N: usize = 4;
/// Every child is killed past this: a hang fails the test instead of hanging CI.
const CHILD_TIMEOUT: Duration = Duration::from_secs(60);
/// The rendezvous protocol's first word (version 2), for the raw attacks.
const MAGIC: u64 = 0x6474_6a6f_696e_0002;

/// Every launcher's variables: a child gets only those a test gives it.
const LAUNCH_VARS: [&str; 26] = [
    "DIST_TENSOR_RANK",
    "DIST_TENSOR_WORLD_SIZE",
    "DIST_TENSOR_LOCAL_RANK",
    "DIST_TENSOR_LOCAL_WORLD_SIZE",
    "DIST_TENSOR_JOB_ID",
    "DIST_TENSOR_LAUNCH_ID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_MCA_orte_precondition_transports",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PMIX_NAMESPACE",
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
];

// ---- the victim -------------------------------------------------------------------------------

/// This rank's number before it joins, from whichever launcher's variable is set.
fn rank_from_env() -> usize {
    ["DIST_TENSOR_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn inputs(rank: usize) -> (Vec<f64>, Vec<f64>) {
    let x = (0..7).map(|i| ((rank * 37 + i * 11) % 23) as f64 / 3.0 - 2.5).collect();
    (x, vec![rank as f64 * 3.0 + 0.25])
}

/// What a victim prints on success: its all_reduce and all_gather results.
fn expected(n: usize) -> String {
    let mut sum = vec![0.0f64; 7];
    let mut gathered = Vec::new();
    for r in 0..n {
        let (x, g) = inputs(r);
        for (s, v) in sum.iter_mut().zip(x) {
            *s += v;
        }
        gathered.extend(g);
    }
    format!("{sum:?}|{gathered:?}")
}

/// A rank of the victim job: joins (rank `DELAY_RANK` after `DELAY_MS`), runs an all_reduce and
/// an all_gather, prints `RESULT <what it got>` or `ERROR <error>`.
fn victim() {
    let me = rank_from_env();
    if std::env::var("DELAY_RANK").ok().and_then(|r| r.parse().ok()) == Some(me) {
        let ms = std::env::var("DELAY_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
        std::thread::sleep(Duration::from_millis(ms));
    }
    let out = World::from_env().and_then(|world| {
        world.run(|rank| {
            let (x, g) = inputs(rank.rank());
            let sum = collectives::all_reduce(rank, &x)?;
            let gathered = collectives::all_gather(rank, &g)?;
            Ok(format!("{sum:?}|{gathered:?}"))
        })
    });
    match out {
        Ok(v) => println!("RESULT {}", v[0]),
        Err(e) => println!("ERROR {e}"),
    }
}

// ---- launching --------------------------------------------------------------------------------

/// One process this test started, and what it printed.
struct Ended {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Ended {
    fn printed(&self, tag: &str) -> Option<String> {
        let prefix = format!("{tag} ");
        self.stdout.lines().find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
    }
}

/// Starts this binary running test `name` in role `role`, with `env`, as `user` (uid, gid, the
/// binary's copy it can read) if given.
fn start(name: &str, role: &str, env: &[(String, String)], user: Option<&User>) -> Child {
    let exe = match user {
        Some(u) => u.exe.clone(),
        None => std::env::current_exe().unwrap(),
    };
    let mut command = Command::new(exe);
    command
        .args([name, "--exact", "--nocapture", "--test-threads=1", "-q"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in LAUNCH_VARS {
        command.env_remove(var);
    }
    command.env("SEC_ROLE", role).envs(env.iter().map(|(k, v)| (k, v)));
    if let Some(u) = user {
        command.uid(u.uid).gid(u.gid).current_dir("/");
    }
    // A copy just written may be briefly "busy": a child another test thread forked meanwhile
    // holds the writing fd until it execs.
    for _ in 0..100 {
        match command.spawn() {
            Err(e) if e.raw_os_error() == Some(26) => std::thread::sleep(Duration::from_millis(20)),
            spawned => return spawned.unwrap(),
        }
    }
    panic!("the attacker's copy of this binary stayed busy")
}

/// Waits for `children` (killing any still running after [`CHILD_TIMEOUT`]).
fn finish(children: Vec<Child>) -> Vec<Ended> {
    let deadline = Instant::now() + CHILD_TIMEOUT;
    let readers: Vec<_> = children
        .into_iter()
        .map(|mut child| {
            let o = common::jobs::read_on_thread(child.stdout.take().unwrap());
            let e = common::jobs::read_on_thread(child.stderr.take().unwrap());
            (child, o, e)
        })
        .collect();
    readers
        .into_iter()
        .map(|(mut child, o, e)| {
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break child.wait().unwrap();
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            Ended { ok: status.success(), stdout: o.join().unwrap(), stderr: e.join().unwrap() }
        })
        .collect()
}

/// Starts the `n` victim ranks of test `name`: rank `r` gets `common` and `per_rank(r)`.
fn victims(
    name: &str,
    n: usize,
    common: &[(&str, &str)],
    per_rank: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<Child> {
    (0..n)
        .map(|r| {
            let mut env: Vec<(String, String)> =
                common.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            env.extend(per_rank(r));
            start(name, "victim", &env, None)
        })
        .collect()
}

fn ours(r: usize, n: usize) -> Vec<(String, String)> {
    vec![
        ("DIST_TENSOR_RANK".into(), r.to_string()),
        ("DIST_TENSOR_WORLD_SIZE".into(), n.to_string()),
    ]
}

/// A fresh value nobody else uses.
fn fresh(tag: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    format!("{tag}-{}-{}", std::process::id(), nanos.as_nanos())
}

/// Every victim either printed the right result or an error; returns the errors.
fn no_wrong_result(ended: &[Ended], n: usize) -> Vec<String> {
    let want = expected(n);
    let mut errors = Vec::new();
    for (r, e) in ended.iter().enumerate() {
        match (e.printed("RESULT"), e.printed("ERROR")) {
            (Some(got), _) => assert_eq!(got, want, "rank {r} returned Ok on wrong data"),
            (None, Some(err)) => errors.push(err),
            (None, None) => panic!("rank {r} printed nothing:\n{}\n{}", e.stdout, e.stderr),
        }
    }
    errors
}

fn all_correct(ended: &[Ended], n: usize) {
    let want = expected(n);
    for (r, e) in ended.iter().enumerate() {
        assert_eq!(
            e.printed("RESULT"),
            Some(want.clone()),
            "rank {r}:\n{}\n{}",
            e.stdout,
            e.stderr
        );
        assert!(e.ok, "rank {r}");
    }
}

// ---- another user -----------------------------------------------------------------------------

/// A second local account for the attacker, and a copy of this binary it may run.
struct User {
    uid: u32,
    gid: u32,
    exe: std::path::PathBuf,
    dir: std::path::PathBuf,
}

impl Drop for User {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The attacker's account, made with `useradd` (as root); `Err` says why there is none.
fn other_user(test: &str) -> Result<User, String> {
    use std::os::unix::fs::PermissionsExt;
    if rustix::process::geteuid().as_raw() != 0 {
        return Err("not root: cannot create a second user to attack from".into());
    }
    let name = "dtsec-attacker";
    let made = Command::new("useradd")
        .args(["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name])
        .output();
    match made {
        Ok(out) if out.status.success() || out.status.code() == Some(9) => {} // 9: it exists
        Ok(out) => return Err(format!("useradd failed: {}", String::from_utf8_lossy(&out.stderr))),
        Err(e) => return Err(format!("no useradd: {e}")),
    }
    let id = |flag: &str| -> Result<u32, String> {
        let out = Command::new("id").args([flag, name]).output().map_err(|e| e.to_string())?;
        String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|e| format!("id {flag}: {e}"))
    };
    let (uid, gid) = (id("-u")?, id("-g")?);
    // The test binary may sit under a directory the other user cannot enter: a readable copy.
    let dir = std::env::temp_dir().join(fresh(&format!("dtsec-{test}")));
    std::fs::create_dir(&dir).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| e.to_string())?;
    let exe = dir.join("attacker");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| e.to_string())?;
    Ok(User { uid, gid, exe, dir })
}

fn skip(test: &str, why: &str) {
    eprintln!("SKIPPED {test}: {why}");
}

// ---- attacker roles ---------------------------------------------------------------------------

/// Binds the rendezvous name `SEC_NAME` first and holds it for `SEC_HOLD_MS`, answering every
/// connection with a forged welcome; prints `SQUATTING` once bound and `CONNECTION k` on each.
fn squatter() {
    let name = std::env::var("SEC_NAME").unwrap();
    let hold: u64 = std::env::var("SEC_HOLD_MS").unwrap().parse().unwrap();
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = UnixListener::bind_addr(&addr).unwrap();
    println!("SQUATTING");
    std::io::stdout().flush().unwrap();
    listener.set_nonblocking(true).unwrap();
    let end = Instant::now() + Duration::from_millis(hold);
    let mut served = 0;
    while Instant::now() < end {
        match listener.accept() {
            Ok((mut s, _)) => {
                served += 1;
                println!("CONNECTION {served}");
                std::io::stdout().flush().unwrap();
                let forged: Vec<u8> = [MAGIC, 0, 1 << 20, 1 << 21, 3_600_000, 0]
                    .iter()
                    .flat_map(|w: &u64| w.to_le_bytes())
                    .collect();
                let _ = s.write_all(&forged);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    println!("SERVED {served}");
}

fn hello(rank: u64, size: u64, pid: u64, launch: u64) -> Vec<u8> {
    [MAGIC, rank, size, pid, launch].iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Connects to `SEC_NAME` as soon as it listens and sends what no rank would: garbage, nothing,
/// hellos with each field out of range, forged pids, another launch, an oversized message, and
/// more connections than rank 0 keeps waiting. Prints `ATTACKED <count>`.
fn raw_attacker() {
    let name = std::env::var("SEC_NAME").unwrap();
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let connect = || loop {
        if let Ok(s) = UnixStream::connect_addr(&addr) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let pid = u64::from(std::process::id());
    let mut attacks: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.0\r\n\r\n".to_vec(),
        vec![0xff; 40],
        hello(3, 1 << 62, pid, 0),
        hello(99, 4, pid, 0),
        hello(0, 4, pid, 0),
        hello(3, 4, 1, 0),
        hello(3, 4, 0, 0),
        hello(3, 4, pid, 0x1234), // a well-formed rank of another launch
        vec![0x5a; 1 << 20],
    ];
    let mut half = hello(3, 4, pid, 0);
    half.truncate(20);
    attacks.push(half);
    let mut held = Vec::new();
    for bytes in &attacks {
        let mut s = connect();
        s.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
        let _ = s.write_all(bytes);
        held.push(s);
    }
    // Then a flood of silent connections, more than rank 0 lets wait.
    std::thread::sleep(Duration::from_millis(200));
    let silent: Vec<UnixStream> = (0..300).map(|_| connect()).collect();
    println!("ATTACKED {}", attacks.len() + silent.len());
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_millis(3000));
    drop(silent);
    drop(held);
}

/// Listens on `SEC_NAME` as a forged rank 0 of the victims' own user: answers each hello with
/// the forgery `SEC_FORGE` names.
fn fake_host() {
    let name = std::env::var("SEC_NAME").unwrap();
    let forge = std::env::var("SEC_FORGE").unwrap();
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = UnixListener::bind_addr(&addr).unwrap();
    println!("LISTENING");
    std::io::stdout().flush().unwrap();
    for _ in 1..N {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 40];
        s.read_exact(&mut hello).unwrap();
        let launch = u64::from_le_bytes(hello[32..40].try_into().unwrap());
        let words: Vec<u64> = match forge.as_str() {
            "magic" => vec![0xdead_beef, 0, 0, 0, 0, launch],
            "status" => vec![MAGIC, 77, 0, 0, 0, launch],
            "capacity" => vec![MAGIC, 0, 18_446_742_974_198_972_416, 1 << 21, 3_600_000, launch],
            "launch" => vec![MAGIC, 0, 1 << 20, 0, 1000, launch ^ 1],
            _ => vec![MAGIC],
        };
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let _ = s.write_all(&bytes);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A rank that stops itself (`SIGSTOP`) when it is rank `STOP_RANK`; the others wait for it in
/// a collective call (`STOP_MODE=call`) or on a signal (`signal`).
fn stopper() {
    let stop: usize = std::env::var("STOP_RANK").unwrap().parse().unwrap();
    let mode = std::env::var("STOP_MODE").unwrap();
    let out = World::from_env().and_then(|world| {
        world.run(|rank| {
            let sigs = rank.alloc_signals(1)?;
            if rank.rank() == stop {
                let me = rustix::process::getpid();
                rustix::process::kill_process(me, rustix::process::Signal::STOP).unwrap();
            }
            if mode == "call" {
                collectives::all_gather(rank, &[1.0f32]).map(drop)
            } else {
                rank.wait(&sigs, 0, WaitCmp::Ge(1), WaitSem::Acquire).map(drop)
            }
        })
    });
    match out {
        Ok(_) => println!("RESULT ok"),
        Err(e) => println!("ERROR {e}"),
    }
}

/// Runs this process's role if it is a child; returns whether it was one.
fn child_role() -> bool {
    match std::env::var("SEC_ROLE").as_deref() {
        Ok("victim") => victim(),
        Ok("squat") => squatter(),
        Ok("raw") => raw_attacker(),
        Ok("fake-host") => fake_host(),
        Ok("stopper") => stopper(),
        Ok(other) => panic!("unknown role {other}"),
        Err(_) => return false,
    }
    true
}

/// Reads `child`'s standard output up to the line `line` (so the attack is in place before the
/// victims start); returns the reader to keep it draining.
fn wait_for_line(child: &mut Child, line: &str) -> std::thread::JoinHandle<String> {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "the attacker ended before {line}: {seen}");
        seen.push_str(&l);
        if l.trim() == line || l.starts_with(line) {
            break;
        }
    }
    std::thread::spawn(move || {
        let mut rest = seen;
        let _ = out.read_to_string(&mut rest);
        rest
    })
}

/// Ends `child` (the victims are done with it) and returns what it printed.
fn end_attacker(mut child: Child, out: std::thread::JoinHandle<String>) -> String {
    let _ = child.kill();
    attacker_output(child, out)
}

fn attacker_output(mut child: Child, out: std::thread::JoinHandle<String>) -> String {
    let deadline = Instant::now() + CHILD_TIMEOUT;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    format!("{}{err}", out.join().unwrap())
}

// ---- hole 1: another user joins a running job -------------------------------------------------

#[test]
fn a_process_of_another_user_cannot_join_a_running_job() {
    const NAME: &str = "a_process_of_another_user_cannot_join_a_running_job";
    if child_role() {
        return;
    }
    let user = match other_user("join") {
        Ok(user) => user,
        Err(why) => return skip(NAME, &why),
    };
    let job = fresh("join");
    let launch = fresh("launch");
    let common = [
        (JOB_ID_ENV, job.as_str()),
        (LAUNCH_ID_ENV, launch.as_str()),
        (JOIN_TIMEOUT_ENV, "20000"),
        ("DELAY_RANK", "3"),
        ("DELAY_MS", "1500"),
    ];
    // The real rank 3 starts 1.5 s late; the attacker, of another uid but knowing every variable
    // of the job (its id, its launch id), joins at once as rank 3, over and over.
    let ranks = victims(NAME, N, &common, |r| ours(r, N));
    let mut env: Vec<(String, String)> =
        common.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    env.retain(|(k, _)| k != "DELAY_RANK");
    env.extend(ours(3, N));
    let attackers: Vec<Child> = (0..4).map(|_| start(NAME, "victim", &env, Some(&user))).collect();
    let ended = finish(ranks);
    let attacked = finish(attackers);
    all_correct(&ended, N);
    for a in &attacked {
        assert!(a.printed("RESULT").is_none(), "the other user joined: {}", a.stdout);
        assert!(a.printed("ERROR").is_some(), "{}\n{}", a.stdout, a.stderr);
    }
    let log = &ended[0].stderr;
    assert!(log.contains(&format!("uid {}: another user", user.uid)), "rank 0 logged: {log}");
}

// ---- hole 2: another user binds a predictable job id first ------------------------------------

/// Squats the rendezvous name of job id `id` as another user, starts the victims with
/// `per_rank`, and checks that every victim fails naming the squatter, none with `Ok`.
fn squatted(name: &str, user: &User, id: &str, per_rank: impl Fn(usize) -> Vec<(String, String)>) {
    let env = vec![
        ("SEC_NAME".to_string(), format!("dist-tensor/{id}")),
        ("SEC_HOLD_MS".to_string(), "30000".to_string()),
    ];
    let mut squatter = start(name, "squat", &env, Some(user));
    let out = wait_for_line(&mut squatter, "SQUATTING");
    let ranks = victims(name, N, &[(JOIN_TIMEOUT_ENV, "3000")], per_rank);
    let ended = finish(ranks);
    let squat = end_attacker(squatter, out);
    let errors = no_wrong_result(&ended, N);
    assert_eq!(errors.len(), N, "every rank must fail while another user holds the name");
    for (r, err) in errors.iter().enumerate() {
        assert!(
            err.contains(&format!("(uid {})", user.uid)) && err.contains("another user"),
            "rank {r} of {id}: {err}\nsquatter: {squat}"
        );
    }
}

#[test]
#[cfg_attr(
    feature = "mpi",
    ignore = "with feature mpi, the mpirun variables this test sets by hand start MPI itself (a singleton \
              world of one rank); the default build runs it"
)]
fn a_squatter_of_another_user_on_a_predictable_job_id_is_refused_by_every_rank() {
    const NAME: &str =
        "a_squatter_of_another_user_on_a_predictable_job_id_is_refused_by_every_rank";
    if child_role() {
        return;
    }
    let user = match other_user("squat") {
        Ok(user) => user,
        Err(why) => return skip(NAME, &why),
    };
    let port = (20000 + std::process::id() % 20000).to_string();
    // torchrun's id from its master address and default run id.
    let torch = |r: usize| -> Vec<(String, String)> {
        [
            ("RANK", r.to_string()),
            ("WORLD_SIZE", N.to_string()),
            ("MASTER_ADDR", "localhost".into()),
            ("MASTER_PORT", port.clone()),
            ("TORCHELASTIC_RUN_ID", "none".into()),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    };
    squatted(NAME, &user, &format!("torch:none:localhost:{port}.0"), torch);
    // mpirun's namespace, which follows from mpirun's pid, without mpirun's key.
    let ns = format!("prterun-host-{}@1", std::process::id());
    let pmix = |r: usize| -> Vec<(String, String)> {
        [
            ("OMPI_COMM_WORLD_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_SIZE", N.to_string()),
            ("PMIX_NAMESPACE", ns.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    };
    squatted(NAME, &user, &format!("pmix:{ns}"), pmix);
    // Slurm's job and step.
    let slurm = |r: usize| -> Vec<(String, String)> {
        [
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", N.to_string()),
            ("SLURM_JOB_ID", "4242".into()),
            ("SLURM_STEP_ID", "0".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    };
    squatted(NAME, &user, "slurm:4242.0", slurm);
}

#[test]
#[cfg_attr(
    feature = "mpi",
    ignore = "with feature mpi, the mpirun variables this test sets by hand start MPI itself (a singleton \
              world of one rank); the default build runs it"
)]
fn mpiruns_key_makes_the_namespace_unguessable_so_the_squatter_misses() {
    const NAME: &str = "mpiruns_key_makes_the_namespace_unguessable_so_the_squatter_misses";
    if child_role() {
        return;
    }
    let user = match other_user("key") {
        Ok(user) => user,
        Err(why) => return skip(NAME, &why),
    };
    let ns = format!("prterun-host-{}@2", std::process::id());
    let env = vec![
        ("SEC_NAME".to_string(), format!("dist-tensor/pmix:{ns}")),
        ("SEC_HOLD_MS".to_string(), "30000".to_string()),
    ];
    let mut squatter = start(NAME, "squat", &env, Some(&user));
    let out = wait_for_line(&mut squatter, "SQUATTING");
    let key = format!("{:016x}-{:016x}", std::process::id(), 0x5eed_u64);
    let ranks = victims(NAME, N, &[(JOIN_TIMEOUT_ENV, "10000")], |r| {
        vec![
            ("OMPI_COMM_WORLD_RANK".into(), r.to_string()),
            ("OMPI_COMM_WORLD_SIZE".into(), N.to_string()),
            ("PMIX_NAMESPACE".into(), ns.clone()),
            ("OMPI_MCA_orte_precondition_transports".into(), key.clone()),
        ]
    });
    let ended = finish(ranks);
    let squat = end_attacker(squatter, out);
    all_correct(&ended, N);
    assert!(!squat.contains("CONNECTION"), "a rank reached the squatter: {squat}");
}

// ---- holes 3 and 6: a forged rank 0 (of the victims' own user) --------------------------------

#[test]
fn forged_answers_of_a_fake_rank_0_are_refused_naming_the_field() {
    const NAME: &str = "forged_answers_of_a_fake_rank_0_are_refused_naming_the_field";
    if child_role() {
        return;
    }
    for (forge, field) in [
        ("magic", "sent a bad magic"),
        ("status", "sent a bad status"),
        // The capacity a reserved part larger than the capacity once wrapped to, with a 3600 s
        // wait: what the victims have is not what rank 0 says, and nothing of it is used.
        ("capacity", "sent a bad capacity"),
        ("launch", "another launch"),
        ("short", "did not let rank"),
    ] {
        let job = fresh("forge");
        let env = vec![
            ("SEC_NAME".to_string(), format!("dist-tensor/own:{job}")),
            ("SEC_FORGE".to_string(), forge.to_string()),
        ];
        let mut host = start(NAME, "fake-host", &env, None);
        let out = wait_for_line(&mut host, "LISTENING");
        let common = [(JOB_ID_ENV, job.as_str()), (JOIN_TIMEOUT_ENV, "3000")];
        let ranks: Vec<Child> =
            (1..N).map(|r| victims(NAME, 1, &common, |_| ours(r, N)).remove(0)).collect();
        let ended = finish(ranks);
        let _ = attacker_output(host, out);
        for (r, e) in ended.iter().enumerate() {
            assert!(e.printed("RESULT").is_none(), "rank {} took a forged rank 0", r + 1);
            let err = e.printed("ERROR").unwrap_or_default();
            assert!(err.contains(field), "forgery {forge}: rank {}: {err}\n{}", r + 1, e.stderr);
        }
    }
}

// ---- hole 5: garbage, silence, oversized and forged clients -----------------------------------

#[test]
fn raw_clients_sending_garbage_or_nothing_do_not_break_start_up() {
    const NAME: &str = "raw_clients_sending_garbage_or_nothing_do_not_break_start_up";
    if child_role() {
        return;
    }
    let job = fresh("raw");
    let env = vec![("SEC_NAME".to_string(), format!("dist-tensor/own:{job}"))];
    let mut attacker = start(NAME, "raw", &env, None);
    let common = [
        (JOB_ID_ENV, job.as_str()),
        (JOIN_TIMEOUT_ENV, "20000"),
        ("DELAY_RANK", "3"),
        ("DELAY_MS", "1500"),
    ];
    let start_at = Instant::now();
    let ranks = victims(NAME, N, &common, |r| ours(r, N));
    let out = wait_for_line(&mut attacker, "ATTACKED");
    let ended = finish(ranks);
    let took = start_at.elapsed();
    let attack = attacker_output(attacker, out);
    all_correct(&ended, N);
    let log = &ended[0].stderr;
    for refusal in [
        "bad magic",
        "bad world_size: 4611686018427387904 is not in",
        "bad rank: 99 is not in 1..4",
        "bad rank: 0 is not in 1..4",
        "bad pid: 0 is not a process id",
        "its hello claims pid 1",
        "another launch",
    ] {
        assert!(log.contains(refusal), "{refusal:?} not refused: {log}\nattacker: {attack}");
    }
    assert!(took < Duration::from_secs(15), "start-up took {took:?}");
}

// ---- hole 4: two launches with one explicit job id --------------------------------------------

#[test]
fn two_launches_with_one_job_id_never_mix() {
    const NAME: &str = "two_launches_with_one_job_id_never_mix";
    if child_role() {
        return;
    }
    for round in 0..3 {
        let job = fresh("dup");
        let launch = |tag: &str, n: usize| {
            let launch_id = fresh(tag);
            let common = [
                (JOB_ID_ENV, job.as_str()),
                (LAUNCH_ID_ENV, launch_id.as_str()),
                (JOIN_TIMEOUT_ENV, "3000"),
                ("DELAY_RANK", "3"),
                ("DELAY_MS", "300"),
            ];
            victims(NAME, n, &common, |r| ours(r, n))
        };
        // Same size, then different sizes (as each launch's late rank 3 may join the other).
        let (na, nb) = if round == 2 { (N, N + 1) } else { (N, N) };
        let a = launch("a", na);
        let b = launch("b", nb);
        let (a, b) = (finish(a), finish(b));
        let errors_a = no_wrong_result(&a, na);
        let errors_b = no_wrong_result(&b, nb);
        let all: Vec<&String> = errors_a.iter().chain(&errors_b).collect();
        assert!(!all.is_empty(), "both launches cannot have joined one rendezvous");
        assert!(
            all.iter().any(|e| e.contains("another launch") || e.contains("is in use")),
            "the reuse was not named: {all:#?}"
        );
    }
}

// ---- hole 7: hostile numbers ------------------------------------------------------------------

#[test]
fn hostile_sizes_are_errors_with_short_messages_not_panics() {
    const NAME: &str = "hostile_sizes_are_errors_with_short_messages_not_panics";
    if child_role() {
        return;
    }
    for size in [(1u64 << 62).to_string(), "10000000".into(), u64::MAX.to_string()] {
        let ranks = victims(NAME, 1, &[], |_| {
            vec![
                ("DIST_TENSOR_RANK".into(), "0".into()),
                ("DIST_TENSOR_WORLD_SIZE".into(), size.clone()),
                (JOB_ID_ENV.into(), fresh("size")),
            ]
        });
        let ended = finish(ranks);
        let err = ended[0].printed("ERROR").unwrap_or_else(|| panic!("{}", ended[0].stderr));
        assert!(err.contains("more ranks than"), "{err}");
        assert!(err.len() < 300, "{} bytes", err.len());
    }
    let err = Tensor::<f32>::try_zeros(&[1 << 40, 0, 1 << 30]).unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");
    assert_eq!(Tensor::<f32>::try_zeros(&[1 << 20, 0, 1 << 20]).unwrap().len(), 0);
}

// ---- a clearer failure: a stopped rank is named ----------------------------------------------

#[test]
fn a_stopped_rank_is_named_when_its_peers_time_out() {
    const NAME: &str = "a_stopped_rank_is_named_when_its_peers_time_out";
    if child_role() {
        return;
    }
    for (mode, stop) in [("call", 2usize), ("signal", 1)] {
        let job = fresh("stop");
        let mut ranks: Vec<Option<Child>> = (0..3)
            .map(|r| {
                let mut env = ours(r, 3);
                for (k, v) in [
                    (JOB_ID_ENV, job.as_str()),
                    (WAIT_TIMEOUT_ENV, "500"),
                    ("STOP_RANK", &stop.to_string()),
                    ("STOP_MODE", mode),
                ] {
                    env.push((k.to_string(), v.to_string()));
                }
                Some(start(NAME, "stopper", &env, None))
            })
            .collect();
        // The others end on their own; then the stopped one is killed.
        let others: Vec<Child> =
            (0..3).filter(|&r| r != stop).map(|r| ranks[r].take().unwrap()).collect();
        let ended = finish(others);
        let mut stopped = ranks[stop].take().unwrap();
        let _ = stopped.kill();
        let _ = stopped.wait();
        for e in &ended {
            let err = e.printed("ERROR").unwrap_or_else(|| panic!("{}\n{}", e.stdout, e.stderr));
            assert!(
                err.contains(&format!("rank {stop} is stopped (pid {}", stopped.id())),
                "{mode}: {err}"
            );
        }
    }
}
