//! A world of GPUs in one process: one rank per GPU, peer access both ways, the symmetric heap,
//! per-op signals and buffers, the world's failure state, and waiting for a GPU without hanging.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::driver::{CudaDevice, Event, HostMapped, Streams};
use super::kernels::{Ctl, MAX_RANKS, SyncArgs};
use super::memory::{DeviceBuffer, SymmRegion, SymmetricHeap};
use super::nccl::Nccl;
use crate::error::ProgramLabel;
use crate::shmem::{Call, Rank};
use crate::{Error, Result};

use super::GPU_HEAP_BYTES_ENV;

/// Default capacity of each GPU's symmetric heap.
const DEFAULT_GPU_HEAP_BYTES: usize = 4 << 30;

/// Words of a rank's fault record (host-mapped): 1 rank, 2 program, 3 signal, 4 awaited, 5 seen,
/// 6 ready, 7 op.
pub(crate) const FAULT_WORDS: usize = 8;

/// What every kernel of a world polls, and where a failed wait reports. Shared by the world and
/// every device tensor made in it, so that waiting for one reports the world's failure.
pub(crate) struct Watch {
    /// Word 0: non-zero once the world failed (kernels read it); word 1: 1 + the rank that
    /// failed first on the host, if one did.
    abort: HostMapped,
    faults: Vec<HostMapped>,
    pub(crate) timeout: Duration,
    nccl: Mutex<Option<Arc<Nccl>>>,
    /// What the rank that failed first on the host said.
    reason: Mutex<Option<String>>,
    /// A world of processes: the abort word may be raised by another process, whose reason
    /// this process's watch thread copies here from the control block a moment later.
    in_processes: bool,
}

