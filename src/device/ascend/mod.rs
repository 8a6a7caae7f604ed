//! Real NPUs: Ascend devices through the CANN runtime, loaded at run time, running the crate's
//! tile kernels written in Ascend C.
//!
//! Nothing of CANN is needed to build the crate: the runtime is opened with `libloading` when
//! first asked for, and where it is absent every call here returns an error that says why (the
//! library not found, with every path tried), while the host simulation runs as ever.
//!
//! # The shape of the backend
//!
//! It mirrors the GPU backend's: kernels as sources in the crate, compiled at first use and
//! cached, launched on symmetric device memory, one rank per device as a thread of this process.
//!
//! - [`World::ascend`](crate::World::ascend) (or [`AscendWorldBuilder`]) opens one NPU per rank
//!   and makes on each a context, a stream, an HCCL communicator (`HcclCommInitAll`) and a PE of
//!   Ascend SHMEM, whose symmetric heap the kernels work on. Without SHMEM the world builds on
//!   HCCL alone (the kernels then say they need it; the unfused baselines run).
//! - The ops' entry points (`DistTensor`'s methods, `fused::*`, `collectives::*`) exchange and
//!   check shapes on the host as ever, then, on an Ascend world, hand the work to the op's
//!   launcher in [`kernels`](KernelSource): it sizes the device buffers (symmetric ones through
//!   `aclshmem_malloc`, the same on every rank), computes the signal counts, and launches.
//! - Each kernel is an Ascend C source beside its launcher ([`KernelSource::all`]), the twin of
//!   the host kernel of the same name, in the seed's conventions: grid-stride loops over
//!   flattened task spaces, peers rotated by the rank, masks at ragged edges (exact
//!   `DataCopyPad` lengths, never padding), communication on vector sub-core 0 of mix kernels,
//!   core counts from the launch. It is compiled by `aclrtc` at its first use in a world, for
//!   the device's architecture (`--npu-arch=dav-2201` on Atlas A2/A3, or [`NPU_ARCH_ENV`]) and
//!   the element type, then loaded on every device (`aclrtBinaryLoadFromData`,
//!   `aclrtBinaryGetFunction`); its arguments are appended in the order of its signature
//!   (checked: a launcher that passes them out of order gets an error, not a kernel reading
//!   the wrong pointer) and it is launched on every AI core (mix kernels) or every vector core
//!   (vector-only ones) of the device, as the device reports them.
//! - Waits in kernels time out after the world's wait timeout and report, through a status
//!   record in device memory, the program, the signal and the values seen, as
//!   [`Error::WaitTimeout`]; the host's stream synchronisation has a timeout too.
//! - [`vendor`] calls CANN's own fused operators (MC2 `aclnnAllGatherMatmul`,
//!   `aclnnMatmulReduceScatter`) as the comparison path, and the unfused baselines
//!   (`fused::*_unfused`) run an HCCL collective and `aclnnMatmul`. [`last_path`] says which
//!   path a rank's last op took.
//!
//! # Running on NPUs
//!
//! On a machine with Atlas A2 (910B) or A3 NPUs:
//!
//! 1. Install CANN 8.3 or later (the toolkit and the kernels package) and
//!    `source /usr/local/Ascend/ascend-toolkit/set_env.sh`: the crate finds AscendCL, `aclrtc`
//!    (`libacl_rtc.so`), HCCL and the operator library through `$ASCEND_HOME_PATH`.
//! 2. Install Ascend SHMEM and `source` its `set_env.sh` (for `$SHMEM_HOME_PATH`): its
//!    `libshmem.so` and the headers the kernels include are found there.
//! 3. Run the NPU example, which checks every op against an f64 host reference and says which
//!    path ran: `cargo run --release --example ascend_npu -- --devices 0,1`. To move any
//!    program of the crate to NPUs, make its world with `World::ascend(&[0, 1, ...])` instead of
//!    `World::threads(n)`; the `DistTensor` code stays as it is.
//! 4. `ASCEND_RT_VISIBLE_DEVICES` chooses the devices the process sees, as for any CANN program;
//!    [`NPU_ARCH_ENV`] overrides the compile architecture for a SoC the crate does not know.
//!
//! Element types on NPUs: f32, f16 and bf16 (f64 has no NPU kernel and is refused, naming the
//! rank). Tensors are copied to the device for each op and the result back (no device-resident
//! tensors yet).
//!
//! # What has been verified where
//!
//! **Nothing here has run on an NPU, and no kernel source has been compiled by CANN's
//! compiler.** No NPU and no CANN were available where this backend was written. What was
//! checked, and how:
//!
//! - The C signatures of every vendor call (AscendCL, `aclrtc`, HCCL, Ascend SHMEM, `aclnn`)
//!   were taken from the vendors' public headers and documentation.
//! - Against a stand-in CANN (`tests/cann_stand_in/`, small C libraries built by the tests that
//!   record every call): the loader, the world's set-up and tear-down, the call sequence of
//!   every op (compile once, load per device, arguments in the kernel's order, launch on the
//!   device's core counts, synchronise), the SHMEM allocations, the unfused and vendor paths, and
//!   that vendor errors, compile logs and kernel timeouts come back as typed errors naming the
//!   call (`cargo test --release ascend`).
//! - **Run on the CPU**, through an executing build of the same stand-in (`tests/ascend_run.rs`):
//!   its `aclrtc` compiles the source the crate sends, with the crate's options, with the host
//!   C++ compiler against a CPU implementation of the Ascend C and Ascend SHMEM device calls the
//!   kernels use (`tests/cann_stand_in/ascendc_cpu/`), and its AscendCL runs each launch on one
//!   thread per core (mix kernels: a cube thread serving the `Matmul` products and one thread
//!   per vector sub-core of every AI core), with the device's reported core counts. The crate's
//!   side is its real path: it compiles, caches, loads and launches as on an NPU. Copies and
//!   vector ops are queued per pipe and take effect only at the synchronisation that orders
//!   them; the unified buffer's capacity, every tensor's bounds, the device allocations and the
//!   rule that only vector sub-core 0 of a mix kernel communicates are checked as the kernel
//!   runs. Every kernel runs through `World::ascend` on worlds of 1, 2, 3, 4 and 8 ranks, in
//!   f32, f16 and bf16, on ragged shapes, against f64 references, and mutated copies of the
//!   kernels (padding for a mask, no rank rotation, communication off sub-core 0, a hard-coded
//!   core count, a removed flag or barrier, a missing wait) fail.
//!
//!   **What that proves**: the kernels' logic, indexing, masks at ragged edges, task
//!   flattening, pipe synchronisation as Ascend C specifies it, signal counts and waits, the
//!   sub-core gating, and the host code around them. **What it does not**: that CANN's
//!   compiler accepts the sources (intrinsic constraints, `__aicore__` restrictions), the
//!   timing, the cube unit's exact rounding (the stand-in accumulates in f32 in order of K),
//!   hardware memory ordering beyond what the kernels' barriers and signals state, the real
//!   Matmul library's tiling, and the unfused and vendor paths (HCCL and `aclnn` compute
//!   nothing in the stand-in).
//! - The kernel sources also compile, for syntax, against a declared surface of Ascend C's API
//!   for every element type, and follow the seed's conventions (`tests/ascend_kernels.rs`).
//! - Not verified anywhere: the speed, the system counter rate the kernels' timeouts assume
//!   (50 MHz), and whether Ascend SHMEM accepts one PE per device from threads of one process
//!   (its documentation describes a PE as a process; the world checks after initialising and
//!   fails with an error saying so if not).
//!
//! The layers, as cudarc layers NVIDIA's libraries:
//!
//! | layer | holds |
//! | --- | --- |
//! | [`sys`] | the raw symbol tables, one per library, opened once and searched for in several places |
//! | [`result`] | one wrapper per C call, turning a status into [`Error::DeviceStatus`] with the vendor's message |
//! | this module | [`Ascend`] (an initialised runtime), [`AscendDevice`] (a device, reset on drop), [`CoreCounts`]; the world ([`AscendWorldBuilder`]), the kernels ([`KernelSource`]), the vendor path ([`vendor`]) |
//!
//! An NPU's [`Topology`] also lets the host simulation run a world with a real device's core
//! counts, read from the device, never written as constants.
//!
//! # Examples
//! ```
//! use dist_tensor::device::ascend::Ascend;
//! use dist_tensor::Error;
//!
//! match Ascend::open() {
//!     Ok(ascend) => {
//!         for index in 0..ascend.device_count()? {
//!             let topology = ascend.device(index)?.topology()?;
//!             assert!(topology.aicore_num() > 0);
//!         }
//!     }
//!     // No CANN here: the error names every path tried.
//!     Err(Error::LibraryNotFound { tried, .. }) => {
//!         assert!(tried.iter().any(|t| t.contains("/usr/local/Ascend/ascend-toolkit/latest/lib64")))
//!     }
//!     Err(e) => return Err(e),
//! }
//! # Ok::<(), dist_tensor::Error>(())
//! ```

