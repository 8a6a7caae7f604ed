//! Ranks that are processes of one host: the rendezvous that gives every process every rank's
//! heap segment and the shared control block, and the watch for peers that die.
//!
//! Rank 0 listens on an abstract Unix socket named from the job id (an abstract name is no file:
//! nothing is left behind). Every other rank connects and says who it is; rank 0 answers with
//! the world's settings and the control block's memfd; each rank creates its own segment as a
//! memfd and sends it; rank 0 hands every rank every segment. The fds travel with `SCM_RIGHTS`.
//! Each process then maps every segment (its table of peer bases) and the control block, and the
//! connections close. Memfds have no name either, so a crash leaves nothing in `/dev/shm` or
//! `/tmp`: the memory goes when the last process that maps it does.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use super::control::{Control, RankState, describe_status};
use super::heap::Heap;
use super::job_env::{JobEnv, MAX_WORLD_SIZE};
use super::mapping::Mapping;
use super::world::Settings;
use crate::{Error, Result};

const MAGIC: u64 = 0x6474_6a6f_696e_0002; // "dtjoin", version 2
/// Rank 0's answers to a hello.
const OK: u64 = 0;
/// Another rank's environment is inconsistent: the job fails (that rank's error says which).
const REFUSED: u64 = 1;
/// The joining process belongs to another launch that uses the same job id.
const OTHER_LAUNCH: u64 = 2;
/// Rank 0 could not read the hello.
const MALFORMED: u64 = 3;
/// Words of a hello: magic, rank, world size, pid, launch identity.
pub(crate) const HELLO_WORDS: usize = 5;
/// Words of rank 0's answer: magic, status, capacity, reserved bytes, wait timeout in ms, launch
/// identity.
pub(crate) const ANSWER_WORDS: usize = 6;
/// How long rank 0 waits for a connection's hello before it drops the connection (a process that
/// connects and says nothing does not hold up the real ranks meanwhile: hellos are read as they
/// come). Generous, as a real rank on a loaded host may be slow to send it.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// Most connections that may wait for their hello at once (beyond it, the oldest is dropped).
const MAX_PENDING: usize = 256;
/// How long a connection may wait for its hello before a newer one may take its place when the
/// waiting room is full.
const SILENT_AFTER: Duration = Duration::from_millis(100);
/// Connections rank 0 accepts before it reads the hellos that came.
const ACCEPTS_PER_ROUND: usize = 16;
/// Refusals rank 0 prints, and keeps for its time-out message; the rest are counted.
const REFUSALS_SHOWN: usize = 16;
/// How often a blocked waiter looks for dead peers.
const PEER_CHECK: Duration = Duration::from_millis(5);

/// Who meets in one rendezvous: the processes of one node, by local rank, and the global rank
/// each of them is in a world of `world_size` ranks (for a job of one host, every rank as itself).
#[derive(Debug, Clone)]
pub(crate) struct Members {
    pub(crate) world_size: usize,
    pub(crate) ranks: Vec<usize>,
}

impl Members {
    /// Every rank of a world of `n`, on one node.
    pub(crate) fn all(n: usize) -> Members {
        Members { world_size: n, ranks: (0..n).collect() }
    }
}

/// What a process learns when it joins its job.
pub(crate) struct Joined {
    pub(crate) heap: Heap,
    pub(crate) control: Control,
    pub(crate) settings: Settings,
    pub(crate) peers: PeerWatch,
}

fn system(rank: usize, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |e| Error::System { op: "World::from_env", rank, what, source: Arc::new(e) }
}

fn refused(reason: String) -> Error {
    Error::Environment { op: "World::from_env", reason }
}

/// A received field that is not acceptable: which, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadField {
    pub(crate) field: &'static str,
    pub(crate) reason: String,
}

fn bad(field: &'static str, reason: impl Into<String>) -> BadField {
    BadField { field, reason: reason.into() }
}

fn words_of(bytes: &[u8], count: usize) -> Result<Vec<u64>, BadField> {
    if bytes.len() != count * 8 {
        return Err(bad(
            "length",
            format!("{} bytes where {} were expected", bytes.len(), count * 8),
        ));
    }
    Ok(bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
}

fn check_magic(word: u64) -> Result<(), BadField> {
    if word == MAGIC {
        Ok(())
    } else {
        Err(bad(
            "magic",
            format!("{word:#018x}, not {MAGIC:#018x}: not a dist-tensor rank of this version"),
        ))
    }
}

/// What a joining rank tells rank 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) pid: u32,
    pub(crate) launch: u64,
}

impl Hello {
    pub(crate) fn encode(&self) -> Vec<u8> {
        [MAGIC, self.rank as u64, self.world_size as u64, u64::from(self.pid), self.launch]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    /// Reads a hello and checks every field on its own (the world size and launch against rank
    /// 0's are checked by the caller, which decides what a difference means).
    pub(crate) fn decode(bytes: &[u8]) -> Result<Hello, BadField> {
        let w = words_of(bytes, HELLO_WORDS)?;
        check_magic(w[0])?;
        let world_size = usize::try_from(w[2])
            .ok()
            .filter(|&s| (2..=MAX_WORLD_SIZE).contains(&s))
            .ok_or_else(|| bad("world_size", format!("{} is not in 2..={MAX_WORLD_SIZE}", w[2])))?;
        let rank = usize::try_from(w[1])
            .ok()
            .filter(|&r| (1..world_size).contains(&r))
            .ok_or_else(|| bad("rank", format!("{} is not in 1..{world_size}", w[1])))?;
        let pid = u32::try_from(w[3])
            .ok()
            .filter(|&p| p != 0 && p <= i32::MAX as u32)
            .ok_or_else(|| bad("pid", format!("{} is not a process id", w[3])))?;
        Ok(Hello { rank, world_size, pid, launch: w[4] })
    }
}

/// Rank 0's answer to a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Joined: rank 0's settings and launch identity (the joining rank compares them with its
    /// own).
    Welcome { capacity: u64, reserved: u64, timeout_ms: u64, launch: u64 },
    /// Refused, with the status that says why.
    Refused(u64),
}

