//! Raw symbol tables of the CANN libraries, opened at run time with `libloading`.
//!
//! One table per library: [`Acl`] for the AscendCL runtime (`libascendcl.so`, or `libacl_rt.so`
//! under its newer name) and [`Hccl`] for the collective library (`libhccl.so`, with
//! `libhcomm.so` for the communicator calls on newer CANN). Libraries are opened with
//! `RTLD_NOW | RTLD_GLOBAL`, as CANN's own loaders do, so a missing dependency is reported at
//! open time and the symbols are visible to the operator libraries CANN opens later.
//!
//! Where a library is looked for, in order ([`search_order`]):
//!
//! 1. `$ASCEND_HOME_PATH/lib64` (the variable CANN's `set_env.sh` exports);
//! 2. the usual install roots, [`INSTALL_ROOTS`], each with `lib64`;
//! 3. the loader's own search path (`LD_LIBRARY_PATH`, the `ld.so` cache), by bare file name.
//!
//! In each place `libascendcl.so` is tried before `libacl_rt.so`. When nothing opens, the error
//! lists every path tried with the loader's reason, so a user can see why no NPU is available.
//!
//! A symbol the crate cannot do without is required when the table is built; a newer or
//! optional one (`aclrtGetDeviceInfo`, `aclGetRecentErrMsg`, ...) is kept as an `Option`, and
//! the [`result`](super::result) layer falls back to the older call. The function pointers
//! stay inside the tables: call them through [`result`](super::result).

use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use libloading::Library;

use crate::{Error, Result};

/// The status every AscendCL call returns (`aclError`, a C `int`); 0 is success.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::{AclError, ACL_SUCCESS};
/// let ok: AclError = ACL_SUCCESS;
/// assert_eq!(ok, 0);
/// ```
pub type AclError = c_int;

/// `ACL_SUCCESS`: the call succeeded.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::sys::ACL_SUCCESS, 0);
/// ```
pub const ACL_SUCCESS: AclError = 0;

/// `ACL_ERROR_REPEAT_INITIALIZE`: `aclInit` was already called in this process. The crate
/// treats it as success, since another part of the process may have initialised the runtime.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::sys::ACL_ERROR_REPEAT_INITIALIZE, 100_002);
/// ```
pub const ACL_ERROR_REPEAT_INITIALIZE: AclError = 100_002;

/// The core-count queries of the older `aclGetDeviceCapability` (C enum `aclDeviceInfo`).
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::DeviceInfo;
/// assert_eq!((DeviceInfo::AiCoreNum as i32, DeviceInfo::VectorCoreNum as i32), (0, 1));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DeviceInfo {
    /// `ACL_DEVICE_INFO_AI_CORE_NUM`: the number of AI cores.
    AiCoreNum = 0,
    /// `ACL_DEVICE_INFO_VECTOR_CORE_NUM`: the number of vector cores.
    VectorCoreNum = 1,
}

/// The core-count attributes of the newer `aclrtGetDeviceInfo` (C enum `aclrtDevAttr`).
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::DevAttr;
/// assert_eq!((DevAttr::AiCoreNum as i32, DevAttr::VectorCoreNum as i32), (101, 201));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DevAttr {
    /// `ACL_DEV_ATTR_AICORE_CORE_NUM`: the number of AI cores.
    AiCoreNum = 101,
    /// `ACL_DEV_ATTR_VECTOR_CORE_NUM`: the number of vector cores.
    VectorCoreNum = 201,
}

/// The status every HCCL call returns (`HcclResult`, a C enum); 0 is success.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::{HcclResult, HCCL_SUCCESS};
/// let ok: HcclResult = HCCL_SUCCESS;
/// assert_eq!(ok, 0);
/// ```
pub type HcclResult = c_int;

/// `HCCL_SUCCESS`: the call succeeded.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::sys::HCCL_SUCCESS, 0);
/// ```
pub const HCCL_SUCCESS: HcclResult = 0;

/// Size of an [`HcclRootInfo`] in bytes (`HCCL_ROOT_INFO_BYTES`).
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::{HcclRootInfo, HCCL_ROOT_INFO_BYTES};
/// assert_eq!(std::mem::size_of::<HcclRootInfo>(), HCCL_ROOT_INFO_BYTES);
/// ```
pub const HCCL_ROOT_INFO_BYTES: usize = 4108;