mod kernels;
mod npu;
pub mod result;
pub mod sys;
mod unfused;
pub mod vendor;
pub(crate) mod world;

pub use kernels::KernelSource;
pub(crate) use npu::AscendRank;
pub use world::{
    AscendWorldBuilder, DEFAULT_DEVICE_HEAP_BYTES, NPU_ARCH_ENV, PathTaken, last_path, npu_arch,
};

/// The NPU side of the ops, for the ops' entry points (`fused`, `collectives`): each takes the
/// shapes the ranks agreed on and runs the kernel on the rank's NPU.
pub(crate) mod launch {
    pub(crate) use super::kernels::all_gather::run as all_gather;
    pub(crate) use super::kernels::all_gather_matmul::run as all_gather_matmul;
    pub(crate) use super::kernels::all_to_all::{Layout as AllToAllLayout, run as all_to_all};
    pub(crate) use super::kernels::all_to_all_v::run as all_to_all_v;
    pub(crate) use super::kernels::broadcast::run as broadcast;
    pub(crate) use super::kernels::flash_decode::run as flash_decode;
    pub(crate) use super::kernels::matmul_reduce_scatter::run as matmul_reduce_scatter;
    pub(crate) use super::kernels::reduce_scatter::run as reduce_scatter;
    pub(crate) use super::unfused::{
        all_gather_matmul as all_gather_matmul_unfused,
        matmul_reduce_scatter as matmul_reduce_scatter_unfused,
    };
}

