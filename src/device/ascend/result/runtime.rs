//! Contexts, streams, device memory, and loading and launching compiled kernels.
//!
//! Each function makes one AscendCL call (`acl/acl_rt.h`) and turns a failing status into
//! [`Error::DeviceStatus`] with the vendor's message. Handles are the runtime's opaque
//! pointers; the safe layer owns them.

use std::ffi::{CStr, c_void};
use std::time::Duration;

use super::check;
use crate::device::ascend::sys::{
    Acl, BINARY_LOAD_OPT_MAGIC, BINARY_MAGIC_ELF_AICORE, BinaryLoadOption, BinaryLoadOptions,
    KernelCalls, MEM_MALLOC_HUGE_FIRST, MemcpyKind,
};
use crate::{Error, Result};

/// `aclrtCreateContext`: a context on `device`, current for the calling thread from now on.
pub(crate) fn create_context(acl: &Acl, device: u32) -> Result<*mut c_void> {
    let id = super::device_id("aclrtCreateContext", device)?;
    let mut context = std::ptr::null_mut();
    // SAFETY: `aclrtCreateContext(aclrtContext *context, int32_t deviceId)`; `context` is a live
    // local the call writes.
    let status = unsafe { (acl.aclrt_create_context)(&mut context, id) };
    check(acl, "aclrtCreateContext", status)?;
    Ok(context)
}

/// `aclrtDestroyContext`.
///
/// # Safety
/// `context` came from [`create_context`] on this runtime and is not used afterwards.
pub(crate) unsafe fn destroy_context(acl: &Acl, context: *mut c_void) -> Result<()> {
    // SAFETY: `aclrtDestroyContext(aclrtContext)`, on a context the caller owns.
    let status = unsafe { (acl.aclrt_destroy_context)(context) };
    check(acl, "aclrtDestroyContext", status)
}

/// `aclrtSetCurrentContext`: binds `context` (and its device) to the calling thread.
///
/// # Safety
/// `context` came from [`create_context`] on this runtime and is still alive.
pub(crate) unsafe fn set_current_context(acl: &Acl, context: *mut c_void) -> Result<()> {
    // SAFETY: `aclrtSetCurrentContext(aclrtContext)`, on a live context.
    let status = unsafe { (acl.aclrt_set_current_context)(context) };
    check(acl, "aclrtSetCurrentContext", status)
}

/// `aclrtCreateStream`: a stream of the calling thread's current context.
pub(crate) fn create_stream(acl: &Acl) -> Result<*mut c_void> {
    let mut stream = std::ptr::null_mut();
    // SAFETY: `aclrtCreateStream(aclrtStream *stream)`; `stream` is a live local.
    let status = unsafe { (acl.aclrt_create_stream)(&mut stream) };
    check(acl, "aclrtCreateStream", status)?;
    Ok(stream)
}

/// `aclrtDestroyStream`.
///
/// # Safety
/// `stream` came from [`create_stream`] on this runtime and is not used afterwards.
pub(crate) unsafe fn destroy_stream(acl: &Acl, stream: *mut c_void) -> Result<()> {
    // SAFETY: `aclrtDestroyStream(aclrtStream)`, on a stream the caller owns.
    let status = unsafe { (acl.aclrt_destroy_stream)(stream) };
    check(acl, "aclrtDestroyStream", status)
}

/// Waits for everything queued on `stream`: `aclrtSynchronizeStreamWithTimeout` with `timeout`
/// where the runtime has it (so that a kernel waiting on a peer that never comes cannot hang the
/// host), `aclrtSynchronizeStream` otherwise.
///
/// # Safety
/// `stream` is a live stream of this runtime.
pub(crate) unsafe fn synchronize_stream(
    acl: &Acl,
    stream: *mut c_void,
    timeout: Duration,
) -> Result<()> {
    match acl.aclrt_synchronize_stream_with_timeout {
        Some(sync) => {
            let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX).max(1);
            // SAFETY: `aclrtSynchronizeStreamWithTimeout(aclrtStream, int32_t timeout)` (ms), on
            // a live stream.
            let status = unsafe { sync(stream, ms) };
            check(acl, "aclrtSynchronizeStreamWithTimeout", status)
        }
        None => {
            // SAFETY: `aclrtSynchronizeStream(aclrtStream)`, on a live stream.
            let status = unsafe { (acl.aclrt_synchronize_stream)(stream) };
            check(acl, "aclrtSynchronizeStream", status)
        }
    }
}

