//! The AscendCL runtime's table: `libascendcl.so`, or `libacl_rt.so` under its newer name.

use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use libloading::Library;

use super::{
    ACL_FILE_NAMES, ACL_LABEL, ASCEND_HOME_PATH, AclError, ascend_home_from_env, lookup,
    open_first, require, search_order,
};
use crate::Result;

/// The AscendCL runtime's symbol table: required calls resolved, optional ones as `Option`s.
///
/// The function pointers are valid while the table lives (it owns the open library); they are
/// called through [`result`](crate::device::ascend::result).
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::Acl;
/// use dist_tensor::Error;
///
/// match Acl::load_default() {
///     // A machine with CANN: the runtime's required calls resolved.
///     Ok(acl) => assert!(acl.provides("aclInit")),
///     // This machine: no CANN, and the error lists every place looked in.
///     Err(Error::LibraryNotFound { tried, .. }) => {
///         assert!(tried.iter().any(|t| t.contains("/usr/local/Ascend/cann/lib64/libascendcl.so")))
///     }
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Acl {
    path: PathBuf,
    pub(crate) acl_init: unsafe extern "C" fn(config_path: *const c_char) -> AclError,
    pub(crate) acl_finalize: unsafe extern "C" fn() -> AclError,
    pub(crate) aclrt_get_device_count: unsafe extern "C" fn(count: *mut u32) -> AclError,
    pub(crate) aclrt_set_device: unsafe extern "C" fn(device_id: i32) -> AclError,
    pub(crate) aclrt_reset_device: unsafe extern "C" fn(device_id: i32) -> AclError,
    pub(crate) aclrt_get_soc_name: Option<unsafe extern "C" fn() -> *const c_char>,
    pub(crate) acl_get_recent_err_msg: Option<unsafe extern "C" fn() -> *const c_char>,
    pub(crate) aclrt_get_device_info:
        Option<unsafe extern "C" fn(device_id: u32, attr: c_int, value: *mut i64) -> AclError>,
    pub(crate) acl_get_device_capability:
        Option<unsafe extern "C" fn(device_id: u32, info: c_int, value: *mut i64) -> AclError>,
    // Contexts, streams and memory: in every CANN runtime.
    pub(crate) aclrt_create_context:
        unsafe extern "C" fn(context: *mut *mut c_void, device_id: i32) -> AclError,
    pub(crate) aclrt_destroy_context: unsafe extern "C" fn(context: *mut c_void) -> AclError,
    pub(crate) aclrt_set_current_context: unsafe extern "C" fn(context: *mut c_void) -> AclError,
    pub(crate) aclrt_create_stream: unsafe extern "C" fn(stream: *mut *mut c_void) -> AclError,
    pub(crate) aclrt_destroy_stream: unsafe extern "C" fn(stream: *mut c_void) -> AclError,
    pub(crate) aclrt_synchronize_stream: unsafe extern "C" fn(stream: *mut c_void) -> AclError,
    pub(crate) aclrt_synchronize_stream_with_timeout:
        Option<unsafe extern "C" fn(stream: *mut c_void, timeout_ms: i32) -> AclError>,
    pub(crate) aclrt_malloc:
        unsafe extern "C" fn(dev_ptr: *mut *mut c_void, size: usize, policy: c_int) -> AclError,
    pub(crate) aclrt_free: unsafe extern "C" fn(dev_ptr: *mut c_void) -> AclError,
    pub(crate) aclrt_memcpy: unsafe extern "C" fn(
        dst: *mut c_void,
        dest_max: usize,
        src: *const c_void,
        count: usize,
        kind: c_int,
    ) -> AclError,
    /// Loading and launching compiled kernels (CANN 8.3 and later): all of them, or the name of
    /// the first one this runtime lacks.
    pub(crate) kernels: std::result::Result<KernelCalls, &'static str>,
    // Declared last so that it is dropped (closed) after everything above.
    _library: Library,
}

static DEFAULT_ACL: OnceLock<Result<Arc<Acl>>> = OnceLock::new();