/// The opaque identity of a communicator's root rank (`HcclRootInfo`), made by one rank and
/// sent to the others before they join.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::HcclRootInfo;
/// let info = HcclRootInfo::zeroed();
/// assert!(info.as_bytes().iter().all(|&b| b == 0));
/// ```
#[derive(Clone)]
#[repr(C)]
pub struct HcclRootInfo {
    internal: [u8; HCCL_ROOT_INFO_BYTES],
}

impl HcclRootInfo {
    /// An all-zero root info, to be filled by `HcclGetRootInfo` or from bytes a peer sent.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::{HcclRootInfo, HCCL_ROOT_INFO_BYTES};
    /// assert_eq!(HcclRootInfo::zeroed().as_bytes().len(), HCCL_ROOT_INFO_BYTES);
    /// ```
    pub fn zeroed() -> Self {
        HcclRootInfo { internal: [0; HCCL_ROOT_INFO_BYTES] }
    }

    /// The raw bytes, to send to the other ranks.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::HcclRootInfo;
    /// assert_eq!(HcclRootInfo::zeroed().as_bytes()[0], 0);
    /// ```
    pub fn as_bytes(&self) -> &[u8; HCCL_ROOT_INFO_BYTES] {
        &self.internal
    }
}

impl fmt::Debug for HcclRootInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HcclRootInfo({} bytes)", HCCL_ROOT_INFO_BYTES)
    }
}

/// The environment variable naming the CANN install (set by CANN's `set_env.sh`).
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::sys::ASCEND_HOME_PATH, "ASCEND_HOME_PATH");
/// ```
pub const ASCEND_HOME_PATH: &str = "ASCEND_HOME_PATH";

/// The usual CANN install roots, searched after `$ASCEND_HOME_PATH`.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::INSTALL_ROOTS;
/// assert_eq!(INSTALL_ROOTS[0], "/usr/local/Ascend/ascend-toolkit/latest");
/// ```
pub const INSTALL_ROOTS: [&str; 2] =
    ["/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann"];

/// File names of the AscendCL runtime, in the order tried: the classic name, then the newer one.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::sys::ACL_FILE_NAMES;
/// assert_eq!(ACL_FILE_NAMES, ["libascendcl.so", "libacl_rt.so"]);
/// ```
pub const ACL_FILE_NAMES: [&str; 2] = ["libascendcl.so", "libacl_rt.so"];

/// File name of the HCCL collective library.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::sys::HCCL_FILE_NAME, "libhccl.so");
/// ```
pub const HCCL_FILE_NAME: &str = "libhccl.so";

/// File name of the library holding HCCL's communicator calls on newer CANN.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::sys::HCOMM_FILE_NAME, "libhcomm.so");
/// ```
pub const HCOMM_FILE_NAME: &str = "libhcomm.so";

const ACL_LABEL: &str = "AscendCL (libascendcl.so or libacl_rt.so)";
const HCCL_LABEL: &str = "HCCL (libhccl.so)";

/// Every place a library is looked for, in order: `ascend_home/lib64`, then each of
/// [`INSTALL_ROOTS`] with `lib64`, then the bare file names (the loader's search path). Within
/// each place the file names are tried in the order given. Duplicates are dropped.
///
/// # Examples
/// ```
/// use std::path::{Path, PathBuf};
/// use dist_tensor::device::ascend::sys::{search_order, ACL_FILE_NAMES};
///
/// let order = search_order(Some(Path::new("/opt/cann")), &ACL_FILE_NAMES);
/// assert_eq!(order[0], PathBuf::from("/opt/cann/lib64/libascendcl.so"));
/// assert_eq!(order[1], PathBuf::from("/opt/cann/lib64/libacl_rt.so"));
/// assert_eq!(order[2], PathBuf::from("/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so"));
/// assert_eq!(order.last(), Some(&PathBuf::from("libacl_rt.so")));
/// assert_eq!(order.len(), 8);
/// ```
pub fn search_order(ascend_home: Option<&Path>, file_names: &[&str]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(home) = ascend_home {
        dirs.push(home.join("lib64"));
    }
    dirs.extend(INSTALL_ROOTS.iter().map(|root| Path::new(root).join("lib64")));
    let mut order: Vec<PathBuf> = Vec::new();
    for dir in &dirs {
        for name in file_names {
            push_unique(&mut order, dir.join(name));
        }
    }
    for name in file_names {
        push_unique(&mut order, PathBuf::from(name));
    }
    order
}

