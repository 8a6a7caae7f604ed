//! A world whose ranks run on NPUs: [`World::ascend`](crate::World::ascend) and
//! [`AscendWorldBuilder`].
//!
//! One rank per NPU, each a thread of this process (the shape of `World::threads`, and of the
//! vendor's own multi-device samples: one thread per device, HCCL communicators made together
//! with `HcclCommInitAll`). Per rank: a context and a stream on its device, an HCCL
//! communicator, and a PE of Ascend SHMEM for the symmetric heap the fused kernels and
//! collectives work on (`symm_at` is `aclshmem_ptr`). Where SHMEM is absent the world still
//! builds, on HCCL alone: the tile kernels then report that they need SHMEM, and the unfused
//! baselines (HCCL collective + `aclnnMatmul`) run.
//!
//! Ascend SHMEM's documentation describes a PE as a process. Whether its host library accepts
//! one PE per device from several threads of one process has not been tried on hardware: after
//! initialising, every rank checks that SHMEM reports it as its own PE of the right count, and
//! the world fails with an error that says so if not (rather than run on a confused heap).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::Duration;

use super::kernels::{self, KernelCache};
use super::npu::{AscendRankHandles, Handle, RankState};
use super::sys::{self, Acl, Hccl, Nnop, Rtc, Shmem};
use super::{Ascend, AscendDevice, result};
use crate::shmem::{DeviceRuntime, DeviceSetup};
use crate::shmem::{Rank, World};
use crate::{DType, Device, Error, Result};

const OP: &str = "World::ascend";

/// The environment variable that overrides the architecture kernels are compiled for (the
/// value of aclrtc's `--npu-arch=` option), for SoCs the crate does not know.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::NPU_ARCH_ENV, "DIST_TENSOR_NPU_ARCH");
/// ```
pub const NPU_ARCH_ENV: &str = "DIST_TENSOR_NPU_ARCH";

/// Default bytes of Ascend SHMEM's symmetric heap per device.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::DEFAULT_DEVICE_HEAP_BYTES, 1 << 30);
/// ```
pub const DEFAULT_DEVICE_HEAP_BYTES: usize = 1 << 30;

/// Host symmetric memory an Ascend world keeps for its shape exchanges and barriers (address
/// space: untouched pages cost nothing).
const HOST_META_HEAP_BYTES: usize = 64 << 20;

/// The rate of the device's system counter, which the kernels' waits measure their timeout in.
/// Assumed 50 MHz (the Atlas A2 value as commonly documented); not read from the device.
const SYSTEM_COUNTER_HZ: u64 = 50_000_000;

/// How much longer than the kernels' own wait timeout the host waits for a stream, so that a
/// kernel's timeout is reported from its status record, with the signal it waited for.
const SYNC_MARGIN: Duration = Duration::from_secs(10);

/// The `--npu-arch` a SoC's kernels are compiled for: `dav-2201` for the Atlas A2 (910B) and
/// A3 (910_93) families, whose AI cores share the architecture `aclrtc` documents; `None` for
/// others (set [`NPU_ARCH_ENV`] for them).
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::npu_arch;
/// assert_eq!(npu_arch("Ascend910B3"), Some("dav-2201"));
/// assert_eq!(npu_arch("Ascend910_9392"), Some("dav-2201"));
/// assert_eq!(npu_arch("Ascend310P3"), None);
/// ```
pub fn npu_arch(soc: &str) -> Option<&'static str> {
    (soc.starts_with("Ascend910B") || soc.starts_with("Ascend910_93")).then_some("dav-2201")
}

/// Which path an op took on an NPU, as [`last_path`] reports it.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::PathTaken;
/// let p = PathTaken::Kernel("all_gather_matmul");
/// assert_eq!(p.to_string(), "tile kernel all_gather_matmul (Ascend C, aclrtc)");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PathTaken {
    /// The crate's own tile kernel, compiled by `aclrtc`.
    Kernel(&'static str),
    /// The unfused baseline: an HCCL collective and `aclnnMatmul`.
    Unfused(&'static str),
    /// The vendor's fused operator (MC2), the comparison path.
    Vendor(&'static str),
}

impl std::fmt::Display for PathTaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathTaken::Kernel(name) => write!(f, "tile kernel {name} (Ascend C, aclrtc)"),
            PathTaken::Unfused(name) => write!(f, "unfused {name} (HCCL + aclnn)"),
            PathTaken::Vendor(name) => write!(f, "vendor fused operator {name} (MC2, aclnn)"),
        }
    }
}