impl Answer {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let words = match *self {
            Answer::Welcome { capacity, reserved, timeout_ms, launch } => {
                [MAGIC, OK, capacity, reserved, timeout_ms, launch]
            }
            Answer::Refused(status) => [MAGIC, status, 0, 0, 0, 0],
        };
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Answer, BadField> {
        let w = words_of(bytes, ANSWER_WORDS)?;
        check_magic(w[0])?;
        match w[1] {
            OK => Ok(Answer::Welcome {
                capacity: w[2],
                reserved: w[3],
                timeout_ms: w[4],
                launch: w[5],
            }),
            REFUSED | OTHER_LAUNCH | MALFORMED => Ok(Answer::Refused(w[1])),
            other => Err(bad("status", format!("{other} is no status of the rendezvous"))),
        }
    }

    /// Checks a welcome's settings against this rank's own (every rank must have the same):
    /// returns the field that differs. Nothing rank 0 sent is used, only compared.
    pub(crate) fn check_settings(
        capacity: u64,
        reserved: u64,
        timeout_ms: u64,
        own: &Settings,
    ) -> Result<(), BadField> {
        if capacity != own.capacity as u64 {
            return Err(bad(
                "capacity",
                format!(
                    "rank 0's heap segment is {capacity} bytes, this rank's {} (set {} the same \
                     on every rank)",
                    own.capacity,
                    super::world::HEAP_BYTES_ENV
                ),
            ));
        }
        if reserved != own.reserved as u64 {
            return Err(bad(
                "reserved",
                format!("rank 0 reserves {reserved} bytes, this rank {}", own.reserved),
            ));
        }
        if timeout_ms != timeout_millis(own.wait_timeout) {
            return Err(bad(
                "wait_timeout",
                format!(
                    "rank 0 waits {timeout_ms} ms, this rank {} ms (set {} the same on every \
                     rank)",
                    timeout_millis(own.wait_timeout),
                    super::world::WAIT_TIMEOUT_ENV
                ),
            ));
        }
        Ok(())
    }
}

fn timeout_millis(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
}

/// Checks the tag of a segment passed for a world of `n` ranks, of which `seen` already came.
pub(crate) fn segment_tag(tag: u64, n: usize, seen: &[bool]) -> Result<usize, BadField> {
    let q = usize::try_from(tag)
        .ok()
        .filter(|&q| q < n)
        .ok_or_else(|| bad("segment tag", format!("rank {tag} of a world of {n}")))?;
    if seen.get(q).copied().unwrap_or(false) {
        return Err(bad("segment tag", format!("rank {q}'s segment came twice")));
    }
    Ok(q)
}

pub(crate) fn send_fd(stream: &UnixStream, tag: u64, fd: &OwnedFd) -> std::io::Result<()> {
    let fds = [fd.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    let payload = tag.to_le_bytes();
    rustix::net::sendmsg(stream, &[IoSlice::new(&payload)], &mut control, SendFlags::NOSIGNAL)?;
    Ok(())
}

/// Receives a tag and one fd; more fds than one, or none, is an error (the extra ones close).
pub(crate) fn recv_fd(stream: &UnixStream) -> std::io::Result<(u64, OwnedFd)> {
    let mut payload = [0u8; 8];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        stream,
        &mut [IoSliceMut::new(&mut payload)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::WAITALL,
    )?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(more) = msg {
            fds.extend(more);
        }
    }
    if got.bytes == 8 && fds.len() == 1 {
        return Ok((u64::from_le_bytes(payload), fds.pop().expect("one fd")));
    }
    let what = if got.bytes == 0 {
        "the peer closed the connection before passing its memory".to_string()
    } else {
        format!(
            "a message of {} bytes with {} fds where 8 bytes and one fd were due",
            got.bytes,
            fds.len()
        )
    };
    Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, what))
}

fn socket_name(job_id: &str) -> String {
    format!("dist-tensor/{job_id}")
}

fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn own_pid() -> u32 {
    rustix::process::getpid().as_raw_nonzero().get() as u32
}

/// The kernel's word on who is at the other end of `stream`: its pid and uid.
fn peer_of(stream: &UnixStream) -> std::io::Result<(u32, u32)> {
    let cred = rustix::net::sockopt::socket_peercred(stream)?;
    Ok((cred.pid.as_raw_nonzero().get() as u32, cred.uid.as_raw()))
}

/// The pid of the process at the other end of `stream`, which must run as this process's user
/// (what a later rendezvous of the same world, such as the GPU one, checks against the pids the
/// control block recorded).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU rendezvous uses it
pub(crate) fn peer_pid(stream: &UnixStream) -> std::io::Result<u32> {
    let (pid, uid) = peer_of(stream)?;
    if uid != own_uid() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("pid {pid} runs as uid {uid}, this process as {}", own_uid()),
        ));
    }
    Ok(pid)
}

/// A list of ranks for a message, cut short when long (a world of millions must not make a
/// message of megabytes).
pub(crate) fn rank_list(ranks: &[usize]) -> String {
    crate::error::rank_list(ranks)
}

/// What rank 0 refused while it waited, for its log and its time-out message.
#[derive(Default)]
struct Refusals {
    shown: Vec<String>,
    more: usize,
}

