//! The CUDA driver, loaded at run time: typed errors, the libraries' presence, one [`CudaDevice`] per
//! device per process (its context, streams and caches), events and host-mapped memory.
//!
//! Everything here goes through cudarc's `result` / `sys` layers. cudarc panics when a library
//! or a symbol is missing, so each library is checked with `is_culib_present` before its first
//! call, and first calls run under `catch_unwind`: a machine without CUDA gets an error, never a
//! panic from inside cudarc.

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result as cu, sys};

use super::blas::Blas;
use super::kernels::ModuleCache;
use crate::{Error, Result};

/// Converts a driver error into the crate's error, naming the call.
pub(crate) fn status(call: &'static str, err: cu::DriverError) -> Error {
    let name = err.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let text = err.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Error::DeviceStatus { call, code: err.0 as i32, message: format!("{name}: {text}") }
}

/// `result.map_err(status(call))`, shorter.
pub(crate) trait Check<T> {
    /// Names the failing call in the error.
    fn check(self, call: &'static str) -> Result<T>;
}

impl<T> Check<T> for std::result::Result<T, cu::DriverError> {
    fn check(self, call: &'static str) -> Result<T> {
        self.map_err(|e| status(call, e))
    }
}

impl Check<()> for sys::CUresult {
    fn check(self, call: &'static str) -> Result<()> {
        self.result().check(call)
    }
}

/// Runs a first call into a library, turning a panic inside cudarc (a missing symbol) into an
/// error.
pub(crate) fn guarded<T>(library: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into());
        Err(Error::DeviceUnavailable {
            op: "World::cuda",
            device: "cuda".into(),
            reason: format!("{library} could not be used: {message}"),
        })
    })
}

/// Checks that a library can be opened; the error lists every file name tried.
pub(crate) fn require_library(
    library: &'static str,
    file_stem: &str,
    present: unsafe fn() -> bool,
) -> Result<()> {
    // SAFETY: only tries to open the library (dlopen), calling nothing in it.
    if unsafe { present() } {
        Ok(())
    } else {
        Err(Error::LibraryNotFound { library, tried: cudarc::get_lib_name_candidates(file_stem) })
    }
}

/// The driver's variable that chooses when kernels are loaded (read once, by `cuInit`).
pub(crate) const MODULE_LOADING_ENV: &str = "CUDA_MODULE_LOADING";

/// Loads and initializes the driver once per process.
///
/// Unless the user chose otherwise, kernels are loaded eagerly (`CUDA_MODULE_LOADING=EAGER`):
/// loading a kernel waits, under the context's lock, until the GPU's queued work has drained,
/// and a kernel of a multi-rank op may be spinning until this rank's next launch. With lazy
/// loading (the driver's default since CUDA 12.2) cuBLASLt loads its GEMM kernels at their
/// first launch, in the middle of an op: on one H200 (2026-12-02) ranks sharing the GPU then
/// deadlocked in their first `matmul_reduce_scatter` (example 08, `--ranks 2`).
pub(crate) fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        require_library("the NVIDIA driver (libcuda)", "cuda", sys::is_culib_present)?;
        if std::env::var_os(MODULE_LOADING_ENV).is_none() {
            // SAFETY: runs once, before the driver (the variable's only reader) starts; the
            // library reads no other variable while a CUDA world is being opened.
            unsafe { std::env::set_var(MODULE_LOADING_ENV, "EAGER") };
        }
        guarded("libcuda", || cu::init().check("cuInit"))
    })
    .clone()
}

/// Whether the driver loads kernels lazily (at first use) in this process.
pub(crate) fn lazy_loading() -> Result<bool> {
    init()?;
    let mut mode = sys::CUmoduleLoadingMode::CU_MODULE_EAGER_LOADING;
    // SAFETY: writes `mode`.
    unsafe { sys::cuModuleGetLoadingMode(&mut mode) }.check("cuModuleGetLoadingMode")?;
    Ok(mode == sys::CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING)
}