fn push_unique(list: &mut Vec<PathBuf>, path: PathBuf) {
    if !list.contains(&path) {
        list.push(path);
    }
}

/// `$ASCEND_HOME_PATH`, when set and not empty.
pub(crate) fn ascend_home_from_env() -> Option<PathBuf> {
    std::env::var_os(ASCEND_HOME_PATH).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// A bare file name, left to the loader's search path.
fn is_bare(path: &Path) -> bool {
    !path.is_absolute() && path.components().count() == 1
}

/// Opens one file with `RTLD_NOW | RTLD_GLOBAL`.
///
/// # Safety
/// Opening a library runs its initialisers: `path` must be a library that is sound to load.
unsafe fn open_library(path: &Path) -> std::result::Result<Library, libloading::Error> {
    #[cfg(unix)]
    {
        use libloading::os::unix::{Library as UnixLibrary, RTLD_GLOBAL, RTLD_NOW};
        // SAFETY: the caller vouches that loading `path` is sound.
        unsafe { UnixLibrary::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map(Library::from)
    }
    #[cfg(not(unix))]
    {
        // SAFETY: the caller vouches that loading `path` is sound.
        unsafe { Library::new(path) }
    }
}

/// One line of a not-found list: the path and the loader's reason, without the path twice.
fn describe_failure(path: &Path, error: &libloading::Error) -> String {
    let shown = path.display().to_string();
    let reason = error.to_string();
    let reason = reason.strip_prefix(&format!("{shown}: ")).unwrap_or(&reason).to_string();
    if is_bare(path) {
        format!("{shown} on the loader's search path ({reason})")
    } else {
        format!("{shown} ({reason})")
    }
}

/// Opens the first candidate that opens.
///
/// # Errors
/// [`Error::LibraryNotFound`] naming `library`, with `tried` followed by every candidate.
///
/// # Safety
/// Every candidate must be sound to load (see [`Acl::load`]).
unsafe fn open_first(
    library: &'static str,
    candidates: &[PathBuf],
    mut tried: Vec<String>,
) -> Result<(Library, PathBuf)> {
    for path in candidates {
        if !is_bare(path) && !path.exists() {
            tried.push(format!("{} (no such file)", path.display()));
            continue;
        }
        // SAFETY: the caller vouches for every candidate.
        match unsafe { open_library(path) } {
            Ok(lib) => return Ok((lib, path.clone())),
            Err(e) => tried.push(describe_failure(path, &e)),
        }
    }
    Err(Error::LibraryNotFound { library, tried })
}

/// Looks a symbol up, `None` when the library does not export it.
///
/// # Safety
/// `T` must be the function-pointer type of `name`'s C signature.
unsafe fn lookup<T: Copy>(lib: &Library, name: &'static str) -> Option<T> {
    // SAFETY: the caller vouches that `T` is the symbol's type.
    unsafe { lib.get::<T>(name.as_bytes()) }.ok().map(|symbol| *symbol)
}

/// Looks a symbol up in `first`, then in `second`.
///
/// # Safety
/// As [`lookup`], for both libraries.
unsafe fn lookup_either<T: Copy>(
    first: &Library,
    second: Option<&Library>,
    name: &'static str,
) -> Option<T> {
    // SAFETY: forwarded from the caller.
    unsafe { lookup(first, name).or_else(|| second.and_then(|lib| lookup(lib, name))) }
}

/// Looks a required symbol up.
///
/// # Errors
/// [`Error::SymbolMissing`] naming the symbol and the library's path.
///
/// # Safety
/// As [`lookup`].
unsafe fn require<T: Copy>(lib: &Library, path: &Path, name: &'static str) -> Result<T> {
    // SAFETY: forwarded from the caller.
    unsafe { lookup(lib, name) }
        .ok_or_else(|| Error::SymbolMissing { symbol: name, library: path.display().to_string() })
}

/// The AscendCL runtime's symbol table: required calls resolved, optional ones as `Option`s.
///
/// The function pointers are valid while the table lives (it owns the open library); they are
/// called through [`result`](super::result).
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
    // Declared last so that it is dropped (closed) after everything above.
    _library: Library,
}

static DEFAULT_ACL: OnceLock<Result<Arc<Acl>>> = OnceLock::new();

impl Acl {
    /// Opens the AscendCL runtime at exactly `path` and resolves its symbols.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] when the file does not open (the loader's reason included);
    /// [`Error::SymbolMissing`] when a required call is absent.
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
    /// [`Error::LibraryNotFound`] listing every path tried with the loader's reason;
    /// [`Error::SymbolMissing`] when the library that opened lacks a required call.
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
    /// As [`Acl::discover`]; on a machine without CANN, [`Error::LibraryNotFound`].
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
            | "aclrtResetDevice" => true,
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
            .finish_non_exhaustive()
    }
}