impl Refusals {
    fn note(&mut self, job: &str, what: String) {
        if self.shown.len() < REFUSALS_SHOWN {
            eprintln!("dist-tensor: job {job:?}: rank 0 refused {what}");
            self.shown.push(what);
        } else {
            if self.more == 0 {
                eprintln!("dist-tensor: job {job:?}: rank 0 refuses more connections (not shown)");
            }
            self.more += 1;
        }
    }

    fn summary(&self) -> String {
        if self.shown.is_empty() {
            return String::new();
        }
        let more = if self.more > 0 { format!("; and {} more", self.more) } else { String::new() };
        format!("; meanwhile it refused {}{more}", self.shown.join("; "))
    }
}

/// A connection rank 0 accepted from a process of its own user, waiting for its hello.
struct Pending {
    stream: UnixStream,
    pid: u32,
    bytes: Vec<u8>,
    since: Instant,
}

/// The connection that has waited longest for its hello: its index and how long.
fn oldest(pending: &[Pending]) -> (usize, Duration) {
    pending
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.since.elapsed()))
        .max_by_key(|&(_, waited)| waited)
        .unwrap_or((0, Duration::ZERO))
}

enum Progress {
    Waiting,
    Closed,
    Done,
}

impl Pending {
    /// Reads what has come (never more than a hello: a longer message is cut there and then
    /// found wrong by its fields).
    fn progress(&mut self) -> Progress {
        let want = HELLO_WORDS * 8;
        let mut chunk = [0u8; HELLO_WORDS * 8];
        while self.bytes.len() < want {
            match self.stream.read(&mut chunk[..want - self.bytes.len()]) {
                Ok(0) => return Progress::Closed,
                Ok(k) => self.bytes.extend_from_slice(&chunk[..k]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Progress::Waiting,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Progress::Closed,
            }
        }
        Progress::Done
    }
}

/// Joins the job `env` describes: rank 0 hosts the rendezvous, every other rank connects to it.
/// Gives up after `join_timeout` with an error naming the ranks that did not come.
///
/// Both ends check who the other is: rank 0 accepts only processes of its own user (the
/// kernel's `SO_PEERCRED`) whose hello is well formed and of the same launch (`launch`: see
/// [`job_env::launch_identity`](super::job_env::launch_identity)), dropping anything else and
/// waiting on; a joining rank talks only to a rank 0 of its own user and launch, with the same
/// settings as its own.
///
/// `env`'s rank and world size are those of the node (local rank, ranks on the node); `members`
/// says which global rank each is: the heap and control block are those of the whole world,
/// with the segments of this node's ranks mapped.
pub(crate) fn join(
    env: &JobEnv,
    members: &Members,
    settings: Settings,
    join_timeout: Duration,
) -> Result<Joined> {
    let deadline = Instant::now() + join_timeout;
    if env.world_size == 1 {
        let me = members.ranks[0];
        let control = Mapping::memfd("dist-tensor control", Control::bytes(members.world_size))
            .map_err(system(me, "cannot create the control block"))?;
        let segment = Mapping::memfd(&format!("dist-tensor heap {me}"), settings.capacity)
            .map_err(system(me, "cannot create the heap segment"))?;
        let control = Control::create(control, members.world_size);
        let mut segments: Vec<Option<Mapping>> = (0..members.world_size).map(|_| None).collect();
        segments[me] = Some(segment);
        let heap = Heap::new(segments, settings.capacity, settings.reserved);
        let peers = PeerWatch::new(me, members.clone(), (0..members.world_size).map(|_| None));
        return Ok(Joined { heap, control, settings, peers });
    }
    let launch = super::job_env::launch_identity(&|name| std::env::var(name).ok());
    if env.rank == 0 {
        host(env, members, settings, deadline, join_timeout, launch)
    } else {
        guest(env, members, settings, deadline, join_timeout, launch)
    }
}

/// Tells every joined rank (and `extra`, the process that caused it) that the job fails.
fn refuse_all(guests: &mut [Option<(UnixStream, u32)>], extra: Option<&mut UnixStream>) {
    let refusal = Answer::Refused(REFUSED).encode();
    for (stream, _) in guests.iter_mut().flatten() {
        let _ = stream.write_all(&refusal);
    }
    if let Some(stream) = extra {
        let _ = stream.set_nonblocking(false);
        let _ = stream.write_all(&refusal);
    }
}

/// Rank 0: accepts every other rank, hands out the settings, the control block and every segment.
fn host(
    env: &JobEnv,
    members: &Members,
    settings: Settings,
    deadline: Instant,
    timeout: Duration,
    launch: u64,
) -> Result<Joined> {
    let n = env.world_size;
    let global = |local: usize| members.ranks[local];
    let job = env.job_id.clone();
    let name = socket_name(&env.job_id);
    let address = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(system(0, "cannot name the rendezvous socket"))?;
    let listener = UnixListener::bind_addr(&address).map_err(|e| {
        if e.kind() != std::io::ErrorKind::AddrInUse {
            return system(0, format!("cannot listen on the rendezvous socket {name:?}"))(e);
        }
        // Who holds the name? The kernel says, for a process that listens.
        let holder = UnixStream::connect_addr(&address).ok().and_then(|s| peer_of(&s).ok());
        match holder {
            Some((pid, uid)) if uid != own_uid() => Error::ForeignPeer {
                op: "World::from_env",
                rank: global(0),
                job: job.clone(),
                pid,
                uid,
                reason: format!(
                    "a process of another user holds this job's rendezvous name (this user is \
                     uid {}): it cannot join, but this job cannot start under this job id; \
                     launch again with another one",
                    own_uid()
                ),
            },
            holder => refused(format!(
                "job id {:?} is in use by another running job on this host{}: give each job \
                 its own",
                env.job_id,
                holder.map_or(String::new(), |(pid, _)| format!(" (its rank 0 is pid {pid})"))
            )),
        }
    })?;
    listener.set_nonblocking(true).map_err(system(0, "rendezvous socket"))?;

    // Every other rank says who it is; anything else is dropped and noted.
    let me_uid = own_uid();
    let mut guests: Vec<Option<(UnixStream, u32)>> = (0..n).map(|_| None).collect();
    let mut pending: Vec<Pending> = Vec::new();
    let mut refusals = Refusals::default();
    let mut joined = 1;
    while joined < n {
        let mut busy = false;
        // A few connections at a time, then their hellos: a flood must not keep a real rank's
        // hello from being read.
        for _ in 0..ACCEPTS_PER_ROUND {
            match listener.accept() {
                Ok((stream, _)) => {
                    busy = true;
                    match peer_of(&stream) {
                        Ok((pid, uid)) if uid != me_uid => refusals.note(
                            &job,
                            format!(
                                "pid {pid} of uid {uid}: another user (this job is uid {me_uid})"
                            ),
                        ),
                        Ok((pid, _))
                            if pending.len() >= MAX_PENDING
                                && oldest(&pending).1 < SILENT_AFTER =>
                        {
                            refusals.note(
                                &job,
                                format!("pid {pid}: {MAX_PENDING} connections wait already"),
                            );
                        }
                        Ok((pid, _)) => {
                            // Full: the connection that waited longest goes, once it has been
                            // silent for a while (a real rank sends its hello at once, so a
                            // flood of silent ones cannot starve it).
                            if pending.len() >= MAX_PENDING {
                                let old = pending.swap_remove(oldest(&pending).0);
                                refusals.note(
                                    &job,
                                    format!("pid {}: silent while others waited", old.pid),
                                );
                            }
                            if stream.set_nonblocking(true).is_ok() {
                                pending.push(Pending {
                                    stream,
                                    pid,
                                    bytes: Vec::new(),
                                    since: Instant::now(),
                                });
                            }
                        }
                        Err(e) => refusals.note(&job, format!("a connection of unknown peer: {e}")),
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => return Err(system(0, "accepting a rank")(e)),
            }
        }
        let mut i = 0;
        while i < pending.len() {
            match pending[i].progress() {
                Progress::Waiting if pending[i].since.elapsed() < HELLO_DEADLINE => i += 1,
                Progress::Waiting => {
                    let p = pending.swap_remove(i);
                    refusals.note(
                        &job,
                        format!("pid {}: no complete hello within {HELLO_DEADLINE:?}", p.pid),
                    );
                }
                Progress::Closed => {
                    let p = pending.swap_remove(i);
                    refusals.note(&job, format!("pid {}: closed before its hello", p.pid));
                }
                Progress::Done => {
                    busy = true;
                    let mut p = pending.swap_remove(i);
                    let _ = p.stream.set_nonblocking(false);
                    let _ = p.stream.set_write_timeout(Some(Duration::from_millis(100)));
                    let hello = match Hello::decode(&p.bytes) {
                        Ok(hello) => hello,
                        Err(b) => {
                            let _ = p.stream.write_all(&Answer::Refused(MALFORMED).encode());
                            refusals.note(
                                &job,
                                format!("pid {}: bad {}: {}", p.pid, b.field, b.reason),
                            );
                            continue;
                        }
                    };
                    if hello.pid != p.pid {
                        let _ = p.stream.write_all(&Answer::Refused(MALFORMED).encode());
                        refusals.note(
                            &job,
                            format!("pid {}: its hello claims pid {}", p.pid, hello.pid),
                        );
                        continue;
                    }
                    if hello.launch != launch {
                        let _ = p.stream.write_all(&Answer::Refused(OTHER_LAUNCH).encode());
                        refusals.note(
                            &job,
                            format!(
                                "pid {} (rank {}): another launch (another executable or \
                                 launcher identity) with the same job id",
                                p.pid, hello.rank
                            ),
                        );
                        continue;
                    }
                    // The same launch: a difference now is the launch's own inconsistency, and
                    // fails the job at once.
                    let fatal = if hello.world_size != n {
                        Some((
                            "world_size",
                            format!(
                                "rank {} has a world of {} ranks, rank 0 of {n}",
                                hello.rank, hello.world_size
                            ),
                        ))
                    } else if let Some((_, pid)) = &guests[hello.rank] {
                        Some((
                            "rank",
                            format!(
                                "two processes claim rank {}: pids {pid} and {}",
                                hello.rank, p.pid
                            ),
                        ))
                    } else {
                        None
                    };
                    if let Some((field, reason)) = fatal {
                        refuse_all(&mut guests, Some(&mut p.stream));
                        return Err(Error::BadPeerMessage {
                            op: "World::from_env",
                            rank: global(0),
                            job,
                            peer: format!("pid {}", p.pid),
                            field,
                            reason,
                        });
                    }
                    guests[hello.rank] = Some((p.stream, p.pid));
                    joined += 1;
                }
            }
        }
        if joined == n {
            break;
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..n).filter(|&r| guests[r].is_none()).collect();
            return Err(refused(format!(
                "ranks {} of {n} did not join job {:?} within {timeout:?} (set {} to wait \
                 longer){}",
                rank_list(&missing),
                env.job_id,
                super::job_env::JOIN_TIMEOUT_ENV,
                refusals.summary()
            )));
        }
        if !busy {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    drop(pending);
    drop(listener); // the name is gone: nothing to clean up

    // From here every read and write has the join's deadline.
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
    for (stream, _) in guests.iter_mut().flatten() {
        stream.set_read_timeout(Some(left)).map_err(system(0, "rendezvous"))?;
        stream.set_write_timeout(Some(left)).map_err(system(0, "rendezvous"))?;
    }
    let control_map = Mapping::memfd("dist-tensor control", Control::bytes(members.world_size))
        .map_err(system(global(0), "cannot create the control block"))?;
    let control = Control::create(control_map, members.world_size);
    control.pid(global(0)).store(own_pid(), Ordering::Release);
    for (rank, guest) in guests.iter().enumerate() {
        if let Some((_, pid)) = guest {
            control.pid(global(rank)).store(*pid, Ordering::Release);
        }
    }
    let control_fd = control
        .mapping()
        .fd()
        .expect("a memfd")
        .try_clone_to_owned()
        .map_err(system(0, "control fd"))?;
    let welcome = Answer::Welcome {
        capacity: settings.capacity as u64,
        reserved: settings.reserved as u64,
        timeout_ms: timeout_millis(settings.wait_timeout),
        launch,
    }
    .encode();
    for (rank, guest) in guests.iter_mut().enumerate() {
        if let Some((stream, _)) = guest {
            stream.write_all(&welcome).map_err(system(0, format!("answering rank {rank}")))?;
            send_fd(stream, n as u64, &control_fd)
                .map_err(system(0, format!("passing the control block to rank {rank}")))?;
        }
    }
    let own = Mapping::memfd("dist-tensor heap 0", settings.capacity)
        .map_err(system(0, "cannot create the heap segment"))?;
    let mut fds: Vec<Option<OwnedFd>> = (0..n).map(|_| None).collect();
    fds[0] =
        Some(own.fd().expect("a memfd").try_clone_to_owned().map_err(system(0, "segment fd"))?);
    for (rank, guest) in guests.iter_mut().enumerate() {
        if let Some((stream, pid)) = guest {
            let (tag, fd) =
                recv_fd(stream).map_err(system(0, format!("receiving rank {rank}'s segment")))?;
            if tag != rank as u64 {
                return Err(Error::BadPeerMessage {
                    op: "World::from_env",
                    rank: global(0),
                    job,
                    peer: format!("rank {rank} (pid {pid})"),
                    field: "segment tag",
                    reason: format!("its own segment is tagged rank {tag}"),
                });
            }
            fds[rank] = Some(fd);
        }
    }
    let mut segments: Vec<Option<Mapping>> = (0..members.world_size).map(|_| None).collect();
    for (q, fd) in fds.iter().enumerate().skip(1) {
        let fd = fd.as_ref().expect("every segment arrived");
        let fd = fd.try_clone().map_err(system(0, "segment fd"))?;
        segments[global(q)] = Some(
            Mapping::from_fd(fd, settings.capacity)
                .map_err(system(global(0), format!("mapping rank {}'s segment", global(q))))?,
        );
    }
    for (rank, guest) in guests.iter_mut().enumerate() {
        if let Some((stream, _)) = guest {
            for (q, fd) in fds.iter().enumerate() {
                let fd = fd.as_ref().expect("every segment arrived");
                send_fd(stream, q as u64, fd)
                    .map_err(system(0, format!("passing segments to rank {rank}")))?;
            }
        }
    }
    segments[global(0)] = Some(own);
    // Wait until every rank mapped everything (it then closes its end), so that no rank starts
    // before all can reach every segment.
    for guest in guests.iter_mut().flatten() {
        let mut byte = [0u8; 1];
        let _ = guest.0.read(&mut byte);
    }
    let heap = Heap::new(segments, settings.capacity, settings.reserved);
    let peers = PeerWatch::open(global(0), members, &control);
    Ok(Joined { heap, control, settings, peers })
}

/// Every other rank: connects to rank 0 (retrying until it listens), checks it, sends its segment.
fn guest(
    env: &JobEnv,
    members: &Members,
    settings: Settings,
    deadline: Instant,
    timeout: Duration,
    launch: u64,
) -> Result<Joined> {
    let (me, n) = (env.rank, env.world_size);
    let global = |local: usize| members.ranks[local];
    let job = env.job_id.clone();
    let name = socket_name(&env.job_id);
    let address = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(system(global(me), "cannot name the rendezvous socket"))?;
    let mut stream = loop {
        match UnixStream::connect_addr(&address) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => {
                return Err(refused(format!(
                    "rank 0 of job {:?} did not open the rendezvous within {timeout:?} ({e}): it \
                     did not start, or failed before listening (its own error says why); set {} \
                     to wait longer",
                    env.job_id,
                    super::job_env::JOIN_TIMEOUT_ENV
                )));
            }
        }
    };
    // Who listens? The kernel says; a process of another user is never rank 0 of this job.
    let (host_pid, host_uid) = peer_of(&stream).map_err(system(global(me), "rendezvous peer"))?;
    let foreign = |reason: String| Error::ForeignPeer {
        op: "World::from_env",
        rank: global(me),
        job: job.clone(),
        pid: host_pid,
        uid: host_uid,
        reason,
    };
    if host_uid != own_uid() {
        return Err(foreign(format!(
            "the process that listens on this job's rendezvous runs as another user (this rank \
             is uid {}): it is not rank 0 of this job (a squatter of a predictable job id?); \
             nothing was sent to it",
            own_uid()
        )));
    }
    let from_host = |field: &'static str, reason: String| Error::BadPeerMessage {
        op: "World::from_env",
        rank: global(me),
        job: job.clone(),
        peer: format!("rank 0 (pid {host_pid})"),
        field,
        reason,
    };
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(system(me, "rendezvous"))?;
    stream.set_write_timeout(Some(left)).map_err(system(me, "rendezvous"))?;
    let hello = Hello { rank: me, world_size: n, pid: own_pid(), launch };
    stream.write_all(&hello.encode()).map_err(system(me, "joining"))?;
    let mut answer = [0u8; ANSWER_WORDS * 8];
    stream.read_exact(&mut answer).map_err(|e| {
        refused(format!(
            "rank 0 (pid {host_pid}) did not let rank {me} join within {timeout:?}: {e} (did \
             every rank start? rank 0's own error says why it gave up)"
        ))
    })?;
    let (capacity, reserved, timeout_ms, host_launch) =
        match Answer::decode(&answer).map_err(|b| from_host(b.field, b.reason))? {
            Answer::Welcome { capacity, reserved, timeout_ms, launch } => {
                (capacity, reserved, timeout_ms, launch)
            }
            Answer::Refused(OTHER_LAUNCH) => {
                return Err(foreign(format!(
                    "rank 0 of job {:?} belongs to another launch (another executable or \
                     launcher identity) that uses the same job id at the same time: give each \
                     launch its own {}",
                    env.job_id,
                    super::job_env::JOB_ID_ENV
                )));
            }
            Answer::Refused(MALFORMED) => {
                return Err(refused(format!(
                    "rank 0 (pid {host_pid}) could not read rank {me}'s hello: another version \
                     of dist-tensor?"
                )));
            }
            Answer::Refused(_) => {
                return Err(refused(format!(
                    "rank 0 refused rank {me}: another rank's environment is inconsistent (its \
                     error says which)"
                )));
            }
        };
    if host_launch != launch {
        return Err(foreign(format!(
            "rank 0 of job {:?} belongs to another launch (another executable or launcher \
             identity) that uses the same job id at the same time: give each launch its own {}",
            env.job_id,
            super::job_env::JOB_ID_ENV
        )));
    }
    Answer::check_settings(capacity, reserved, timeout_ms, &settings)
        .map_err(|b| from_host(b.field, b.reason))?;
    let (tag, control_fd) = recv_fd(&stream).map_err(system(me, "receiving the control block"))?;
    if tag != n as u64 {
        return Err(from_host("control block tag", format!("{tag}, not the world size {n}")));
    }
    let control_map = Mapping::from_fd(control_fd, Control::bytes(members.world_size))
        .map_err(|e| from_host("control block", e.to_string()))?;
    let control = Control::open(control_map, members.world_size)
        .map_err(|reason| from_host("control block", reason))?;
    let host_recorded = control.pid(global(0)).load(Ordering::Acquire);
    if host_recorded != host_pid {
        return Err(from_host(
            "pid",
            format!("the control block names pid {host_recorded} as rank 0, the kernel {host_pid}"),
        ));
    }
    let own = Mapping::memfd(&format!("dist-tensor heap {me}"), settings.capacity)
        .map_err(system(me, "cannot create the heap segment"))?;
    send_fd(
        &stream,
        me as u64,
        &own.fd().expect("a memfd").try_clone_to_owned().map_err(system(me, "segment fd"))?,
    )
    .map_err(system(me, "passing the segment"))?;
    let mut segments: Vec<Option<Mapping>> = (0..members.world_size).map(|_| None).collect();
    let mut seen = vec![false; n];
    for _ in 0..n {
        let (tag, fd) = recv_fd(&stream).map_err(system(me, "receiving the segments"))?;
        let q = segment_tag(tag, n, &seen).map_err(|b| from_host(b.field, b.reason))?;
        seen[q] = true;
        if q == me {
            continue; // its own, mapped already
        }
        segments[global(q)] = Some(
            Mapping::from_fd(fd, settings.capacity)
                .map_err(|e| from_host("segment", format!("rank {}'s: {e}", global(q))))?,
        );
    }
    segments[global(me)] = Some(own);
    drop(stream); // tells rank 0 this rank has mapped everything
    let heap = Heap::new(segments, settings.capacity, settings.reserved);
    let peers = PeerWatch::open(global(me), members, &control);
    Ok(Joined { heap, control, settings, peers })
}

/// A rank of this node (other than `me`, among `n`, `local` says which are of this node) whose
/// process is stopped (SIGSTOP, or held by a debugger), with its pid: what a wait that timed out
/// names, rather than the signal it waited on. Ranks that are threads have no pid and are never
/// named.
pub(crate) fn stopped_peer(
    control: &Control,
    me: usize,
    n: usize,
    local: impl Fn(usize) -> bool,
) -> Option<(usize, u32)> {
    let own = own_pid();
    (0..n).filter(|&p| p != me && local(p)).find_map(|p| {
        let pid = control.pid(p).load(Ordering::Acquire);
        (pid != 0 && pid != own && is_stopped(pid)).then_some((p, pid))
    })
}

/// Whether process `pid` is stopped: the state after the command in `/proc/<pid>/stat` (the
/// command may hold spaces and parentheses, so after the last `)`).
fn is_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
    matches!(state, Some('T' | 't'))
}

/// Watches the other processes of the node: one pidfd each; a process that ended while its rank
/// was still running is marked died in the control block, which fails the world and names it.
pub(crate) struct PeerWatch {
    me: usize,
    members: Members,
    /// By global rank; only this node's other ranks have one.
    pidfds: std::sync::Mutex<Vec<Option<OwnedFd>>>,
    start: Instant,
    last: AtomicU64,
}

impl PeerWatch {
    fn new(me: usize, members: Members, pidfds: impl Iterator<Item = Option<OwnedFd>>) -> Self {
        PeerWatch {
            me,
            members,
            pidfds: std::sync::Mutex::new(pidfds.collect()),
            start: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    fn open(me: usize, members: &Members, control: &Control) -> PeerWatch {
        let fds = (0..members.world_size).map(|rank| {
            if rank == me || !members.ranks.contains(&rank) {
                None
            } else {
                pidfd(control.pid(rank).load(Ordering::Acquire))
            }
        });
        PeerWatch::new(me, members.clone(), fds)
    }

    /// Looks (at most every few milliseconds) for peers whose process ended while running.
    pub(crate) fn check(&self, control: &Control) {
        let now = self.start.elapsed().as_micros() as u64;
        let last = self.last.load(Ordering::Relaxed);
        if now < last + PEER_CHECK.as_micros() as u64
            || self.last.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_err()
        {
            return;
        }
        let mut fds = super::heap::lock(&self.pidfds);
        for &rank in &self.members.ranks {
            if rank == self.me {
                continue;
            }
            let slot = &mut fds[rank];
            if slot.is_none() {
                let pid = control.pid(rank).load(Ordering::Acquire);
                if pid != 0 {
                    *slot = pidfd(pid);
                }
            }
            let Some(fd) = slot.as_ref() else { continue };
            let mut poll = [PollFd::new(fd, PollFlags::IN)];
            let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
            if !matches!(rustix::event::poll(&mut poll, Some(&zero)), Ok(1)) {
                continue;
            }
            // A rank gone inside a run fails the world; one gone between runs fails only the
            // waits that need it (its state says died), since its peers may finish their own
            // run without it.
            if control.mark_died(rank, -1) == Some(RankState::Running) {
                control.fail(rank, &format!("rank {rank} {}", describe_status(-1)));
            }
        }
    }
}

fn pidfd(pid: u32) -> Option<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid as i32)?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn settings() -> Settings {
        Settings { capacity: 1 << 20, reserved: 4096, wait_timeout: Duration::from_secs(60) }
    }

