//! A GPU world whose ranks are processes (`World::from_env` on GPUs): each process takes one
//! GPU by its local rank, and the ranks' symmetric heap segments are GPU memory shared between
//! the processes.
//!
//! After the host rendezvous (`shmem::process`) every process knows every rank's pid. Then a
//! second, GPU rendezvous on the abstract Unix socket `dist-tensor/<job>/cuda` (no file: nothing
//! is left behind) passes the descriptors, with `SCM_RIGHTS` as the host heap's memfds:
//!
//! 1. each rank makes its segment with `cuMemCreate` and exports it as an fd (see `vmm`);
//! 2. every other rank connects to rank 0 (the kernel's `SO_PEERCRED` pid must be the one the
//!    control block names for the rank it claims, both ways), says its rank, heap size and GPU
//!    (UUID), and sends its fd;
//! 3. rank 0 answers with the settings, whether ranks share a GPU, an NCCL id (rank 0's
//!    `ncclGetUniqueId`, where every rank has a GPU of its own), the fd of a memfd of words every
//!    process maps and registers with the driver (the abort word, every rank's fault record:
//!    what kernels read and write while they wait), then every rank's segment fd;
//! 4. every rank maps every segment (`symm_at(region, peer)` is that mapping's base plus the
//!    offset, as in the threads world), tells rank 0, and the connections close.
//!
//! The host side's pid watch raises the shared abort word when a peer dies (see
//! `shmem::device_process`): every kernel's waits give up, whichever process it runs in.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, sys};
use cudarc::nccl::sys as nc_sys;

use super::driver::{Check, CudaDevice, HostMapped};
use super::memory::{DeviceBuffer, SymmetricHeap, TensorPool};
use super::nccl::Nccl;
use super::vmm::{self, Handle, Window};
use super::world::{CudaWorld, FAULT_WORDS};
use crate::shmem::{Mapping, ProcessJob, peer_pid, recv_fd, send_fd};
use crate::{Error, Result};

const MAGIC: u64 = 0x6474_6375_6461_0001; // "dtcuda", version 1
/// Words of a hello: magic, rank, heap bytes, GPU UUID (two words), the address of the window
/// this rank reserved.
const HELLO_WORDS: usize = 6;
/// Words of rank 0's answer: magic, heap bytes, whether ranks share a GPU, whether an NCCL id
/// follows, the address of the window every process maps the segments at; then the id's bytes
/// and the number of ranks on each rank's GPU.
const ANSWER_WORDS: usize = 5;
const NCCL_ID_BYTES: usize = 128;

/// Default capacity of each rank's segment (as the threads world's heap).
const DEFAULT_GPU_HEAP_BYTES: usize = 4 << 30;

/// What a world of processes keeps beside the threads world's state.
pub(crate) struct ProcessPart {
    pub(crate) rank: usize,
    /// Per rank: how many ranks of the world run on its GPU (1 where each has its own).
    pub(crate) sharing: Vec<u32>,
    /// Rank 0's NCCL id, where every rank has its own GPU and rank 0 could load NCCL.
    nccl_id: Option<[u8; NCCL_ID_BYTES]>,
    /// The addresses every rank's segment is mapped at, the same in every process.
    window: std::ops::Range<u64>,
    /// The second half of this rank's segment, where its tensors live (see
    /// `memory::TensorPool`): a kernel publishes a tensor's own address to its peers.
    pub(crate) pool: Arc<TensorPool>,
    /// By op state: the pool's copy of an input made outside the world (a tensor of the GPU
    /// itself, in `cuMemAlloc` memory), which a kernel of that op published.
    stages: std::sync::Mutex<std::collections::HashMap<usize, DeviceBuffer>>,
}

impl ProcessPart {
    /// Whether some GPU holds more than one rank.
    pub(crate) fn shares_devices(&self) -> bool {
        self.sharing.iter().any(|&s| s > 1)
    }