impl Acl {
    /// Opens the AscendCL runtime at exactly `path` and resolves its symbols.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`](crate::Error::LibraryNotFound) when the file does not open (the loader's reason included);
    /// [`Error::SymbolMissing`](crate::Error::SymbolMissing) when a required call is absent.
    ///
    /// # Safety
    /// Loading runs the library's initialisers, and its symbols are then called with the C
    /// signatures of CANN's public headers: `path` must be a CANN runtime, or a library that
    /// exports the same symbols with the same signatures (such as the crate's test stand-in).
    ///
    /// # Examples
    /// ```
    /// use std::path::Path;
    /// use dist_tensor::device::ascend::sys::Acl;
    /// use dist_tensor::Error;
    ///
    /// let missing = Path::new("/nonexistent/lib64/libascendcl.so");
    /// // SAFETY: were the file present, it would be a CANN runtime.
    /// let err = unsafe { Acl::load(missing) }.unwrap_err();
    /// assert!(matches!(err, Error::LibraryNotFound { ref tried, .. } if tried.len() == 1));
    /// assert!(err.to_string().contains("/nonexistent/lib64/libascendcl.so (no such file)"));
    /// ```
    pub unsafe fn load(path: &Path) -> Result<Acl> {
        // SAFETY: the caller vouches for `path`.
        let (library, path) = unsafe { open_first(ACL_LABEL, &[path.to_path_buf()], Vec::new()) }?;
        // SAFETY: as above; the symbols are resolved with the headers' signatures.
        unsafe { Self::resolve(library, path) }
    }

    /// Searches for the runtime in [`search_order`] with `ascend_home` as `$ASCEND_HOME_PATH`,
    /// and opens the first file that opens.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`](crate::Error::LibraryNotFound) listing every path tried with the loader's reason;
    /// [`Error::SymbolMissing`](crate::Error::SymbolMissing) when the library that opened lacks a required call.
    ///
    /// # Safety
    /// Every file in the search order must be sound to load, as for [`Acl::load`]: `ascend_home`
    /// must be a CANN install (or hold the test stand-in), and so must the usual install roots
    /// and the loader's search path.
    ///
    /// # Examples
    /// ```
    /// use std::path::Path;
    /// use dist_tensor::device::ascend::sys::Acl;
    /// use dist_tensor::Error;
    ///
    /// // SAFETY: the directories searched hold a CANN install when they hold anything.
    /// match unsafe { Acl::discover(Some(Path::new("/nonexistent-cann"))) } {
    ///     Ok(acl) => assert!(acl.provides("aclFinalize")),
    ///     Err(Error::LibraryNotFound { tried, .. }) => {
    ///         assert_eq!(tried[0], "/nonexistent-cann/lib64/libascendcl.so (no such file)");
    ///         assert_eq!(tried[1], "/nonexistent-cann/lib64/libacl_rt.so (no such file)");
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub unsafe fn discover(ascend_home: Option<&Path>) -> Result<Acl> {
        let mut tried = Vec::new();
        if ascend_home.is_none() {
            tried.push(format!("${ASCEND_HOME_PATH} (not set)"));
        }
        let candidates = search_order(ascend_home, &ACL_FILE_NAMES);
        // SAFETY: the caller vouches for every candidate.
        let (library, path) = unsafe { open_first(ACL_LABEL, &candidates, tried) }?;
        // SAFETY: as above.
        unsafe { Self::resolve(library, path) }
    }

    /// The process default: [`Acl::discover`] with `$ASCEND_HOME_PATH`, done once; later calls
    /// return the same table, or the same error.
    ///
    /// The files opened are those of the CANN install that the environment names, trusted as
    /// every CANN program trusts them.
    ///
    /// # Errors
    /// As [`Acl::discover`]; on a machine without CANN, [`Error::LibraryNotFound`](crate::Error::LibraryNotFound).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Acl;
    /// use dist_tensor::Error;
    ///
    /// let first = Acl::load_default();
    /// let again = Acl::load_default();
    /// match (first, again) {
    ///     (Ok(a), Ok(b)) => assert!(std::sync::Arc::ptr_eq(&a, &b)),
    ///     (Err(a), Err(b)) => {
    ///         assert!(matches!(a, Error::LibraryNotFound { .. }));
    ///         assert_eq!(a.to_string(), b.to_string());
    ///     }
    ///     _ => unreachable!("the first result is kept"),
    /// }
    /// ```
    pub fn load_default() -> Result<Arc<Acl>> {
        DEFAULT_ACL
            .get_or_init(|| {
                let home = ascend_home_from_env();
                // SAFETY: the search covers `$ASCEND_HOME_PATH`, the standard install roots and
                // the loader's path, which hold the CANN install this process is configured with.
                unsafe { Acl::discover(home.as_deref()) }.map(Arc::new)
            })
            .clone()
    }