    #[test]
    fn a_hello_round_trips_and_each_bad_field_is_named() {
        let hello = Hello { rank: 3, world_size: 4, pid: 1234, launch: 99 };
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        let with = |i: usize, v: u64| {
            let mut bytes = hello.encode();
            bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
            Hello::decode(&bytes).unwrap_err().field
        };
        assert_eq!(with(0, 7), "magic");
        assert_eq!(with(1, 0), "rank"); // rank 0 never joins as a guest
        assert_eq!(with(1, 4), "rank");
        assert_eq!(with(2, 1 << 62), "world_size");
        assert_eq!(with(2, 1), "world_size");
        assert_eq!(with(3, 0), "pid");
        assert_eq!(with(3, 1 << 40), "pid");
        assert_eq!(Hello::decode(&[0; 7]).unwrap_err().field, "length");
        assert_eq!(Hello::decode(&[0; 4096]).unwrap_err().field, "length");
    }

    #[test]
    fn settings_that_differ_from_this_ranks_are_refused_naming_the_field() {
        let own = settings();
        let ms = 60_000;
        assert!(Answer::check_settings(1 << 20, 4096, ms, &own).is_ok());
        // A reserved part larger than the capacity once wrapped the capacity to ~2^64.
        assert_eq!(
            Answer::check_settings(1 << 20, 1 << 21, ms, &own).unwrap_err().field,
            "reserved"
        );
        assert_eq!(Answer::check_settings(u64::MAX, 4096, ms, &own).unwrap_err().field, "capacity");
        let err = Answer::check_settings(1 << 20, 4096, 3_600_000, &own).unwrap_err();
        assert_eq!(err.field, "wait_timeout");
        assert!(err.reason.contains("3600000 ms"), "{}", err.reason);
    }