impl Watch {
    /// Fails the world: every wait of every kernel gives up, NCCL operations are aborted.
    pub(crate) fn abort(&self, failed_rank: Option<usize>, reason: &str) {
        if let Some(r) = failed_rank {
            // In a world of processes the word may have been set by the failed rank's own
            // process (shared memory): the reason still comes here, once, for that rank.
            let first = self.abort.get(1);
            if first == 0 {
                self.abort.set(1, r as u64 + 1);
            }
            if first == 0 || first == r as u64 + 1 {
                self.reason
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(|| reason.to_string());
            }
        }
        self.abort.set(0, 1);
        if let Some(nccl) = self.nccl.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            nccl.abort();
        }
    }

    pub(crate) fn aborted(&self) -> bool {
        self.abort.get(0) != 0
    }

    /// The error `rank` reports once the world failed, or `Ok` if it did not.
    pub(crate) fn check(&self, rank: usize) -> Result<()> {
        if !self.aborted() {
            return Ok(());
        }
        let fault = &self.faults[rank];
        if fault.get(6) != 0 {
            return Err(Error::WaitTimeout {
                rank: fault.get(1) as usize,
                program: ProgramLabel::Program { id: fault.get(2) as usize, sub_vec: 0 },
                signal: fault.get(3) as usize,
                awaited: format!(">= {} (op {})", fault.get(4), op_name(fault.get(7) as u32)),
                seen: fault.get(5),
                timeout: self.timeout,
            });
        }
        let faulted = (0..self.faults.len()).find(|&r| self.faults[r].get(6) != 0);
        let (failed_rank, reason) = match faulted {
            Some(r) => (r, format!("a wait of rank {r}'s kernels timed out")),
            None => (self.abort.get(1).checked_sub(1).map_or(rank, |r| r as usize), self.reason()),
        };
        Err(Error::PeerFailed { rank, failed_rank, reason })
    }

    /// What the rank that failed first said. In a world of processes the failed process wrote
    /// it to the control block before it raised the abort word, and this process's watch thread
    /// copies it here within a millisecond or so: wait that long rather than say less.
    fn reason(&self) -> String {
        let start = Instant::now();
        loop {
            if let Some(r) = self.reason.lock().unwrap_or_else(|p| p.into_inner()).clone() {
                return r;
            }
            if !self.in_processes || start.elapsed() > Duration::from_millis(200) {
                return "the world failed".into();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Waits until `event` is done, polling, so that a failed world ends the wait: when the
    /// world fails, its kernels end (every wait in them gives up) and this returns the error.
    pub(crate) fn wait_event(&self, rank: usize, event: &Event) -> Result<()> {
        let start = Instant::now();
        // Kernel waits time out on their own; past that (and a margin) the GPU itself is stuck.
        let limit = self.timeout * 2 + Duration::from_secs(10);
        let mut spins = 0u32;
        while !event.done()? {
            if start.elapsed() > limit {
                self.abort(Some(rank), "its GPU did not finish");
                return Err(Error::DeviceUnavailable {
                    op: "wait for GPU work",
                    device: format!("rank {rank}"),
                    reason: format!("the GPU did not finish within {limit:?}; the world is failed"),
                });
            }
            spins += 1;
            if spins < 200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.check(rank)
    }
}

/// Names of the ops, for fault records (`Ctl::op`).
pub(crate) fn op_name(op: u32) -> &'static str {
    match op {
        OP_BARRIER => "barrier",
        OP_ALL_GATHER_MATMUL => "all_gather_matmul",
        OP_MATMUL_REDUCE_SCATTER => "matmul_reduce_scatter",
        OP_ALL_TO_ALL => "all_to_all",
        OP_ALL_GATHER => "all_gather",
        OP_REDUCE => "reduce",
        OP_BROADCAST => "broadcast",
        OP_FLASH_DECODE => "flash_decode",
        _ => "unknown",
    }
}

pub(crate) const OP_BARRIER: u32 = 1;
pub(crate) const OP_ALL_GATHER_MATMUL: u32 = 2;
pub(crate) const OP_MATMUL_REDUCE_SCATTER: u32 = 3;
pub(crate) const OP_ALL_TO_ALL: u32 = 4;
pub(crate) const OP_ALL_GATHER: u32 = 5;
pub(crate) const OP_REDUCE: u32 = 6;
pub(crate) const OP_BROADCAST: u32 = 7;
pub(crate) const OP_FLASH_DECODE: u32 = 8;

/// Words of an op's signal region: table, ready, done (one per rank each), then the block
/// counter.
const SIGNAL_WORDS: usize = 3 * MAX_RANKS + 1;

/// The state one rank keeps for one op (or one path of an op) between calls: its signals,
/// symmetric buffers, local buffers and the number of calls so far (the epoch its signals carry;
/// signals are never reset).
pub(crate) struct OpState {
    pub(crate) epoch: u64,
    signals: SymmRegion,
    buffers: HashMap<&'static str, SymmRegion>,
    locals: HashMap<&'static str, DeviceBuffer>,
    /// Events for ordering this op's streams, made once and recorded again on every call (a
    /// wait on an event takes its state when queued, so reuse is safe).
    events: Vec<Event>,
}

/// A world of GPUs, one rank per GPU.
pub(crate) struct CudaWorld {
    pub(crate) gpus: Vec<Arc<CudaDevice>>,
    /// Per rank: the streams its ops run on (a world of its own, so that two worlds on the same
    /// GPUs never queue behind each other's waits).
    pub(crate) streams: Vec<Arc<Streams>>,
    pub(crate) heap: SymmetricHeap,
    pub(crate) watch: Arc<Watch>,
    /// Per rank: a u32 in device memory that the first failing wait claims.
    claims: SymmRegion,
    states: Vec<Mutex<HashMap<&'static str, OpState>>>,
    /// A world of processes (one rank in this process): what its NCCL needs (see `process`).
    pub(crate) process: Option<super::process::ProcessPart>,
    /// Per rank: how many ranks of this world run on its GPU (1 unless the world lists a device
    /// more than once). Kernels that wait on peers take that share of the GPU's SMs, so that
    /// every rank's waiting kernel is resident at once and none starves another of SMs.
    sharing: Vec<u32>,
}

impl CudaWorld {
    /// Opens `devices` (CUDA ordinals, rank `r` on `devices[r]`), enables peer access between
    /// every pair, and makes the symmetric heaps.
    pub(crate) fn open(devices: &[usize], wait_timeout: Duration) -> Result<CudaWorld> {
        if devices.is_empty() || devices.len() > MAX_RANKS {
            return Err(Error::InvalidArgument {
                op: "World::cuda",
                rank: 0,
                reason: format!("a GPU world has 1 to {MAX_RANKS} devices, not {}", devices.len()),
            });
        }
        // A device listed more than once holds several ranks (correctness on one GPU): each its
        // own heap segment and streams; a device cannot enable peer access to itself, so only
        // distinct devices are paired.
        let gpus = devices.iter().map(|&d| CudaDevice::get(d)).collect::<Result<Vec<_>>>()?;
        for a in &gpus {
            for b in gpus.iter().filter(|b| b.ordinal != a.ordinal) {
                a.enable_peer_access(b)?;
            }
        }
        super::driver::prepare_for_ranks(&gpus, devices.len(), "World::cuda")?;
        let sharing: Vec<u32> =
            devices.iter().map(|d| devices.iter().filter(|e| *e == d).count() as u32).collect();
        let heap_bytes = match std::env::var(GPU_HEAP_BYTES_ENV) {
            Ok(text) => text.trim().parse().map_err(|_| Error::InvalidArgument {
                op: "World::cuda",
                rank: 0,
                reason: format!("{GPU_HEAP_BYTES_ENV}={text:?} is not a whole number"),
            })?,
            Err(_) => DEFAULT_GPU_HEAP_BYTES,
        };
        let heap = SymmetricHeap::new(&gpus, heap_bytes)?;
        gpus[0].bind()?;
        let watch = Arc::new(Watch {
            abort: HostMapped::new(2)?,
            faults: (0..gpus.len()).map(|_| HostMapped::new(FAULT_WORDS)).collect::<Result<_>>()?,
            timeout: wait_timeout,
            nccl: Mutex::new(None),
            reason: Mutex::new(None),
            in_processes: false,
        });
        let n = gpus.len();
        let claims = (0..n).map(|r| heap.alloc(r, 256)).collect::<Result<Vec<_>>>()?[0];
        for (r, gpu) in gpus.iter().enumerate() {
            gpu.bind()?;
            // SAFETY: the claim word is in this rank's heap segment.
            unsafe { cudarc::driver::result::memset_d8_sync(heap.symm_at(claims, r), 0, 256) }
                .map_err(|e| super::driver::status("cuMemsetD8", e))?;
        }
        let streams = gpus.iter().map(|g| Streams::new(g).map(Arc::new)).collect::<Result<_>>()?;
        Ok(CudaWorld {
            sharing,
            streams,
            gpus,
            heap,
            watch,
            claims,
            states: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
            process: None,
        })
    }

    /// The world of rank `part.rank` of a world of processes: `gpu` is its GPU (every slot of
    /// `gpus` holds it: this process has no other), `heap` maps every rank's segment, `abort`
    /// and `faults` are words every process of the world maps (see `process`).
    pub(crate) fn assemble(
        gpu: &Arc<CudaDevice>,
        heap: SymmetricHeap,
        abort: HostMapped,
        faults: Vec<HostMapped>,
        wait_timeout: Duration,
        part: super::process::ProcessPart,
    ) -> Result<CudaWorld> {
        let n = faults.len();
        let me = part.rank;
        gpu.bind()?;
        let watch = Arc::new(Watch {
            abort,
            faults,
            timeout: wait_timeout,
            nccl: Mutex::new(None),
            reason: Mutex::new(None),
            in_processes: true,
        });
        // Every rank allocates its claim word at the same offset; only its own is used.
        let claims = (0..n).map(|r| heap.alloc(r, 256)).collect::<Result<Vec<_>>>()?[0];
        // SAFETY: the claim word is in this rank's own segment.
        unsafe { cudarc::driver::result::memset_d8_sync(heap.symm_at(claims, me), 0, 256) }
            .map_err(|e| super::driver::status("cuMemsetD8", e))?;
        let streams = Arc::new(Streams::new(gpu)?);
        Ok(CudaWorld {
            gpus: vec![gpu.clone(); n],
            streams: vec![streams; n],
            heap,
            watch,
            claims,
            states: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
            sharing: part.sharing.clone(),
            process: Some(part),
        })
    }

    /// Number of ranks.
    pub(crate) fn num_ranks(&self) -> usize {
        self.gpus.len()
    }

    /// Whether some GPU holds more than one rank of this world. NCCL refuses such a world
    /// ("Duplicate GPU detected"), and timings in it mean nothing.
    pub(crate) fn shares_devices(&self) -> bool {
        self.sharing.iter().any(|&s| s > 1)
    }

    /// The NCCL communicators of this world, made on first use.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] when ranks share a GPU (callers use the world's own
    /// collectives there instead).
    pub(crate) fn nccl(&self) -> Result<Arc<Nccl>> {
        if self.shares_devices() {
            return Err(Error::DeviceUnavailable {
                op: "NCCL",
                device: format!("cuda:{}", self.gpus[0].ordinal),
                reason: "ranks of this world share a GPU, which NCCL refuses".into(),
            });
        }
        let mut guard = self.watch.nccl.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = guard.as_ref() {
            return Ok(n.clone());
        }
        let nccl = Arc::new(match &self.process {
            Some(part) => part.nccl(&self.gpus[part.rank], self.num_ranks())?,
            None => Nccl::new(&self.gpus)?,
        });
        *guard = Some(nccl.clone());
        Ok(nccl)
    }
}

/// One rank's view of a GPU world, for the duration of an op on that rank's thread.
#[derive(Clone, Copy)]
pub(crate) struct CudaRank<'w> {
    pub(crate) world: &'w CudaWorld,
    pub(crate) rank: usize,
    /// The rank in the world's runtime, whose one exchange the ranks agree through; absent only
    /// for what one rank does alone (waiting for its GPU, placing a tensor).
    host: Option<&'w Rank<'w>>,
}

impl<'w> CudaRank<'w> {
    /// Rank `rank` of `world` on its own, with its GPU's context bound to this thread.
    pub(crate) fn new(world: &'w CudaWorld, rank: usize) -> Result<Self> {
        world.gpus[rank].bind()?;
        Ok(CudaRank { world, rank, host: None })
    }

    /// `host`'s rank of `world`, with its GPU's context bound to this thread.
    pub(crate) fn of(world: &'w CudaWorld, host: &'w Rank<'w>) -> Result<Self> {
        let rank = host.rank();
        world.gpus[rank].bind()?;
        Ok(CudaRank { world, rank, host: Some(host) })
    }

    /// The rank in the world's runtime, for its exchange.
    pub(crate) fn host(&self) -> Result<&'w Rank<'w>> {
        self.host.ok_or(Error::InvalidArgument {
            op: "device::cuda",
            rank: self.rank,
            reason: "a collective step outside a rank's op (no exchange to meet the others in)"
                .into(),
        })
    }

    pub(crate) fn gpu(&self) -> &'w Arc<CudaDevice> {
        &self.world.gpus[self.rank]
    }

    pub(crate) fn num_ranks(&self) -> usize {
        self.world.num_ranks()
    }

    /// How many ranks share this rank's GPU (1 unless the world lists a device twice).
    pub(crate) fn sharing(&self) -> u32 {
        self.world.sharing[self.rank]
    }

    /// Grid for kernel `f` with `tasks` warp-sized tasks on this rank: `kernels::grid_for`, on
    /// this rank's share of its GPU. Where ranks share the GPU, the share is one block per SM of
    /// `1 / sharing` of the SMs: a rank's waiting kernel then leaves the other SMs free of its
    /// blocks for the work a peer must finish before it signals. (The hang this was first
    /// written against turned out to be lazy kernel loading: see `driver::init`.)
    pub(crate) fn grid_for(&self, f: super::kernels::Function, tasks: u64) -> u32 {
        let sms = self.gpu().sm_count as u32;
        let share = match self.sharing() {
            1 => sms * f.blocks_per_sm,
            sharing => sms / sharing,
        };
        super::kernels::grid_for(self.gpu(), f, tasks).min(share.max(1))
    }

    pub(crate) fn stream(&self) -> sys::CUstream {
        self.world.streams[self.rank].main
    }

    pub(crate) fn copy_stream(&self) -> sys::CUstream {
        self.world.streams[self.rank].copy
    }

    /// Where tensors this rank makes belong.
    pub(crate) fn home(&self) -> super::storage::Home {
        super::storage::Home {
            streams: Some(self.world.streams[self.rank].clone()),
            watch: Some((self.world.watch.clone(), self.rank)),
            pool: self.world.process.as_ref().map(|p| p.pool.clone()),
        }
    }

    /// What this rank's kernels of op `op` report to.
    pub(crate) fn ctl(&self, op: u32) -> Ctl {
        let w = &self.world.watch;
        Ctl {
            abort: w.abort.device_word(0),
            fault: w.faults[self.rank].device_word(0),
            claim: self.world.heap.symm_at(self.world.claims, self.rank),
            timeout_ns: w.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: self.rank as u32,
            op,
        }
    }

    /// The error this rank reports if the world failed.
    pub(crate) fn check(&self) -> Result<()> {
        self.world.watch.check(self.rank)
    }

    /// Waits (failure-aware) until everything queued on this rank's streams is done.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let (main, copy) = (Event::new(false)?, Event::new(false)?);
        main.record(self.stream())?;
        copy.record(self.copy_stream())?;
        self.world.watch.wait_event(self.rank, &main)?;
        self.world.watch.wait_event(self.rank, &copy)
    }

    /// Meets every rank (a barrier) through the world's one exchange. Fails when the world does,
    /// or after the wait timeout.
    pub(crate) fn barrier(&self, why: &'static str) -> Result<()> {
        self.host()?.exchange(Call::untyped(why), &[], None, &[]).map(drop)
    }

    /// Runs `f` on this rank's state for op `key`, made on first use (collective: every rank
    /// calls the same ops in the same order).
    pub(crate) fn with_state<R>(
        &self,
        key: &'static str,
        f: impl FnOnce(&mut OpState) -> Result<R>,
    ) -> Result<R> {
        let mut states = self.world.states[self.rank].lock().unwrap_or_else(|p| p.into_inner());
        if !states.contains_key(key) {
            let signals = self.world.heap.alloc(self.rank, SIGNAL_WORDS * 8)?;
            // SAFETY: the region is in this rank's segment; zeroed before any peer can use it
            // (peers signal only after this rank's first kernel of the op published).
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    self.world.heap.symm_at(signals, self.rank),
                    0,
                    signals.bytes,
                    self.stream(),
                )
            }
            .map_err(|e| super::driver::status("cuMemsetD8Async", e))?;
            states.insert(
                key,
                OpState {
                    epoch: 0,
                    signals,
                    buffers: HashMap::new(),
                    locals: HashMap::new(),
                    events: Vec::new(),
                },
            );
            drop(states);
            // Every rank's signals must be zero before any rank's first kernel signals it.
            self.synchronize()?;
            self.barrier("cuda op state")?;
            states = self.world.states[self.rank].lock().unwrap_or_else(|p| p.into_inner());
        }
        f(states.get_mut(key).expect("inserted above"))
    }

    /// The signal and pointer-table addresses of `state` for this call (epoch already advanced).
    pub(crate) fn sync_args(&self, state: &OpState) -> SyncArgs {
        let heap = &self.world.heap;
        let n = self.num_ranks();
        let word = |peer: usize, i: usize| heap.symm_at(state.signals, peer) + 8 * i as u64;
        let mut s = SyncArgs {
            epoch: state.epoch,
            table: word(self.rank, 0),
            ready: word(self.rank, MAX_RANKS),
            done: word(self.rank, 2 * MAX_RANKS),
            counter: word(self.rank, 3 * MAX_RANKS),
            rank: self.rank as u32,
            world: n as u32,
            ..SyncArgs::default()
        };
        for p in 0..n {
            s.table_peer[p] = word(p, 0);
            s.ready_peer[p] = word(p, MAX_RANKS);
            s.done_peer[p] = word(p, 2 * MAX_RANKS);
        }
        s
    }

    /// The symmetric buffer `name` of `state`, at least `bytes` long: the same region on every
    /// rank. Growing it is collective: every rank first waits until its GPU is idle (no peer
    /// still writes the old region), then the old region is freed and a larger one allocated.
    pub(crate) fn symmetric(
        &self,
        state: &mut OpState,
        name: &'static str,
        bytes: usize,
    ) -> Result<SymmRegion> {
        if let Some(&r) = state.buffers.get(name)
            && r.bytes >= bytes
        {
            return Ok(r);
        }
        self.synchronize()?;
        self.barrier("cuda symmetric buffer")?;
        let old = state.buffers.remove(name);
        if let Some(old) = old {
            self.world.heap.free(self.rank, old);
        }
        // Geometric growth, so that slowly growing shapes reallocate rarely; exactly what is
        // asked for when that does not fit (every rank takes the same branch: same heaps).
        let want = bytes.max(old.map_or(0, |r| r.bytes * 3 / 2));
        let region = match self.world.heap.alloc(self.rank, want) {
            Ok(r) => r,
            Err(_) if want > bytes => self.world.heap.alloc(self.rank, bytes)?,
            Err(e) => return Err(e),
        };
        state.buffers.insert(name, region);
        Ok(region)
    }

    /// This rank's own buffer `name` of `state` (not symmetric), at least `bytes` long.
    pub(crate) fn local(
        &self,
        state: &mut OpState,
        name: &'static str,
        bytes: usize,
    ) -> Result<u64> {
        if let Some(b) = state.locals.get(name)
            && b.bytes >= bytes
        {
            return Ok(b.ptr);
        }
        let buf = DeviceBuffer::new(self.gpu(), bytes, self.stream())?;
        let ptr = buf.ptr;
        // The old buffer goes back to the cache; only work queued after this reuses it.
        state.locals.insert(name, buf);
        Ok(ptr)
    }

    /// Makes `to` wait for the work queued on `from` so far, through `state`'s event `slot`.
    pub(crate) fn join(
        &self,
        state: &mut OpState,
        slot: usize,
        from: sys::CUstream,
        to: sys::CUstream,
    ) -> Result<()> {
        while state.events.len() <= slot {
            state.events.push(Event::new(false)?);
        }
        let event = &state.events[slot];
        event.record(from)?;
        super::driver::stream_wait(to, event)
    }

    /// An address of `mine` (the input a kernel of `state` publishes to its peers) that every
    /// rank can read: `mine` itself in a world of threads; in a world of processes, see
    /// `process::ProcessPart::publishable`.
    pub(crate) fn publishable(
        &self,
        state: &OpState,
        mine: u64,
        stream: sys::CUstream,
    ) -> Result<u64> {
        match &self.world.process {
            Some(part) => part.publishable(state.signals.offset, mine, stream),
            None => Ok(mine),
        }
    }

    /// `region` on rank `peer`.
    pub(crate) fn symm_at(&self, region: SymmRegion, peer: usize) -> u64 {
        self.world.heap.symm_at(region, peer)
    }
}