use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use self::sys::{DevAttr, DeviceInfo};
use crate::device::Topology;
use crate::{Error, Result};

/// The environment variable that chooses which devices a process sees
/// (`ASCEND_RT_VISIBLE_DEVICES`, such as `1,3`).
///
/// The runtime applies it: it reports as many devices as the variable lists, and the ids the
/// crate takes ([`Ascend::device`]) are indices into that list. The crate reads it too, to map
/// an index back to the device it stands for ([`AscendDevice::physical_id`]) and to say so in
/// its errors.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::VISIBLE_DEVICES, "ASCEND_RT_VISIBLE_DEVICES");
/// ```
pub const VISIBLE_DEVICES: &str = "ASCEND_RT_VISIBLE_DEVICES";

/// The devices [`VISIBLE_DEVICES`] makes visible, in order; `None` when it is unset or names
/// none.
///
/// It is read as the runtime reads it: ids separated by commas, and reading stops at the first
/// entry that is not a plain number (so `1, 2` means only device 1).
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{visible_devices, VISIBLE_DEVICES};
/// if std::env::var_os(VISIBLE_DEVICES).is_none() {
///     assert_eq!(visible_devices(), None);
/// }
/// ```
pub fn visible_devices() -> Option<Vec<u32>> {
    let value = std::env::var(VISIBLE_DEVICES).ok()?;
    let ids = parse_visible(&value);
    (!ids.is_empty()).then_some(ids)
}

fn parse_visible(value: &str) -> Vec<u32> {
    value
        .split(',')
        .map_while(|entry| {
            let digits = !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit());
            digits.then(|| entry.parse::<u32>().ok()).flatten()
        })
        .collect()
}