    #[test]
    fn segment_tags_are_in_range_and_come_once() {
        assert_eq!(segment_tag(2, 4, &[false; 4]), Ok(2));
        assert_eq!(segment_tag(4, 4, &[false; 4]).unwrap_err().field, "segment tag");
        assert_eq!(segment_tag(u64::MAX, 4, &[false; 4]).unwrap_err().field, "segment tag");
        assert!(
            segment_tag(1, 4, &[false, true, false, false]).unwrap_err().reason.contains("twice")
        );
    }

    #[test]
    fn a_memfd_that_is_not_sealed_is_not_mapped() {
        let fd = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 16).unwrap();
        let err = Mapping::from_fd(fd, 1 << 16).err().unwrap().to_string();
        assert!(err.contains("seal"), "{err}");
        let sealed = Mapping::memfd("sealed", 1 << 16).unwrap();
        let fd = sealed.fd().unwrap().try_clone_to_owned().unwrap();
        assert!(rustix::fs::ftruncate(&fd, 0).is_err(), "a sealed segment cannot shrink");
        let err = Mapping::from_fd(fd, 1 << 17).err().unwrap().to_string();
        assert!(err.contains("where 131072 were expected"), "{err}");
    }

    #[test]
    fn a_passed_fd_message_must_be_one_tag_and_one_fd() {
        let memfd = || Mapping::memfd("t", 4096).unwrap().fd().unwrap().try_clone_to_owned();
        // Right: a tag and one fd.
        let (a, b) = UnixStream::pair().unwrap();
        send_fd(&a, 7, &memfd().unwrap()).unwrap();
        assert_eq!(recv_fd(&b).unwrap().0, 7);
        // Two fds at once: refused (both close).
        let (one, two) = (memfd().unwrap(), memfd().unwrap());
        let fds = [one.as_fd(), two.as_fd()];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        control.push(SendAncillaryMessage::ScmRights(&fds));
        let tag = 1u64.to_le_bytes();
        rustix::net::sendmsg(&a, &[IoSlice::new(&tag)], &mut control, SendFlags::NOSIGNAL).unwrap();
        assert!(recv_fd(&b).unwrap_err().to_string().contains("with 2 fds"));
        // A tag and no fd; then bytes that are not a tag; then nothing.
        (&a).write_all(&9u64.to_le_bytes()).unwrap();
        assert!(recv_fd(&b).unwrap_err().to_string().contains("with 0 fds"));
        (&a).write_all(&[1, 2, 3]).unwrap();
        drop(a);
        assert!(recv_fd(&b).is_err());
        assert!(recv_fd(&b).unwrap_err().to_string().contains("closed the connection"));
    }

