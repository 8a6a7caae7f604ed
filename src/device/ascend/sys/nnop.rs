//! The vendor operators' table: `libopapi.so` (the `aclnn*` operators) and `libnnopbase.so`
//! (`aclTensor` descriptors). Used for the comparison path only: the MC2 fused operators
//! (`aclnnAllGatherMatmul`, `aclnnMatmulReduceScatter`) and the GEMM of the unfused baselines
//! (`aclnnMatmul`). The crate's own kernels do not need them.

use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::path::{Path, PathBuf};

use libloading::Library;

use super::{candidates_beside, lookup_either, open_first};
use crate::{Error, Result};

const OPAPI_FILE_NAME: &str = "libopapi.so";
const NNOPBASE_FILE_NAME: &str = "libnnopbase.so";
const OPAPI_LABEL: &str = "the CANN operator library (libopapi.so)";

/// `aclDataType`: the element types the vendor operators are called with here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum AclDataType {
    /// `ACL_FLOAT`.
    Float = 0,
    /// `ACL_FLOAT16`.
    Float16 = 1,
    /// `ACL_BF16`.
    Bf16 = 27,
}

/// `ACL_FORMAT_ND`: a plain row-major tensor.
pub(crate) const FORMAT_ND: c_int = 2;

/// `aclnnStatus`: 0 is success.
pub(crate) type AclnnStatus = i32;

/// The first phase of a two-phase operator for a product with a collective: inputs, the group
/// name, two integer attributes, the output; it returns the workspace size and an executor.
pub(crate) type AllGatherMatmulGetWorkspaceSize = unsafe extern "C" fn(
    x1: *const c_void,
    x2: *const c_void,
    bias: *const c_void,
    group: *const c_char,
    gather_index: i64,
    comm_turn: i64,
    stream_mode: i64,
    output: *const c_void,
    gather_out: *const c_void,
    workspace_size: *mut u64,
    executor: *mut *mut c_void,
) -> AclnnStatus;

/// `aclnnMatmulReduceScatterGetWorkspaceSize`.
pub(crate) type MatmulReduceScatterGetWorkspaceSize = unsafe extern "C" fn(
    x1: *const c_void,
    x2: *const c_void,
    bias: *const c_void,
    group: *const c_char,
    reduce_op: *const c_char,
    comm_turn: i64,
    stream_mode: i64,
    output: *const c_void,
    workspace_size: *mut u64,
    executor: *mut *mut c_void,
) -> AclnnStatus;

/// The second phase every `aclnn*` operator shares: workspace, its size, the executor, a stream.
pub(crate) type Execute = unsafe extern "C" fn(
    workspace: *mut c_void,
    workspace_size: u64,
    executor: *mut c_void,
    stream: *mut c_void,
) -> AclnnStatus;

/// The vendor operators' symbol table. The MC2 operators are optional (`None` where this CANN
/// lacks them); tensors and `aclnnMatmul` are required.
///
/// # Examples
/// ```
/// use std::path::Path;
/// use dist_tensor::device::ascend::sys::Nnop;
/// use dist_tensor::Error;
///
/// // SAFETY: the directories searched hold a CANN install when they hold anything.
/// match unsafe { Nnop::discover(Some(Path::new("/nonexistent-cann/lib64")), None) } {
///     Ok(nnop) => assert!(nnop.provides("aclnnMatmul")),
///     Err(Error::LibraryNotFound { tried, .. }) => {
///         assert_eq!(tried[0], "/nonexistent-cann/lib64/libopapi.so (no such file)");
///     }
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Nnop {
    path: PathBuf,
    pub(crate) create_tensor: unsafe extern "C" fn(
        view_dims: *const i64,
        view_dims_num: u64,
        data_type: c_int,
        stride: *const i64,
        offset: i64,
        format: c_int,
        storage_dims: *const i64,
        storage_dims_num: u64,
        data: *mut c_void,
    ) -> *mut c_void,
    pub(crate) destroy_tensor: unsafe extern "C" fn(tensor: *const c_void) -> AclnnStatus,
    pub(crate) matmul_get_workspace_size: unsafe extern "C" fn(
        a: *const c_void,
        b: *const c_void,
        out: *mut c_void,
        cube_math_type: i8,
        workspace_size: *mut u64,
        executor: *mut *mut c_void,
    ) -> AclnnStatus,
    pub(crate) matmul: Execute,
    pub(crate) all_gather_matmul: Option<(AllGatherMatmulGetWorkspaceSize, Execute)>,
    pub(crate) matmul_reduce_scatter: Option<(MatmulReduceScatterGetWorkspaceSize, Execute)>,
    // Declared last so that they are dropped (closed) after the pointers above.
    _opapi: Library,
    _nnopbase: Option<Library>,
}