/// A sentence on [`VISIBLE_DEVICES`] for error messages, empty when it is unset.
fn visibility_note() -> String {
    match std::env::var(VISIBLE_DEVICES) {
        Ok(value) => format!(" ({VISIBLE_DEVICES}={value})"),
        Err(_) => String::new(),
    }
}

/// An initialised CANN runtime (`aclInit` done). Cheap to clone; every clone is the same
/// runtime.
///
/// [`Ascend::open`] gives the process default, found as [`sys::Acl::load_default`] says and
/// initialised once; it stays initialised until the process exits, because older CANN allows
/// `aclInit` only once per process. A runtime made by [`Ascend::with_library`] or
/// [`Ascend::open_path`] is finalised (`aclFinalize`) when its last clone is dropped.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::Ascend;
/// use dist_tensor::Error;
///
/// let ascend = match Ascend::open() {
///     Ok(ascend) => ascend,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// let same = ascend.clone();
/// assert_eq!(same.device_count()?, ascend.device_count()?);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Clone)]
pub struct Ascend {
    runtime: Arc<Runtime>,
}

struct Runtime {
    acl: Arc<sys::Acl>,
    hccl: OnceLock<Result<Arc<sys::Hccl>>>,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // A failure to finalise has nowhere to go from a drop, and leaves nothing to undo.
        let _ = result::finalize(&self.acl);
    }
}

static DEFAULT_RUNTIME: OnceLock<Result<Ascend>> = OnceLock::new();

impl Ascend {
    /// The process default runtime: AscendCL found through `$ASCEND_HOME_PATH`, the usual
    /// install roots and the loader's path, then initialised. Done once; later calls return
    /// the same runtime, or the same error.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] listing every path tried (a machine without CANN);
    /// [`Error::SymbolMissing`] for a runtime too old; [`Error::DeviceStatus`] when `aclInit`
    /// fails, with the vendor's message.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// match Ascend::open() {
    ///     Ok(ascend) => assert!(ascend.library().provides("aclInit")),
    ///     Err(Error::LibraryNotFound { library, tried }) => {
    ///         assert!(library.starts_with("AscendCL"));
    ///         assert!(tried.iter().any(|t| t.starts_with("/usr/local/Ascend/cann/lib64/libacl_rt.so")));
    ///         assert!(tried.iter().any(|t| t.contains("loader's search path")));
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn open() -> Result<Ascend> {
        DEFAULT_RUNTIME
            .get_or_init(|| sys::Acl::load_default().and_then(Ascend::with_library))
            .clone()
    }

