//! Thin wrappers over the raw calls of [`sys`]: each makes one C call and turns a failing
//! status into [`Error::DeviceStatus`] carrying the vendor's own message (`aclGetRecentErrMsg`
//! for AscendCL, `HcclGetErrorString` for HCCL).
//!
//! Calls that only a newer CANN has return `Option<Result<_>>`: `None` when the library lacks
//! the symbol, so the caller can fall back to the older call.

use std::ffi::{CStr, c_char};

use super::sys::{self, Acl, AclError, DevAttr, DeviceInfo, Hccl, HcclResult, HcclRootInfo};
use crate::{Error, Result};

/// Copies a C string the vendor returned; `None` for a null or empty one.
///
/// # Safety
/// `ptr` is null or points to a NUL-terminated string valid for the duration of the call.
unsafe fn owned_string(ptr: *const c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated, as the caller vouches; copied before returning.
    let text = unsafe { CStr::from_ptr(ptr) }.to_string_lossy().trim().to_string();
    (!text.is_empty()).then_some(text)
}

/// The message of the most recent failing AscendCL call on this thread
/// (`aclGetRecentErrMsg`, which also clears it). `None` when there is none, or the library
/// predates the call.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Acl};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// result::init(&acl)?;
/// // Nothing failed yet on this thread.
/// assert!(result::recent_error_message(&acl).map_or(true, |m| !m.is_empty()));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn recent_error_message(acl: &Acl) -> Option<String> {
    let get = acl.acl_get_recent_err_msg?;
    // SAFETY: `aclGetRecentErrMsg(void) -> const char *` per acl_base.h, from the table's
    // library; the string it returns stays valid until the next AscendCL call on this thread,
    // and `owned_string` copies it at once.
    unsafe { owned_string(get()) }
}

/// Turns an AscendCL status into a result: `Ok` on [`sys::ACL_SUCCESS`], otherwise
/// [`Error::DeviceStatus`] with the call's name, the code and the vendor's message.
///
/// # Errors
/// [`Error::DeviceStatus`] when `status` is not success.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Acl};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// assert!(result::check(&acl, "aclInit", 0).is_ok());
/// let err = result::check(&acl, "aclrtSetDevice", 107_001).unwrap_err();
/// assert!(matches!(err, Error::DeviceStatus { call: "aclrtSetDevice", code: 107_001, .. }));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn check(acl: &Acl, call: &'static str, status: AclError) -> Result<()> {
    if status == sys::ACL_SUCCESS {
        return Ok(());
    }
    let message = recent_error_message(acl).unwrap_or_else(|| {
        if acl.acl_get_recent_err_msg.is_some() {
            "no message from aclGetRecentErrMsg".to_string()
        } else {
            "no message: this runtime lacks aclGetRecentErrMsg".to_string()
        }
    });
    Err(Error::DeviceStatus { call, code: status, message })
}

/// `aclInit(NULL)`: initialises the runtime. A repeated initialisation
/// ([`sys::ACL_ERROR_REPEAT_INITIALIZE`]) counts as success.
///
/// # Errors
/// [`Error::DeviceStatus`] with the vendor's message.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Acl};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// result::init(&acl)?;
/// result::init(&acl)?; // a second time is not an error
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn init(acl: &Acl) -> Result<()> {
    // SAFETY: `aclInit(const char *configPath) -> aclError` per acl.h; a null path is allowed.
    let status = unsafe { (acl.acl_init)(std::ptr::null()) };
    if status == sys::ACL_ERROR_REPEAT_INITIALIZE {
        // The message is consumed so that it does not show up in a later, unrelated error.
        let _ = recent_error_message(acl);
        return Ok(());
    }
    check(acl, "aclInit", status)
}

/// `aclFinalize()`: releases the runtime.
///
/// # Errors
/// [`Error::DeviceStatus`] with the vendor's message.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Acl};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// // This example's process owns the runtime, so it may finalise it.
/// result::init(&acl)?;
/// assert!(result::finalize(&acl).is_ok());
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn finalize(acl: &Acl) -> Result<()> {
    // SAFETY: `aclFinalize(void) -> aclError` per acl.h.
    let status = unsafe { (acl.acl_finalize)() };
    check(acl, "aclFinalize", status)
}