    /// Resolves the table from an open library.
    ///
    /// # Safety
    /// `library` must export CANN's symbols with the headers' signatures.
    unsafe fn resolve(library: Library, path: PathBuf) -> Result<Acl> {
        let lib = &library;
        let p = path.as_path();
        // SAFETY (every lookup below): each type is the C signature of the symbol named, from
        // CANN's acl_base.h / acl_rt.h, and the caller vouches that the library follows them.
        unsafe {
            Ok(Acl {
                acl_init: require(lib, p, "aclInit")?,
                acl_finalize: require(lib, p, "aclFinalize")?,
                aclrt_get_device_count: require(lib, p, "aclrtGetDeviceCount")?,
                aclrt_set_device: require(lib, p, "aclrtSetDevice")?,
                aclrt_reset_device: require(lib, p, "aclrtResetDevice")?,
                aclrt_get_soc_name: lookup(lib, "aclrtGetSocName"),
                acl_get_recent_err_msg: lookup(lib, "aclGetRecentErrMsg"),
                aclrt_get_device_info: lookup(lib, "aclrtGetDeviceInfo"),
                acl_get_device_capability: lookup(lib, "aclGetDeviceCapability"),
                aclrt_create_context: require(lib, p, "aclrtCreateContext")?,
                aclrt_destroy_context: require(lib, p, "aclrtDestroyContext")?,
                aclrt_set_current_context: require(lib, p, "aclrtSetCurrentContext")?,
                aclrt_create_stream: require(lib, p, "aclrtCreateStream")?,
                aclrt_destroy_stream: require(lib, p, "aclrtDestroyStream")?,
                aclrt_synchronize_stream: require(lib, p, "aclrtSynchronizeStream")?,
                aclrt_synchronize_stream_with_timeout: lookup(
                    lib,
                    "aclrtSynchronizeStreamWithTimeout",
                ),
                aclrt_malloc: require(lib, p, "aclrtMalloc")?,
                aclrt_free: require(lib, p, "aclrtFree")?,
                aclrt_memcpy: require(lib, p, "aclrtMemcpy")?,
                kernels: KernelCalls::resolve(lib),
                path,
                _library: library,
            })
        }
    }

    /// The file the table was opened from (a bare file name when the loader's search path
    /// found it).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::{Acl, ACL_FILE_NAMES};
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
    /// let name = acl.path().file_name().unwrap().to_string_lossy().into_owned();
    /// assert!(ACL_FILE_NAMES.contains(&name.as_str()));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the library exports the C symbol `symbol` among those the crate uses.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Acl;
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
    /// assert!(acl.provides("aclrtSetDevice"));
    /// assert!(!acl.provides("notAnAclSymbol"));
    /// // At least one of the two core-count queries, for the topology.
    /// assert!(acl.provides("aclrtGetDeviceInfo") || acl.provides("aclGetDeviceCapability"));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn provides(&self, symbol: &str) -> bool {
        match symbol {
            "aclInit"
            | "aclFinalize"
            | "aclrtGetDeviceCount"
            | "aclrtSetDevice"
            | "aclrtResetDevice"
            | "aclrtCreateContext"
            | "aclrtDestroyContext"
            | "aclrtSetCurrentContext"
            | "aclrtCreateStream"
            | "aclrtDestroyStream"
            | "aclrtSynchronizeStream"
            | "aclrtMalloc"
            | "aclrtFree"
            | "aclrtMemcpy" => true,
            "aclrtSynchronizeStreamWithTimeout" => {
                self.aclrt_synchronize_stream_with_timeout.is_some()
            }
            name if KernelCalls::NAMES.contains(&name) => self.kernels.is_ok(),
            "aclrtGetSocName" => self.aclrt_get_soc_name.is_some(),
            "aclGetRecentErrMsg" => self.acl_get_recent_err_msg.is_some(),
            "aclrtGetDeviceInfo" => self.aclrt_get_device_info.is_some(),
            "aclGetDeviceCapability" => self.acl_get_device_capability.is_some(),
            _ => false,
        }
    }
}

impl fmt::Debug for Acl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acl")
            .field("path", &self.path)
            .field("aclrtGetDeviceInfo", &self.aclrt_get_device_info.is_some())
            .field("aclGetDeviceCapability", &self.acl_get_device_capability.is_some())
            .field("kernels", &self.kernels.as_ref().err().map_or("all", |missing| missing))
            .finish_non_exhaustive()
    }
}

