//! The vendor's operators (`aclnn*`), two phases each: the first checks the arguments and
//! returns the workspace size and an executor, the second runs the executor on a stream.
//! Failures carry AscendCL's message (`aclGetRecentErrMsg`), where the operator library
//! reports them.

use std::ffi::{CString, c_void};

use super::check;
use crate::device::ascend::sys::{Acl, AclDataType, FORMAT_ND, Nnop};
use crate::{Error, Result};

/// `aclCreateTensor`: a row-major (`ACL_FORMAT_ND`) descriptor of `shape` over device memory
/// `data`.
///
/// # Safety
/// `data` is device memory holding `shape`'s elements of `dtype`, alive while the descriptor is
/// used.
pub(crate) unsafe fn create_tensor(
    nnop: &Nnop,
    shape: &[i64],
    dtype: AclDataType,
    data: *mut c_void,
) -> Result<*mut c_void> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let rank = shape.len() as u64;
    // SAFETY: `aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum,
    // aclDataType, const int64_t *stride, int64_t offset, aclFormat, const int64_t
    // *storageDims, uint64_t storageDimsNum, void *tensorData)`: the arrays hold `rank` entries
    // and are copied by the call.
    let tensor = unsafe {
        (nnop.create_tensor)(
            shape.as_ptr(),
            rank,
            dtype as i32,
            strides.as_ptr(),
            0,
            FORMAT_ND,
            shape.as_ptr(),
            rank,
            data,
        )
    };
    if tensor.is_null() {
        return Err(Error::DeviceStatus {
            call: "aclCreateTensor",
            code: 0,
            message: format!("returned null for a {dtype:?} tensor of shape {shape:?}"),
        });
    }
    Ok(tensor)
}

/// `aclDestroyTensor`.
///
/// # Safety
/// `tensor` came from [`create_tensor`] and is not used afterwards.
pub(crate) unsafe fn destroy_tensor(nnop: &Nnop, tensor: *mut c_void) {
    // SAFETY: `aclnnStatus aclDestroyTensor(const aclTensor *)` on a descriptor the caller owns.
    // A failure to free a descriptor has nowhere to go and leaves nothing to undo.
    let _ = unsafe { (nnop.destroy_tensor)(tensor) };
}

/// The first phase's result: the workspace the second phase needs, and the executor.
pub(crate) struct Prepared {
    pub(crate) workspace_bytes: u64,
    pub(crate) executor: *mut c_void,
}

/// `aclnnMatmulGetWorkspaceSize`: `out = a @ b` (cube math type 1, `ALLOW_FP32_DOWN_PRECISION`
/// off: f32 stays f32).
///
/// # Safety
/// The descriptors are live and describe device memory of the current device.
pub(crate) unsafe fn matmul_prepare(
    acl: &Acl,
    nnop: &Nnop,
    a: *mut c_void,
    b: *mut c_void,
    out: *mut c_void,
) -> Result<Prepared> {
    // cubeMathType 0, KEEP_DTYPE: compute in the inputs' type (f16/bf16 multiply with f32
    // accumulation on the cube unit; f32 stays f32).
    const KEEP_DTYPE: i8 = 0;
    let (mut workspace_bytes, mut executor) = (0u64, std::ptr::null_mut());
    // SAFETY: `aclnnMatmulGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2,
    // aclTensor *out, int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor)`.
    let status = unsafe {
        (nnop.matmul_get_workspace_size)(a, b, out, KEEP_DTYPE, &mut workspace_bytes, &mut executor)
    };
    check(acl, "aclnnMatmulGetWorkspaceSize", status)?;
    Ok(Prepared { workspace_bytes, executor })
}

/// The group name as a C string.
fn group_name(call: &'static str, group: &str) -> Result<CString> {
    CString::new(group).map_err(|_| Error::InvalidArgument {
        op: call,
        rank: 0,
        reason: format!("the HCCL group name {group:?} holds a NUL byte"),
    })
}

