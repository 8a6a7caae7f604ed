//! Raw symbol tables of the CANN libraries, opened at run time with `libloading`.
//!
//! One table per library (one file each):
//!
//! | table | library | for |
//! | --- | --- | --- |
//! | [`Acl`] | `libascendcl.so` (or `libacl_rt.so`, its newer name) | devices, contexts, streams, memory; loading and launching kernels |
//! | [`Hccl`] | `libhccl.so`, with `libhcomm.so` for the communicator calls on newer CANN | communicators and the collectives of the unfused baselines |
//! | [`Rtc`] | `libacl_rtc.so` | compiling Ascend C source at run time (`aclrtc`, CANN 8.3+) |
//! | [`Shmem`] | `libshmem.so` (Ascend SHMEM) | the symmetric heap on device memory |
//! | [`Nnop`] | `libopapi.so` and `libnnopbase.so` | the vendor's operators (`aclnn*`): the MC2 fused ops and the GEMM of the unfused baselines |
//!
//! Libraries are opened with `RTLD_NOW | RTLD_GLOBAL`, as CANN's own loaders do, so a missing
//! dependency is reported at open time and the symbols are visible to the operator libraries
//! CANN opens later.
//!
//! Where AscendCL is looked for, in order ([`search_order`]):
//!
//! 1. `$ASCEND_HOME_PATH/lib64` (the variable CANN's `set_env.sh` exports);
//! 2. the usual install roots, [`INSTALL_ROOTS`], each with `lib64`;
//! 3. the loader's own search path (`LD_LIBRARY_PATH`, the `ld.so` cache), by bare file name.
//!
//! In each place `libascendcl.so` is tried before `libacl_rt.so`. The other libraries are looked
//! for first in the directory AscendCL came from, then in the same places (Ascend SHMEM, a
//! separate package, first under `$SHMEM_HOME_PATH`). When nothing opens, the error lists every
//! path tried with the loader's reason, so a user can see why no NPU is available.
//!
//! A symbol the crate cannot do without is required when the table is built; a newer or
//! optional one (`aclrtGetDeviceInfo`, `aclGetRecentErrMsg`, the kernel-launch calls of CANN
//! 8.3, ...) is kept as an `Option`, and the [`result`](super::result) layer falls back to the
//! older call or reports which symbol is missing. The function pointers stay inside the tables:
//! call them through [`result`](super::result).
//!
//! The C signatures are those of CANN's public headers (`acl/acl_rt.h`, `acl/acl_rt_compile.h`,
//! `hccl/hccl.h`, the `aclnnop` headers) and of Ascend SHMEM's `include/host` headers; each
//! table's resolver names the header it follows.

mod acl;
mod hccl;
mod nnop;
mod rtc;
mod shmem;

pub use acl::Acl;
pub(crate) use acl::{
    BINARY_LOAD_OPT_MAGIC, BINARY_MAGIC_ELF_AICORE, BinaryLoadOption, BinaryLoadOptions,
    KernelCalls, MEM_MALLOC_HUGE_FIRST, MemcpyKind,
};
pub(crate) use hccl::{COMM_NAME_BYTES, CollectiveCalls, HcclDataType, HcclReduceOp};
pub use hccl::{HCCL_ROOT_INFO_BYTES, HCCL_SUCCESS, Hccl, HcclResult, HcclRootInfo};
pub use nnop::Nnop;
pub(crate) use nnop::{AclDataType, FORMAT_ND};
pub use rtc::Rtc;
pub(crate) use shmem::{INIT_WITH_UNIQUEID, ShmemInitAttr, ShmemUniqueId};
pub use shmem::{SHMEM_HOME_PATH, Shmem};

use std::ffi::c_int;
use std::path::{Path, PathBuf};

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

/// Where a library other than AscendCL is looked for: `first_dir` (the directory AscendCL came
/// from), then [`search_order`] with `ascend_home`, each file name in turn.
fn candidates_beside(
    first_dir: Option<&Path>,
    ascend_home: Option<&Path>,
    file_names: &[&str],
) -> Vec<PathBuf> {
    let mut list: Vec<PathBuf> = Vec::new();
    if let Some(dir) = first_dir.filter(|d| !d.as_os_str().is_empty()) {
        for name in file_names {
            push_unique(&mut list, dir.join(name));
        }
    }
    for path in search_order(ascend_home, file_names) {
        push_unique(&mut list, path);
    }
    list
}