    /// Initialises the runtime of an open symbol table (`aclInit`); it is finalised when the
    /// last clone of the result is dropped. Prefer [`Ascend::open`]: finalising ends the
    /// runtime for the whole process, including for other handles on the same library.
    ///
    /// # Errors
    /// [`Error::DeviceStatus`] when `aclInit` fails, with the vendor's message.
    ///
    /// # Examples
    /// ```
    /// use std::path::Path;
    /// use std::sync::Arc;
    /// use dist_tensor::device::ascend::{sys::Acl, Ascend};
    /// use dist_tensor::Error;
    ///
    /// // SAFETY: the directories searched hold a CANN install when they hold anything.
    /// match unsafe { Acl::discover(Some(Path::new("/opt/no-cann-here"))) } {
    ///     Ok(acl) => assert!(Ascend::with_library(Arc::new(acl))?.device_count().is_ok()),
    ///     Err(e) => assert!(matches!(e, Error::LibraryNotFound { .. })),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn with_library(acl: Arc<sys::Acl>) -> Result<Ascend> {
        result::init(&acl)?;
        Ok(Ascend { runtime: Arc::new(Runtime { acl, hccl: OnceLock::new() }) })
    }

    /// Opens and initialises the runtime at exactly `path` (for tests and tools that must use
    /// one particular library). Finalised when the last clone is dropped.
    ///
    /// # Errors
    /// As [`sys::Acl::load`] and [`Ascend::with_library`].
    ///
    /// # Safety
    /// As [`sys::Acl::load`]: `path` must be a CANN runtime, or a library exporting the same
    /// symbols with the same C signatures.
    ///
    /// # Examples
    /// ```
    /// use std::path::Path;
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// // SAFETY: were the file present, it would be a CANN runtime.
    /// let err = unsafe { Ascend::open_path(Path::new("/opt/no-cann-here/libascendcl.so")) }
    ///     .unwrap_err();
    /// assert!(matches!(err, Error::LibraryNotFound { .. }));
    /// assert!(err.to_string().contains("/opt/no-cann-here/libascendcl.so (no such file)"));
    /// ```
    pub unsafe fn open_path(path: &Path) -> Result<Ascend> {
        // SAFETY: the caller vouches for `path`.
        let acl = unsafe { sys::Acl::load(path) }?;
        Ascend::with_library(Arc::new(acl))
    }

    /// The runtime's symbol table, for calls through [`result`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::{result, Ascend};
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// assert_eq!(result::device_count(ascend.library())?, ascend.device_count()?);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn library(&self) -> &sys::Acl {
        &self.runtime.acl
    }

    /// How many devices this process sees (`aclrtGetDeviceCount`, after the runtime applied
    /// [`VISIBLE_DEVICES`]).
    ///
    /// # Errors
    /// [`Error::DeviceStatus`] with the vendor's message.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// assert!(ascend.device_count()? < 65_536);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn device_count(&self) -> Result<u32> {
        result::device_count(&self.runtime.acl)
    }

    /// Opens device `index` (`aclrtSetDevice`) for this thread; it is reset
    /// (`aclrtResetDevice`) when the handle is dropped. `index` counts the visible devices.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] when there is no such device (naming how many there are
    /// and [`VISIBLE_DEVICES`] if set); [`Error::DeviceStatus`] when the runtime refuses it.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// let past_the_end = ascend.device_count()?;
    /// let err = ascend.device(past_the_end).unwrap_err();
    /// assert!(matches!(err, Error::DeviceUnavailable { .. }));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn device(&self, index: u32) -> Result<AscendDevice> {
        let count = self.device_count()?;
        if index >= count {
            let seen = match count {
                0 => "no device".to_string(),
                1 => "1 device (index 0)".to_string(),
                n => format!("{n} devices (indices 0 to {})", n - 1),
            };
            return Err(Error::DeviceUnavailable {
                op: "Ascend::device",
                device: device_label(index),
                reason: format!(
                    "the CANN runtime at {} sees {seen}{}",
                    self.runtime.acl.path().display(),
                    visibility_note()
                ),
            });
        }
        result::set_device(&self.runtime.acl, index)?;
        Ok(AscendDevice { ascend: self.clone(), index })
    }

    /// HCCL, the collective library, opened on first use (only collectives need it): first
    /// beside the AscendCL library, then where [`sys::Hccl::discover`] looks. The first result
    /// is kept.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] listing every path tried; [`Error::SymbolMissing`] when a
    /// communicator call is in neither `libhccl.so` nor `libhcomm.so`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// match ascend.hccl() {
    ///     Ok(hccl) => assert!(hccl.provides("HcclCommInitRootInfo")),
    ///     Err(e) => assert!(e.to_string().contains("libhccl.so")),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn hccl(&self) -> Result<Arc<sys::Hccl>> {
        self.runtime
            .hccl
            .get_or_init(|| {
                let beside = self.runtime.acl.path().parent().filter(|d| !d.as_os_str().is_empty());
                let home = sys::ascend_home_from_env();
                // SAFETY: the directory AscendCL came from and the CANN install roots hold HCCL
                // when they hold anything; the same trust as for AscendCL itself.
                unsafe { sys::Hccl::discover(beside, home.as_deref()) }.map(Arc::new)
            })
            .clone()
    }
}

impl fmt::Debug for Ascend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ascend").field("library", &self.runtime.acl.path()).finish()
    }
}

fn device_label(index: u32) -> String {
    format!("Ascend {index}")
}