    /// An address of `mine` that every process of the world can read: `mine` itself inside the
    /// segments' window (every tensor made in the world: its pool is there); else (a tensor
    /// made outside the world) a copy of the allocation holding it, queued on `stream` before
    /// the kernel that publishes it, in a pool buffer kept for op state `key`.
    pub(crate) fn publishable(&self, key: usize, mine: u64, stream: sys::CUstream) -> Result<u64> {
        if mine == 0 || self.window.contains(&mine) {
            return Ok(mine);
        }
        let (mut base, mut size) = (0, 0);
        // SAFETY: `mine` is a device address of this process; both are written.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, mine) }
            .check("cuMemGetAddressRange")?;
        let mut stages = self.stages.lock().unwrap_or_else(|p| p.into_inner());
        let at = match stages.get(&key) {
            Some(b) if b.bytes >= size => b.ptr,
            _ => {
                // The old copy goes back to the pool's cache for `stream`: only work queued
                // after this reuses it, once this rank's last kernel that published it ended
                // (kernels wait for every peer's `done`), so no peer reads it any more.
                let buf = DeviceBuffer::in_pool(&self.pool, size, stream)?;
                let at = buf.ptr;
                stages.insert(key, buf);
                at
            }
        };
        // SAFETY: both ranges are `size` bytes of device memory of this process.
        unsafe { cu::memcpy_dtod_async(at, base, size, stream) }.check("cuMemcpyDtoDAsync")?;
        Ok(at + (mine - base))
    }

    /// This rank's NCCL communicator (collective: every rank's first unfused op calls it).
    pub(crate) fn nccl(&self, gpu: &CudaDevice, n: usize) -> Result<Nccl> {
        if self.shares_devices() {
            return Err(Error::DeviceUnavailable {
                op: "NCCL",
                device: format!("cuda:{}", gpu.ordinal),
                reason: "processes of this world share a GPU, which NCCL refuses".into(),
            });
        }
        let Some(bytes) = self.nccl_id else {
            return Err(Error::DeviceUnavailable {
                op: "NCCL",
                device: format!("cuda:{}", gpu.ordinal),
                reason: "rank 0 could not load NCCL when the world was made, so it made no id"
                    .into(),
            });
        };
        // SAFETY: a plain C struct of bytes.
        let mut id: nc_sys::ncclUniqueId = unsafe { std::mem::zeroed() };
        for (d, s) in id.internal.iter_mut().zip(bytes) {
            *d = s as _;
        }
        Nccl::init_rank(gpu, n, self.rank, id)
    }
}

/// The words every process maps: the world's abort words and every rank's fault record,
/// registered with the driver so that kernels read and write them.
struct SharedWords {
    map: Mapping,
    gpu: Arc<CudaDevice>,
    device: sys::CUdeviceptr,
}

impl SharedWords {
    fn bytes(n: usize) -> usize {
        ((2 + n * FAULT_WORDS) * 8).div_ceil(4096) * 4096
    }

    fn register(gpu: &Arc<CudaDevice>, map: Mapping) -> Result<Arc<SharedWords>> {
        gpu.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the mapping is page-aligned and lives as long as the registration (Drop).
        unsafe { sys::cuMemHostRegister_v2(map.base().cast(), map.len(), flags) }
            .check("cuMemHostRegister")?;
        let mut device = 0;
        // SAFETY: registered with DEVICEMAP just above.
        let got = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, map.base().cast(), 0) };
        let words = SharedWords { map, gpu: gpu.clone(), device };
        got.check("cuMemHostGetDevicePointer")?;
        Ok(Arc::new(words))
    }

    fn view(self: &Arc<Self>, word: usize, words: usize) -> HostMapped {
        // SAFETY: inside the mapping (`bytes` has room for every view the world takes).
        let host = unsafe { (self.map.base() as *mut u64).add(word) };
        HostMapped::view(host, self.device + 8 * word as u64, words, self.clone())
    }
}

impl Drop for SharedWords {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: registered in `register`; no kernel of this process uses it any more.
        let _ = unsafe { sys::cuMemHostUnregister(self.map.base().cast()) };
    }
}

// SAFETY: a mapping and driver handles, usable from any thread.
unsafe impl Send for SharedWords {}
// SAFETY: as for Send; the words are only accessed through `HostMapped`'s volatile reads.
unsafe impl Sync for SharedWords {}