/// HCCL's symbol table: `libhccl.so`, with `libhcomm.so` where newer CANN keeps the
/// communicator calls. Each communicator call is looked up in `libhccl.so` first, then in
/// `libhcomm.so`. Opened only when collectives need it (see `Ascend::hccl`).
///
/// # Examples
/// ```
/// use std::path::Path;
/// use dist_tensor::device::ascend::sys::Hccl;
/// use dist_tensor::Error;
///
/// // SAFETY: the directories searched hold a CANN install when they hold anything.
/// match unsafe { Hccl::discover(Some(Path::new("/nonexistent-cann/lib64")), None) } {
///     Ok(hccl) => assert!(hccl.provides("HcclGetRootInfo")),
///     Err(Error::LibraryNotFound { library, tried }) => {
///         assert!(library.starts_with("HCCL"));
///         assert_eq!(tried[0], "/nonexistent-cann/lib64/libhccl.so (no such file)");
///     }
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Hccl {
    path: PathBuf,
    comm_path: Option<PathBuf>,
    pub(crate) hccl_get_root_info: unsafe extern "C" fn(root_info: *mut HcclRootInfo) -> HcclResult,
    // The NPU collectives will call the three below; they are resolved now so that a missing
    // one is reported when HCCL is opened rather than in the middle of a collective.
    #[allow(dead_code)]
    pub(crate) hccl_comm_init_root_info: unsafe extern "C" fn(
        n_ranks: u32,
        root_info: *const HcclRootInfo,
        rank: u32,
        comm: *mut *mut c_void,
    ) -> HcclResult,
    #[allow(dead_code)]
    pub(crate) hccl_comm_destroy: unsafe extern "C" fn(comm: *mut c_void) -> HcclResult,
    #[allow(dead_code)]
    pub(crate) hccl_get_rank_size:
        unsafe extern "C" fn(comm: *mut c_void, rank_size: *mut u32) -> HcclResult,
    pub(crate) hccl_get_error_string:
        Option<unsafe extern "C" fn(code: HcclResult) -> *const c_char>,
    // Declared last so that they are dropped (closed) after the pointers above.
    _hccl: Library,
    _hcomm: Option<Library>,
}