/// Prepares `gpus` for a world of `ranks` ranks whose kernels wait on each other: refuses lazy
/// kernel loading (see [`init`]) and loads every kernel of the library now, so that no kernel
/// is loaded while an op runs.
pub(crate) fn prepare_for_ranks(
    gpus: &[Arc<CudaDevice>],
    ranks: usize,
    op: &'static str,
) -> Result<()> {
    if ranks < 2 {
        return Ok(());
    }
    if lazy_loading()? {
        return Err(Error::DeviceUnavailable {
            op,
            device: format!("cuda:{}", gpus.first().map_or(0, |g| g.ordinal)),
            reason: format!(
                "{MODULE_LOADING_ENV}=LAZY: a kernel loaded at its first launch waits for the \
                 GPU to drain, which a peer's kernel waiting for this rank never lets it do; \
                 unset {MODULE_LOADING_ENV} or set it to EAGER"
            ),
        });
    }
    let mut seen = Vec::new();
    for gpu in gpus {
        if !seen.contains(&gpu.ordinal) {
            seen.push(gpu.ordinal);
            super::kernels::preload(gpu)?;
        }
    }
    Ok(())
}

/// Number of CUDA devices visible to this process.
pub(crate) fn device_count() -> Result<usize> {
    init()?;
    Ok(cu::device::get_count().check("cuDeviceGetCount")? as usize)
}

/// One GPU of this process: its primary context, a stream for tensors outside GPU worlds (each
/// world has streams of its own, see `Streams`), a cache of freed device memory, compiled modules
/// and cuBLASLt plans.
pub(crate) struct CudaDevice {
    pub(crate) ordinal: usize,
    pub(crate) dev: sys::CUdevice,
    pub(crate) ctx: sys::CUcontext,
    pub(crate) name: String,
    pub(crate) sm_count: usize,
    pub(crate) arch: (i32, i32),
    /// Where work on tensors outside GPU worlds runs, in order.
    pub(crate) stream: sys::CUstream,
    /// Freed allocations by (stream, size), for the next allocation of that size on that stream.
    pub(crate) free_cache: Mutex<HashMap<(usize, usize), Vec<sys::CUdeviceptr>>>,
    pub(crate) modules: ModuleCache,
    /// cuBLASLt per stream (each with its own workspace, which two streams must not share).
    pub(crate) blas: Mutex<HashMap<usize, Blas>>,
}