/// A device opened with `aclrtSetDevice`, reset with `aclrtResetDevice` when dropped.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::Ascend;
/// use dist_tensor::Error;
///
/// let ascend = match Ascend::open() {
///     Ok(ascend) => ascend,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// if ascend.device_count()? > 0 {
///     let npu = ascend.device(0)?;
///     assert_eq!(npu.index(), 0);
///     let topology = npu.topology()?; // the device's own core counts
///     assert_eq!(topology.aivector_core_num(), npu.core_counts()?.vector_cores);
/// } // aclrtResetDevice(0) here
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct AscendDevice {
    ascend: Ascend,
    index: u32,
}

impl AscendDevice {
    /// The device's index among the visible devices (the id the runtime takes).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// if ascend.device_count()? > 0 {
    ///     assert_eq!(ascend.device(0)?.index(), 0);
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The device this index stands for: entry `index` of [`VISIBLE_DEVICES`] when it is set,
    /// otherwise the index itself.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::{visible_devices, Ascend};
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// if ascend.device_count()? > 0 && visible_devices().is_none() {
    ///     assert_eq!(ascend.device(0)?.physical_id(), 0);
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn physical_id(&self) -> u32 {
        visible_devices()
            .and_then(|ids| ids.get(self.index as usize).copied())
            .unwrap_or(self.index)
    }

    /// The chip's name (`aclrtGetSocName`), such as `Ascend910B3`.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] when the runtime gives no name (with its message), or lacks
    /// the call.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// if ascend.device_count()? > 0 {
    ///     assert!(ascend.device(0)?.soc_name()?.starts_with("Ascend"));
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn soc_name(&self) -> Result<String> {
        let acl = self.ascend.library();
        result::soc_name(acl).ok_or_else(|| {
            let reason = if acl.provides("aclrtGetSocName") {
                let message = result::recent_error_message(acl)
                    .unwrap_or_else(|| "no message from aclGetRecentErrMsg".to_string());
                format!("aclrtGetSocName returned no name: {message}")
            } else {
                format!("the CANN runtime at {} lacks aclrtGetSocName", acl.path().display())
            };
            Error::DeviceUnavailable { op: "AscendDevice::soc_name", device: self.label(), reason }
        })
    }

    /// The device's AI-core and vector-core counts: `aclrtGetDeviceInfo` where the runtime has
    /// it (newer CANN), otherwise, or when it fails, `aclGetDeviceCapability`.
    ///
    /// # Errors
    /// [`Error::DeviceStatus`] with the vendor's message (that of the newer call when both
    /// fail); [`Error::SymbolMissing`] when the runtime has neither call;
    /// [`Error::DeviceUnavailable`] for a negative count.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// if ascend.device_count()? > 0 {
    ///     let counts = ascend.device(0)?.core_counts()?;
    ///     assert!(counts.ai_cores > 0);
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn core_counts(&self) -> Result<CoreCounts> {
        let ai_cores = self.count("AI cores", DevAttr::AiCoreNum, DeviceInfo::AiCoreNum)?;
        let vector_cores =
            self.count("vector cores", DevAttr::VectorCoreNum, DeviceInfo::VectorCoreNum)?;
        Ok(CoreCounts { ai_cores, vector_cores })
    }

    /// One core count, through the newer call with a fallback to the older.
    fn count(&self, what: &str, attr: DevAttr, info: DeviceInfo) -> Result<usize> {
        let acl = self.ascend.library();
        let value = match result::device_info(acl, self.index, attr) {
            Some(Ok(value)) => Ok(value),
            Some(Err(newer)) => match result::device_capability(acl, self.index, info) {
                Some(Ok(value)) => Ok(value),
                _ => Err(newer),
            },
            None => result::device_capability(acl, self.index, info).unwrap_or_else(|| {
                Err(Error::SymbolMissing {
                    symbol: "aclrtGetDeviceInfo / aclGetDeviceCapability",
                    library: acl.path().display().to_string(),
                })
            }),
        }?;
        usize::try_from(value).map_err(|_| Error::DeviceUnavailable {
            op: "AscendDevice::core_counts",
            device: self.label(),
            reason: format!("the runtime reports {value} {what}"),
        })
    }