    #[test]
    fn long_rank_lists_are_summarised() {
        let many: Vec<usize> = (1..10_000_000).collect();
        let text = rank_list(&many);
        assert!(text.len() < 200 && text.contains("9999999 in all"), "{text}");
        assert_eq!(rank_list(&[2]), "[2]");
        assert_eq!(rank_list(&[]), "[]");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any bytes as a hello: an error naming a field, or a hello whose every field is in
        /// range. Never a panic.
        #[test]
        fn any_bytes_as_a_hello(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            match Hello::decode(&bytes) {
                Ok(h) => {
                    prop_assert!(h.world_size >= 2 && h.world_size <= MAX_WORLD_SIZE);
                    prop_assert!(h.rank >= 1 && h.rank < h.world_size);
                    prop_assert!(h.pid >= 1 && h.pid <= i32::MAX as u32);
                    prop_assert_eq!(Hello::decode(&h.encode()), Ok(h));
                }
                Err(b) => prop_assert!(!b.field.is_empty() && b.reason.len() < 200),
            }
        }

        /// Any words after a valid magic: every field is checked, not only the magic.
        #[test]
        fn any_words_as_a_hello(words in proptest::collection::vec(any::<u64>(), 4)) {
            let mut bytes = MAGIC.to_le_bytes().to_vec();
            bytes.extend(words.iter().flat_map(|w| w.to_le_bytes()));
            if let Ok(h) = Hello::decode(&bytes) {
                prop_assert_eq!(h.rank as u64, words[0]);
                prop_assert!((words[1] as usize) <= MAX_WORLD_SIZE && words[0] < words[1]);
            }
        }

        /// Any answer: a welcome, a refusal of a known status, or an error naming a field; and a
        /// welcome is used only when every setting equals this rank's own.
        #[test]
        fn any_answer(
            status in prop_oneof![Just(0u64), Just(1), Just(2), Just(3), any::<u64>()],
            capacity in prop_oneof![Just(1u64 << 20), any::<u64>()],
            reserved in prop_oneof![Just(4096u64), any::<u64>()],
            timeout_ms in prop_oneof![Just(60_000u64), any::<u64>()],
            launch in any::<u64>(),
            magic in prop_oneof![Just(MAGIC), any::<u64>()],
        ) {
            let bytes: Vec<u8> = [magic, status, capacity, reserved, timeout_ms, launch]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect();
            match Answer::decode(&bytes) {
                Ok(Answer::Welcome { capacity: c, reserved: r, timeout_ms: t, .. }) => {
                    prop_assert_eq!(status, OK);
                    let ok = Answer::check_settings(c, r, t, &settings()).is_ok();
                    prop_assert_eq!(ok, (c, r, t) == (1 << 20, 4096, 60_000));
                }
                Ok(Answer::Refused(s)) => prop_assert!([REFUSED, OTHER_LAUNCH, MALFORMED].contains(&s)),
                Err(b) => prop_assert!(magic != MAGIC || b.field == "status"),
            }
        }

        /// Any segment tag, against any set of segments already received.
        #[test]
        fn any_segment_tag(tag in any::<u64>(), n in 1usize..64, seen in any::<u64>()) {
            let seen: Vec<bool> = (0..n).map(|q| seen >> q & 1 == 1).collect();
            match segment_tag(tag, n, &seen) {
                Ok(q) => prop_assert!(q < n && !seen[q] && q as u64 == tag),
                Err(b) => prop_assert_eq!(b.field, "segment tag"),
            }
        }

        /// Any bytes in a control block's header and failure record: opening it is an error or
        /// a block of the right world size, and its failure record reads within the block.
        #[test]
        fn any_control_block(
            header in proptest::collection::vec(any::<u64>(), 8),
            record_len in any::<u32>(),
            n in 1usize..16,
            keep_magic in any::<bool>(),
        ) {
            let map = Mapping::anonymous(Control::bytes(n)).unwrap();
            let base = map.base() as *mut u64;
            for (i, w) in header.iter().enumerate() {
                // SAFETY: inside the mapping's 64-byte header, 8-aligned.
                unsafe { base.add(i).write(*w) };
            }
            if keep_magic {
                // SAFETY: as above.
                unsafe { base.write(0x6469_7374_5f74_656e); base.add(1).write(n as u64) };
            }
            // SAFETY: as above: the failure record's length, at byte 20.
            unsafe { (map.base().add(20) as *mut u32).write(record_len) };
            match Control::open(map, n) {
                Ok(control) => {
                    prop_assert!(keep_magic || header[0] == 0x6469_7374_5f74_656e);
                    if let Some((rank, text)) = control.first_failure() {
                        prop_assert!(rank < n);
                        prop_assert!(text.len() <= 3 * super::super::control::FAILURE_TEXT_BYTES + 100);
                    }
                    let _ = control.failed();
                }
                Err(reason) => prop_assert!(reason.len() < 200),
            }
        }
    }
}
