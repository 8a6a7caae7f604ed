//! GEMM through cuBLASLt: row-major `C[m, n] = A[m, k] B[k, n]`, half types in, f32 accumulate,
//! output in the element type or in f32 (partials of matmul_reduce_scatter). Plans (descriptors,
//! layouts and the chosen algorithm) are cached per shape and alignment: the safe cudarc call
//! rebuilds them on every call, which costs host time at decode sizes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::{result as lt, sys as lt_sys};
use cudarc::driver::{result as cu, sys};

use super::driver::{Check, CudaDevice, guarded, require_library};
use super::memory::DeviceBuffer;
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
/// Untimed runs before timing, to bring the clocks up.
const TUNE_WARMUP: usize = 20;

fn blas_error(call: &'static str, e: lt::CublasError) -> Error {
    Error::DeviceStatus { call, code: e.0 as i32, message: format!("{:?}", e.0) }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    input: DType,
    output: DType,
    align: [u32; 3],
    batch: Batch,
    transposed: Transposed,
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
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

/// One GPU's cuBLASLt handle, workspace and plans.
pub(crate) struct Blas {
    handle: lt_sys::cublasLtHandle_t,
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

pub(crate) fn dtype_bytes(d: DType) -> usize {
    match d {
        DType::F32 => 4,
        DType::F64 => 8,
        DType::F16 | DType::BF16 => 2,
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        for plan in self.plans.values() {
            // SAFETY: each descriptor is destroyed once, and no call uses it any more.
            unsafe {
                let _ = lt::destroy_matmul_desc(plan.desc);
                for l in plan.layouts {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
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
        Ok(Blas {
            handle,
            workspace: DeviceBuffer::new(gpu, WORKSPACE_BYTES, stream)?,
            plans: HashMap::new(),
        })
    }

    fn plan(&mut self, gpu: &Arc<CudaDevice>, key: PlanKey) -> Result<&Plan> {
        if !self.plans.contains_key(&key) {
            let plan = self.make_plan(gpu, key)?;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    fn make_plan(&self, gpu: &Arc<CudaDevice>, key: PlanKey) -> Result<Plan> {
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
        let mut found = [std::mem::MaybeUninit::<lt_sys::cublasLtMatmulHeuristicResult_t>::zeroed();
            CANDIDATES];
        let mut count = 0;
        // SAFETY: every descriptor is valid and describes this product; `found` has room for
        // CANDIDATES results.
        let status = unsafe {
            lt_sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                b_layout,
                a_layout,
                c_layout,
                c_layout,
                pref,
                CANDIDATES as i32,
                found.as_mut_ptr() as *mut _,
                &mut count,
            )
        };
        // SAFETY: `pref` is not used after this.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        // SAFETY: the first `count` results were written.
        let algos: Vec<lt_sys::cublasLtMatmulAlgo_t> = found[..count.max(0) as usize]
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
        let mut plan = Plan { desc, layouts: [a_layout, b_layout, c_layout], algo: algos[0] };
        if algos.len() > 1 && m * n * k * key.batch.count as u64 >= TUNE_MIN_WORK {
            plan.algo = self.fastest(gpu, key, &plan, &algos)?;
        }
        Ok(plan)
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
        algos: &[lt_sys::cublasLtMatmulAlgo_t],
    ) -> Result<lt_sys::cublasLtMatmulAlgo_t> {
        // A stream of its own (not `Streams`, whose drop takes the cuBLASLt lock held here).
        let stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).check("cuStreamCreate")?;
        let result = self.time_candidates(gpu, key, plan, algos, stream);
        // SAFETY: the stream is idle (the timing synchronized it, or failed before queuing).
        let _ = unsafe { cu::stream::synchronize(stream) };
        super::memory::release_stream_cache(gpu, stream);
        // SAFETY: nothing uses the stream any more.
        let _ = unsafe { cu::stream::destroy(stream) };
        result
    }

    fn time_candidates(
        &self,
        gpu: &Arc<CudaDevice>,
        key: PlanKey,
        plan: &Plan,
        algos: &[lt_sys::cublasLtMatmulAlgo_t],
        stream: sys::CUstream,
    ) -> Result<lt_sys::cublasLtMatmulAlgo_t> {
        let (ib, ob) = (dtype_bytes(key.input), dtype_bytes(key.output));
        // Operands at the plan's alignments: offsets into buffers aligned to 256 bytes.
        let offset = |align: u32| if align >= 256 { 0 } else { align as usize };
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
        let ptrs = (
            a.ptr + offset(key.align[0]) as u64,
            b.ptr + offset(key.align[1]) as u64,
            c.ptr + offset(key.align[2]) as u64,
        );
        let (start, stop) = (super::driver::Event::new(true)?, super::driver::Event::new(true)?);
        // Bring the clocks up first (an idle H200 runs at a fraction of its clock, and the
        // candidates timed first would look slow), then time every candidate in two passes and
        // keep each one's best, so that a passing disturbance does not pick the winner.
        let mut usable: Vec<bool> = algos
            .iter()
            .map(|algo| self.launch(plan, algo, key.input, ptrs, stream).is_ok())
            .collect();
        for _ in 0..TUNE_WARMUP {
            let _ = self.launch(plan, &algos[0], key.input, ptrs, stream);
        }
        let mut times = vec![f32::INFINITY; algos.len()];
        for _pass in 0..2 {
            for (i, algo) in algos.iter().enumerate() {
                if !usable[i] {
                    continue;
                }
                start.record(stream)?;
                for _ in 0..TUNE_RUNS {
                    usable[i] &= self.launch(plan, algo, key.input, ptrs, stream).is_ok();
                }
                stop.record(stream)?;
                // SAFETY: the stream is this function's own; nothing else waits on it.
                unsafe { cu::stream::synchronize(stream) }.check("cuStreamSynchronize")?;
                times[i] = times[i].min(start.elapsed_ms(&stop)?);
            }
        }
        let best = (0..algos.len())
            .filter(|&i| usable[i])
            .min_by(|&a, &b| times[a].total_cmp(&times[b]))
            .unwrap_or(0);
        Ok(algos[best])
    }

    fn launch(
        &self,
        plan: &Plan,
        algo: &lt_sys::cublasLtMatmulAlgo_t,
        input: DType,
        (a, b, c): (u64, u64, u64),
        stream: sys::CUstream,
    ) -> std::result::Result<(), lt::CublasError> {
        let (alpha64, beta64) = (1.0f64, 0.0f64);
        let (alpha32, beta32) = (1.0f32, 0.0f32);
        let (alpha, beta) = if input == DType::F64 {
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
                self.workspace.ptr as *mut c_void,
                WORKSPACE_BYTES,
                stream as lt_sys::cudaStream_t,
            )
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
    blas.launch(plan, &plan.algo, input, (a, b, c), stream).map_err(|e| Error::DeviceStatus {
        call: "cublasLtMatmul",
        code: e.0 as i32,
        message: format!(
            "{} x [{m}, {k}] x [{k}, {n}] ({input} -> {output}) on cuda:{}: {:?}",
            batch.count, gpu.ordinal, e.0
        ),
    })
}