impl Hccl {
    /// Opens `libhccl.so` and `libhcomm.so`, each from the first place it opens: `first_dir`
    /// (typically the directory AscendCL was found in), then [`search_order`] with `ascend_home`.
    /// `libhcomm.so` is optional (older CANN keeps everything in `libhccl.so`).
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] listing every path tried for `libhccl.so`;
    /// [`Error::SymbolMissing`] when a communicator call is in neither library.
    ///
    /// # Safety
    /// Every file searched must be HCCL, or a library exporting the same symbols with the same C
    /// signatures (see [`Acl::load`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Hccl;
    /// use dist_tensor::Error;
    ///
    /// // SAFETY: the directories searched hold a CANN install when they hold anything.
    /// match unsafe { Hccl::discover(None, None) } {
    ///     Ok(hccl) => assert!(hccl.path().ends_with("libhccl.so")),
    ///     // No CANN on this machine: every place is listed, the usual roots first.
    ///     Err(Error::LibraryNotFound { tried, .. }) => assert_eq!(
    ///         tried[0],
    ///         "/usr/local/Ascend/ascend-toolkit/latest/lib64/libhccl.so (no such file)"
    ///     ),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub unsafe fn discover(first_dir: Option<&Path>, ascend_home: Option<&Path>) -> Result<Hccl> {
        let candidates = |name: &str| {
            let mut list: Vec<PathBuf> = first_dir.map(|d| d.join(name)).into_iter().collect();
            for path in search_order(ascend_home, &[name]) {
                push_unique(&mut list, path);
            }
            list
        };
        // SAFETY: the caller vouches for every candidate.
        let (hccl, path) =
            unsafe { open_first(HCCL_LABEL, &candidates(HCCL_FILE_NAME), Vec::new()) }?;
        // Where libhccl.so was found comes first for libhcomm.so too.
        let hccl_dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let mut comm_candidates: Vec<PathBuf> =
            hccl_dir.map(|d| d.join(HCOMM_FILE_NAME)).into_iter().collect();
        for p in candidates(HCOMM_FILE_NAME) {
            push_unique(&mut comm_candidates, p);
        }
        // SAFETY: as above.
        let hcomm = unsafe { open_first("libhcomm.so", &comm_candidates, Vec::new()) }.ok();
        // SAFETY: as above.
        unsafe { Self::resolve(hccl, path, hcomm) }
    }

    /// Resolves the table.
    ///
    /// # Safety
    /// Both libraries must export HCCL's symbols with the headers' signatures.
    unsafe fn resolve(
        hccl: Library,
        path: PathBuf,
        hcomm: Option<(Library, PathBuf)>,
    ) -> Result<Hccl> {
        let (hcomm, comm_path) = match hcomm {
            Some((lib, p)) => (Some(lib), Some(p)),
            None => (None, None),
        };
        let where_looked = match &comm_path {
            Some(comm) => format!("{} and {}", path.display(), comm.display()),
            None => format!("{} (no {HCOMM_FILE_NAME} found)", path.display()),
        };
        let missing =
            |symbol: &'static str| Error::SymbolMissing { symbol, library: where_looked.clone() };
        let (first, second) = (&hccl, hcomm.as_ref());
        // SAFETY (every lookup below): each type is the C signature of the symbol named, from
        // HCCL's hccl.h / hccl_comm.h, and the caller vouches that the libraries follow them.
        unsafe {
            Ok(Hccl {
                hccl_get_root_info: lookup_either(first, second, "HcclGetRootInfo")
                    .ok_or_else(|| missing("HcclGetRootInfo"))?,
                hccl_comm_init_root_info: lookup_either(first, second, "HcclCommInitRootInfo")
                    .ok_or_else(|| missing("HcclCommInitRootInfo"))?,
                hccl_comm_destroy: lookup_either(first, second, "HcclCommDestroy")
                    .ok_or_else(|| missing("HcclCommDestroy"))?,
                hccl_get_rank_size: lookup_either(first, second, "HcclGetRankSize")
                    .ok_or_else(|| missing("HcclGetRankSize"))?,
                hccl_get_error_string: lookup_either(first, second, "HcclGetErrorString"),
                path,
                comm_path,
                _hccl: hccl,
                _hcomm: hcomm,
            })
        }
    }

    /// The `libhccl.so` opened.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Hccl;
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
    /// assert!(hccl.path().ends_with("libhccl.so"));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `libhcomm.so` opened, if any.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Hccl;
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
    /// assert!(hccl.comm_path().map_or(true, |p| p.ends_with("libhcomm.so")));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn comm_path(&self) -> Option<&Path> {
        self.comm_path.as_deref()
    }

    /// Whether `symbol`, among the HCCL calls the crate uses, was found.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Hccl;
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
    /// assert!(hccl.provides("HcclCommInitRootInfo"));
    /// assert!(!hccl.provides("notAnHcclSymbol"));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn provides(&self, symbol: &str) -> bool {
        match symbol {
            "HcclGetRootInfo" | "HcclCommInitRootInfo" | "HcclCommDestroy" | "HcclGetRankSize" => {
                true
            }
            "HcclGetErrorString" => self.hccl_get_error_string.is_some(),
            _ => false,
        }
    }
}

impl fmt::Debug for Hccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hccl")
            .field("path", &self.path)
            .field("comm_path", &self.comm_path)
            .finish_non_exhaustive()
    }
}