fn words(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

fn encode(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Opens this process's rank of the GPU world of `job`.
pub(crate) fn open_process_world(job: &ProcessJob<'_>) -> Result<Arc<CudaWorld>> {
    let (me, n) = (job.rank, job.world_size);
    if n > super::kernels::MAX_RANKS {
        return Err(Error::InvalidArgument {
            op: "World::from_env",
            rank: me,
            reason: format!("a GPU world has 1 to {} ranks, not {n}", super::kernels::MAX_RANKS),
        });
    }
    let count = super::driver::device_count()?;
    if count == 0 {
        return Err(Error::DeviceUnavailable {
            op: "World::from_env",
            device: "cuda".into(),
            reason: "this process sees no CUDA device (CUDA_VISIBLE_DEVICES?)".into(),
        });
    }
    let gpu = CudaDevice::get(job.local_rank % count)?;
    super::driver::prepare_for_ranks(std::slice::from_ref(&gpu), n, "World::from_env")?;
    let grain = vmm::granularity(&gpu)?;
    let capacity = match std::env::var(super::GPU_HEAP_BYTES_ENV) {
        Ok(text) => text.trim().parse().map_err(|_| Error::InvalidArgument {
            op: "World::from_env",
            rank: me,
            reason: format!("{}={text:?} is not a whole number", super::GPU_HEAP_BYTES_ENV),
        })?,
        Err(_) => DEFAULT_GPU_HEAP_BYTES,
    };
    let capacity = usize::max(capacity, 1).div_ceil(grain) * grain;
    let uuid = cu::device::get_uuid(gpu.dev).check("cuDeviceGetUuid")?;
    let uuid: Vec<u8> = uuid.bytes.iter().map(|&b| b as u8).collect();
    let uuid = [
        u64::from_le_bytes(uuid[..8].try_into().expect("16 bytes")),
        u64::from_le_bytes(uuid[8..].try_into().expect("16 bytes")),
    ];
    // Each segment: the symmetric heap, then as much again for the rank's tensors (its pool).
    let seg = 2 * capacity;
    let (own, own_fd) = Handle::create(&gpu, seg)?;
    let deadline = Instant::now() + job.join_timeout;
    // Every rank reserves the window's addresses first, where the driver likes (the processes
    // made the same calls so far, so these are mostly the same address); rank 0 then names the
    // address all use.
    let window = Window::reserve(&gpu, seg * n, 0)?;
    let (answer, words_fd, fds, to_host, mut window) = if n == 1 {
        let map = Mapping::memfd("dist-tensor gpu words", SharedWords::bytes(n))
            .map_err(system(me, "cannot create the GPU words"))?;
        (Answer { sharing: vec![1], nccl_id: None }, map, vec![], None, window)
    } else if me == 0 {
        host(job, &gpu, capacity, uuid, own_fd, window, deadline)?
    } else {
        guest(job, &gpu, capacity, uuid, own_fd, window, deadline)?
    };
    // Every segment at the same address in every process: rank q's at base + q * seg.
    window.map(&gpu, me * seg, own)?;
    for (q, fd) in fds.iter().enumerate() {
        if q == me {
            continue;
        }
        let mapped = Handle::import(&gpu, fd, seg).and_then(|h| window.map(&gpu, q * seg, h));
        mapped.map_err(|e| Error::DeviceUnavailable {
            op: "World::from_env",
            device: format!("cuda:{}", gpu.ordinal),
            reason: format!("rank {me} could not map rank {q}'s heap segment: {e}"),
        })?;
    }
    drop(fds);
    if let Some(mut stream) = to_host {
        // Mapped: rank 0 may go on (a rank that failed to map closes without this byte).
        stream.write_all(&[1]).map_err(system(me, "telling rank 0 the segments are mapped"))?;
    }
    let shared = SharedWords::register(&gpu, words_fd)?;
    let abort = shared.view(0, 2);
    let faults = (0..n).map(|r| shared.view(2 + r * FAULT_WORDS, FAULT_WORDS)).collect();
    let gpus = vec![gpu.clone(); n];
    let base = window.base;
    let at = |q: usize, half: usize| base + (q * seg + half) as u64;
    let bases = (0..n).map(|q| at(q, 0)).collect();
    // The window is unmapped when both the heap and the pool are gone (tensors, which hold the
    // pool, may outlive the world).
    let window = Arc::new(window);
    let pool = TensorPool::new(me, &gpu, at(me, capacity), capacity, window.clone());
    let heap = SymmetricHeap::from_mapped(&gpus, bases, capacity, Box::new(window));
    let part = ProcessPart {
        rank: me,
        sharing: answer.sharing,
        nccl_id: answer.nccl_id,
        window: base..at(n, 0),
        pool: Arc::new(pool),
        stages: Default::default(),
    };
    Ok(Arc::new(CudaWorld::assemble(&gpu, heap, abort, faults, job.wait_timeout, part)?))
}

struct Answer {
    sharing: Vec<u32>,
    nccl_id: Option<[u8; NCCL_ID_BYTES]>,
}

fn system(rank: usize, what: &str) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.to_string();
    move |e| Error::System { op: "World::from_env", rank, what, source: Arc::new(e) }
}

fn socket(job: &ProcessJob<'_>) -> Result<SocketAddr> {
    let name = format!("dist-tensor/{}/cuda", job.job_id);
    SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(system(job.rank, "cannot name the GPU rendezvous socket"))
}

/// The error of a rank whose peer's GPU heap segment differs from its own: `theirs` and `ours`
/// name whose size is whose in the message.
fn heap_differs(
    job: &ProcessJob<'_>,
    peer: String,
    (whose, theirs): (&str, u64),
    (mine, ours): (&str, usize),
) -> Error {
    Error::BadPeerMessage {
        op: "World::from_env",
        rank: job.rank,
        job: job.job_id.to_string(),
        peer,
        field: "gpu heap bytes",
        reason: format!(
            "{whose} GPU heap segment is {theirs} bytes, {mine} {ours} (set {} the same on every \
             rank)",
            super::GPU_HEAP_BYTES_ENV
        ),
    }
}

/// Gives up when the deadline passed or the host world failed meanwhile.
fn give_up(job: &ProcessJob<'_>, deadline: Instant, waiting_for: &str) -> Option<Error> {
    if let Some((rank, reason)) = (job.failed)() {
        return Some(Error::PeerFailed { rank: job.rank, failed_rank: rank, reason });
    }
    (Instant::now() >= deadline).then(|| Error::Environment {
        op: "World::from_env",
        reason: format!(
            "rank {} of job {:?}: {waiting_for} did not join the GPU world within {:?} (set {} \
             to wait longer)",
            job.rank,
            job.job_id,
            job.join_timeout,
            crate::shmem::job_env::JOIN_TIMEOUT_ENV
        ),
    })
}

/// What the GPU rendezvous gives a rank: the answer, the shared words, every rank's segment fd,
/// (on a rank other than 0) the connection to tell rank 0 once it mapped them, and the window of
/// addresses reserved for them (the same in every process).
type Rendezvous = (Answer, Mapping, Vec<OwnedFd>, Option<UnixStream>, Window);

/// Where every process maps the window: the address every rank reserved, where they agree;
/// else above all of them (aligned to `align`), where none of them has anything yet.
fn common_address(bases: &[u64], size: usize, align: usize) -> u64 {
    if bases.iter().all(|&b| b == bases[0]) {
        return bases[0];
    }
    let top = bases.iter().max().copied().unwrap_or(0) + size as u64;
    top.div_ceil(align as u64) * align as u64
}

/// The window at `at`: `window` itself when it is there, else a new reservation there.
fn move_window(gpu: &CudaDevice, window: Window, size: usize, at: u64) -> Result<Window> {
    if window.base == at {
        return Ok(window);
    }
    drop(window);
    Window::reserve(gpu, size, at)
}

#[allow(clippy::too_many_arguments)] // the rendezvous's inputs, named at its one call
fn host(
    job: &ProcessJob<'_>,
    gpu: &CudaDevice,
    capacity: usize,
    uuid: [u64; 2],
    own_fd: OwnedFd,
    window: Window,
    deadline: Instant,
) -> Result<Rendezvous> {
    let n = job.world_size;
    let mut bases = vec![window.base; n];
    let listener = UnixListener::bind_addr(&socket(job)?)
        .map_err(system(0, "cannot listen on the GPU rendezvous socket"))?;
    listener.set_nonblocking(true).map_err(system(0, "GPU rendezvous socket"))?;
    let mut guests: Vec<Option<UnixStream>> = (0..n).map(|_| None).collect();
    let mut fds: Vec<Option<OwnedFd>> = (0..n).map(|_| None).collect();
    let mut uuids = vec![[0u64; 2]; n];
    uuids[0] = uuid;
    fds[0] = Some(own_fd);
    while guests.iter().skip(1).any(Option::is_none) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let missing: Vec<usize> = (1..n).filter(|&r| guests[r].is_none()).collect();
                let who = format!("ranks {}", crate::error::rank_list(&missing));
                if let Some(e) = give_up(job, deadline, &who) {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(system(0, "accepting a rank")(e)),
        };
        // Only a process the host rendezvous admitted, for the rank it was admitted as.
        let Ok(pid) = peer_pid(&stream) else { continue };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let mut hello = [0u8; HELLO_WORDS * 8];
        if (&stream).read_exact(&mut hello).is_err() {
            continue;
        }
        let w = words(&hello);
        let rank = w[1] as usize;
        if w[0] != MAGIC
            || rank == 0
            || rank >= n
            || job.pids[rank] != pid
            || guests[rank].is_some()
        {
            eprintln!("dist-tensor: job {:?}: GPU rendezvous dropped pid {pid}", job.job_id);
            continue;
        }
        if w[2] != capacity as u64 {
            let peer = format!("rank {rank} (pid {pid})");
            return Err(heap_differs(job, peer, ("its", w[2]), ("rank 0's", capacity)));
        }
        let (tag, fd) = recv_fd(&stream).map_err(system(0, "receiving a GPU segment"))?;
        if tag != rank as u64 {
            continue;
        }
        uuids[rank] = [w[3], w[4]];
        bases[rank] = w[5];
        fds[rank] = Some(fd);
        guests[rank] = Some(stream);
    }
    drop(listener); // the name is gone
    let sharing: Vec<u32> =
        uuids.iter().map(|u| uuids.iter().filter(|v| *v == u).count() as u32).collect();
    let nccl_id = if sharing.iter().all(|&s| s == 1) {
        gpu.bind()?;
        Nccl::unique_id().ok().map(|id| {
            let mut bytes = [0u8; NCCL_ID_BYTES];
            for (d, s) in bytes.iter_mut().zip(id.internal) {
                *d = s as u8;
            }
            bytes
        })
    } else {
        None
    };
    let words_map = Mapping::memfd("dist-tensor gpu words", SharedWords::bytes(n))
        .map_err(system(0, "cannot create the GPU words"))?;
    let words_fd =
        words_map.fd().expect("a memfd").try_clone_to_owned().map_err(system(0, "GPU words fd"))?;
    let shares = sharing.iter().any(|&s| s > 1);
    let size = 2 * capacity * n;
    let at = common_address(&bases, size, vmm::granularity(gpu)?);
    let window = move_window(gpu, window, size, at)?;
    let mut answer =
        encode(&[MAGIC, capacity as u64, u64::from(shares), nccl_id.is_some() as u64, window.base]);
    answer.extend_from_slice(&nccl_id.unwrap_or([0; NCCL_ID_BYTES]));
    answer.extend_from_slice(&encode(&sharing.iter().map(|&s| u64::from(s)).collect::<Vec<_>>()));
    let fds: Vec<OwnedFd> = fds.into_iter().map(|f| f.expect("every segment came")).collect();
    for stream in guests.iter_mut().skip(1) {
        let stream = stream.as_mut().expect("every rank joined");
        stream
            .write_all(&answer)
            .and_then(|_| send_fd(stream, n as u64, &words_fd))
            .and_then(|_| {
                fds.iter().enumerate().try_for_each(|(q, fd)| send_fd(stream, q as u64, fd))
            })
            .map_err(system(0, "answering a rank on the GPU rendezvous"))?;
    }
    // Every rank maps every segment, says so and closes, before rank 0 goes on.
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
    for (rank, stream) in guests.iter_mut().enumerate().skip(1) {
        let stream = stream.as_mut().expect("every rank joined");
        let _ = stream.set_read_timeout(Some(left));
        let mut byte = [0u8; 1];
        if !matches!(stream.read(&mut byte), Ok(1)) || byte[0] != 1 {
            return Err(give_up(job, Instant::now(), &format!("rank {rank}")).unwrap_or_else(
                || Error::Environment {
                    op: "World::from_env",
                    reason: format!(
                        "rank {rank} could not map the GPU heap segments (its own error says why)"
                    ),
                },
            ));
        }
    }
    Ok((Answer { sharing, nccl_id }, words_map, fds, None, window))
}