// SAFETY: the raw handles are plain identifiers of driver objects, usable from any thread once
// the context is bound there (`bind`); the mutable caches are behind mutexes.
unsafe impl Send for CudaDevice {}
// SAFETY: as for Send.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// The process's `CudaDevice` for device `ordinal`, opened on first use.
    pub(crate) fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
        static GPUS: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
        let mut gpus = GPUS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        if let Some(gpu) = gpus.get(&ordinal) {
            return Ok(gpu.clone());
        }
        let gpu = Arc::new(CudaDevice::open(ordinal)?);
        gpus.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    fn open(ordinal: usize) -> Result<CudaDevice> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::DeviceUnavailable {
                op: "World::cuda",
                device: format!("cuda:{ordinal}"),
                reason: format!("this machine has {count} CUDA device(s)"),
            });
        }
        let dev = cu::device::get(ordinal as i32).check("cuDeviceGet")?;
        // SAFETY: `dev` is a valid device handle; the primary context is released in Drop.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.check("cuDevicePrimaryCtxRetain")?;
        // SAFETY: `ctx` was just retained.
        unsafe { cu::ctx::set_current(ctx) }.check("cuCtxSetCurrent")?;
        let attr = |a| {
            // SAFETY: `dev` is valid and `a` a device attribute.
            unsafe { cu::device::get_attribute(dev, a) }.check("cuDeviceGetAttribute")
        };
        use sys::CUdevice_attribute::*;
        let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let arch = (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let name = cu::device::get_name(dev).check("cuDeviceGetName")?;
        let stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).check("cuStreamCreate")?;
        Ok(CudaDevice {
            ordinal,
            dev,
            ctx,
            name,
            sm_count,
            arch,
            stream,
            free_cache: Mutex::new(HashMap::new()),
            modules: ModuleCache::default(),
            blas: Mutex::new(HashMap::new()),
        })
    }

    /// Makes this GPU's context current on the calling thread (cudarc binds contexts per thread).
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: the context lives as long as `self`.
        unsafe { cu::ctx::set_current(self.ctx) }.check("cuCtxSetCurrent")
    }

    /// Lets this GPU's kernels and copies reach `peer`'s memory ("already enabled" is success).
    pub(crate) fn enable_peer_access(&self, peer: &CudaDevice) -> Result<()> {
        if peer.ordinal == self.ordinal {
            return Ok(());
        }
        let mut can = 0;
        // SAFETY: both device handles are valid; `can` is written.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.dev, peer.dev) }
            .check("cuDeviceCanAccessPeer")?;
        if can == 0 {
            return Err(Error::DeviceUnavailable {
                op: "World::cuda",
                device: format!("cuda:{}", self.ordinal),
                reason: format!("it cannot access cuda:{}'s memory (no peer access)", peer.ordinal),
            });
        }
        self.bind()?;
        // SAFETY: the peer context is valid and retained by `peer`.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx, 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            other => other.check("cuCtxEnablePeerAccess"),
        }
    }

    /// Blocks until every stream of this GPU is idle. Only for tear-down and error paths:
    /// waits for ops go through the world's failure-aware wait instead.
    pub(crate) fn synchronize_now(&self) -> Result<()> {
        self.bind()?;
        cu::ctx::synchronize().check("cuCtxSynchronize")
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Process-wide GPUs live until exit; this runs only if one is ever dropped.
        let _ = self.bind();
        for (_, ptrs) in self.free_cache.get_mut().map(std::mem::take).unwrap_or_default() {
            for p in ptrs {
                // SAFETY: cached pointers came from cuMemAlloc and nothing uses them.
                let _ = unsafe { cu::free_sync(p) };
            }
        }
        // SAFETY: the context was retained in `open`.
        let _ = unsafe { cu::primary_ctx::release(self.dev) };
    }
}

/// A compute stream and a high-priority copy stream of one GPU, owned by a world's rank and by
/// every tensor made there (so that a tensor outlives its world); destroyed, once idle, when the
/// last owner goes.
pub(crate) struct Streams {
    pub(crate) gpu: Arc<CudaDevice>,
    pub(crate) main: sys::CUstream,
    pub(crate) copy: sys::CUstream,
}

// SAFETY: stream handles are usable from any thread of the process.
unsafe impl Send for Streams {}
// SAFETY: as for Send.
unsafe impl Sync for Streams {}

impl Streams {
    pub(crate) fn new(gpu: &Arc<CudaDevice>) -> Result<Streams> {
        gpu.bind()?;
        let main =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).check("cuStreamCreate")?;
        let (_, greatest) =
            cu::stream::get_priority_range().check("cuCtxGetStreamPriorityRange")?;
        let copy = cu::stream::create_with_priority(cu::stream::StreamKind::NonBlocking, greatest)
            .check("cuStreamCreateWithPriority")?;
        let streams = Streams { gpu: gpu.clone(), main, copy };
        // The products run on the main stream: their libraries start now, not mid-op.
        super::blas::prepare(gpu, main)?;
        Ok(streams)
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        for s in [self.main, self.copy] {
            // SAFETY: the stream is valid; waiting leaves it idle before its buffers are freed.
            let _ = unsafe { cu::stream::synchronize(s) };
            // cuBLASLt first: its workspace goes back to this stream's cache, freed next.
            let blas =
                self.gpu.blas.lock().unwrap_or_else(|p| p.into_inner()).remove(&(s as usize));
            drop(blas);
            super::memory::release_stream_cache(&self.gpu, s);
            // SAFETY: idle, and no owner is left.
            let _ = unsafe { cu::stream::destroy(s) };
        }
    }
}

/// A CUDA event: with timing for the report, without for ordering streams.
pub(crate) struct Event {
    pub(crate) raw: sys::CUevent,
}

// SAFETY: an event handle is usable from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as for Send.
unsafe impl Sync for Event {}

