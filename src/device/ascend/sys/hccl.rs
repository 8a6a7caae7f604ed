//! HCCL's table: `libhccl.so`, with `libhcomm.so` where newer CANN keeps the communicator calls.

use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::path::{Path, PathBuf};

use libloading::Library;

use super::{
    HCCL_FILE_NAME, HCCL_LABEL, HCOMM_FILE_NAME, lookup_either, open_first, push_unique,
    search_order,
};
use crate::{Error, Result};

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
    // Resolved when HCCL is opened so that a missing one is reported then rather than in the
    // middle of a collective; the crate makes its communicators with HcclCommInitAll.
    #[allow(dead_code)]
    pub(crate) hccl_comm_init_root_info: unsafe extern "C" fn(
        n_ranks: u32,
        root_info: *const HcclRootInfo,
        rank: u32,
        comm: *mut *mut c_void,
    ) -> HcclResult,
    pub(crate) hccl_comm_destroy: unsafe extern "C" fn(comm: *mut c_void) -> HcclResult,
    #[allow(dead_code)]
    pub(crate) hccl_get_rank_size:
        unsafe extern "C" fn(comm: *mut c_void, rank_size: *mut u32) -> HcclResult,
    pub(crate) hccl_get_error_string:
        Option<unsafe extern "C" fn(code: HcclResult) -> *const c_char>,
    /// Communicators for several devices of this process at once (one thread per device), and
    /// the collectives of the unfused baselines: all of them, or the first one missing.
    pub(crate) collectives: std::result::Result<CollectiveCalls, &'static str>,
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
    /// signatures (see [`Acl::load`](super::Acl::load)).
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
                collectives: CollectiveCalls::resolve(first, second),
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
            name if CollectiveCalls::NAMES.contains(&name) => self.collectives.is_ok(),
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

/// `HcclDataType`: the element types collectives move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum HcclDataType {
    /// `HCCL_DATA_TYPE_FP16`.
    Fp16 = 3,
    /// `HCCL_DATA_TYPE_FP32`.
    Fp32 = 4,
    /// `HCCL_DATA_TYPE_BFP16`.
    Bf16 = 11,
}

/// `HcclReduceOp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum HcclReduceOp {
    /// `HCCL_REDUCE_SUM`.
    Sum = 0,
}

/// `HcclCommInitAll`, `HcclGetCommName` and the collectives of the unfused baselines
/// (`hccl/hccl.h`), resolved as a group.
pub(crate) struct CollectiveCalls {
    pub(crate) comm_init_all:
        unsafe extern "C" fn(ndev: u32, devices: *mut i32, comms: *mut *mut c_void) -> HcclResult,
    pub(crate) get_comm_name:
        unsafe extern "C" fn(comm: *mut c_void, name: *mut c_char) -> HcclResult,
    pub(crate) all_gather_v: unsafe extern "C" fn(
        send: *mut c_void,
        send_count: u64,
        recv: *mut c_void,
        recv_counts: *const c_void,
        recv_displs: *const c_void,
        data_type: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> HcclResult,
    pub(crate) reduce_scatter_v: unsafe extern "C" fn(
        send: *mut c_void,
        send_counts: *const c_void,
        send_displs: *const c_void,
        recv: *mut c_void,
        recv_count: u64,
        data_type: c_int,
        op: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> HcclResult,
}

/// The most bytes of a communicator's name, with its NUL (`COMM_NAME_MAX_LENGTH`).
pub(crate) const COMM_NAME_BYTES: usize = 128;

impl CollectiveCalls {
    /// The C names, in the order they are resolved.
    pub(crate) const NAMES: [&'static str; 4] =
        ["HcclCommInitAll", "HcclGetCommName", "HcclAllGatherV", "HcclReduceScatterV"];

    fn resolve(
        first: &Library,
        second: Option<&Library>,
    ) -> std::result::Result<CollectiveCalls, &'static str> {
        let [init_all, name, all_gather_v, reduce_scatter_v] = Self::NAMES;
        // SAFETY (every lookup): each type is the C signature of the symbol named, from
        // hccl/hccl.h (`HcclComm` and `aclrtStream` are `void *`, C enums are passed as ints, the
        // count and displacement arrays are `uint64_t` arrays in host memory); the libraries are
        // HCCL or follow its headers, as the table's constructor requires.
        unsafe {
            Ok(CollectiveCalls {
                comm_init_all: lookup_either(first, second, init_all).ok_or(init_all)?,
                get_comm_name: lookup_either(first, second, name).ok_or(name)?,
                all_gather_v: lookup_either(first, second, all_gather_v).ok_or(all_gather_v)?,
                reduce_scatter_v: lookup_either(first, second, reduce_scatter_v)
                    .ok_or(reduce_scatter_v)?,
            })
        }
    }
}