/// Which path `rank`'s last op on an NPU took; `None` on a host world, or before any op.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::last_path;
/// use dist_tensor::World;
/// let paths = World::threads(2)?.run(|rank| Ok(last_path(rank)))?;
/// assert_eq!(paths, vec![None, None]); // a host world
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn last_path(rank: &Rank<'_>) -> Option<PathTaken> {
    let npu = rank.ascend()?;
    super::npu::lock(&npu.npu().state).last_path
}

/// The symmetric heap of an Ascend world.
enum Heap {
    /// Ascend SHMEM, initialised on every rank; its headers' directory, for device code.
    Shmem { shmem: Arc<Shmem>, include: Option<PathBuf> },
    /// No SHMEM: why (the error that was met looking for it, or that it was turned off).
    Absent(String),
}

/// The NPUs of an Ascend world and what was made on them; held by the
/// [`World`] (see [`World::ascend`]) and dropped with it.
pub(crate) struct AscendWorld {
    runtime: Ascend,
    pub(crate) ranks: Vec<AscendRankHandles>,
    hccl: std::result::Result<Arc<Hccl>, Error>,
    heap: Heap,
    shmem_ready: bool,
    rtc: std::result::Result<Arc<Rtc>, Error>,
    nnop: OnceLock<Result<Arc<Nnop>>>,
    arch: std::result::Result<String, String>,
    soc: String,
    pub(crate) kernels: KernelCache,
    wait_timeout: Duration,
    // Declared last: the devices are reset after every handle made on them is gone.
    _devices: Vec<AscendDevice>,
}

impl AscendWorld {
    pub(crate) fn acl(&self) -> &Acl {
        self.runtime.library()
    }

    /// Ascend SHMEM, or the error saying why `op` cannot run without it.
    pub(crate) fn shmem(&self, op: &'static str) -> Result<&Shmem> {
        match &self.heap {
            Heap::Shmem { shmem, .. } => Ok(shmem),
            Heap::Absent(why) => Err(Error::DeviceUnavailable {
                op,
                device: "Ascend".into(),
                reason: format!(
                    "the tile kernels work on Ascend SHMEM's symmetric heap, and this world has \
                     none ({why}); the unfused baselines (HCCL + aclnn) run without it"
                ),
            }),
        }
    }

    /// The run-time compiler, or the error met looking for it.
    pub(crate) fn rtc(&self, _op: &'static str) -> Result<&Rtc> {
        self.rtc.as_deref().map_err(Clone::clone)
    }

    /// HCCL, or the error met looking for it.
    pub(crate) fn hccl(&self) -> Result<&Hccl> {
        self.hccl.as_deref().map_err(Clone::clone)
    }

    /// The vendor operator library, opened at first use (only the baselines and the MC2
    /// comparison need it).
    pub(crate) fn nnop(&self) -> Result<Arc<Nnop>> {
        self.nnop
            .get_or_init(|| {
                let acl_dir = self.acl().path().parent().map(PathBuf::from);
                let home = sys::ascend_home_from_env();
                // SAFETY: the directory AscendCL came from and the CANN install roots hold the
                // operator library when they hold anything; the same trust as for AscendCL.
                unsafe { Nnop::discover(acl_dir.as_deref(), home.as_deref()) }.map(Arc::new)
            })
            .clone()
    }

    /// The options kernels are compiled with for element type `dtype`.
    pub(crate) fn compile_options(&self, op: &'static str, dtype: DType) -> Result<Vec<String>> {
        let arch = self.arch.as_ref().map_err(|reason| Error::DeviceUnavailable {
            op,
            device: "Ascend".into(),
            reason: reason.clone(),
        })?;
        let mut options = vec![
            format!("--npu-arch={arch}"),
            "-std=c++17".to_string(),
            format!("-DDT_ELEM={}", kernels::elem_type_name(op, dtype)?),
        ];
        if let Heap::Shmem { include: Some(dir), .. } = &self.heap {
            options.push(format!("-I{}", dir.display()));
        }
        Ok(options)
    }

    /// The SoC's name (`aclrtGetSocName`), as the first device reported it.
    pub(crate) fn soc(&self) -> &str {
        &self.soc
    }

    /// How long the host waits for a stream.
    pub(crate) fn sync_timeout(&self) -> Duration {
        self.wait_timeout + SYNC_MARGIN
    }

