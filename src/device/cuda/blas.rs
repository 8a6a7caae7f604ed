//! GEMM through cuBLASLt and cuBLAS: row-major `C[m, n] = A[m, k] B[k, n]`, half types in, f32
//! accumulate, output in the element type or in f32 (partials of matmul_reduce_scatter). Plans
//! (descriptors, layouts and the chosen algorithm) are cached per shape and alignment: the safe
//! cudarc call rebuilds them on every call, which costs host time at decode sizes. A large
//! product runs cuBLAS's own choice (`cublasGemmEx`, what PyTorch calls) where cuBLAS can run it:
//! in the training step of `gpu_report --train` on one H200 (2026-12-04, five rounds taking turns)
//! the step was 0.4% to 2.3% faster with it than with the fastest of cuBLASLt's candidates and
//! cuBLAS's own, each timed alone (the timed choice was slower inside the step than alone).
//! [`GEMM_ALGO_ENV`](super::GEMM_ALGO_ENV) asks for that timed choice or for cuBLASLt's
//! heuristic's first instead.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::cublas::sys as blas_sys;
use cudarc::cublaslt::{result as lt, sys as lt_sys};
use cudarc::driver::{result as cu, sys};

use super::driver::{Check, CudaDevice, guarded, require_library};
use super::memory::DeviceBuffer;
use super::{GEMM_ALGO_ENV, GemmCandidate};
use crate::tensor::DType;
use crate::{Error, Result};

/// Workspace cuBLASLt may use per call (what NVIDIA recommends for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;
/// Candidate algorithms asked of the heuristic.
const CANDIDATES: usize = 8;
/// Products of at least this many multiply-adds (m * n * k) get their algorithm chosen by timing
/// the candidates; smaller ones take the heuristic's first.
const TUNE_MIN_WORK: u64 = 1 << 32;
/// Timed runs per candidate and pass.
const TUNE_RUNS: usize = 5;
/// Untimed runs of each candidate before timing, to bring the clocks up.
const TUNE_WARMUP: usize = 3;

/// How a large product's algorithm is picked ([`GEMM_ALGO_ENV`](super::GEMM_ALGO_ENV)).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Choice {
    Tuned,
    Cublas,
    Heuristic,
}

/// The [`Choice`] that `value` (of [`GEMM_ALGO_ENV`], `None` where unset) names.
fn parse_choice(value: Option<&str>) -> std::result::Result<Choice, String> {
    match value {
        Some("tuned") => Ok(Choice::Tuned),
        None | Some("cublas") => Ok(Choice::Cublas),
        Some("heuristic") => Ok(Choice::Heuristic),
        Some(other) => {
            Err(format!("{GEMM_ALGO_ENV}={other:?}: expected tuned, cublas or heuristic"))
        }
    }
}

/// The process's [`Choice`], or the error naming the variable's bad value.
fn choice() -> Result<Choice> {
    static CHOICE: OnceLock<std::result::Result<Choice, String>> = OnceLock::new();
    CHOICE
        .get_or_init(|| parse_choice(std::env::var(GEMM_ALGO_ENV).ok().as_deref()))
        .clone()
        .map_err(|reason| Error::Environment { op: "matmul on a GPU", reason })
}

/// How candidate algorithms are timed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// Untimed products first (of the first candidate, or of each with `warm_all`).
    pub(crate) warmup: usize,
    pub(crate) warm_all: bool,
    /// Passes over the candidates, and products a candidate runs in one pass.
    pub(crate) passes: usize,
    pub(crate) runs: usize,
}

impl Timing {
    /// What a plan's tuning does: every candidate warmed, so that the GPU runs at the clocks of
    /// sustained work before any is timed (a burst of the first candidate alone picked, on one
    /// H200, an algorithm 7% slower under load than the best).
    const TUNE: Timing = Timing { warmup: TUNE_WARMUP, warm_all: true, passes: 3, runs: TUNE_RUNS };
}

/// A product's algorithm: one of cuBLASLt's, or cuBLAS's own choice (`cublasGemmEx` /
/// `cublasGemmStridedBatchedEx` with its default tensor-op algorithm).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Algo {
    Lt(lt_sys::cublasLtMatmulAlgo_t),
    Cublas,
}