impl Event {
    /// A new event on the current context. `timing` events can be measured with `elapsed_ms`
    /// (events without timing cannot: cudarc's `new_event(None)` trap).
    pub(crate) fn new(timing: bool) -> Result<Event> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        Ok(Event { raw: cu::event::create(flags).check("cuEventCreate")? })
    }

    /// Records the event at the current end of `stream`.
    pub(crate) fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: both handles are valid.
        unsafe { cu::event::record(self.raw, stream) }.check("cuEventRecord")
    }

    /// Whether the work before the last record has finished.
    pub(crate) fn done(&self) -> Result<bool> {
        // SAFETY: the event is valid.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => other.check("cuEventQuery").map(|_| false),
        }
    }

    /// Milliseconds between `self` and `end` (both recorded, both done).
    pub(crate) fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        // SAFETY: both events are valid timing events.
        unsafe { cu::event::elapsed(self.raw, end.raw) }.check("cuEventElapsedTime")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is not used after this.
        let _ = unsafe { cu::event::destroy(self.raw) };
    }
}

/// Makes `stream` wait (on the device) for the work `event` was recorded after.
pub(crate) fn stream_wait(stream: sys::CUstream, event: &Event) -> Result<()> {
    // SAFETY: both handles are valid.
    unsafe {
        cu::stream::wait_event(stream, event.raw, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
    }
    .check("cuStreamWaitEvent")
}

/// Pinned host memory mapped into every context of the process: words the host and every GPU
/// read and write while kernels run (the world's abort word, each rank's fault record).
pub(crate) struct HostMapped {
    host: *mut c_void,
    pub(crate) device: sys::CUdeviceptr,
    words: usize,
    /// For words inside memory shared between processes (registered with the driver, see
    /// `process`): what keeps that memory mapped and registered; `None` for memory of our own.
    owner: Option<Arc<dyn Send + Sync>>,
}

// SAFETY: the memory is plain pinned host memory owned by this value; all accesses are volatile
// word reads and writes.
unsafe impl Send for HostMapped {}
// SAFETY: as for Send.
unsafe impl Sync for HostMapped {}

impl HostMapped {
    /// `words` u64 words, zeroed. A context must be current.
    pub(crate) fn new(words: usize) -> Result<HostMapped> {
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: allocates pinned memory; freed in Drop.
        let host = unsafe { cu::malloc_host(words * 8, flags) }.check("cuMemHostAlloc")?;
        // SAFETY: `host` holds `words` u64 words.
        unsafe { std::ptr::write_bytes(host as *mut u64, 0, words) };
        let mut device = 0;
        // SAFETY: `host` was allocated with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }
            .check("cuMemHostGetDevicePointer")?;
        Ok(HostMapped { host, device, words, owner: None })
    }

    /// `words` words at `host` (device address `device`) inside memory that `owner` keeps mapped
    /// and registered with the driver (a world of processes shares it).
    pub(crate) fn view(
        host: *mut u64,
        device: sys::CUdeviceptr,
        words: usize,
        owner: Arc<dyn Send + Sync>,
    ) -> HostMapped {
        HostMapped { host: host as *mut c_void, device, words, owner: Some(owner) }
    }

    /// Reads word `i`.
    pub(crate) fn get(&self, i: usize) -> u64 {
        assert!(i < self.words);
        // SAFETY: in bounds; GPUs write these words concurrently, hence volatile.
        unsafe { std::ptr::read_volatile((self.host as *const u64).add(i)) }
    }

    /// Writes word `i`.
    pub(crate) fn set(&self, i: usize, v: u64) {
        assert!(i < self.words);
        // SAFETY: in bounds; see `get`.
        unsafe { std::ptr::write_volatile((self.host as *mut u64).add(i), v) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// The device address of word `i`.
    pub(crate) fn device_word(&self, i: usize) -> u64 {
        self.device + 8 * i as u64
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        if self.owner.is_some() {
            return; // the owner unregisters and unmaps once the last view is gone
        }
        // SAFETY: allocated by cuMemHostAlloc; no kernel uses it once its world is gone.
        let _ = unsafe { cu::free_host(self.host) };
    }
}
