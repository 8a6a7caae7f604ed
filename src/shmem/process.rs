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

use super::control::{Control, describe_status};
use super::heap::Heap;
use super::job_env::JobEnv;
use super::mapping::Mapping;
use super::world::Settings;
use crate::{Error, Result};

const MAGIC: u64 = 0x6474_6a6f_696e_0001; // "dtjoin", version 1
const OK: u64 = 0;
const REFUSED: u64 = 1;
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

fn write_words(stream: &mut UnixStream, words: &[u64]) -> std::io::Result<()> {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    stream.write_all(&bytes)
}

fn read_words(stream: &mut UnixStream, count: usize) -> std::io::Result<Vec<u64>> {
    let mut bytes = vec![0u8; count * 8];
    stream.read_exact(&mut bytes)?;
    Ok(bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
}

fn send_fd(stream: &UnixStream, tag: u64, fd: &OwnedFd) -> std::io::Result<()> {
    let fds = [fd.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    let payload = tag.to_le_bytes();
    rustix::net::sendmsg(stream, &[IoSlice::new(&payload)], &mut control, SendFlags::NOSIGNAL)?;
    Ok(())
}

fn recv_fd(stream: &UnixStream) -> std::io::Result<(u64, OwnedFd)> {
    let mut payload = [0u8; 8];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        stream,
        &mut [IoSliceMut::new(&mut payload)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::WAITALL,
    )?;
    let fd = control.drain().find_map(|msg| match msg {
        RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
        _ => None,
    });
    match fd {
        Some(fd) if got.bytes == 8 => Ok((u64::from_le_bytes(payload), fd)),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the peer closed the connection before passing its memory",
        )),
    }
}

fn socket_name(job_id: &str) -> String {
    format!("dist-tensor/{job_id}")
}

/// Joins the job `env` describes: rank 0 hosts the rendezvous, every other rank connects to it.
/// Gives up after `join_timeout` with an error naming the ranks that did not come.
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
    if env.rank == 0 {
        host(env, members, settings, deadline, join_timeout)
    } else {
        guest(env, members, deadline, join_timeout)
    }
}

