//! The tile kernels: CUDA C in `kernels/`, compiled by NVRTC for the device's architecture at
//! first use, cached per (kernel file, dtype) for the process and loaded once per GPU; their
//! argument structs (mirrors of the C structs, `#[repr(C)]`); and launching them.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result as cu, sys};
use cudarc::nvrtc::{result as rtc, sys as rtc_sys};

use super::driver::{Check, CudaDevice, guarded, require_library};
use crate::tensor::DType;
use crate::{Error, Result};

/// Most ranks a kernel's argument structs have room for (`DT_MAX_RANKS` in the C code).
pub(crate) const MAX_RANKS: usize = 8;
/// Threads per block of the data-moving kernels (their `__launch_bounds__`).
pub(crate) const BLOCK: u32 = 256;

const COMMON: &str = include_str!("kernels/common.cuh");

/// A kernel source file and the kernels in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// `dt_signal`, `dt_fill_random`.
    Signal,
    /// `dt_exchange`.
    Exchange,
    /// `dt_reduce`.
    Reduce,
    /// Local math on one tensor (`local.rs`): elementwise ops, casts, softmax, norms, sums,
    /// permutations.
    Local,
    /// Training on one tensor (`train.rs`): activation derivatives, optimizer steps.
    Train,
    /// The norms' backward pass (`norm_grad.rs`).
    NormGrad,
    /// `dt_flash_decode` (`ops/flash_decode.rs`).
    FlashDecode,
}

impl Source {
    fn text(self) -> &'static str {
        match self {
            Source::Signal => include_str!("kernels/signal.cu"),
            Source::Exchange => include_str!("kernels/exchange.cu"),
            Source::Reduce => include_str!("kernels/reduce.cu"),
            Source::Local => include_str!("kernels/local.cu"),
            Source::Train => include_str!("kernels/train.cu"),
            Source::NormGrad => include_str!("kernels/norm_grad.cu"),
            Source::FlashDecode => include_str!("kernels/flash_decode.cu"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Source::Signal => "signal.cu",
            Source::Exchange => "exchange.cu",
            Source::Reduce => "reduce.cu",
            Source::Local => "local.cu",
            Source::Train => "train.cu",
            Source::NormGrad => "norm_grad.cu",
            Source::FlashDecode => "flash_decode.cu",
        }
    }
}

fn elem_define(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
    }
}

/// Compiled images, per (source, dtype, architecture), for the whole process.
fn compiled(source: Source, dtype: DType, arch: (i32, i32)) -> Result<std::sync::Arc<Vec<u8>>> {
    type Images = Mutex<HashMap<(Source, DType, (i32, i32)), std::sync::Arc<Vec<u8>>>>;
    static IMAGES: OnceLock<Images> = OnceLock::new();
    let images = IMAGES.get_or_init(Default::default);
    if let Some(image) =
        images.lock().unwrap_or_else(|p| p.into_inner()).get(&(source, dtype, arch))
    {
        return Ok(image.clone());
    }
    require_library("NVRTC (libnvrtc)", "nvrtc", rtc_sys::is_culib_present)?;
    let image = guarded("libnvrtc", || compile(source, dtype, arch))?;
    let image = std::sync::Arc::new(image);
    images.lock().unwrap_or_else(|p| p.into_inner()).insert((source, dtype, arch), image.clone());
    Ok(image)
}

fn nvrtc_error(call: &'static str, e: rtc::NvrtcError, log: String) -> Error {
    Error::DeviceStatus { call, code: e.0 as i32, message: format!("{e:?}\n{log}") }
}