/// `algo`'s configuration attributes, for [`GemmCandidate::config`].
fn algo_config(algo: &Algo) -> String {
    use lt_sys::cublasLtMatmulAlgoConfigAttributes_t::*;
    let algo = match algo {
        Algo::Cublas => return "cuBLAS's own (cublasGemmEx, default tensor-op algorithm)".into(),
        Algo::Lt(algo) => algo,
    };
    let get = |attr, bytes: usize| {
        let (mut value, mut written) = (0u32, 0usize);
        // SAFETY: `algo` is an initialised algorithm; the attribute is an integer of `bytes`
        // (4, or 2 for the uint16_t ones of cublasLt.h) bytes, and `value` has room for it
        // (little-endian: the low bytes).
        let status = unsafe {
            lt_sys::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                &mut value as *mut u32 as *mut c_void,
                bytes,
                &mut written,
            )
        };
        if status == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS { value as i64 } else { -1 }
    };
    format!(
        "cuBLASLt id {} tile {} stages {} split-k {} swizzle {} cluster {}",
        get(CUBLASLT_ALGO_CONFIG_ID, 4),
        get(CUBLASLT_ALGO_CONFIG_TILE_ID, 4),
        get(CUBLASLT_ALGO_CONFIG_STAGES_ID, 4),
        get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 4),
        get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 4),
        get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 2),
    )
}

fn blas_error(call: &'static str, e: lt::CublasError) -> Error {
    Error::DeviceStatus { call, code: e.0 as i32, message: format!("{:?}", e.0) }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    input: DType,
    output: DType,
    align: [u32; 3],
    batch: Batch,
    transposed: Transposed,
}

impl PlanKey {
    /// Multiply-adds of the whole call.
    fn work(&self) -> u64 {
        (self.m * self.n * self.k * self.batch.count) as u64
    }
}

/// Operands stored transposed and read so in place (cuBLASLt's transpose flags, no copy): `a`
/// stored `[k, m]`, `b` stored `[n, k]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct Transposed {
    pub(crate) a: bool,
    pub(crate) b: bool,
}

/// `count` products in one call (cuBLASLt's strided batch): product `i` reads `a` at `i *
/// stride_a` elements and `b` at `i * stride_b` (0: the same matrix for every product) and
/// writes `c` at `i * m * n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Batch {
    pub(crate) count: usize,
    pub(crate) stride_a: u64,
    pub(crate) stride_b: u64,
}

impl Batch {
    /// One product.
    pub(crate) const ONE: Batch = Batch { count: 1, stride_a: 0, stride_b: 0 };
}

struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    algo: Algo,
}

/// One stream's cuBLASLt and cuBLAS handles, workspace and plans.
pub(crate) struct Blas {
    handle: lt_sys::cublasLtHandle_t,
    /// cuBLAS's handle on this stream, with the workspace; `None` where libcublas is absent
    /// (its candidate is then not offered).
    cublas: Option<blas_sys::cublasHandle_t>,
    /// The stream this `Blas` serves (its products are queued there).
    stream: sys::CUstream,
    workspace: DeviceBuffer,
    plans: HashMap<PlanKey, Plan>,
}

fn cuda_type(d: DType) -> lt_sys::cudaDataType {
    match d {
        DType::F32 => lt_sys::cudaDataType::CUDA_R_32F,
        DType::F64 => lt_sys::cudaDataType::CUDA_R_64F,
        DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => lt_sys::cudaDataType::CUDA_R_16BF,
    }
}

fn cublas_type(d: DType) -> blas_sys::cudaDataType {
    match d {
        DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        DType::F64 => blas_sys::cudaDataType::CUDA_R_64F,
        DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
    }
}

/// `key`'s m, n and k as cuBLAS's 32-bit ints, where they and the batch's strides fit.
fn cublas_dims(key: &PlanKey) -> Option<(i32, i32, i32)> {
    let fits = |v: usize| i32::try_from(v).ok();
    fits(key.batch.count)?;
    Some((fits(key.m)?, fits(key.n)?, fits(key.k)?))
}

/// A cuBLAS handle bound to `stream`, using `workspace` (cuBLASLt's: the two run in order on
/// one stream); `None` where libcublas is absent or fails to start (its candidate is then left
/// out, as an optional extra).
fn cublas_handle(stream: sys::CUstream, workspace: u64) -> Option<blas_sys::cublasHandle_t> {
    // SAFETY: only opens the library (dlopen).
    if !unsafe { blas_sys::is_culib_present() } {
        return None;
    }
    let mut h = std::ptr::null_mut();
    let ok = guarded("libcublas", || {
        // SAFETY: `h` receives a new handle under the current context (the caller bound it);
        // the stream and workspace outlive it (both belong to the `Blas` that owns it). The
        // workspace is set after the stream (setting a stream resets it).
        let ok = unsafe {
            blas_sys::cublasCreate_v2(&mut h) == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && bind_cublas(h, stream, workspace)
        };
        Ok(ok)
    })
    .unwrap_or(false);
    if ok {
        Some(h)
    } else {
        if !h.is_null() {
            // SAFETY: the handle was made above and is not used after this.
            let _ = unsafe { blas_sys::cublasDestroy_v2(h) };
        }
        None
    }
}