    /// The device's [`Topology`]: its AI cores, with vector cores / AI cores sub-cores each
    /// (24 x 2 on a 910B).
    ///
    /// # Errors
    /// As [`AscendDevice::core_counts`]; [`Error::DeviceUnavailable`] when the counts do not
    /// make a topology (see [`CoreCounts::topology`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::Ascend;
    /// use dist_tensor::Error;
    ///
    /// let ascend = match Ascend::open() {
    ///     Ok(ascend) => ascend,
    ///     // No CANN on this machine: the error lists every place looked in.
    ///     Err(e @ Error::LibraryNotFound { .. }) => {
    ///         assert!(e.to_string().contains("libascendcl.so"));
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e),
    /// };
    /// if ascend.device_count()? > 0 {
    ///     assert!(ascend.device(0)?.topology()?.sub_vec_num() >= 1);
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topology(&self) -> Result<Topology> {
        self.core_counts()?.topology_of("AscendDevice::topology", self.label())
    }

    fn label(&self) -> String {
        device_label(self.index)
    }
}

impl Drop for AscendDevice {
    fn drop(&mut self) {
        // A failure to reset has nowhere to go from a drop; the runtime releases the device at
        // finalisation in any case.
        let _ = result::reset_device(self.ascend.library(), self.index);
    }
}

impl fmt::Debug for AscendDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AscendDevice")
            .field("index", &self.index)
            .field("library", &self.ascend.library().path())
            .finish()
    }
}

/// A device's core counts, as the runtime reports them.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::CoreCounts;
/// use dist_tensor::device::Topology;
///
/// let b3 = CoreCounts { ai_cores: 24, vector_cores: 48 };
/// assert_eq!(b3.topology()?, Topology::ascend_910b());
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CoreCounts {
    /// AI cores (`ACL_DEV_ATTR_AICORE_CORE_NUM`, or info 0 of `aclGetDeviceCapability`).
    pub ai_cores: usize,
    /// Vector cores, over the whole device (`ACL_DEV_ATTR_VECTOR_CORE_NUM`, or info 1).
    pub vector_cores: usize,
}

impl CoreCounts {
    /// The topology these counts make: `ai_cores` AI cores with `vector_cores / ai_cores`
    /// vector sub-cores each.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] when there are no AI cores, or the vector cores are not a
    /// whole, positive multiple of them (a device without the split cube/vector layout the
    /// kernels are written for).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::CoreCounts;
    /// use dist_tensor::Error;
    ///
    /// let t = CoreCounts { ai_cores: 20, vector_cores: 40 }.topology()?;
    /// assert_eq!((t.aicore_num(), t.sub_vec_num()), (20, 2));
    /// let uneven = CoreCounts { ai_cores: 8, vector_cores: 7 }.topology().unwrap_err();
    /// assert!(matches!(uneven, Error::DeviceUnavailable { .. }));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topology(&self) -> Result<Topology> {
        self.topology_of("CoreCounts::topology", "Ascend".to_string())
    }

    fn topology_of(&self, op: &'static str, device: String) -> Result<Topology> {
        let CoreCounts { ai_cores, vector_cores } = *self;
        let reason = if ai_cores == 0 {
            Some("the runtime reports no AI cores".to_string())
        } else if vector_cores == 0 || vector_cores % ai_cores != 0 {
            Some(format!(
                "{vector_cores} vector cores are not a whole multiple of {ai_cores} AI cores: this \
                 device lacks the split cube/vector layout (vector sub-cores per AI core) the \
                 kernels are written for"
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => Err(Error::DeviceUnavailable { op, device, reason }),
            None => Topology::new(ai_cores, vector_cores / ai_cores),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_visible;

    #[test]
    fn visible_devices_are_read_as_the_runtime_reads_them() {
        assert_eq!(parse_visible("1,2,3"), vec![1, 2, 3]);
        assert_eq!(parse_visible("4"), vec![4]);
        // Reading stops at the first entry that is not a plain number.
        assert_eq!(parse_visible("1, 2,3"), vec![1]);
        assert_eq!(parse_visible("1,x,3"), vec![1]);
        assert_eq!(parse_visible(""), Vec::<u32>::new());
        assert_eq!(parse_visible(",1"), Vec::<u32>::new());
    }
}