/// `aclrtGetDeviceCount`: the number of devices the runtime sees (after the runtime applied
/// `ASCEND_RT_VISIBLE_DEVICES`).
///
/// # Errors
/// [`Error::DeviceStatus`] with the vendor's message.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Acl};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// result::init(&acl)?;
/// assert!(result::device_count(&acl)? < 65_536);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn device_count(acl: &Acl) -> Result<u32> {
    let mut count: u32 = 0;
    // SAFETY: `aclrtGetDeviceCount(uint32_t *count) -> aclError` per acl_rt.h; `count` is a
    // live local the call writes once.
    let status = unsafe { (acl.aclrt_get_device_count)(&mut count) };
    check(acl, "aclrtGetDeviceCount", status)?;
    Ok(count)
}

fn device_id(call: &'static str, device: u32) -> Result<i32> {
    i32::try_from(device).map_err(|_| Error::InvalidArgument {
        op: call,
        rank: 0,
        reason: format!("device id {device} does not fit the runtime's int32_t"),
    })
}

/// `aclrtSetDevice`: makes `device` the current device of this thread, opening it.
///
/// # Errors
/// [`Error::InvalidArgument`] for an id beyond `i32::MAX`; [`Error::DeviceStatus`] with the
/// vendor's message.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Acl};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// result::init(&acl)?;
/// assert!(result::set_device(&acl, u32::MAX).is_err());
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn set_device(acl: &Acl, device: u32) -> Result<()> {
    let id = device_id("aclrtSetDevice", device)?;
    // SAFETY: `aclrtSetDevice(int32_t deviceId) -> aclError` per acl_rt.h.
    let status = unsafe { (acl.aclrt_set_device)(id) };
    check(acl, "aclrtSetDevice", status)
}

/// `aclrtResetDevice`: releases what `aclrtSetDevice` opened on `device`.
///
/// # Errors
/// [`Error::InvalidArgument`] for an id beyond `i32::MAX`; [`Error::DeviceStatus`] with the
/// vendor's message.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Acl};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// result::init(&acl)?;
/// assert!(result::reset_device(&acl, u32::MAX).is_err());
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn reset_device(acl: &Acl, device: u32) -> Result<()> {
    let id = device_id("aclrtResetDevice", device)?;
    // SAFETY: `aclrtResetDevice(int32_t deviceId) -> aclError` per acl_rt.h.
    let status = unsafe { (acl.aclrt_reset_device)(id) };
    check(acl, "aclrtResetDevice", status)
}

/// `aclrtGetSocName`: the chip's name (such as `Ascend910B3`). `None` when the runtime
/// returns none, or lacks the call.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Acl};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// result::init(&acl)?;
/// assert!(result::soc_name(&acl).map_or(true, |name| !name.is_empty()));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn soc_name(acl: &Acl) -> Option<String> {
    let get = acl.aclrt_get_soc_name?;
    // SAFETY: `aclrtGetSocName(void) -> const char *` per acl_base.h; the runtime owns the
    // string (null on failure), and `owned_string` copies it at once.
    unsafe { owned_string(get()) }
}

/// `aclrtGetDeviceInfo` (newer CANN): one attribute of `device`. `None` when the runtime lacks
/// the call, so the caller can fall back to [`device_capability`].
///
/// # Errors
/// Inside the `Some`: [`Error::InvalidArgument`] for an id beyond `i32::MAX`,
/// [`Error::DeviceStatus`] with the vendor's message.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::{Acl, DevAttr}};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// result::init(&acl)?;
/// if let Some(Ok(cores)) = result::device_info(&acl, 0, DevAttr::AiCoreNum) {
///     assert!(cores > 0);
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn device_info(acl: &Acl, device: u32, attr: DevAttr) -> Option<Result<i64>> {
    let get = acl.aclrt_get_device_info?;
    let query = || {
        device_id("aclrtGetDeviceInfo", device)?;
        let mut value: i64 = 0;
        // SAFETY: `aclrtGetDeviceInfo(uint32_t deviceId, aclrtDevAttr attr, int64_t *value)` per
        // acl_rt.h (a C enum is passed as an int); `value` is a live local the call writes.
        let status = unsafe { get(device, attr as i32, &mut value) };
        check(acl, "aclrtGetDeviceInfo", status).map(|()| value)
    };
    Some(query())
}

