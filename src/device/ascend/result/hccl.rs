//! HCCL's communicators and collectives, for the unfused baselines on NPUs. Each call queues
//! work on a stream; the caller synchronises.

use std::ffi::{CStr, c_void};

use super::hccl_check;
use crate::device::ascend::sys::{
    COMM_NAME_BYTES, CollectiveCalls, Hccl, HcclDataType, HcclReduceOp,
};
use crate::{Error, Result};

/// The collective calls, or the error naming the first one this HCCL lacks.
fn calls(hccl: &Hccl) -> Result<&CollectiveCalls> {
    hccl.collectives.as_ref().map_err(|&symbol| Error::SymbolMissing {
        symbol,
        library: match hccl.comm_path() {
            Some(comm) => format!("{} and {}", hccl.path().display(), comm.display()),
            None => hccl.path().display().to_string(),
        },
    })
}

/// `HcclCommInitAll`: one communicator per device of this process, in the order given (rank `r`
/// is `devices[r]`).
pub(crate) fn comm_init_all(hccl: &Hccl, devices: &[u32]) -> Result<Vec<*mut c_void>> {
    let calls = calls(hccl)?;
    let mut ids: Vec<i32> = devices
        .iter()
        .map(|&d| {
            i32::try_from(d).map_err(|_| Error::InvalidArgument {
                op: "HcclCommInitAll",
                rank: 0,
                reason: format!("device id {d} does not fit an int32_t"),
            })
        })
        .collect::<Result<_>>()?;
    let mut comms = vec![std::ptr::null_mut(); devices.len()];
    let n = u32::try_from(devices.len()).expect("fewer devices than u32::MAX");
    // SAFETY: `HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms)`: both arrays
    // hold `ndev` entries and live across the call.
    let status = unsafe { (calls.comm_init_all)(n, ids.as_mut_ptr(), comms.as_mut_ptr()) };
    hccl_check(hccl, "HcclCommInitAll", status)?;
    Ok(comms)
}

/// `HcclGetCommName`: the communicator's name, the `group` the vendor operators take.
///
/// # Safety
/// `comm` is a live communicator of this HCCL.
pub(crate) unsafe fn comm_name(hccl: &Hccl, comm: *mut c_void) -> Result<String> {
    let calls = calls(hccl)?;
    let mut name = [0u8; COMM_NAME_BYTES];
    // SAFETY: `HcclGetCommName(HcclComm, char *commName)` writes at most COMM_NAME_MAX_LENGTH
    // bytes, the size of `name`.
    let status = unsafe { (calls.get_comm_name)(comm, name.as_mut_ptr().cast()) };
    hccl_check(hccl, "HcclGetCommName", status)?;
    let text = CStr::from_bytes_until_nul(&name).map_err(|_| Error::DeviceStatus {
        call: "HcclGetCommName",
        code: 0,
        message: "the name is not NUL-terminated".into(),
    })?;
    Ok(text.to_string_lossy().into_owned())
}

/// `HcclCommDestroy`.
///
/// # Safety
/// `comm` is a live communicator of this HCCL, not used afterwards.
pub(crate) unsafe fn comm_destroy(hccl: &Hccl, comm: *mut c_void) -> Result<()> {
    // SAFETY: `HcclCommDestroy(HcclComm)` on a communicator the caller owns.
    let status = unsafe { (hccl.hccl_comm_destroy)(comm) };
    hccl_check(hccl, "HcclCommDestroy", status)
}

/// Where a collective runs: a communicator and a stream of the same device.
#[derive(Clone, Copy)]
pub(crate) struct On {
    pub(crate) comm: *mut c_void,
    pub(crate) stream: *mut c_void,
}

/// `HcclAllGatherV`: rank `r`'s `counts[r]` elements land at `displs[r]` of every rank's `recv`.
///
/// # Safety
/// `send` holds `send_count` elements and `recv` the sum of `counts`, in device memory of the
/// communicator's device; the handles are live; both stay valid until the stream is synchronised.
#[allow(clippy::too_many_arguments)] // the C call's own arguments
pub(crate) unsafe fn all_gather_v(
    hccl: &Hccl,
    send: *mut c_void,
    send_count: u64,
    recv: *mut c_void,
    counts: &[u64],
    displs: &[u64],
    dtype: HcclDataType,
    on: On,
) -> Result<()> {
    let calls = calls(hccl)?;
    // SAFETY: `HcclAllGatherV(void *sendBuf, uint64_t sendCount, void *recvBuf, const void
    // *recvCounts, const void *recvDispls, HcclDataType, HcclComm, aclrtStream)`; the count and
    // displacement arrays are host `uint64_t` arrays of the world's size.
    let status = unsafe {
        (calls.all_gather_v)(
            send,
            send_count,
            recv,
            counts.as_ptr().cast(),
            displs.as_ptr().cast(),
            dtype as i32,
            on.comm,
            on.stream,
        )
    };
    hccl_check(hccl, "HcclAllGatherV", status)
}

/// `HcclReduceScatterV` with a sum: rank `r` gets the sum over ranks of `counts[r]` elements at
/// `displs[r]` of every rank's `send`.
///
/// # Safety
/// As [`all_gather_v`], with `recv` holding `recv_count` elements.
#[allow(clippy::too_many_arguments)] // the C call's own arguments
pub(crate) unsafe fn reduce_scatter_v(
    hccl: &Hccl,
    send: *mut c_void,
    counts: &[u64],
    displs: &[u64],
    recv: *mut c_void,
    recv_count: u64,
    dtype: HcclDataType,
    on: On,
) -> Result<()> {
    let calls = calls(hccl)?;
    // SAFETY: `HcclReduceScatterV(void *sendBuf, const void *sendCounts, const void *sendDispls,
    // void *recvBuf, uint64_t recvCount, HcclDataType, HcclReduceOp, HcclComm, aclrtStream)`.
    let status = unsafe {
        (calls.reduce_scatter_v)(
            send,
            counts.as_ptr().cast(),
            displs.as_ptr().cast(),
            recv,
            recv_count,
            dtype as i32,
            HcclReduceOp::Sum as i32,
            on.comm,
            on.stream,
        )
    };
    hccl_check(hccl, "HcclReduceScatterV", status)
}