/// Compiles `source` for `dtype` to a cubin for `arch` (sm_XY).
fn compile(source: Source, dtype: DType, arch: (i32, i32)) -> Result<Vec<u8>> {
    let text = format!("#define DT_ELEM {}\n{COMMON}\n{}", elem_define(dtype), source.text());
    let text = CString::new(text).expect("kernel sources have no NUL");
    let name = CString::new(source.name()).expect("no NUL");
    let prog = rtc::create_program(&text, Some(&name))
        .map_err(|e| nvrtc_error("nvrtcCreateProgram", e, String::new()))?;
    let options = [
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "-std=c++17".to_string(),
        "-default-device".to_string(),
        "-lineinfo".to_string(),
    ];
    // SAFETY: `prog` is a valid program; destroyed below on every path.
    let compiled = unsafe { rtc::compile_program(prog, &options) };
    let log = || {
        // SAFETY: `prog` is valid.
        let raw = unsafe { rtc::get_program_log(prog) }.unwrap_or_default();
        let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let result = match compiled {
        Err(e) => {
            Err(nvrtc_error("nvrtcCompileProgram", e, format!("{}: {}", source.name(), log())))
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled; `size` is written.
            unsafe { rtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| nvrtc_error("nvrtcGetCUBINSize", e, String::new()))?;
            let mut image = vec![0u8; size];
            // SAFETY: `image` holds `size` bytes.
            unsafe { rtc_sys::nvrtcGetCUBIN(prog, image.as_mut_ptr() as *mut _) }
                .result()
                .map_err(|e| nvrtc_error("nvrtcGetCUBIN", e, String::new()))?;
            Ok(image)
        }
    };
    // SAFETY: `prog` is not used after this.
    let _ = unsafe { rtc::destroy_program(prog) };
    result
}

/// Modules loaded on one GPU, per (source, dtype).
#[derive(Default)]
pub(crate) struct ModuleCache {
    modules: Mutex<HashMap<(Source, DType), usize>>,
    functions: Mutex<HashMap<(Source, DType, &'static str), Function>>,
}

/// A kernel loaded on one GPU, with the grid that fills that GPU.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Function {
    raw: usize,
    /// Blocks of [`BLOCK`] threads that fit on one multiprocessor at once.
    pub(crate) blocks_per_sm: u32,
}

impl Function {
    fn raw(self) -> sys::CUfunction {
        self.raw as sys::CUfunction
    }
}

/// Kernel `name` of `source` for `dtype` on `gpu`, compiled and loaded on first use.
pub(crate) fn function(
    gpu: &CudaDevice,
    source: Source,
    dtype: DType,
    name: &'static str,
) -> Result<Function> {
    let cache = &gpu.modules;
    if let Some(&f) =
        cache.functions.lock().unwrap_or_else(|p| p.into_inner()).get(&(source, dtype, name))
    {
        return Ok(f);
    }
    let module = module(gpu, source, dtype)?;
    let cname = CString::new(name).expect("no NUL");
    // SAFETY: `module` is loaded; the name is a kernel of it.
    let raw = unsafe { cu::module::get_function(module, cname) }.check("cuModuleGetFunction")?;
    // SAFETY: `raw` is a valid function.
    let blocks_per_sm =
        unsafe { cu::occupancy::max_active_block_per_multiprocessor(raw, BLOCK as i32, 0) }
            .check("cuOccupancyMaxActiveBlocksPerMultiprocessor")?
            .max(1) as u32;
    let f = Function { raw: raw as usize, blocks_per_sm };
    cache.functions.lock().unwrap_or_else(|p| p.into_inner()).insert((source, dtype, name), f);
    Ok(f)
}

/// The module of `source` for `dtype` on `gpu`, compiled and loaded on first use.
fn module(gpu: &CudaDevice, source: Source, dtype: DType) -> Result<sys::CUmodule> {
    let image = compiled(source, dtype, gpu.arch)?;
    gpu.bind()?;
    let mut modules = gpu.modules.modules.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&m) = modules.get(&(source, dtype)) {
        return Ok(m as sys::CUmodule);
    }
    // SAFETY: `image` is a cubin for this GPU's architecture.
    let m = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
        .check("cuModuleLoadData")?;
    modules.insert((source, dtype), m as usize);
    Ok(m)
}

/// Every kernel source file.
const SOURCES: [Source; 7] = [
    Source::Signal,
    Source::Exchange,
    Source::Reduce,
    Source::Local,
    Source::Train,
    Source::NormGrad,
    Source::FlashDecode,
];
/// Every dtype a kernel is compiled for.
const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Every (source, dtype) pair.
fn every_kernel() -> Vec<(Source, DType)> {
    SOURCES.iter().flat_map(|&s| DTYPES.iter().map(move |&d| (s, d))).collect()
}

/// Compiles every kernel source for every dtype for `arch`, in parallel, into the process's
/// cache. Needs NVRTC only, no GPU.
fn compile_all(arch: (i32, i32)) -> Result<()> {
    std::thread::scope(|scope| {
        let compiles: Vec<_> = every_kernel()
            .into_iter()
            .map(|(source, dtype)| scope.spawn(move || compiled(source, dtype, arch)))
            .collect();
        for compile in compiles {
            compile.join().unwrap_or_else(|_| {
                Err(Error::DeviceStatus {
                    call: "nvrtcCompileProgram",
                    code: -1,
                    message: "a compiling thread panicked".into(),
                })
            })?;
        }
        Ok(())
    })
}