/// `aclGetDeviceCapability` (older CANN): one capability of `device`. `None` when the runtime
/// lacks the call.
///
/// # Errors
/// Inside the `Some`: [`Error::InvalidArgument`] for an id beyond `i32::MAX`,
/// [`Error::DeviceStatus`] with the vendor's message.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::{Acl, DeviceInfo}};
/// use dist_tensor::Error;
/// let acl = match Acl::load_default() {
///     Ok(acl) => acl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libascendcl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// result::init(&acl)?;
/// if let Some(Ok(cores)) = result::device_capability(&acl, 0, DeviceInfo::VectorCoreNum) {
///     assert!(cores >= 0);
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn device_capability(acl: &Acl, device: u32, info: DeviceInfo) -> Option<Result<i64>> {
    let get = acl.acl_get_device_capability?;
    let query = || {
        device_id("aclGetDeviceCapability", device)?;
        let mut value: i64 = 0;
        // SAFETY: `aclGetDeviceCapability(uint32_t deviceId, aclDeviceInfo deviceInfo,
        // int64_t *value)` per acl_base.h (a C enum is passed as an int); `value` is a live
        // local the call writes.
        let status = unsafe { get(device, info as i32, &mut value) };
        check(acl, "aclGetDeviceCapability", status).map(|()| value)
    };
    Some(query())
}

/// The text HCCL gives for a status (`HcclGetErrorString`); `None` when it gives none.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Hccl};
/// use dist_tensor::Error;
/// // SAFETY: the directories searched hold a CANN install when they hold anything.
/// let hccl = match unsafe { Hccl::discover(None, None) } {
///     Ok(hccl) => hccl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libhccl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// assert!(result::hccl_error_string(&hccl, 1).map_or(true, |m| !m.is_empty()));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn hccl_error_string(hccl: &Hccl, status: HcclResult) -> Option<String> {
    let get = hccl.hccl_get_error_string?;
    // SAFETY: `HcclGetErrorString(HcclResult code) -> const char *` per hccl.h; the string is
    // static in the library, and `owned_string` copies it at once.
    unsafe { owned_string(get(status)) }
}

/// Turns an HCCL status into a result: `Ok` on [`sys::HCCL_SUCCESS`], otherwise
/// [`Error::DeviceStatus`] with the call, the code and HCCL's text for it.
///
/// # Errors
/// [`Error::DeviceStatus`] when `status` is not success.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Hccl};
/// use dist_tensor::Error;
/// // SAFETY: the directories searched hold a CANN install when they hold anything.
/// let hccl = match unsafe { Hccl::discover(None, None) } {
///     Ok(hccl) => hccl,
///     // No CANN on this machine: the error lists every place looked in.
///     Err(e @ Error::LibraryNotFound { .. }) => {
///         assert!(e.to_string().contains("libhccl.so"));
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// assert!(result::hccl_check(&hccl, "HcclCommDestroy", 0).is_ok());
/// let err = result::hccl_check(&hccl, "HcclCommDestroy", 4).unwrap_err();
/// assert!(matches!(err, Error::DeviceStatus { code: 4, .. }));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn hccl_check(hccl: &Hccl, call: &'static str, status: HcclResult) -> Result<()> {
    if status == sys::HCCL_SUCCESS {
        return Ok(());
    }
    let message = hccl_error_string(hccl, status)
        .unwrap_or_else(|| "no message from HcclGetErrorString".to_string());
    Err(Error::DeviceStatus { call, code: status, message })
}

/// `HcclGetRootInfo`: the root rank's identity for a new communicator, to send to the others.
///
/// # Errors
/// [`Error::DeviceStatus`] with HCCL's text for the status.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::{result, sys::Hccl};
/// // SAFETY: the directories searched hold a CANN install when they hold anything.
/// match unsafe { Hccl::discover(None, None) } {
///     // Needs a device set on this thread; either way no panic.
///     Ok(hccl) => { let _ = result::hccl_root_info(&hccl); }
///     Err(e) => assert!(e.to_string().contains("not found")),
/// }
/// ```
pub fn hccl_root_info(hccl: &Hccl) -> Result<HcclRootInfo> {
    let mut info = HcclRootInfo::zeroed();
    // SAFETY: `HcclGetRootInfo(HcclRootInfo *rootInfo) -> HcclResult` per hccl.h; `info` is a
    // live, `repr(C)` buffer of HCCL_ROOT_INFO_BYTES that the call fills.
    let status = unsafe { (hccl.hccl_get_root_info)(&mut info) };
    hccl_check(hccl, "HcclGetRootInfo", status)?;
    Ok(info)
}

pub(crate) mod hccl;
pub(crate) mod nnop;
pub(crate) mod rtc;
pub(crate) mod runtime;
pub(crate) mod shmem;