#[allow(clippy::too_many_arguments)] // the rendezvous's inputs, named at its one call
fn guest(
    job: &ProcessJob<'_>,
    gpu: &CudaDevice,
    capacity: usize,
    uuid: [u64; 2],
    own_fd: OwnedFd,
    window: Window,
    deadline: Instant,
) -> Result<Rendezvous> {
    let (me, n) = (job.rank, job.world_size);
    let address = socket(job)?;
    let mut stream = loop {
        match UnixStream::connect_addr(&address) {
            Ok(s) => break s,
            Err(_) => {
                if let Some(e) = give_up(job, deadline, "rank 0") {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    };
    let pid = peer_pid(&stream).map_err(system(me, "GPU rendezvous peer"))?;
    if pid != job.pids[0] {
        return Err(Error::BadPeerMessage {
            op: "World::from_env",
            rank: me,
            job: job.job_id.to_string(),
            peer: format!("pid {pid}"),
            field: "pid",
            reason: format!(
                "the process on the GPU rendezvous is not rank 0 (pid {}): nothing was sent to it",
                job.pids[0]
            ),
        });
    }
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
    stream.set_read_timeout(Some(left)).map_err(system(me, "GPU rendezvous"))?;
    stream
        .write_all(&encode(&[MAGIC, me as u64, capacity as u64, uuid[0], uuid[1], window.base]))
        .map_err(system(me, "joining the GPU rendezvous"))?;
    send_fd(&stream, me as u64, &own_fd).map_err(system(me, "passing the GPU segment"))?;
    drop(own_fd);
    let mut answer = vec![0u8; ANSWER_WORDS * 8 + NCCL_ID_BYTES + n * 8];
    stream.read_exact(&mut answer).map_err(|e| {
        give_up(job, Instant::now(), "rank 0").unwrap_or_else(|| {
            system(me, "rank 0's answer on the GPU rendezvous (its own error says why)")(e)
        })
    })?;
    let w = words(&answer[..ANSWER_WORDS * 8]);
    let bad = |field: &'static str, reason: String| Error::BadPeerMessage {
        op: "World::from_env",
        rank: me,
        job: job.job_id.to_string(),
        peer: format!("rank 0 (pid {pid})"),
        field,
        reason,
    };
    if w[0] != MAGIC {
        return Err(bad("magic", format!("{:#x}: another version of dist-tensor?", w[0])));
    }
    if w[1] != capacity as u64 {
        let peer = format!("rank 0 (pid {pid})");
        return Err(heap_differs(job, peer, ("rank 0's", w[1]), ("this rank's", capacity)));
    }
    let nccl_id = (w[3] != 0).then(|| {
        let mut id = [0u8; NCCL_ID_BYTES];
        id.copy_from_slice(&answer[ANSWER_WORDS * 8..ANSWER_WORDS * 8 + NCCL_ID_BYTES]);
        id
    });
    let sharing: Vec<u32> =
        words(&answer[ANSWER_WORDS * 8 + NCCL_ID_BYTES..]).iter().map(|&s| s as u32).collect();
    if sharing.iter().any(|&s| s == 0 || s as usize > n) {
        return Err(bad("sharing", format!("{sharing:?} is no count of ranks per GPU")));
    }
    let (tag, words_fd) = recv_fd(&stream).map_err(system(me, "receiving the GPU words"))?;
    if tag != n as u64 {
        return Err(bad("GPU words tag", format!("{tag}, not the world size {n}")));
    }
    let words_map = Mapping::from_fd(words_fd, SharedWords::bytes(n))
        .map_err(system(me, "mapping the GPU words"))?;
    let mut fds = Vec::with_capacity(n);
    for q in 0..n {
        let (tag, fd) = recv_fd(&stream).map_err(system(me, "receiving the GPU segments"))?;
        if tag != q as u64 {
            return Err(bad("segment tag", format!("{tag} where rank {q}'s segment was due")));
        }
        fds.push(fd);
    }
    // The addresses rank 0 named: those this rank holds already, as a rule; else addresses above
    // every rank's reservation (if they are taken here after all, the error says so).
    let window = move_window(gpu, window, 2 * capacity * n, w[4])?;
    Ok((Answer { sharing, nccl_id }, words_map, fds, Some(stream), window))
}

#[cfg(test)]
mod tests {
    use super::common_address;

    #[test]
    fn the_window_goes_where_every_rank_reserved_it_or_above_them_all() {
        assert_eq!(common_address(&[0x7000_0000, 0x7000_0000], 1 << 20, 1 << 21), 0x7000_0000);
        let at = common_address(&[0x7000_0000, 0x7020_0000, 0x6000_0000], 1 << 20, 1 << 21);
        assert!(at >= 0x7020_0000 + (1 << 20) && at.is_multiple_of(1 << 21), "{at:#x}");
    }
}