/// Compiles (in parallel, once per process) and loads (eagerly: see `driver::init`) every
/// kernel source for every dtype on `gpu`. A world of several ranks calls it when it opens:
/// loading a module waits for the GPU to drain, which must never happen in the middle of an op
/// whose kernels on other ranks wait for this rank's next launch.
pub(crate) fn preload(gpu: &CudaDevice) -> Result<()> {
    compile_all(gpu.arch)?;
    for (source, dtype) in every_kernel() {
        module(gpu, source, dtype)?;
    }
    Ok(())
}

/// Launches `f` with one argument, the struct `args` (copied at launch).
pub(crate) fn launch<A>(
    f: Function,
    grid: u32,
    block: u32,
    stream: sys::CUstream,
    args: &A,
) -> Result<()> {
    let mut params = [args as *const A as *mut c_void];
    // SAFETY: the kernel takes exactly one parameter of type `A` (the C mirror of it); the driver
    // copies it before returning.
    unsafe {
        cu::launch_kernel(f.raw(), (grid.max(1), 1, 1), (block, 1, 1), 0, stream, &mut params)
    }
    .check("cuLaunchKernel")
}

/// Launches `f` with the given raw parameter pointers.
pub(crate) fn launch_raw(
    f: Function,
    grid: u32,
    block: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller passes pointers to values of the kernel's parameter types, in order.
    unsafe { cu::launch_kernel(f.raw(), (grid.max(1), 1, 1), (block, 1, 1), 0, stream, params) }
        .check("cuLaunchKernel")
}

/// `Ctl` in common.cuh: where a wait reports, how it learns the world failed.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ctl {
    pub(crate) abort: u64,
    pub(crate) fault: u64,
    pub(crate) claim: u64,
    pub(crate) timeout_ns: u64,
    pub(crate) rank: u32,
    pub(crate) op: u32,
}

/// `Sync` in common.cuh: the signals and pointer table of one op on one rank.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SyncArgs {
    pub(crate) epoch: u64,
    pub(crate) table: u64,
    pub(crate) table_peer: [u64; MAX_RANKS],
    pub(crate) ready: u64,
    pub(crate) ready_peer: [u64; MAX_RANKS],
    pub(crate) done: u64,
    pub(crate) done_peer: [u64; MAX_RANKS],
    pub(crate) counter: u64,
    pub(crate) rank: u32,
    pub(crate) world: u32,
}

/// `Runs` in common.cuh: contiguous runs of elements, cut into chunks (one task each).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Runs {
    pub(crate) count: u64,
    pub(crate) a: u64,
    pub(crate) p1n: u64,
    pub(crate) len: u64,
    pub(crate) chunk: u64,
    pub(crate) chunks: u64,
    pub(crate) s0: u64,
    pub(crate) sa: u64,
    pub(crate) s1: u64,
    pub(crate) sbase: u64,
    pub(crate) d0: u64,
    pub(crate) da: u64,
    pub(crate) d1: u64,
    pub(crate) dbase: u64,
}

impl Runs {
    /// `p0n * a * p1n` runs of `len` elements; run (p0, ia, p1) starts at
    /// `src.0 + p0 * src.1 + ia * src.2 + p1 * src.3` and goes to the same form of `dst`.
    /// `chunk_bytes` cuts long runs into tasks.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        (p0n, a, p1n): (usize, usize, usize),
        len: usize,
        src: (usize, usize, usize, usize),
        dst: (usize, usize, usize, usize),
        elem_bytes: usize,
        chunk_bytes: usize,
    ) -> Runs {
        let count = if len == 0 { 0 } else { p0n * a * p1n };
        let chunk = (chunk_bytes / elem_bytes).max(1);
        Runs {
            count: count as u64,
            a: a.max(1) as u64,
            p1n: p1n.max(1) as u64,
            len: len as u64,
            chunk: chunk as u64,
            chunks: len.div_ceil(chunk).max(1) as u64,
            sbase: src.0 as u64,
            s0: src.1 as u64,
            sa: src.2 as u64,
            s1: src.3 as u64,
            dbase: dst.0 as u64,
            d0: dst.1 as u64,
            da: dst.2 as u64,
            d1: dst.3 as u64,
        }
    }

    /// One contiguous run of `len` elements from `src` to `dst` (element offsets).
    pub(crate) fn contiguous(
        len: usize,
        src: usize,
        dst: usize,
        elem_bytes: usize,
        chunk_bytes: usize,
    ) -> Runs {
        Runs::new((1, 1, 1), len, (src, 0, 0, 0), (dst, 0, 0, 0), elem_bytes, chunk_bytes)
    }

    /// Tasks this part gives the kernel.
    pub(crate) fn tasks(&self) -> u64 {
        self.count * self.chunks
    }
}