    /// The kernels' wait budget in device cycles.
    pub(crate) fn timeout_cycles(&self) -> usize {
        let cycles = self.wait_timeout.as_micros() as u64 * (SYSTEM_COUNTER_HZ / 1_000_000);
        usize::try_from(cycles.min(i64::MAX as u64)).unwrap_or(usize::MAX)
    }

    /// The communicator of rank `r`, or the error met making them.
    pub(crate) fn comm(&self, r: usize) -> Result<Handle> {
        self.hccl()?;
        Ok(self.ranks[r].comm)
    }
}

impl Drop for AscendWorld {
    fn drop(&mut self) {
        let this = &*self;
        // Each rank on a thread of its own, at once: SHMEM's finalisation is collective.
        std::thread::scope(|scope| {
            for npu in &this.ranks {
                scope.spawn(move || {
                    let acl = this.acl();
                    // SAFETY: the context lives until below; errors have nowhere to go here.
                    if unsafe { result::runtime::set_current_context(acl, npu.context.0) }.is_err()
                    {
                        return;
                    }
                    npu.release(this);
                    if let (true, Heap::Shmem { shmem, .. }) = (this.shmem_ready, &this.heap) {
                        let _ = result::shmem::finalize(shmem);
                    }
                    if let (Ok(hccl), false) = (&this.hccl, npu.comm == Handle::NULL) {
                        // SAFETY: the communicator was made for this rank and is used no more.
                        let _ = unsafe { result::hccl::comm_destroy(hccl, npu.comm.0) };
                    }
                    // SAFETY: the stream was made on this context; nothing is queued on it.
                    let _ = unsafe { result::runtime::destroy_stream(acl, npu.stream.0) };
                });
            }
        });
        for npu in &this.ranks {
            // SAFETY: every handle made on the context is gone.
            let _ = unsafe { result::runtime::destroy_context(this.acl(), npu.context.0) };
        }
    }
}

/// Settings of an Ascend world before it is made.
///
/// # Examples
/// ```
/// use std::time::Duration;
/// use dist_tensor::device::ascend::AscendWorldBuilder;
/// use dist_tensor::Error;
///
/// let built = AscendWorldBuilder::new(&[0, 1])
///     .heap_bytes(256 << 20)
///     .wait_timeout(Duration::from_secs(30))
///     .build();
/// match built {
///     Ok(world) => assert_eq!(world.num_ranks(), 2),
///     // No CANN on this machine: the error lists every path tried.
///     Err(Error::LibraryNotFound { library, .. }) => assert!(library.starts_with("AscendCL")),
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct AscendWorldBuilder {
    devices: Vec<u32>,
    runtime: Option<Ascend>,
    heap_bytes: usize,
    wait_timeout: Option<Duration>,
    shmem: bool,
}

impl AscendWorldBuilder {
    /// A world of one rank per device in `devices` (indices among the visible devices; rank `r`
    /// runs on `devices[r]`).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::AscendWorldBuilder;
    /// let builder = AscendWorldBuilder::new(&[0, 1, 2, 3]);
    /// assert!(format!("{builder:?}").contains("[0, 1, 2, 3]"));
    /// ```
    pub fn new(devices: &[u32]) -> Self {
        AscendWorldBuilder {
            devices: devices.to_vec(),
            runtime: None,
            heap_bytes: DEFAULT_DEVICE_HEAP_BYTES,
            wait_timeout: None,
            shmem: true,
        }
    }

    /// Runs on `runtime` instead of the process default ([`Ascend::open`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::{Ascend, AscendWorldBuilder};
    /// if let Ok(ascend) = Ascend::open() {
    ///     let _builder = AscendWorldBuilder::new(&[0]).runtime(ascend);
    /// }
    /// ```
    pub fn runtime(mut self, runtime: Ascend) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// Bytes of Ascend SHMEM's symmetric heap per device (default
    /// [`DEFAULT_DEVICE_HEAP_BYTES`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::AscendWorldBuilder;
    /// let builder = AscendWorldBuilder::new(&[0]).heap_bytes(64 << 20);
    /// assert!(format!("{builder:?}").contains("67108864"));
    /// ```
    pub fn heap_bytes(mut self, bytes: usize) -> Self {
        self.heap_bytes = bytes;
        self
    }