/// `aclrtMalloc`: `bytes` of device memory on the current context's device (huge pages first).
pub(crate) fn malloc(acl: &Acl, bytes: usize) -> Result<*mut c_void> {
    let mut ptr = std::ptr::null_mut();
    // SAFETY: `aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)`; `ptr` is a
    // live local. A zero size is refused by the runtime, so callers ask for at least one byte.
    let status = unsafe { (acl.aclrt_malloc)(&mut ptr, bytes.max(1), MEM_MALLOC_HUGE_FIRST) };
    check(acl, "aclrtMalloc", status)?;
    Ok(ptr)
}

/// `aclrtFree`.
///
/// # Safety
/// `ptr` came from [`malloc`] on this runtime and is not used afterwards.
pub(crate) unsafe fn free(acl: &Acl, ptr: *mut c_void) -> Result<()> {
    // SAFETY: `aclrtFree(void *devPtr)`, on memory the caller owns.
    let status = unsafe { (acl.aclrt_free)(ptr) };
    check(acl, "aclrtFree", status)
}

/// `aclrtMemcpy` of `bytes` from host memory to device memory.
///
/// # Safety
/// `src` is valid for `bytes` reads; `dst` is device memory of this runtime with room for them.
pub(crate) unsafe fn copy_to_device(
    acl: &Acl,
    dst: *mut c_void,
    src: *const u8,
    bytes: usize,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: `aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
    // aclrtMemcpyKind kind)`; the caller vouches for both ranges.
    let status = unsafe {
        (acl.aclrt_memcpy)(dst, bytes, src.cast(), bytes, MemcpyKind::HostToDevice as i32)
    };
    check(acl, "aclrtMemcpy", status)
}

/// `aclrtMemcpy` of `bytes` from device memory to host memory.
///
/// # Safety
/// `dst` is valid for `bytes` writes; `src` is device memory of this runtime holding them.
pub(crate) unsafe fn copy_to_host(
    acl: &Acl,
    dst: *mut u8,
    src: *const c_void,
    bytes: usize,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: as in `copy_to_device`, the other way.
    let status = unsafe {
        (acl.aclrt_memcpy)(dst.cast(), bytes, src, bytes, MemcpyKind::DeviceToHost as i32)
    };
    check(acl, "aclrtMemcpy", status)
}

/// The kernel-launch calls, or the error naming the first one this runtime lacks.
fn kernel_calls(acl: &Acl) -> Result<&KernelCalls> {
    acl.kernels.as_ref().map_err(|&symbol| Error::SymbolMissing {
        symbol,
        library: format!(
            "{} (loading and launching compiled kernels needs CANN 8.3 or later)",
            acl.path().display()
        ),
    })
}

/// `aclrtBinaryLoadFromData`: loads an AI-core ELF (from `aclrtcGetBinData`) onto the current
/// context's device.
pub(crate) fn binary_load(acl: &Acl, elf: &[u8]) -> Result<*mut c_void> {
    let calls = kernel_calls(acl)?;
    let mut option =
        BinaryLoadOption { kind: BINARY_LOAD_OPT_MAGIC, value: [BINARY_MAGIC_ELF_AICORE, 0, 0, 0] };
    let options = BinaryLoadOptions { options: &mut option, count: 1 };
    let mut bin = std::ptr::null_mut();
    // SAFETY: `aclrtBinaryLoadFromData(const void *data, size_t length, const
    // aclrtBinaryLoadOptions *options, aclrtBinHandle *binHandle)`: `elf` is valid for its
    // length, `options` points to one live option, `bin` is a live local.
    let status = unsafe {
        (calls.binary_load_from_data)(elf.as_ptr().cast(), elf.len(), &options, &mut bin)
    };
    check(acl, "aclrtBinaryLoadFromData", status)?;
    Ok(bin)
}

