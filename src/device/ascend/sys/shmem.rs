//! Ascend SHMEM's table: `libshmem.so`, the symmetric heap on device memory (the `aclshmem_*`
//! host calls of Ascend SHMEM's `include/host` headers).
//!
//! SHMEM is a separate package from CANN: its `set_env.sh` exports `$SHMEM_HOME_PATH`, with the
//! library in `shmem/lib` and the headers that device code includes in `shmem/include`.

use std::ffi::{c_int, c_uint, c_void};
use std::fmt;
use std::path::{Path, PathBuf};

use libloading::Library;

use super::{candidates_beside, open_first, push_unique, require};
use crate::Result;

/// The environment variable Ascend SHMEM's `set_env.sh` exports: the root of its install.
///
/// # Examples
/// ```
/// assert_eq!(dist_tensor::device::ascend::sys::SHMEM_HOME_PATH, "SHMEM_HOME_PATH");
/// ```
pub const SHMEM_HOME_PATH: &str = "SHMEM_HOME_PATH";

const SHMEM_FILE_NAME: &str = "libshmem.so";
const SHMEM_LABEL: &str = "Ascend SHMEM (libshmem.so)";

/// `ACLSHMEMX_INIT_WITH_UNIQUEID`: bootstrap from a unique id that one PE makes and the others
/// receive (the crate hands it from rank to rank in host memory).
pub(crate) const INIT_WITH_UNIQUEID: c_uint = 1 << 3;

/// `aclshmemx_uniqueid_t`: a version word, the PE and PE count it was made for, and 124 opaque
/// bytes.
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct ShmemUniqueId {
    pub(crate) version: i32,
    pub(crate) my_pe: i32,
    pub(crate) n_pes: i32,
    pub(crate) internal: [u8; 124],
}

impl ShmemUniqueId {
    /// `ACLSHMEM_UNIQUEID_INITIALIZER`: the version word set, everything else zero.
    pub(crate) fn new() -> Self {
        let version = (1 << 16) + size_of::<ShmemUniqueId>() as i32;
        ShmemUniqueId { version, my_pe: 0, n_pes: 0, internal: [0; 124] }
    }
}

/// `aclshmem_init_optional_attr_t`.
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct ShmemOptionalAttr {
    pub(crate) version: i32,
    pub(crate) data_op_engine_type: c_int,
    pub(crate) shm_init_timeout: u32,
    pub(crate) shm_create_timeout: u32,
    pub(crate) control_operation_timeout: u32,
    pub(crate) sock_fd: i32,
}

/// `aclshmemx_init_attr_t`, with the defaults its C++ header gives (MTE data engine, 120 s
/// timeouts, instance 0).
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct ShmemInitAttr {
    pub(crate) my_pe: c_int,
    pub(crate) n_pes: c_int,
    pub(crate) ip_port: [u8; 64],
    pub(crate) local_mem_size: u64,
    pub(crate) option_attr: ShmemOptionalAttr,
    pub(crate) comm_args: *mut c_void,
    pub(crate) instance_id: u64,
}

impl ShmemInitAttr {
    /// The header's defaults; `aclshmemx_set_attr_uniqueid_args` fills in the rest.
    pub(crate) fn new() -> Self {
        const DEFAULT_TIMEOUT_S: u32 = 120;
        const DATA_OP_MTE: c_int = 1;
        ShmemInitAttr {
            my_pe: 0,
            n_pes: 0,
            ip_port: [0; 64],
            local_mem_size: 0,
            option_attr: ShmemOptionalAttr {
                version: (1 << 16) + size_of::<ShmemOptionalAttr>() as i32,
                data_op_engine_type: DATA_OP_MTE,
                shm_init_timeout: DEFAULT_TIMEOUT_S,
                shm_create_timeout: DEFAULT_TIMEOUT_S,
                control_operation_timeout: DEFAULT_TIMEOUT_S,
                sock_fd: 0,
            },
            comm_args: std::ptr::null_mut(),
            instance_id: 0,
        }
    }
}