/// `ExchangeArgs` in exchange.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ExchangeArgs {
    pub(crate) ctl: Ctl,
    pub(crate) sync: SyncArgs,
    pub(crate) mode: u32,
    pub(crate) nparts: u32,
    pub(crate) mine: u64,
    pub(crate) local: u64,
    pub(crate) prefix: [u64; MAX_RANKS + 1],
    pub(crate) runs: [Runs; MAX_RANKS],
    pub(crate) peers: [u64; MAX_RANKS],
}

/// `FlashDecodeArgs` in flash_decode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FlashDecodeArgs {
    pub(crate) ctl: Ctl,
    pub(crate) sync: SyncArgs,
    pub(crate) mode: u32,
    pub(crate) ndst: u32,
    pub(crate) nsrc: u32,
    pub(crate) slot: u32,
    pub(crate) batch: u64,
    pub(crate) heads: u64,
    pub(crate) kv_heads: u64,
    pub(crate) d: u64,
    pub(crate) dv: u64,
    pub(crate) scale: f64,
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) out: u64,
    pub(crate) lse: u64,
    pub(crate) keys: u64,
    pub(crate) chunks: [u64; MAX_RANKS],
    pub(crate) src_off: [u64; MAX_RANKS + 1],
    pub(crate) recv: [u64; MAX_RANKS],
}

/// `ReduceArgs` in reduce.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ReduceArgs {
    pub(crate) ctl: Ctl,
    pub(crate) sync: SyncArgs,
    pub(crate) mode: u32,
    pub(crate) world: u32,
    pub(crate) mine: u64,
    pub(crate) out: u64,
    pub(crate) parts: [u64; MAX_RANKS],
    pub(crate) runs: Runs,
}

/// `SignalArgs` in signal.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SignalArgs {
    pub(crate) ctl: Ctl,
    pub(crate) want: u64,
    pub(crate) value: u64,
    pub(crate) n_wait: u32,
    pub(crate) n_notify: u32,
    pub(crate) wait: [u64; MAX_RANKS],
    pub(crate) wait_index: [u64; MAX_RANKS],
    pub(crate) notify: [u64; MAX_RANKS],
}

/// Grid for a kernel with `tasks` warp-sized tasks: enough blocks to fill the GPU (from its
/// multiprocessor count and the kernel's occupancy), fewer when there is less work.
pub(crate) fn grid_for(gpu: &CudaDevice, f: Function, tasks: u64) -> u32 {
    let full = gpu.sm_count as u64 * f.blocks_per_sm as u64;
    let warps_per_block = (BLOCK / 32) as u64;
    tasks.div_ceil(warps_per_block).clamp(1, full) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel file compiles, for every dtype, for Hopper (sm_90: the H200s this library
    /// runs on), wherever NVRTC loads; no GPU is needed. CI has no GPU but fetches NVRTC (see
    /// `.ci/run`), so a kernel that does not compile fails there, not first on a device.
    #[test]
    fn every_kernel_source_compiles_for_every_dtype_for_hopper() {
        if let Err(e) = require_library("NVRTC (libnvrtc)", "nvrtc", rtc_sys::is_culib_present) {
            eprintln!("skipped: {e}");
            return;
        }
        const HOPPER: (i32, i32) = (9, 0);
        let start = std::time::Instant::now();
        compile_all(HOPPER).unwrap_or_else(|e| panic!("a kernel does not compile: {e}"));
        for (source, dtype) in every_kernel() {
            let image = compiled(source, dtype, HOPPER).unwrap();
            // A cubin is an ELF file.
            assert_eq!(&image[..4], b"\x7fELF", "{} {dtype:?}", source.name());
        }
        eprintln!("{} kernel images compiled in {:.1?}", every_kernel().len(), start.elapsed());
    }
}