/// Rank 0: accepts every other rank, hands out the settings, the control block and every segment.
fn host(
    env: &JobEnv,
    members: &Members,
    settings: Settings,
    deadline: Instant,
    timeout: Duration,
) -> Result<Joined> {
    let n = env.world_size;
    let global = |local: usize| members.ranks[local];
    let name = socket_name(&env.job_id);
    let address = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(system(0, "cannot name the rendezvous socket"))?;
    let listener = UnixListener::bind_addr(&address).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            refused(format!(
                "job id {:?} is in use by another running job on this host: give each job its own",
                env.job_id
            ))
        } else {
            system(0, format!("cannot listen on the rendezvous socket {name:?}"))(e)
        }
    })?;
    listener.set_nonblocking(true).map_err(system(0, "rendezvous socket"))?;

    // Every other rank says who it is.
    let mut guests: Vec<Option<(UnixStream, u32)>> = (0..n).map(|_| None).collect();
    let mut joined = 1;
    while joined < n {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false).map_err(system(0, "rendezvous"))?;
                stream.set_read_timeout(Some(Duration::from_secs(5))).ok();
                let hello =
                    read_words(&mut stream, 4).map_err(system(0, "reading a rank's hello"))?;
                let (rank, size, pid) = (hello[1] as usize, hello[2] as usize, hello[3] as u32);
                let problem = if hello[0] != MAGIC {
                    Some(
                        "a process that is not a dist-tensor rank of this version joined"
                            .to_string(),
                    )
                } else if size != n {
                    Some(format!("rank {rank} has a world of {size} ranks, rank 0 of {n}"))
                } else if rank == 0 || rank >= n || guests[rank].is_some() {
                    Some(format!("two processes claim rank {rank}"))
                } else {
                    None
                };
                if let Some(reason) = problem {
                    let _ = write_words(&mut stream, &[MAGIC, REFUSED]);
                    for (s, _) in guests.iter_mut().flatten() {
                        let _ = write_words(s, &[MAGIC, REFUSED]);
                    }
                    return Err(refused(reason));
                }
                guests[rank] = Some((stream, pid));
                joined += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..n).filter(|&r| guests[r].is_none()).collect();
                    return Err(refused(format!(
                        "ranks {missing:?} of {n} did not join job {:?} within {timeout:?} \
                         (set {} to wait longer)",
                        env.job_id,
                        super::job_env::JOIN_TIMEOUT_ENV
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(system(0, "accepting a rank")(e)),
        }
    }
    drop(listener); // the name is gone: nothing to clean up

    let control_map = Mapping::memfd("dist-tensor control", Control::bytes(members.world_size))
        .map_err(system(global(0), "cannot create the control block"))?;
    let control = Control::create(control_map, members.world_size);
    let own_pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
    control.pid(global(0)).store(own_pid, Ordering::Release);
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
    let timeout_ms = u64::try_from(settings.wait_timeout.as_millis()).unwrap_or(u64::MAX);
    for (rank, guest) in guests.iter_mut().enumerate() {
        if let Some((stream, _)) = guest {
            let words = [MAGIC, OK, settings.capacity as u64, settings.reserved as u64, timeout_ms];
            write_words(stream, &words).map_err(system(0, format!("answering rank {rank}")))?;
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
        if let Some((stream, _)) = guest {
            let (_, fd) =
                recv_fd(stream).map_err(system(0, format!("receiving rank {rank}'s segment")))?;
            fds[rank] = Some(fd);
        }
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
    let mut segments: Vec<Option<Mapping>> = (0..members.world_size).map(|_| None).collect();
    segments[global(0)] = Some(own);
    for (q, fd) in fds.into_iter().enumerate().skip(1) {
        let fd = fd.expect("every segment arrived");
        segments[global(q)] = Some(
            Mapping::from_fd(fd, settings.capacity)
                .map_err(system(global(0), format!("mapping rank {}'s segment", global(q))))?,
        );
    }
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

/// Every other rank: connects to rank 0 (retrying until it listens), sends its segment.
fn guest(env: &JobEnv, members: &Members, deadline: Instant, timeout: Duration) -> Result<Joined> {
    let (me, n) = (env.rank, env.world_size);
    let global = |local: usize| members.ranks[local];
    let name = socket_name(&env.job_id);
    let address = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(system(me, "cannot name the rendezvous socket"))?;
    let mut stream = loop {
        match UnixStream::connect_addr(&address) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => {
                return Err(refused(format!(
                    "rank 0 of job {:?} did not open the rendezvous within {timeout:?} ({e}); \
                     set {} to wait longer",
                    env.job_id,
                    super::job_env::JOIN_TIMEOUT_ENV
                )));
            }
        }
    };
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(system(me, "rendezvous"))?;
    let pid = rustix::process::getpid().as_raw_nonzero().get() as u64;
    write_words(&mut stream, &[MAGIC, me as u64, n as u64, pid]).map_err(system(me, "joining"))?;
    let answer = read_words(&mut stream, 2).map_err(|e| {
        refused(format!(
            "rank 0 did not let rank {me} join within {timeout:?}: {e} (did every rank start?)"
        ))
    })?;
    if answer != [MAGIC, OK] {
        return Err(refused(format!(
            "rank 0 refused rank {me}: another rank's environment is inconsistent (its error says which)"
        )));
    }
    let words = read_words(&mut stream, 3).map_err(system(me, "reading the settings"))?;
    let settings = Settings {
        capacity: words[0] as usize,
        reserved: words[1] as usize,
        wait_timeout: Duration::from_millis(words[2]),
    };
    let (_, control_fd) = recv_fd(&stream).map_err(system(me, "receiving the control block"))?;
    let control_map = Mapping::from_fd(control_fd, Control::bytes(members.world_size))
        .map_err(system(me, "mapping the control block"))?;
    let control = Control::open(control_map, members.world_size).map_err(refused)?;
    let own = Mapping::memfd(&format!("dist-tensor heap {me}"), settings.capacity)
        .map_err(system(me, "cannot create the heap segment"))?;
    send_fd(
        &stream,
        me as u64,
        &own.fd().expect("a memfd").try_clone_to_owned().map_err(system(me, "segment fd"))?,
    )
    .map_err(system(me, "passing the segment"))?;
    let mut segments: Vec<Option<Mapping>> = (0..members.world_size).map(|_| None).collect();
    for _ in 0..n {
        let (q, fd) = recv_fd(&stream).map_err(system(me, "receiving the segments"))?;
        let q = q as usize;
        if q >= n {
            return Err(refused(format!("rank 0 passed a segment for rank {q} of {n}")));
        }
        segments[global(q)] = Some(
            Mapping::from_fd(fd, settings.capacity)
                .map_err(system(me, format!("mapping rank {}'s segment", global(q))))?,
        );
    }
    segments[global(me)] = Some(own);
    drop(stream); // tells rank 0 this rank has mapped everything
    let heap = Heap::new(segments, settings.capacity, settings.reserved);
    let peers = PeerWatch::open(global(me), members, &control);
    Ok(Joined { heap, control, settings, peers })
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
            if matches!(rustix::event::poll(&mut poll, Some(&zero)), Ok(1))
                && control.mark_died(rank, -1)
            {
                control.fail(rank, &format!("rank {rank} {}", describe_status(-1)));
            }
        }
    }
}

fn pidfd(pid: u32) -> Option<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid as i32)?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
}