    /// How long a kernel's wait gives a peer before it reports a timeout (default: as
    /// [`World::builder`]'s).
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::device::ascend::AscendWorldBuilder;
    /// let builder = AscendWorldBuilder::new(&[0]).wait_timeout(Duration::from_secs(5));
    /// assert!(format!("{builder:?}").contains("5s"));
    /// ```
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = Some(timeout);
        self
    }

    /// Builds the world on HCCL alone, without Ascend SHMEM: only the unfused baselines and
    /// the vendor operators run (the tile kernels need the symmetric heap).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::AscendWorldBuilder;
    /// let builder = AscendWorldBuilder::new(&[0, 1]).without_shmem();
    /// assert!(format!("{builder:?}").contains("shmem: false"));
    /// ```
    pub fn without_shmem(mut self) -> Self {
        self.shmem = false;
        self
    }

    /// Opens the devices and makes the world: per rank a context, a stream, an HCCL
    /// communicator and a SHMEM PE.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] naming every path tried when CANN is absent;
    /// [`Error::InvalidArgument`] for no devices or a device named twice;
    /// [`Error::DeviceUnavailable`] for a device that does not exist, devices of different core
    /// counts, or neither SHMEM nor HCCL present (the message names both searches);
    /// [`Error::DeviceStatus`] with the vendor's message when a call fails.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::AscendWorldBuilder;
    /// use dist_tensor::Error;
    /// let err = AscendWorldBuilder::new(&[]).build().unwrap_err();
    /// assert!(matches!(err, Error::InvalidArgument { op: "World::ascend", .. }));
    /// ```
    pub fn build(self) -> Result<World> {
        let devices = self.devices.clone();
        let invalid = |reason: String| Error::InvalidArgument { op: OP, rank: 0, reason };
        if devices.is_empty() {
            return Err(invalid("a world needs at least one device".into()));
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(invalid(format!("device {d} is named twice: one rank per NPU")));
            }
        }
        let runtime = match self.runtime.clone() {
            Some(runtime) => runtime,
            None => Ascend::open()?,
        };
        let world = self.open(runtime, &devices)?;
        let topology = world._devices[0].topology()?;
        for (r, device) in world._devices.iter().enumerate().skip(1) {
            let other = device.topology()?;
            if other != topology {
                return Err(Error::DeviceUnavailable {
                    op: OP,
                    device: format!("Ascend {}", devices[r]),
                    reason: format!(
                        "its cores ({} AI cores x {}) differ from device {}'s ({} x {}): the \
                         ranks of a world share one topology",
                        other.aicore_num(),
                        other.sub_vec_num(),
                        devices[0],
                        topology.aicore_num(),
                        topology.sub_vec_num()
                    ),
                });
            }
        }
        let mut builder = World::builder(devices.len())
            .topology(topology)
            .heap_capacity(HOST_META_HEAP_BYTES)
            .device_setup(DeviceSetup::Opened(Arc::new(world)));
        if let Some(timeout) = self.wait_timeout {
            builder = builder.wait_timeout(timeout);
        }
        let world = builder.build()?;
        Ok(world)
    }

    /// Opens every device and makes its handles; the SHMEM PEs last.
    fn open(&self, runtime: Ascend, devices: &[u32]) -> Result<AscendWorld> {
        let n = devices.len();
        let opened: Vec<AscendDevice> =
            devices.iter().map(|&d| runtime.device(d)).collect::<Result<_>>()?;
        let soc = opened[0].soc_name().unwrap_or_else(|_| "an unnamed SoC".to_string());
        let arch: std::result::Result<String, String> = match std::env::var(NPU_ARCH_ENV) {
            Ok(arch) if !arch.trim().is_empty() => Ok(arch.trim().to_string()),
            _ => npu_arch(&soc).map(str::to_string).ok_or_else(|| {
                format!(
                    "the crate does not know the kernel architecture of {soc}; set \
                     {NPU_ARCH_ENV} to aclrtc's --npu-arch value for it"
                )
            }),
        };
        let acl = runtime.library();
        let mut world = AscendWorld {
            runtime: runtime.clone(),
            ranks: Vec::with_capacity(n),
            hccl: runtime.hccl(),
            heap: Heap::Absent("not initialised".into()),
            shmem_ready: false,
            rtc: Err(Error::DeviceUnavailable {
                op: OP,
                device: "Ascend".into(),
                reason: "not looked for".into(),
            }),
            nnop: OnceLock::new(),
            arch,
            soc,
            kernels: KernelCache::default(),
            wait_timeout: self.wait_timeout.unwrap_or(crate::shmem::DEFAULT_WAIT_TIMEOUT),
            _devices: opened,
        };
        for &device in devices {
            let context = Handle(result::runtime::create_context(acl, device)?);
            // The new context is current on this thread: the stream is made on it.
            let stream = match result::runtime::create_stream(acl) {
                Ok(stream) => Handle(stream),
                Err(e) => {
                    // SAFETY: just made, nothing on it.
                    let _ = unsafe { result::runtime::destroy_context(acl, context.0) };
                    return Err(e);
                }
            };
            world.ranks.push(AscendRankHandles {
                device,
                context,
                stream,
                comm: Handle::NULL,
                state: std::sync::Mutex::new(RankState::default()),
            });
        }
        if let Ok(hccl) = &world.hccl {
            let comms = result::hccl::comm_init_all(hccl, devices)?;
            for (npu, comm) in world.ranks.iter_mut().zip(comms) {
                npu.comm = Handle(comm);
            }
        }
        let acl_dir = acl.path().parent().map(PathBuf::from);
        let home = sys::ascend_home_from_env();
        // SAFETY: the directory AscendCL came from and the CANN install roots hold the run-time
        // compiler when they hold anything; the same trust as for AscendCL.
        world.rtc = unsafe { Rtc::discover(acl_dir.as_deref(), home.as_deref()) }.map(Arc::new);
        if !self.shmem {
            world.heap = Heap::Absent("turned off with AscendWorldBuilder::without_shmem".into());
        } else {
            let shmem_home = std::env::var_os(sys::SHMEM_HOME_PATH).map(PathBuf::from);
            // SAFETY: `$SHMEM_HOME_PATH`, the directory AscendCL came from and the CANN roots
            // hold Ascend SHMEM when they hold a libshmem.so.
            match unsafe {
                Shmem::discover(shmem_home.as_deref(), acl_dir.as_deref(), home.as_deref())
            } {
                Ok(shmem) => {
                    let include = shmem.include_dir();
                    let shmem = Arc::new(shmem);
                    init_shmem(&world, &shmem, self.heap_bytes)?;
                    world.heap = Heap::Shmem { shmem, include };
                    world.shmem_ready = true;
                }
                Err(e) => world.heap = Heap::Absent(e.to_string()),
            }
        }
        if let (Heap::Absent(why), Err(hccl)) = (&world.heap, &world.hccl) {
            return Err(Error::DeviceUnavailable {
                op: OP,
                device: format!("Ascend {devices:?}"),
                reason: format!(
                    "an Ascend world needs Ascend SHMEM (for the tile kernels) or HCCL (for the \
                     unfused baselines), and has neither: SHMEM: {why}; HCCL: {hccl}"
                ),
            });
        }
        Ok(world)
    }
}

