//! Compiling Ascend C source at run time (`aclrtc`): one call that goes from source text to a
//! device binary, with the compiler's log in the error when it fails.

use std::ffi::{CString, c_char, c_int, c_void};

use crate::device::ascend::sys::{AclError, Rtc};
use crate::{Error, Result};

/// What an `aclrtc` status means (the RTC error codes of `acl_rt_compile.h`'s documentation).
fn rtc_status_text(code: AclError) -> &'static str {
    match code {
        176_000 => "ACL_ERROR_RTC_INVALID_PROG: the program handle is not valid",
        176_001 => "ACL_ERROR_RTC_INVALID_INPUT: an argument other than the program is not valid",
        176_002 => "ACL_ERROR_RTC_INVALID_OPTION: a compile option is not valid",
        176_003 => "ACL_ERROR_RTC_COMPILATION: the source did not compile",
        176_004 => "ACL_ERROR_RTC_LINKING: the program did not link",
        _ => "an aclrtc error",
    }
}

fn status(call: &'static str, code: AclError) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    Err(Error::DeviceStatus { call, code, message: rtc_status_text(code).to_string() })
}

/// A program being compiled, destroyed (`aclrtcDestroyProg`) on every way out.
struct Program<'a> {
    rtc: &'a Rtc,
    handle: *mut c_void,
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: `aclrtcDestroyProg(aclrtcProg *prog)` on the program `aclrtcCreateProg` made;
        // nothing uses it afterwards. A failure has nowhere to go from a drop.
        let _ = unsafe { (self.rtc.destroy_prog)(&mut self.handle) };
    }
}

impl Program<'_> {
    /// `aclrtcGetCompileLogSize` + `aclrtcGetCompileLog`; empty when there is none.
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: `aclrtcGetCompileLogSize(aclrtcProg, size_t *)` on a live program.
        if unsafe { (self.rtc.get_compile_log_size)(self.handle, &mut size) } != 0 || size == 0 {
            return String::new();
        }
        let mut log = vec![0u8; size + 1];
        // SAFETY: `aclrtcGetCompileLog(aclrtcProg, char *log)` writes at most the size it
        // reported (the buffer has one more byte, for a terminating NUL).
        if unsafe { (self.rtc.get_compile_log)(self.handle, log.as_mut_ptr().cast()) } != 0 {
            return String::new();
        }
        let end = log.iter().position(|&b| b == 0).unwrap_or(size);
        String::from_utf8_lossy(&log[..end]).trim_end().to_string()
    }
}

/// Compiles `source` (Ascend C, named `kernel`) with `options` (`--npu-arch=dav-2201`, `-D...`,
/// `-I...`) and returns the device binary: `aclrtcCreateProg`, `aclrtcCompileProg`,
/// `aclrtcGetBinDataSize`, `aclrtcGetBinData`, and `aclrtcDestroyProg` on every way out.
///
/// # Errors
/// [`Error::KernelCompile`] with the compiler's log when the source does not compile;
/// [`Error::DeviceStatus`] naming the call for any other failing status; [`Error::InvalidArgument`]
/// for a source or option with a NUL byte.
pub(crate) fn compile(
    rtc: &Rtc,
    kernel: &'static str,
    source: &str,
    options: &[String],
) -> Result<Vec<u8>> {
    let nul = |what: &str| Error::InvalidArgument {
        op: "aclrtcCreateProg",
        rank: 0,
        reason: format!("the {what} of kernel {kernel} holds a NUL byte"),
    };
    let src = CString::new(source).map_err(|_| nul("source"))?;
    let name = CString::new(kernel).map_err(|_| nul("name"))?;
    let opts: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<Result<_, _>>()
        .map_err(|_| nul("options"))?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    let mut handle = std::ptr::null_mut();
    // SAFETY: `aclrtcCreateProg(aclrtcProg *prog, const char *src, const char *name, int
    // numHeaders, const char **headers, const char **includeNames)`: NUL-terminated strings, no
    // headers (the header says they must be 0 and NULL), a live local for the handle.
    let code = unsafe {
        (rtc.create_prog)(
            &mut handle,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    status("aclrtcCreateProg", code)?;
    let program = Program { rtc, handle };

    let count = c_int::try_from(opt_ptrs.len()).expect("a handful of options");
    // SAFETY: `aclrtcCompileProg(aclrtcProg, int numOptions, const char **options)`: a live
    // program and `count` NUL-terminated strings that outlive the call.
    let code = unsafe { (rtc.compile_prog)(program.handle, count, opt_ptrs.as_ptr()) };
    if code != 0 {
        return Err(Error::KernelCompile {
            call: "aclrtcCompileProg",
            kernel,
            options: options.join(" "),
            code,
            log: program.log(),
        });
    }

    let mut size = 0usize;
    // SAFETY: `aclrtcGetBinDataSize(aclrtcProg, size_t *)` on a compiled program.
    let code = unsafe { (rtc.get_bin_data_size)(program.handle, &mut size) };
    status("aclrtcGetBinDataSize", code)?;
    let mut binary = vec![0u8; size];
    // SAFETY: `aclrtcGetBinData(aclrtcProg, char *binData)` writes the `size` bytes it reported
    // into a buffer of exactly that size.
    let code = unsafe { (rtc.get_bin_data)(program.handle, binary.as_mut_ptr().cast()) };
    status("aclrtcGetBinData", code)?;
    if binary.is_empty() {
        return Err(Error::DeviceStatus {
            call: "aclrtcGetBinDataSize",
            code: 0,
            message: format!("kernel {kernel} compiled to an empty binary"),
        });
    }
    Ok(binary)
}
