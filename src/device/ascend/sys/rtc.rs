//! The run-time compiler's table: `libacl_rtc.so` (`aclrtc`, header `acl/acl_rt_compile.h`,
//! CANN 8.3 and later, Atlas A2/A3).

use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::path::{Path, PathBuf};

use libloading::Library;

use super::{AclError, candidates_beside, open_first, require};
use crate::Result;

/// File name of the run-time compiler.
const RTC_FILE_NAME: &str = "libacl_rtc.so";
const RTC_LABEL: &str = "the Ascend C run-time compiler (libacl_rtc.so, CANN 8.3 or later)";

/// The run-time compiler's symbol table (`aclrtc*`): it compiles Ascend C source held in a
/// string into a device binary, which [`Acl`](super::Acl)'s kernel calls then load.
///
/// # Examples
/// ```
/// use std::path::Path;
/// use dist_tensor::device::ascend::sys::Rtc;
/// use dist_tensor::Error;
///
/// // SAFETY: the directories searched hold a CANN install when they hold anything.
/// match unsafe { Rtc::discover(Some(Path::new("/nonexistent-cann/lib64")), None) } {
///     Ok(rtc) => assert!(rtc.path().ends_with("libacl_rtc.so")),
///     Err(Error::LibraryNotFound { tried, .. }) => {
///         assert_eq!(tried[0], "/nonexistent-cann/lib64/libacl_rtc.so (no such file)");
///     }
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Rtc {
    path: PathBuf,
    pub(crate) create_prog: unsafe extern "C" fn(
        prog: *mut *mut c_void,
        src: *const c_char,
        name: *const c_char,
        num_headers: c_int,
        headers: *const *const c_char,
        include_names: *const *const c_char,
    ) -> AclError,
    pub(crate) compile_prog: unsafe extern "C" fn(
        prog: *mut c_void,
        num_options: c_int,
        options: *const *const c_char,
    ) -> AclError,
    pub(crate) get_bin_data_size:
        unsafe extern "C" fn(prog: *mut c_void, size: *mut usize) -> AclError,
    pub(crate) get_bin_data: unsafe extern "C" fn(prog: *mut c_void, data: *mut c_char) -> AclError,
    pub(crate) get_compile_log_size:
        unsafe extern "C" fn(prog: *mut c_void, size: *mut usize) -> AclError,
    pub(crate) get_compile_log:
        unsafe extern "C" fn(prog: *mut c_void, log: *mut c_char) -> AclError,
    pub(crate) destroy_prog: unsafe extern "C" fn(prog: *mut *mut c_void) -> AclError,
    // Declared last so that it is dropped (closed) after the pointers above.
    _library: Library,
}

impl Rtc {
    /// Opens `libacl_rtc.so` from the first place it opens: `first_dir` (typically the directory
    /// AscendCL came from), then `ascend_home/lib64`, the usual install roots and the loader's
    /// search path.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`](crate::Error::LibraryNotFound) listing every path tried (a
    /// CANN older than 8.3 has no run-time compiler); [`Error::SymbolMissing`](crate::Error::SymbolMissing)
    /// when an `aclrtc` call is absent.
    ///
    /// # Safety
    /// Every file searched must be CANN's run-time compiler, or a library exporting the same
    /// symbols with the same C signatures (such as the crate's test stand-in).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Rtc;
    ///
    /// // SAFETY: the directories searched hold a CANN install when they hold anything.
    /// match unsafe { Rtc::discover(None, None) } {
    ///     Ok(rtc) => assert!(rtc.path().ends_with("libacl_rtc.so")),
    ///     Err(e) => assert!(e.to_string().contains("libacl_rtc.so")),
    /// }
    /// ```
    pub unsafe fn discover(first_dir: Option<&Path>, ascend_home: Option<&Path>) -> Result<Rtc> {
        let candidates = candidates_beside(first_dir, ascend_home, &[RTC_FILE_NAME]);
        // SAFETY: the caller vouches for every candidate.
        let (library, path) = unsafe { open_first(RTC_LABEL, &candidates, Vec::new()) }?;
        let (lib, p) = (&library, path.as_path());
        // SAFETY (every lookup below): each type is the C signature of the symbol named, from
        // CANN's acl/acl_rt_compile.h (`aclrtcProg` is a `void *`), and the caller vouches that
        // the library follows it.
        unsafe {
            Ok(Rtc {
                create_prog: require(lib, p, "aclrtcCreateProg")?,
                compile_prog: require(lib, p, "aclrtcCompileProg")?,
                get_bin_data_size: require(lib, p, "aclrtcGetBinDataSize")?,
                get_bin_data: require(lib, p, "aclrtcGetBinData")?,
                get_compile_log_size: require(lib, p, "aclrtcGetCompileLogSize")?,
                get_compile_log: require(lib, p, "aclrtcGetCompileLog")?,
                destroy_prog: require(lib, p, "aclrtcDestroyProg")?,
                path,
                _library: library,
            })
        }
    }

    /// The file the table was opened from.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Rtc;
    /// // SAFETY: the directories searched hold a CANN install when they hold anything.
    /// if let Ok(rtc) = unsafe { Rtc::discover(None, None) } {
    ///     assert_eq!(rtc.path().file_name().unwrap(), "libacl_rtc.so");
    /// }
    /// ```
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl fmt::Debug for Rtc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rtc").field("path", &self.path).finish_non_exhaustive()
    }
}