/// Queues `h`'s calls on `stream`, with `WORKSPACE_BYTES` at `workspace` (set after the stream:
/// setting a stream resets the workspace). Whether both calls succeeded.
///
/// # Safety
/// `h` is a live cuBLAS handle; the stream and the workspace outlive its use with them.
unsafe fn bind_cublas(h: blas_sys::cublasHandle_t, stream: sys::CUstream, workspace: u64) -> bool {
    // SAFETY: as the caller promises.
    unsafe {
        blas_sys::cublasSetStream_v2(h, stream as blas_sys::cudaStream_t)
            == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && blas_sys::cublasSetWorkspace_v2(h, workspace as *mut c_void, WORKSPACE_BYTES)
                == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
    }
}

pub(crate) fn dtype_bytes(d: DType) -> usize {
    match d {
        DType::F32 => 4,
        DType::F64 => 8,
        DType::F16 | DType::BF16 => 2,
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each plan owns its descriptors, destroyed once, when no call uses them any
        // more (they belong to no handle).
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Some(h) = self.cublas {
            // SAFETY: the handle is not used after this.
            let _ = unsafe { blas_sys::cublasDestroy_v2(h) };
        }
        // SAFETY: the handle is not used after this.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// The largest power of two (at most 256) dividing `ptr`: what cuBLASLt may assume.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 { 256 } else { (1u64 << ptr.trailing_zeros().min(8)) as u32 }
}

impl Blas {
    fn new(gpu: &Arc<CudaDevice>, stream: sys::CUstream) -> Result<Blas> {
        require_library("cuBLASLt (libcublasLt)", "cublasLt", lt_sys::is_culib_present)?;
        // The handle belongs to the context current now: bind this GPU's first (a handle made
        // under another GPU's context fails with EXECUTION_FAILED).
        gpu.bind()?;
        let handle = guarded("libcublasLt", || {
            lt::create_handle().map_err(|e| blas_error("cublasLtCreate", e))
        })?;
        let workspace = DeviceBuffer::new(gpu, WORKSPACE_BYTES, stream)?;
        let cublas = cublas_handle(stream, workspace.ptr);
        Ok(Blas { handle, cublas, stream, workspace, plans: HashMap::new() })
    }

    fn plan(&mut self, gpu: &Arc<CudaDevice>, key: PlanKey) -> Result<&Plan> {
        if !self.plans.contains_key(&key) {
            let plan = self.make_plan(gpu, key)?;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    fn make_plan(&self, gpu: &Arc<CudaDevice>, key: PlanKey) -> Result<Plan> {
        // Checked for every product, so that a bad value fails at once, not at the first large one.
        let choice = choice()?;
        let mut plan = self.describe(key)?;
        let algos = self.candidate_algos(key, &plan, CANDIDATES)?;
        plan.algo = algos[0];
        if algos.len() > 1 && key.work() >= TUNE_MIN_WORK {
            plan.algo = match choice {
                Choice::Tuned => self.fastest(gpu, key, &plan, &algos)?,
                Choice::Cublas => *algos.iter().find(|&&a| a == Algo::Cublas).unwrap_or(&algos[0]),
                Choice::Heuristic => algos[0],
            };
        }
        Ok(plan)
    }

    /// cuBLASLt's heuristic's candidates (up to `count`, its first choice first), then cuBLAS's
    /// own where it can run the product.
    fn candidate_algos(&self, key: PlanKey, plan: &Plan, count: usize) -> Result<Vec<Algo>> {
        let mut algos: Vec<Algo> =
            self.heuristic(key, plan, count)?.into_iter().map(Algo::Lt).collect();
        if self.cublas.is_some() && cublas_dims(&key).is_some() {
            algos.push(Algo::Cublas);
        }
        Ok(algos)
    }

    /// The descriptor and layouts of `key`'s product (its algorithm left unset).
    fn describe(&self, key: PlanKey) -> Result<Plan> {
        let (compute, scale) = if key.input == DType::F64 {
            (lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_64F, lt_sys::cudaDataType::CUDA_R_64F)
        } else {
            (lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, lt_sys::cudaDataType::CUDA_R_32F)
        };
        let desc = lt::create_matmul_desc(compute, scale)
            .map_err(|e| blas_error("cublasLtMatmulDescCreate", e))?;
        // Column-major view of the row-major product: C^T (n x m) = B^T (n x k) * A^T (k x m).
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let layout = |t, rows, cols, ld| {
            lt::create_matrix_layout(cuda_type(t), rows, cols, ld as i64)
                .map_err(|e| blas_error("cublasLtMatrixLayoutCreate", e))
        };
        let transpose = |attr| {
            // cublasOperation_t (an int32_t in cublas_api.h, not in cudarc's cuBLASLt module):
            // CUBLAS_OP_T is 1.
            const CUBLAS_OP_T: i32 = 1;
            // SAFETY: `desc` is valid; the value is the attribute's type.
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc,
                    attr,
                    &CUBLAS_OP_T as *const i32 as *const c_void,
                    size_of::<i32>(),
                )
            }
            .map_err(|e| blas_error("cublasLtMatmulDescSetAttribute", e))
        };
        use lt_sys::cublasLtMatmulDescAttributes_t::{
            CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB,
        };
        // Our B, transposed or not, is the column-major call's first operand, our A its second.
        let b_layout = if key.transposed.b {
            transpose(CUBLASLT_MATMUL_DESC_TRANSA)?;
            layout(key.input, k, n, k)?
        } else {
            layout(key.input, n, k, n)?
        };
        let a_layout = if key.transposed.a {
            transpose(CUBLASLT_MATMUL_DESC_TRANSB)?;
            layout(key.input, m, k, m)?
        } else {
            layout(key.input, k, m, k)?
        };
        let c_layout = layout(key.output, n, m, n)?;
        if key.batch.count > 1 {
            let batch = key.batch;
            for (l, stride) in
                [(b_layout, batch.stride_b), (a_layout, batch.stride_a), (c_layout, m * n)]
            {
                let count = i32::try_from(batch.count).map_err(|_| Error::InvalidShape {
                    op: "Tensor::matmul",
                    reason: format!(
                        "{} products in one batch is more than cuBLASLt takes",
                        batch.count
                    ),
                })?;
                use lt_sys::cublasLtMatrixLayoutAttribute_t::*;
                let stride = stride as i64;
                // SAFETY: `l` is valid; each value is the attribute's type in native layout.
                unsafe {
                    lt::set_matrix_layout_attribute(
                        l,
                        CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &count as *const i32 as *const c_void,
                        size_of::<i32>(),
                    )
                    .and_then(|()| {
                        lt::set_matrix_layout_attribute(
                            l,
                            CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            &stride as *const i64 as *const c_void,
                            size_of::<i64>(),
                        )
                    })
                }
                .map_err(|e| blas_error("cublasLtMatrixLayoutSetAttribute", e))?;
            }
        }
        Ok(Plan {
            desc,
            layouts: [a_layout, b_layout, c_layout],
            // Replaced by the caller before any launch.
            algo: Algo::Cublas,
        })
    }

    /// Up to `count` of cuBLASLt's candidate algorithms for `plan`, best guess first.
    fn heuristic(
        &self,
        key: PlanKey,
        plan: &Plan,
        count: usize,
    ) -> Result<Vec<lt_sys::cublasLtMatmulAlgo_t>> {
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let [a_layout, b_layout, c_layout] = plan.layouts;
        let desc = plan.desc;
        let pref = lt::create_matmul_pref()
            .map_err(|e| blas_error("cublasLtMatmulPreferenceCreate", e))?;
        let set = |attr, value: &[u8]| {
            // SAFETY: `pref` is valid; `value` is the attribute's value in native layout.
            unsafe {
                lt::set_matmul_pref_attribute(
                    pref,
                    attr,
                    value.as_ptr() as *const c_void,
                    value.len(),
                )
            }
            .map_err(|e| blas_error("cublasLtMatmulPreferenceSetAttribute", e))
        };
        use lt_sys::cublasLtMatmulPreferenceAttributes_t::*;
        set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(WORKSPACE_BYTES as u64).to_ne_bytes())?;
        // Operand "A" of the column-major call is our B, "B" our A.
        set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align[1].to_ne_bytes())?;
        set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align[0].to_ne_bytes())?;
        set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align[2].to_ne_bytes())?;
        set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align[2].to_ne_bytes())?;
        let mut found =
            vec![std::mem::MaybeUninit::<lt_sys::cublasLtMatmulHeuristicResult_t>::zeroed(); count];
        let mut returned = 0;
        // SAFETY: every descriptor is valid and describes this product; `found` has room for
        // `count` results.
        let status = unsafe {
            lt_sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                b_layout,
                a_layout,
                c_layout,
                c_layout,
                pref,
                count as i32,
                found.as_mut_ptr() as *mut _,
                &mut returned,
            )
        };
        // SAFETY: `pref` is not used after this.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        // SAFETY: the first `count` results were written.
        let algos: Vec<lt_sys::cublasLtMatmulAlgo_t> = found[..returned.max(0) as usize]
            .iter()
            .map(|r| unsafe { r.assume_init() })
            .filter(|r| {
                r.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && r.workspaceSize <= WORKSPACE_BYTES
            })
            .map(|r| r.algo)
            .collect();
        if status.result().is_err() || algos.is_empty() {
            return Err(Error::DeviceStatus {
                call: "cublasLtMatmulAlgoGetHeuristic",
                code: status as i32,
                message: format!(
                    "no cuBLASLt algorithm for [{m}, {k}] x [{k}, {n}] ({} -> {}) with operand alignments {:?} bytes: {status:?}",
                    key.input, key.output, key.align
                ),
            });
        }
        Ok(algos)
    }

    /// Times each candidate algorithm on random operands of the plan's shape (on a stream of its
    /// own, so that nothing else queued waits) and returns the fastest: the heuristic's first
    /// choice is not always the fastest (measured on H200: a product of half the rows took more
    /// than half the time of the whole).
    fn fastest(
        &self,
        gpu: &Arc<CudaDevice>,
        key: PlanKey,
        plan: &Plan,
        algos: &[Algo],
    ) -> Result<Algo> {
        let times = self.time_on_own_stream(gpu, key, plan, algos, Timing::TUNE)?;
        let best = (0..algos.len())
            .filter(|&i| times[i].is_finite())
            .min_by(|&a, &b| times[a].total_cmp(&times[b]))
            .unwrap_or(0);
        Ok(algos[best])
    }

    /// [`Blas::time_candidates`] on a stream made for it, destroyed after.
    fn time_on_own_stream(
        &self,
        gpu: &Arc<CudaDevice>,
        key: PlanKey,
        plan: &Plan,
        algos: &[Algo],
        timing: Timing,
    ) -> Result<Vec<f32>> {
        // A stream of its own (not `Streams`, whose drop takes the cuBLASLt lock held here).
        let stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).check("cuStreamCreate")?;
        let result = self.time_candidates(gpu, key, plan, algos, stream, timing);
        // SAFETY: the stream is idle (the timing synchronized it, or failed before queuing).
        let _ = unsafe { cu::stream::synchronize(stream) };
        super::memory::release_stream_cache(gpu, stream);
        // SAFETY: nothing uses the stream any more.
        let _ = unsafe { cu::stream::destroy(stream) };
        result
    }

    /// Milliseconds of one product with each candidate (infinite where it failed to launch):
    /// after `timing.warmup` untimed products, `timing.passes` passes over the candidates of
    /// `timing.runs` products each, each candidate's fastest pass.
    fn time_candidates(
        &self,
        gpu: &Arc<CudaDevice>,
        key: PlanKey,
        plan: &Plan,
        algos: &[Algo],
        stream: sys::CUstream,
        timing: Timing,
    ) -> Result<Vec<f32>> {
        let (ib, ob) = (dtype_bytes(key.input), dtype_bytes(key.output));
        // Elements each operand spans over the whole batch.
        let Batch { count, stride_a, stride_b } = key.batch;
        let (a_len, b_len) = (
            key.m * key.k + stride_a as usize * (count - 1),
            key.k * key.n + stride_b as usize * (count - 1),
        );
        let a = DeviceBuffer::new(gpu, a_len * ib + 256, stream)?;
        let b = DeviceBuffer::new(gpu, b_len * ib + 256, stream)?;
        let c = DeviceBuffer::new(gpu, key.m * key.n * count * ob + 256, stream)?;
        let f = super::kernels::function(
            gpu,
            super::kernels::Source::Signal,
            key.input,
            "dt_fill_random",
        )?;
        for (buf, len, seed) in [(&a, a_len, 1u64), (&b, b_len, 2)] {
            let (mut ptr, mut n, mut s) = (buf.ptr, len as u64 + 256 / ib as u64, seed);
            let mut params = [
                &mut ptr as *mut u64 as *mut c_void,
                &mut n as *mut u64 as *mut c_void,
                &mut s as *mut u64 as *mut c_void,
            ];
            super::kernels::launch_raw(f, gpu.sm_count as u32 * 4, 256, stream, &mut params)?;
        }
        // A workspace of its own: products queued on the plan's stream before this may still
        // be using that one.
        let workspace = DeviceBuffer::new(gpu, WORKSPACE_BYTES, stream)?;
        let on = (stream, workspace.ptr);
        let times = match self.cublas {
            // SAFETY: the handle is this `Blas`'s, used by no one else while `self` is borrowed;
            // it is bound back to the plan's stream and workspace below.
            Some(h) if !unsafe { bind_cublas(h, stream, workspace.ptr) } => {
                Err(Error::DeviceStatus {
                    call: "cublasSetStream",
                    code: -1,
                    message: "could not move cuBLAS's handle to the tuning stream".into(),
                })
            }
            _ => self.time_on(key, plan, algos, (a.ptr, b.ptr, c.ptr), on, timing),
        };
        if let Some(h) = self.cublas {
            // SAFETY: as above; the plan's stream and workspace live as long as `self`.
            if !unsafe { bind_cublas(h, self.stream, self.workspace.ptr) } {
                return Err(Error::DeviceStatus {
                    call: "cublasSetStream",
                    code: -1,
                    message: "could not move cuBLAS's handle back to its stream".into(),
                });
            }
        }
        times
    }

    /// [`Blas::time_candidates`]'s timing, on buffers `(a, b, c)` at the plan's alignments.
    fn time_on(
        &self,
        key: PlanKey,
        plan: &Plan,
        algos: &[Algo],
        (a, b, c): (u64, u64, u64),
        on: (sys::CUstream, u64),
        timing: Timing,
    ) -> Result<Vec<f32>> {
        let stream = on.0;
        // Operands at the plan's alignments: offsets into buffers aligned to 256 bytes.
        let offset = |align: u32| if align >= 256 { 0 } else { align as u64 };
        let ptrs = (a + offset(key.align[0]), b + offset(key.align[1]), c + offset(key.align[2]));
        let (start, stop) = (super::driver::Event::new(true)?, super::driver::Event::new(true)?);
        // Bring the clocks up first (an idle H200 runs at a fraction of its clock, and the
        // candidates timed first would look slow), then time every candidate in passes and
        // keep each one's best, so that a passing disturbance does not pick the winner.
        let mut usable: Vec<bool> =
            algos.iter().map(|algo| self.launch(&key, plan, algo, ptrs, on).is_ok()).collect();
        let warmed = if timing.warm_all { algos.len() } else { 1 };
        for _ in 0..timing.warmup {
            for (i, algo) in algos.iter().enumerate().take(warmed) {
                if usable[i] {
                    usable[i] &= self.launch(&key, plan, algo, ptrs, on).is_ok();
                }
            }
        }
        let mut times = vec![f32::INFINITY; algos.len()];
        for _pass in 0..timing.passes {
            for (i, algo) in algos.iter().enumerate() {
                if !usable[i] {
                    continue;
                }
                start.record(stream)?;
                for _ in 0..timing.runs {
                    usable[i] &= self.launch(&key, plan, algo, ptrs, on).is_ok();
                }
                stop.record(stream)?;
                // SAFETY: the stream is this function's own; nothing else waits on it.
                unsafe { cu::stream::synchronize(stream) }.check("cuStreamSynchronize")?;
                times[i] = times[i].min(start.elapsed_ms(&stop)? / timing.runs as f32);
            }
        }
        for (t, ok) in times.iter_mut().zip(&usable) {
            if !ok {
                *t = f32::INFINITY;
            }
        }
        Ok(times)
    }

    /// Every candidate of `key`'s product (up to `count`), timed as `timing` says, with its
    /// configuration, and which one the plan uses.
    fn candidates(
        &mut self,
        gpu: &Arc<CudaDevice>,
        key: PlanKey,
        count: usize,
        timing: Timing,
    ) -> Result<Vec<GemmCandidate>> {
        let chosen = self.plan(gpu, key)?.algo;
        let plan = self.describe(key)?;
        let algos = self.candidate_algos(key, &plan, count)?;
        let times = self.time_on_own_stream(gpu, key, &plan, &algos, timing)?;
        Ok(algos
            .iter()
            .zip(times)
            .enumerate()
            .map(|(i, (algo, ms))| GemmCandidate {
                heuristic_rank: i,
                config: algo_config(algo),
                ms: f64::from(ms),
                chosen: *algo == chosen,
            })
            .collect())
    }

    /// `key`'s product with `algo` on `stream`, using `workspace` (`WORKSPACE_BYTES`); the cuBLAS
    /// handle must be bound to the same stream and workspace.
    fn launch(
        &self,
        key: &PlanKey,
        plan: &Plan,
        algo: &Algo,
        (a, b, c): (u64, u64, u64),
        (stream, workspace): (sys::CUstream, u64),
    ) -> std::result::Result<(), (i32, String)> {
        let algo = match algo {
            Algo::Cublas => return self.launch_cublas(key, (a, b, c)),
            Algo::Lt(algo) => algo,
        };
        let (alpha64, beta64) = (1.0f64, 0.0f64);
        let (alpha32, beta32) = (1.0f32, 0.0f32);
        let (alpha, beta) = if key.input == DType::F64 {
            (&alpha64 as *const f64 as *const c_void, &beta64 as *const f64 as *const c_void)
        } else {
            (&alpha32 as *const f32 as *const c_void, &beta32 as *const f32 as *const c_void)
        };
        let [a_layout, b_layout, c_layout] = plan.layouts;
        // SAFETY: the plan describes these operands; the pointers hold the described matrices on
        // this GPU (or a peer's, reachable through peer access); alpha and beta outlive the call.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                alpha,
                beta,
                b as *const c_void,
                b_layout,
                a as *const c_void,
                a_layout,
                c as *const c_void,
                c_layout,
                c as *mut c_void,
                c_layout,
                algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as lt_sys::cudaStream_t,
            )
        }
        .map_err(|e| (e.0 as i32, format!("{:?}", e.0)))
    }

    /// `key`'s product through cuBLAS (column-major, as the cuBLASLt call: `C^T = B^T A^T`), on
    /// the handle's stream (this `Blas`'s).
    fn launch_cublas(
        &self,
        key: &PlanKey,
        (a, b, c): (u64, u64, u64),
    ) -> std::result::Result<(), (i32, String)> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let (Some(h), Some((m, n, k))) = (self.cublas, cublas_dims(key)) else {
            return Err((-1, "cuBLAS cannot run this product".into()));
        };
        // Our B is the call's first operand: stored [k, n] (column-major n x k, ld n), or [n, k]
        // read transposed (column-major k x n, ld k); our A its second: [m, k] (k x m, ld k), or
        // [k, m] read transposed (m x k, ld m).
        let (op_b, ld_b) = if key.transposed.b { (CUBLAS_OP_T, k) } else { (CUBLAS_OP_N, n) };
        let (op_a, ld_a) = if key.transposed.a { (CUBLAS_OP_T, m) } else { (CUBLAS_OP_N, k) };
        let (alpha64, beta64) = (1.0f64, 0.0f64);
        let (alpha32, beta32) = (1.0f32, 0.0f32);
        let (alpha, beta, compute) = if key.input == DType::F64 {
            (
                &alpha64 as *const f64 as *const c_void,
                &beta64 as *const f64 as *const c_void,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
            )
        } else {
            (
                &alpha32 as *const f32 as *const c_void,
                &beta32 as *const f32 as *const c_void,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        let (ti, to) = (cublas_type(key.input), cublas_type(key.output));
        let algo = blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP;
        let Batch { count, stride_a, stride_b } = key.batch;
        // SAFETY: the handle is this stream's, with this `Blas`'s workspace; the pointers hold
        // the described matrices on this GPU; alpha and beta outlive the call.
        let status = unsafe {
            if count > 1 {
                blas_sys::cublasGemmStridedBatchedEx(
                    h,
                    op_b,
                    op_a,
                    n,
                    m,
                    k,
                    alpha,
                    b as *const c_void,
                    ti,
                    ld_b,
                    stride_b as i64,
                    a as *const c_void,
                    ti,
                    ld_a,
                    stride_a as i64,
                    beta,
                    c as *mut c_void,
                    to,
                    n,
                    (key.m * key.n) as i64,
                    count as i32,
                    compute,
                    algo,
                )
            } else {
                blas_sys::cublasGemmEx(
                    h,
                    op_b,
                    op_a,
                    n,
                    m,
                    k,
                    alpha,
                    b as *const c_void,
                    ti,
                    ld_b,
                    a as *const c_void,
                    ti,
                    ld_a,
                    beta,
                    c as *mut c_void,
                    to,
                    n,
                    compute,
                    algo,
                )
            }
        };
        if status == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err((status as i32, format!("{status:?}")))
        }
    }
}