/// `aclnnAllGatherMatmulGetWorkspaceSize`: `output = all_gather(x1) @ x2`, `gather_out =
/// all_gather(x1)`, over HCCL group `group` (no bias; gather index 0, comm turn 0 and stream
/// mode 1, the only values the operator takes).
///
/// # Errors
/// [`Error::SymbolMissing`] when this CANN lacks the operator; [`Error::DeviceStatus`] with the
/// vendor's message when it refuses the arguments.
///
/// # Safety
/// As [`matmul_prepare`].
pub(crate) unsafe fn all_gather_matmul_prepare(
    acl: &Acl,
    nnop: &Nnop,
    x1: *mut c_void,
    x2: *mut c_void,
    group: &str,
    output: *mut c_void,
    gather_out: *mut c_void,
) -> Result<Prepared> {
    const CALL: &str = "aclnnAllGatherMatmulGetWorkspaceSize";
    let (get, _) = nnop.all_gather_matmul.ok_or_else(|| missing(nnop, CALL))?;
    let group = group_name(CALL, group)?;
    let (mut workspace_bytes, mut executor) = (0u64, std::ptr::null_mut());
    let null = std::ptr::null();
    // SAFETY: the signature of `aclnnAllGatherMatmulGetWorkspaceSize` in
    // aclnnop/aclnn_all_gather_matmul.h: (x1, x2, bias, group, gatherIndex, commTurn,
    // streamMode, output, gatherOut, workspaceSize, executor); a null bias means none.
    let status = unsafe {
        get(
            x1,
            x2,
            null,
            group.as_ptr(),
            0,
            0,
            1,
            output,
            gather_out,
            &mut workspace_bytes,
            &mut executor,
        )
    };
    check(acl, CALL, status)?;
    Ok(Prepared { workspace_bytes, executor })
}

/// `aclnnMatmulReduceScatterGetWorkspaceSize`: `output = reduce_scatter(x1 @ x2)` with a sum
/// over HCCL group `group` (no bias; comm turn 0, stream mode 1).
///
/// # Errors
/// As [`all_gather_matmul_prepare`].
///
/// # Safety
/// As [`matmul_prepare`].
pub(crate) unsafe fn matmul_reduce_scatter_prepare(
    acl: &Acl,
    nnop: &Nnop,
    x1: *mut c_void,
    x2: *mut c_void,
    group: &str,
    output: *mut c_void,
) -> Result<Prepared> {
    const CALL: &str = "aclnnMatmulReduceScatterGetWorkspaceSize";
    let (get, _) = nnop.matmul_reduce_scatter.ok_or_else(|| missing(nnop, CALL))?;
    let group = group_name(CALL, group)?;
    let sum = c"sum";
    let (mut workspace_bytes, mut executor) = (0u64, std::ptr::null_mut());
    // SAFETY: the signature of `aclnnMatmulReduceScatterGetWorkspaceSize` in
    // aclnnop/aclnn_matmul_reduce_scatter.h: (x1, x2, bias, group, reduceOp, commTurn,
    // streamMode, output, workspaceSize, executor); a null bias means none.
    let status = unsafe {
        get(
            x1,
            x2,
            std::ptr::null(),
            group.as_ptr(),
            sum.as_ptr(),
            0,
            1,
            output,
            &mut workspace_bytes,
            &mut executor,
        )
    };
    check(acl, CALL, status)?;
    Ok(Prepared { workspace_bytes, executor })
}

fn missing(nnop: &Nnop, symbol: &'static str) -> Error {
    Error::SymbolMissing { symbol, library: nnop.path().display().to_string() }
}

/// Which operator's second phase to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operator {
    /// `aclnnMatmul`.
    Matmul,
    /// `aclnnAllGatherMatmul`.
    AllGatherMatmul,
    /// `aclnnMatmulReduceScatter`.
    MatmulReduceScatter,
}

/// The second phase: runs `prepared`'s executor on `stream` with `workspace`.
///
/// # Safety
/// `prepared` came from the matching first phase, once; `workspace` is device memory of at least
/// its `workspace_bytes` (or null when that is 0); everything stays alive until the stream is
/// synchronised.
pub(crate) unsafe fn execute(
    acl: &Acl,
    nnop: &Nnop,
    operator: Operator,
    prepared: &Prepared,
    workspace: *mut c_void,
    stream: *mut c_void,
) -> Result<()> {
    let (run, call) = match operator {
        Operator::Matmul => (nnop.matmul, "aclnnMatmul"),
        Operator::AllGatherMatmul => (
            nnop.all_gather_matmul.ok_or_else(|| missing(nnop, "aclnnAllGatherMatmul"))?.1,
            "aclnnAllGatherMatmul",
        ),
        Operator::MatmulReduceScatter => (
            nnop.matmul_reduce_scatter.ok_or_else(|| missing(nnop, "aclnnMatmulReduceScatter"))?.1,
            "aclnnMatmulReduceScatter",
        ),
    };
    // SAFETY: `aclnnStatus op(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
    // aclrtStream stream)`, the second phase every aclnn operator shares; the caller vouches for
    // the executor, the workspace and the stream.
    let status = unsafe { run(workspace, prepared.workspace_bytes, prepared.executor, stream) };
    check(acl, call, status)
}