/// The calls that load compiled kernels and launch them (CANN 8.3 and later), resolved as a
/// group: kernels need all of them.
pub(crate) struct KernelCalls {
    pub(crate) binary_load_from_data: unsafe extern "C" fn(
        data: *const c_void,
        length: usize,
        options: *const BinaryLoadOptions,
        bin: *mut *mut c_void,
    ) -> AclError,
    pub(crate) binary_get_function: unsafe extern "C" fn(
        bin: *mut c_void,
        kernel_name: *const c_char,
        func: *mut *mut c_void,
    ) -> AclError,
    pub(crate) binary_unload: unsafe extern "C" fn(bin: *mut c_void) -> AclError,
    pub(crate) kernel_args_init:
        unsafe extern "C" fn(func: *mut c_void, args: *mut *mut c_void) -> AclError,
    pub(crate) kernel_args_append: unsafe extern "C" fn(
        args: *mut c_void,
        param: *mut c_void,
        param_size: usize,
        param_handle: *mut *mut c_void,
    ) -> AclError,
    pub(crate) kernel_args_finalize: unsafe extern "C" fn(args: *mut c_void) -> AclError,
    pub(crate) launch_kernel_with_config: unsafe extern "C" fn(
        func: *mut c_void,
        num_blocks: u32,
        stream: *mut c_void,
        cfg: *mut c_void,
        args: *mut c_void,
        reserve: *mut c_void,
    ) -> AclError,
}

impl KernelCalls {
    /// The C names, in the order they are resolved.
    pub(crate) const NAMES: [&'static str; 7] = [
        "aclrtBinaryLoadFromData",
        "aclrtBinaryGetFunction",
        "aclrtBinaryUnLoad",
        "aclrtKernelArgsInit",
        "aclrtKernelArgsAppend",
        "aclrtKernelArgsFinalize",
        "aclrtLaunchKernelWithConfig",
    ];

    /// All seven calls, or the name of the first one missing.
    fn resolve(lib: &Library) -> std::result::Result<KernelCalls, &'static str> {
        let [load, get, unload, init, append, finalize, launch] = Self::NAMES;
        // SAFETY (every lookup): each type is the C signature of the symbol named, from acl_rt.h
        // (handles are `void *`, and a C enum is passed as an int); the library is a CANN runtime
        // or follows its headers, as the table's constructor requires.
        unsafe {
            Ok(KernelCalls {
                binary_load_from_data: lookup(lib, load).ok_or(load)?,
                binary_get_function: lookup(lib, get).ok_or(get)?,
                binary_unload: lookup(lib, unload).ok_or(unload)?,
                kernel_args_init: lookup(lib, init).ok_or(init)?,
                kernel_args_append: lookup(lib, append).ok_or(append)?,
                kernel_args_finalize: lookup(lib, finalize).ok_or(finalize)?,
                launch_kernel_with_config: lookup(lib, launch).ok_or(launch)?,
            })
        }
    }
}

/// `aclrtMemcpyKind`: the direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum MemcpyKind {
    /// `ACL_MEMCPY_HOST_TO_DEVICE`.
    HostToDevice = 1,
    /// `ACL_MEMCPY_DEVICE_TO_HOST`.
    DeviceToHost = 2,
}

/// `ACL_MEM_MALLOC_HUGE_FIRST`: huge pages where there are any, normal pages otherwise.
pub(crate) const MEM_MALLOC_HUGE_FIRST: c_int = 0;

/// `ACL_RT_BINARY_LOAD_OPT_MAGIC`: the option that says what kind of binary is loaded.
pub(crate) const BINARY_LOAD_OPT_MAGIC: c_int = 2;
/// `ACL_RT_BINARY_MAGIC_ELF_AICORE`: an AI-core ELF, what `aclrtcGetBinData` gives.
pub(crate) const BINARY_MAGIC_ELF_AICORE: u32 = 0x4355_4245;

/// One `aclrtBinaryLoadOption`: a C enum for its type, then a 16-byte union for its value.
#[repr(C)]
pub(crate) struct BinaryLoadOption {
    pub(crate) kind: c_int,
    pub(crate) value: [u32; 4],
}

/// `aclrtBinaryLoadOptions`: an array of options and its length.
#[repr(C)]
pub(crate) struct BinaryLoadOptions {
    pub(crate) options: *mut BinaryLoadOption,
    pub(crate) count: usize,
}