/// Row-major `c[m, n] = a[m, k] * b[k, n]` on `stream` of `gpu`, with the operands `transposed`
/// names stored transposed and read so in place (`a` as `[k, m]`: a weight's gradient; `b` as
/// `[n, k]`: a transposed weight); `input` is the type of `a` and `b`, `output` the type of `c`
/// (the input type, or its accumulator type for partials).
pub(crate) fn matmul(
    gpu: &Arc<CudaDevice>,
    stream: sys::CUstream,
    ptrs: (u64, u64, u64),
    mnk: (usize, usize, usize),
    transposed: Transposed,
    input: DType,
    output: DType,
) -> Result<()> {
    gemm(gpu, stream, ptrs, mnk, Batch::ONE, transposed, input, output)
}

/// [`matmul`] for every product of `batch`, in one cuBLASLt call.
pub(crate) fn matmul_batched(
    gpu: &Arc<CudaDevice>,
    stream: sys::CUstream,
    ptrs: (u64, u64, u64),
    mnk: (usize, usize, usize),
    batch: Batch,
    input: DType,
    output: DType,
) -> Result<()> {
    gemm(gpu, stream, ptrs, mnk, batch, Transposed::default(), input, output)
}

#[allow(clippy::too_many_arguments)] // the product's description, named at each call above
fn gemm(
    gpu: &Arc<CudaDevice>,
    stream: sys::CUstream,
    (a, b, c): (u64, u64, u64),
    (m, n, k): (usize, usize, usize),
    batch: Batch,
    transposed: Transposed,
    input: DType,
    output: DType,
) -> Result<()> {
    if m == 0 || n == 0 || batch.count == 0 {
        return Ok(());
    }
    if k == 0 {
        // An empty sum: zeros.
        // SAFETY: `c` holds count * m * n elements of `output`.
        return unsafe {
            cu::memset_d8_async(c, 0, batch.count * m * n * dtype_bytes(output), stream)
        }
        .check("cuMemsetD8Async");
    }
    let mut guard = gpu.blas.lock().unwrap_or_else(|p| p.into_inner());
    let blas = match guard.entry(stream as usize) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(Blas::new(gpu, stream)?),
    };
    // Every product's operands, not only the first's, must have the alignment the plan assumes.
    let (ib, ob) = (dtype_bytes(input) as u64, dtype_bytes(output) as u64);
    let step = |stride: u64| if batch.count > 1 { stride } else { 0 };
    let align = [
        alignment(a).min(alignment(step(batch.stride_a) * ib)),
        alignment(b).min(alignment(step(batch.stride_b) * ib)),
        alignment(c).min(alignment(step((m * n) as u64) * ob)),
    ];
    let key = PlanKey { m, n, k, input, output, align, batch, transposed };
    blas.plan(gpu, key)?;
    let plan = &blas.plans[&key];
    let on = (stream, blas.workspace.ptr);
    blas.launch(&key, plan, &plan.algo, (a, b, c), on).map_err(|e| Error::DeviceStatus {
        call: if plan.algo == Algo::Cublas { "cublasGemmEx" } else { "cublasLtMatmul" },
        code: e.0,
        message: format!(
            "{} x [{m}, {k}] x [{k}, {n}] ({input} -> {output}) on cuda:{}: {}",
            batch.count, gpu.ordinal, e.1
        ),
    })
}