/// Makes every rank a SHMEM PE, all at once (initialisation is collective), each on a thread
/// of its own with its context bound; then checks that SHMEM sees each rank as its own PE, and
/// that every peer's heap is reachable. Every collective step is taken by all ranks or by none:
/// a rank that failed stops the others before the next one.
fn init_shmem(world: &AscendWorld, shmem: &Shmem, heap_bytes: usize) -> Result<()> {
    let n = world.ranks.len();
    let acl = world.acl();
    // SAFETY: rank 0's context lives as long as the world.
    unsafe { result::runtime::set_current_context(acl, world.ranks[0].context.0) }?;
    let uid = result::shmem::unique_id(shmem)?;
    let barrier = Barrier::new(n);
    let joined: Vec<AtomicBool> = (0..n).map(|_| AtomicBool::new(false)).collect();
    let outcomes: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = world
            .ranks
            .iter()
            .enumerate()
            .map(|(r, npu)| {
                let (barrier, uid, joined) = (&barrier, &uid, &joined);
                scope.spawn(move || {
                    // SAFETY: as above, for rank r's context.
                    let bound = unsafe { result::runtime::set_current_context(acl, npu.context.0) };
                    let init =
                        bound.and_then(|()| result::shmem::init(shmem, r, n, heap_bytes, uid));
                    barrier.wait(); // every PE has initialised (or failed to)
                    let initialised = init.is_ok();
                    let outcome = init.and_then(|()| check_pe(shmem, npu.device, r, n));
                    joined[r].store(outcome.is_ok(), Ordering::SeqCst);
                    barrier.wait(); // every rank knows whether every other joined
                    if outcome.is_err() && initialised {
                        // Every PE initialised, so every one can leave together.
                        let _ = result::shmem::finalize(shmem);
                    }
                    outcome?;
                    if let Some(failed) = joined.iter().position(|j| !j.load(Ordering::SeqCst)) {
                        return Err(Error::DeviceUnavailable {
                            op: OP,
                            device: format!("Ascend {}", npu.device),
                            reason: format!(
                                "rank {failed} did not join Ascend SHMEM (its error says why)"
                            ),
                        });
                    }
                    probe_peers(shmem, npu.device, n)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::DeviceUnavailable {
                        op: OP,
                        device: "Ascend".into(),
                        reason: "a thread joining Ascend SHMEM panicked".into(),
                    })
                })
            })
            .collect()
    });
    // The first rank's own error, before a "rank r did not join".
    let mut errors: Vec<Error> = outcomes.into_iter().filter_map(Result::err).collect();
    errors.sort_by_key(|e| e.to_string().contains("did not join"));
    errors.into_iter().next().map_or(Ok(()), Err)
}