impl Nnop {
    /// Opens `libopapi.so` and `libnnopbase.so`, each from the first place it opens: `first_dir`
    /// (typically where AscendCL came from), then `ascend_home/lib64`, the usual install roots
    /// and the loader's search path. Each call is looked up in `libopapi.so`, then in
    /// `libnnopbase.so`.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] listing every path tried for `libopapi.so`;
    /// [`Error::SymbolMissing`] when a required call is in neither library.
    ///
    /// # Safety
    /// Every file searched must be CANN's operator library, or a library exporting the same
    /// symbols with the same C signatures (such as the crate's test stand-in).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Nnop;
    /// // SAFETY: the directories searched hold a CANN install when they hold anything.
    /// match unsafe { Nnop::discover(None, None) } {
    ///     Ok(nnop) => assert!(nnop.provides("aclCreateTensor")),
    ///     Err(e) => assert!(e.to_string().contains("libopapi.so")),
    /// }
    /// ```
    pub unsafe fn discover(first_dir: Option<&Path>, ascend_home: Option<&Path>) -> Result<Nnop> {
        let opapi = candidates_beside(first_dir, ascend_home, &[OPAPI_FILE_NAME]);
        // SAFETY: the caller vouches for every candidate.
        let (opapi, path) = unsafe { open_first(OPAPI_LABEL, &opapi, Vec::new()) }?;
        let beside = path.parent().filter(|d| !d.as_os_str().is_empty());
        let base = candidates_beside(beside.or(first_dir), ascend_home, &[NNOPBASE_FILE_NAME]);
        // SAFETY: as above.
        let nnopbase = unsafe { open_first("libnnopbase.so", &base, Vec::new()) }.ok().map(|l| l.0);
        let (first, second) = (&opapi, nnopbase.as_ref());
        let missing = |symbol: &'static str| Error::SymbolMissing {
            symbol,
            library: format!("{} (and libnnopbase.so)", path.display()),
        };
        // SAFETY (every lookup below): each type is the C signature of the symbol named, from
        // CANN's aclnn headers (aclnn/acl_meta.h for tensors; aclnnop/aclnn_matmul.h,
        // aclnn_all_gather_matmul.h, aclnn_matmul_reduce_scatter.h for the operators; handles
        // are pointers, C enums are passed as ints), and the caller vouches for the libraries.
        unsafe {
            Ok(Nnop {
                create_tensor: lookup_either(first, second, "aclCreateTensor")
                    .ok_or_else(|| missing("aclCreateTensor"))?,
                destroy_tensor: lookup_either(first, second, "aclDestroyTensor")
                    .ok_or_else(|| missing("aclDestroyTensor"))?,
                matmul_get_workspace_size: lookup_either(
                    first,
                    second,
                    "aclnnMatmulGetWorkspaceSize",
                )
                .ok_or_else(|| missing("aclnnMatmulGetWorkspaceSize"))?,
                matmul: lookup_either(first, second, "aclnnMatmul")
                    .ok_or_else(|| missing("aclnnMatmul"))?,
                all_gather_matmul: pair(
                    first,
                    second,
                    "aclnnAllGatherMatmulGetWorkspaceSize",
                    "aclnnAllGatherMatmul",
                ),
                matmul_reduce_scatter: pair(
                    first,
                    second,
                    "aclnnMatmulReduceScatterGetWorkspaceSize",
                    "aclnnMatmulReduceScatter",
                ),
                path,
                _opapi: opapi,
                _nnopbase: nnopbase,
            })
        }
    }

    /// The `libopapi.so` opened.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Nnop;
    /// // SAFETY: the directories searched hold a CANN install when they hold anything.
    /// if let Ok(nnop) = unsafe { Nnop::discover(None, None) } {
    ///     assert_eq!(nnop.path().file_name().unwrap(), "libopapi.so");
    /// }
    /// ```
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `symbol`, among the vendor calls the crate uses, was found.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::sys::Nnop;
    /// // SAFETY: the directories searched hold a CANN install when they hold anything.
    /// if let Ok(nnop) = unsafe { Nnop::discover(None, None) } {
    ///     assert!(nnop.provides("aclnnMatmul"));
    ///     assert!(!nnop.provides("notAnAclnnSymbol"));
    /// }
    /// ```
    pub fn provides(&self, symbol: &str) -> bool {
        match symbol {
            "aclCreateTensor"
            | "aclDestroyTensor"
            | "aclnnMatmulGetWorkspaceSize"
            | "aclnnMatmul" => true,
            "aclnnAllGatherMatmulGetWorkspaceSize" | "aclnnAllGatherMatmul" => {
                self.all_gather_matmul.is_some()
            }
            "aclnnMatmulReduceScatterGetWorkspaceSize" | "aclnnMatmulReduceScatter" => {
                self.matmul_reduce_scatter.is_some()
            }
            _ => false,
        }
    }
}

/// A two-phase operator's two calls, or `None` when either is missing.
///
/// # Safety
/// As [`lookup_either`], for both types.
unsafe fn pair<G: Copy, R: Copy>(
    first: &Library,
    second: Option<&Library>,
    get: &'static str,
    run: &'static str,
) -> Option<(G, R)> {
    // SAFETY: forwarded from the caller.
    unsafe { Some((lookup_either(first, second, get)?, lookup_either(first, second, run)?)) }
}

impl fmt::Debug for Nnop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nnop")
            .field("path", &self.path)
            .field("aclnnAllGatherMatmul", &self.all_gather_matmul.is_some())
            .field("aclnnMatmulReduceScatter", &self.matmul_reduce_scatter.is_some())
            .finish_non_exhaustive()
    }
}