/// Makes `stream`'s cuBLASLt and cuBLAS handles now, if not yet: a library that starts loads its
/// kernels, which waits for the GPU to drain, so it must not happen in the middle of an op whose
/// kernels on other ranks wait for this rank's next launch (see `driver::init`).
pub(crate) fn prepare(gpu: &Arc<CudaDevice>, stream: sys::CUstream) -> Result<()> {
    let mut guard = gpu.blas.lock().unwrap_or_else(|p| p.into_inner());
    if let std::collections::hash_map::Entry::Vacant(e) = guard.entry(stream as usize) {
        e.insert(Blas::new(gpu, stream)?);
    }
    Ok(())
}

/// Up to `count` of cuBLASLt's candidates for the row-major product `[m, k] x [k, n]` (operands
/// 256-byte aligned, stored as `transposed` says, `input` in and out), each timed on random
/// operands as `timing` says, on a stream of its own; [`GemmCandidate::chosen`] marks the one
/// the product's plan on `stream` uses (made, and tuned, if it was not yet).
#[allow(clippy::too_many_arguments)] // the product's description
pub(crate) fn candidates(
    gpu: &Arc<CudaDevice>,
    stream: sys::CUstream,
    (m, n, k): (usize, usize, usize),
    transposed: Transposed,
    input: DType,
    count: usize,
    timing: Timing,
) -> Result<Vec<GemmCandidate>> {
    let mut guard = gpu.blas.lock().unwrap_or_else(|p| p.into_inner());
    let blas = match guard.entry(stream as usize) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(Blas::new(gpu, stream)?),
    };
    let key =
        PlanKey { m, n, k, input, output: input, align: [256; 3], batch: Batch::ONE, transposed };
    blas.candidates(gpu, key, count, timing)
}

#[cfg(test)]
mod tests {
    use super::{Choice, parse_choice};

    #[test]
    fn gemm_algo_values() {
        assert_eq!(parse_choice(None), Ok(Choice::Cublas));
        assert_eq!(parse_choice(Some("tuned")), Ok(Choice::Tuned));
        assert_eq!(parse_choice(Some("cublas")), Ok(Choice::Cublas));
        assert_eq!(parse_choice(Some("heuristic")), Ok(Choice::Heuristic));
        let err = parse_choice(Some("cuBLAS")).unwrap_err();
        assert!(err.contains("DIST_TENSOR_GEMM_ALGO=\"cuBLAS\""), "{err}");
    }
}
