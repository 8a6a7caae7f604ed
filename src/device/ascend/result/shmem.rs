//! Ascend SHMEM's host calls: initialisation with a unique id, the symmetric heap, peer
//! addresses. SHMEM has no message call of its own: errors carry the meaning of its status
//! (`aclshmem_error_code_t`).

use std::ffi::{c_int, c_void};

use crate::device::ascend::sys::{INIT_WITH_UNIQUEID, Shmem, ShmemInitAttr, ShmemUniqueId};
use crate::{Error, Result};

/// What a SHMEM status means (`aclshmem_error_code_t` in `shmem_host_def.h`).
fn status_text(code: c_int) -> &'static str {
    match code {
        -1 => "ACLSHMEM_INVALID_PARAM: a parameter is not valid",
        -2 => "ACLSHMEM_INVALID_VALUE: a value is out of range",
        -3 => "ACLSHMEM_SMEM_ERROR: the shared-memory layer failed",
        -4 => "ACLSHMEM_INNER_ERROR: an internal error",
        -5 => "ACLSHMEM_NOT_INITED: SHMEM is not initialised",
        -6 => "ACLSHMEM_BOOTSTRAP_ERROR: the bootstrap between PEs failed",
        -7 => "ACLSHMEM_TIMEOUT_ERROR: timed out",
        -8 => "ACLSHMEM_MALLOC_FAILED: an allocation failed",
        -9 => "ACLSHMEM_DL_FUNC_FAILED: a library function could not be loaded",
        -10 => "ACLSHMEM_INNER_TIMEOUT: an internal timeout",
        -11 => "ACLSHMEM_UNDER_API_UNLOAD: a library below SHMEM failed to load",
        -100 => "ACLSHMEM_NOT_SUPPORTED: not supported",
        _ => "an Ascend SHMEM error",
    }
}

fn check(call: &'static str, code: c_int) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    Err(Error::DeviceStatus { call, code, message: status_text(code).to_string() })
}

/// `aclshmemx_get_uniqueid`: the bootstrap id that PE 0 makes and every PE initialises with.
pub(crate) fn unique_id(shmem: &Shmem) -> Result<ShmemUniqueId> {
    let mut uid = ShmemUniqueId::new();
    // SAFETY: `int aclshmemx_get_uniqueid(aclshmemx_uniqueid_t *uid)`; `uid` is a live
    // `repr(C)` copy of the struct with its version word set.
    let code = unsafe { (shmem.get_uniqueid)(&mut uid) };
    check("aclshmemx_get_uniqueid", code)?;
    Ok(uid)
}

/// `aclshmemx_set_attr_uniqueid_args` then `aclshmemx_init_attr(ACLSHMEMX_INIT_WITH_UNIQUEID)`:
/// joins PE `my_pe` of `n_pes` with a heap of `heap_bytes` per PE. Collective: every PE calls it
/// with the same id, at the same time, on its own device (the calling thread's current one).
pub(crate) fn init(
    shmem: &Shmem,
    my_pe: usize,
    n_pes: usize,
    heap_bytes: usize,
    uid: &ShmemUniqueId,
) -> Result<()> {
    let invalid =
        |reason: String| Error::InvalidArgument { op: "aclshmemx_init_attr", rank: my_pe, reason };
    let pe =
        c_int::try_from(my_pe).map_err(|_| invalid(format!("PE {my_pe} does not fit an int")))?;
    let pes =
        c_int::try_from(n_pes).map_err(|_| invalid(format!("{n_pes} PEs do not fit an int")))?;
    let bytes = i64::try_from(heap_bytes)
        .map_err(|_| invalid(format!("a heap of {heap_bytes} bytes does not fit an int64_t")))?;
    let mut uid = *uid;
    let mut attr = ShmemInitAttr::new();
    // SAFETY: `int aclshmemx_set_attr_uniqueid_args(int my_pe, int n_pes, int64_t
    // local_mem_size, aclshmemx_uniqueid_t *uid, aclshmemx_init_attr_t *attr)`: both pointers are
    // live locals of the header's layouts.
    let code = unsafe { (shmem.set_attr_uniqueid_args)(pe, pes, bytes, &mut uid, &mut attr) };
    check("aclshmemx_set_attr_uniqueid_args", code)?;
    // SAFETY: `int aclshmemx_init_attr(aclshmemx_bootstrap_t flags, aclshmemx_init_attr_t
    // *attributes)` with the attributes just filled in.
    let code = unsafe { (shmem.init_attr)(INIT_WITH_UNIQUEID, &mut attr) };
    check("aclshmemx_init_attr", code)
}

/// `aclshmem_finalize`: leaves the SHMEM world. Collective.
pub(crate) fn finalize(shmem: &Shmem) -> Result<()> {
    // SAFETY: `int aclshmem_finalize(void)`.
    let code = unsafe { (shmem.finalize)() };
    check("aclshmem_finalize", code)
}

/// `aclshmem_my_pe` and `aclshmem_n_pes`: the PE this process is, and how many there are.
pub(crate) fn my_pe_and_n_pes(shmem: &Shmem) -> (c_int, c_int) {
    // SAFETY: `int aclshmem_my_pe(void)` and `int aclshmem_n_pes(void)`.
    unsafe { ((shmem.my_pe)(), (shmem.n_pes)()) }
}

/// `aclshmem_malloc`: `bytes` of the symmetric heap, at the same offset on every PE. Collective:
/// every PE allocates the same sizes in the same order.
pub(crate) fn malloc(shmem: &Shmem, bytes: usize) -> Result<*mut c_void> {
    // SAFETY: `void *aclshmem_malloc(size_t size)`; null on failure.
    let ptr = unsafe { (shmem.malloc)(bytes.max(1)) };
    if ptr.is_null() {
        return Err(Error::DeviceStatus {
            call: "aclshmem_malloc",
            code: -8,
            message: format!("returned null for {bytes} bytes: the symmetric heap is full"),
        });
    }
    Ok(ptr)
}

/// `aclshmem_free`. Collective.
///
/// # Safety
/// `ptr` came from [`malloc`] and is not used afterwards, on any PE.
pub(crate) unsafe fn free(shmem: &Shmem, ptr: *mut c_void) {
    // SAFETY: `void aclshmem_free(void *ptr)` on a symmetric allocation the caller owns.
    unsafe { (shmem.free)(ptr) }
}

/// `aclshmem_ptr`: where PE `pe`'s copy of the symmetric object `ptr` is, as an address the
/// local device can load from and store to.
///
/// # Errors
/// [`Error::DeviceStatus`] when SHMEM gives no address (the peer is not reachable by pointer).
///
/// # Safety
/// `ptr` is an address inside this PE's symmetric heap.
pub(crate) unsafe fn peer_ptr(shmem: &Shmem, ptr: *mut c_void, pe: usize) -> Result<*mut c_void> {
    let pe_int = c_int::try_from(pe).unwrap_or(c_int::MAX);
    // SAFETY: `void *aclshmem_ptr(void *ptr, int pe)` on a symmetric address.
    let peer = unsafe { (shmem.ptr)(ptr, pe_int) };
    if peer.is_null() {
        return Err(Error::DeviceStatus {
            call: "aclshmem_ptr",
            code: 0,
            message: format!("no address for PE {pe}: its heap is not reachable by pointer"),
        });
    }
    Ok(peer)
}