/// Ascend SHMEM's symbol table: initialisation with a unique id, the symmetric heap
/// (`aclshmem_malloc` / `aclshmem_free`), and peer addresses (`aclshmem_ptr`).
///
/// # Examples
/// ```
/// use std::path::Path;
/// use dist_tensor::device::ascend::sys::Shmem;
/// use dist_tensor::Error;
///
/// // SAFETY: the directories searched hold Ascend SHMEM when they hold anything.
/// match unsafe { Shmem::discover(Some(Path::new("/nonexistent-shmem")), None, None) } {
///     Ok(shmem) => assert!(shmem.path().ends_with("libshmem.so")),
///     Err(Error::LibraryNotFound { tried, .. }) => {
///         assert_eq!(tried[0], "/nonexistent-shmem/shmem/lib/libshmem.so (no such file)");
///     }
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Shmem {
    path: PathBuf,
    pub(crate) get_uniqueid: unsafe extern "C" fn(uid: *mut ShmemUniqueId) -> c_int,
    pub(crate) set_attr_uniqueid_args: unsafe extern "C" fn(
        my_pe: c_int,
        n_pes: c_int,
        local_mem_size: i64,
        uid: *mut ShmemUniqueId,
        attr: *mut ShmemInitAttr,
    ) -> c_int,
    pub(crate) init_attr: unsafe extern "C" fn(flags: c_uint, attr: *mut ShmemInitAttr) -> c_int,
    pub(crate) finalize: unsafe extern "C" fn() -> c_int,
    pub(crate) malloc: unsafe extern "C" fn(size: usize) -> *mut c_void,
    pub(crate) free: unsafe extern "C" fn(ptr: *mut c_void),
    pub(crate) ptr: unsafe extern "C" fn(ptr: *mut c_void, pe: c_int) -> *mut c_void,
    pub(crate) my_pe: unsafe extern "C" fn() -> c_int,
    pub(crate) n_pes: unsafe extern "C" fn() -> c_int,
    // Declared last so that it is dropped (closed) after the pointers above.
    _library: Library,
}

impl Shmem {
    /// Opens `libshmem.so` from the first place it opens: `shmem_home/shmem/lib` (the
    /// `$SHMEM_HOME_PATH` layout), then `first_dir` (typically where AscendCL came from), then
    /// `ascend_home/lib64`, the usual CANN roots and the loader's search path.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`](crate::Error::LibraryNotFound) listing every path tried;
    /// [`Error::SymbolMissing`](crate::Error::SymbolMissing) when a call the crate uses is absent.
    ///
    /// # Safety
    /// Every file searched must be Ascend SHMEM, or a library exporting the same symbols with the
    /// same C signatures (such as the crate's test stand-in).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Shmem;
    /// use dist_tensor::Error;
    ///
    /// // SAFETY: the directories searched hold Ascend SHMEM when they hold anything.
    /// match unsafe { Shmem::discover(None, None, None) } {
    ///     Ok(shmem) => assert!(shmem.path().ends_with("libshmem.so")),
    ///     Err(e) => assert!(matches!(e, Error::LibraryNotFound { .. })),
    /// }
    /// ```
    pub unsafe fn discover(
        shmem_home: Option<&Path>,
        first_dir: Option<&Path>,
        ascend_home: Option<&Path>,
    ) -> Result<Shmem> {
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(home) = shmem_home {
            candidates.push(home.join("shmem").join("lib").join(SHMEM_FILE_NAME));
        }
        for path in candidates_beside(first_dir, ascend_home, &[SHMEM_FILE_NAME]) {
            push_unique(&mut candidates, path);
        }
        // SAFETY: the caller vouches for every candidate.
        let (library, path) = unsafe { open_first(SHMEM_LABEL, &candidates, Vec::new()) }?;
        let (lib, p) = (&library, path.as_path());
        // SAFETY (every lookup below): each type is the C signature of the symbol named, from
        // Ascend SHMEM's include/host headers (shmem_host_init.h, shmem_host_heap.h,
        // shmem_host_rma.h, shmem_host_team.h; a C enum is passed as an unsigned int), and the
        // caller vouches that the library follows them.
        unsafe {
            Ok(Shmem {
                get_uniqueid: require(lib, p, "aclshmemx_get_uniqueid")?,
                set_attr_uniqueid_args: require(lib, p, "aclshmemx_set_attr_uniqueid_args")?,
                init_attr: require(lib, p, "aclshmemx_init_attr")?,
                finalize: require(lib, p, "aclshmem_finalize")?,
                malloc: require(lib, p, "aclshmem_malloc")?,
                free: require(lib, p, "aclshmem_free")?,
                ptr: require(lib, p, "aclshmem_ptr")?,
                my_pe: require(lib, p, "aclshmem_my_pe")?,
                n_pes: require(lib, p, "aclshmem_n_pes")?,
                path,
                _library: library,
            })
        }
    }

    /// The file the table was opened from.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Shmem;
    /// // SAFETY: the directories searched hold Ascend SHMEM when they hold anything.
    /// if let Ok(shmem) = unsafe { Shmem::discover(None, None, None) } {
    ///     assert_eq!(shmem.path().file_name().unwrap(), "libshmem.so");
    /// }
    /// ```
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory of SHMEM's headers, which device code includes (`shmem.h`): `include`
    /// beside the library's `lib` directory, when it exists.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Shmem;
    /// // SAFETY: the directories searched hold Ascend SHMEM when they hold anything.
    /// if let Ok(shmem) = unsafe { Shmem::discover(None, None, None) } {
    ///     assert!(shmem.include_dir().map_or(true, |dir| dir.ends_with("include")));
    /// }
    /// ```
    pub fn include_dir(&self) -> Option<PathBuf> {
        let lib_dir = self.path.parent()?;
        let include = lib_dir.parent()?.join("include");
        include.is_dir().then_some(include)
    }
}

impl fmt::Debug for Shmem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shmem").field("path", &self.path).finish_non_exhaustive()
    }
}