/// Checks that SHMEM reports rank `r` as its own PE, of `n`.
fn check_pe(shmem: &Shmem, device: u32, r: usize, n: usize) -> Result<()> {
    let (pe, pes) = result::shmem::my_pe_and_n_pes(shmem);
    if usize::try_from(pe) == Ok(r) && usize::try_from(pes) == Ok(n) {
        return Ok(());
    }
    Err(Error::DeviceUnavailable {
        op: OP,
        device: format!("Ascend {device}"),
        reason: format!(
            "after initialising, Ascend SHMEM reports this rank (rank {r} of {n}) as PE {pe} of \
             {pes}: this SHMEM keeps one PE per process, not one per device of a process; run \
             one process per NPU, or build the world without_shmem() for the HCCL paths"
        ),
    })
}

/// Checks, with a small symmetric allocation, that `aclshmem_ptr` gives this PE an address for
/// every peer's heap (the kernels' `symm_at` relies on it), so that an unreachable peer is an
/// error here rather than a fault in a kernel. Collective.
fn probe_peers(shmem: &Shmem, device: u32, n: usize) -> Result<()> {
    let probe = result::shmem::malloc(shmem, 64)?;
    let reachable = (0..n).try_for_each(|pe| {
        // SAFETY: `probe` is a symmetric allocation of this PE.
        unsafe { result::shmem::peer_ptr(shmem, probe, pe) }.map(drop).map_err(|e| {
            Error::DeviceUnavailable {
                op: OP,
                device: format!("Ascend {device}"),
                reason: e.to_string(),
            }
        })
    });
    // SAFETY: every PE frees the probe it allocated, in the same order; nothing uses it.
    unsafe { result::shmem::free(shmem, probe) };
    reachable
}

/// What the runtime needs of an NPU world: each rank's NPU. Its ops copy host operands to the
/// NPU and back, so tensors stay on the host; failures need no device hook (the kernels' waits
/// end through the runtime's own control block).
impl DeviceRuntime for AscendWorld {
    fn device_of(&self, rank: usize) -> Device {
        Device::Ascend(self.ranks[rank].device)
    }

    fn tensor_device(&self, _rank: usize) -> Device {
        Device::Host
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl World {
    /// A world of one rank per Ascend NPU in `devices` (indices among the visible devices),
    /// each rank a thread of this process running the tile kernels on its NPU: compiled from
    /// Ascend C with `aclrtc` at first use, on Ascend SHMEM's symmetric heap. Built by
    /// [`AscendWorldBuilder`](crate::device::ascend::AscendWorldBuilder) with its defaults; see
    /// there for the settings and [`device::ascend`](crate::device::ascend) for what has run
    /// where.
    ///
    /// # Errors
    /// As [`AscendWorldBuilder::build`](crate::device::ascend::AscendWorldBuilder::build): on a
    /// machine without CANN, [`Error::LibraryNotFound`] naming every library path tried.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Error, World};
    /// match World::ascend(&[0, 1]) {
    ///     Ok(world) => assert_eq!(world.num_ranks(), 2),
    ///     Err(Error::LibraryNotFound { tried, .. }) => {
    ///         assert!(tried.iter().any(|t| t.contains("libascendcl.so")))
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn ascend(devices: &[u32]) -> Result<World> {
        super::AscendWorldBuilder::new(devices).build()
    }
}