/// `aclrtBinaryGetFunction`: the kernel `name` of a loaded binary.
///
/// # Safety
/// `bin` came from [`binary_load`] on this runtime and is still loaded.
pub(crate) unsafe fn binary_get_function(
    acl: &Acl,
    bin: *mut c_void,
    name: &CStr,
) -> Result<*mut c_void> {
    let calls = kernel_calls(acl)?;
    let mut func = std::ptr::null_mut();
    // SAFETY: `aclrtBinaryGetFunction(const aclrtBinHandle, const char *kernelName,
    // aclrtFuncHandle *)`, on a loaded binary, a NUL-terminated name and a live local.
    let status = unsafe { (calls.binary_get_function)(bin, name.as_ptr(), &mut func) };
    check(acl, "aclrtBinaryGetFunction", status)?;
    Ok(func)
}

/// `aclrtBinaryUnLoad`.
///
/// # Safety
/// `bin` came from [`binary_load`] on this runtime; its functions are not used afterwards.
pub(crate) unsafe fn binary_unload(acl: &Acl, bin: *mut c_void) -> Result<()> {
    let calls = kernel_calls(acl)?;
    // SAFETY: `aclrtBinaryUnLoad(aclrtBinHandle)`, on a binary the caller owns.
    let status = unsafe { (calls.binary_unload)(bin) };
    check(acl, "aclrtBinaryUnLoad", status)
}

/// `aclrtKernelArgsInit`: an empty argument list for `func` (the runtime owns its memory).
///
/// # Safety
/// `func` came from [`binary_get_function`] and its binary is still loaded.
pub(crate) unsafe fn kernel_args_init(acl: &Acl, func: *mut c_void) -> Result<*mut c_void> {
    let calls = kernel_calls(acl)?;
    let mut args = std::ptr::null_mut();
    // SAFETY: `aclrtKernelArgsInit(aclrtFuncHandle, aclrtArgsHandle *)`, on a live function and
    // a live local.
    let status = unsafe { (calls.kernel_args_init)(func, &mut args) };
    check(acl, "aclrtKernelArgsInit", status)?;
    Ok(args)
}

/// `aclrtKernelArgsAppend`: copies `value` (one argument, in the kernel's parameter order) into
/// the list.
///
/// # Safety
/// `args` came from [`kernel_args_init`] and has not been launched with yet.
pub(crate) unsafe fn kernel_args_append(acl: &Acl, args: *mut c_void, value: &[u8]) -> Result<()> {
    let calls = kernel_calls(acl)?;
    let mut param = std::ptr::null_mut();
    // SAFETY: `aclrtKernelArgsAppend(aclrtArgsHandle, void *param, size_t paramSize,
    // aclrtParamHandle *)`: the runtime copies `paramSize` bytes from host memory `param` (it
    // does not write through it, so a pointer into a shared slice is sound).
    let status = unsafe {
        (calls.kernel_args_append)(args, value.as_ptr().cast_mut().cast(), value.len(), &mut param)
    };
    check(acl, "aclrtKernelArgsAppend", status)
}

/// `aclrtKernelArgsFinalize`: the list is complete.
///
/// # Safety
/// As [`kernel_args_append`].
pub(crate) unsafe fn kernel_args_finalize(acl: &Acl, args: *mut c_void) -> Result<()> {
    let calls = kernel_calls(acl)?;
    // SAFETY: `aclrtKernelArgsFinalize(aclrtArgsHandle)`, on a live list.
    let status = unsafe { (calls.kernel_args_finalize)(args) };
    check(acl, "aclrtKernelArgsFinalize", status)
}

/// `aclrtLaunchKernelWithConfig`: queues `func` on `blocks` cores of `stream`'s device with the
/// finalised `args` (no launch configuration).
///
/// # Safety
/// `func`, `stream` and `args` are live handles of this runtime on one device, and the memory
/// the arguments point to stays valid until the stream is synchronised.
pub(crate) unsafe fn launch(
    acl: &Acl,
    func: *mut c_void,
    blocks: u32,
    stream: *mut c_void,
    args: *mut c_void,
) -> Result<()> {
    let calls = kernel_calls(acl)?;
    let null = std::ptr::null_mut();
    // SAFETY: `aclrtLaunchKernelWithConfig(aclrtFuncHandle, uint32_t numBlocks, aclrtStream,
    // aclrtLaunchKernelCfg *cfg, aclrtArgsHandle, void *reserve)`: a null `cfg` means none, and
    // `reserve` must be null; the handles are live, as the caller vouches.
    let status =
        unsafe { (calls.launch_kernel_with_config)(func, blocks, stream, null, args, null) };
    check(acl, "aclrtLaunchKernelWithConfig", status)
}
