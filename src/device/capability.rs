//! The capability table: which op runs on which backend, for which element type and with which
//! features. Every public collective and fused op consults it at its entry, after its world is
//! known and before any work, and refuses with the typed error it promises
//! ([`Error::DeviceUnavailable`] naming the op, the backend and what is missing), so the refusals
//! live in one place; `tests/op_suite.rs` runs every cell against the code.

use crate::tensor::DType;
use crate::{Error, Result};

/// A kind of backend a world runs its ops on (see [`Rank::device`](crate::Rank::device) for the
/// device of one rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The host simulation of an NPU.
    Host,
    /// NVIDIA GPUs (feature `cuda`).
    Cuda,
    /// Ascend NPUs.
    Ascend,
}

impl Backend {
    /// Every backend.
    pub const ALL: [Backend; 3] = [Backend::Host, Backend::Cuda, Backend::Ascend];

    fn name(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda => "cuda",
            Backend::Ascend => "ascend",
        }
    }

    /// What runs a kernel there, as the refusals say it.
    fn unit(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda => "GPU",
            Backend::Ascend => "NPU",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a call asks of an op beyond its plain form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// An input of more than two dimensions (`[..., K]`).
    NdInput,
    /// A weight read transposed in place.
    TransposedWeight,
    /// The gathered input handed back (`all_gather_matmul_keep_input`).
    KeptInput,
    /// A split other than the even one.
    UnevenSplit,
}

impl Feature {
    /// Every feature.
    pub const ALL: [Feature; 4] =
        [Feature::NdInput, Feature::TransposedWeight, Feature::KeptInput, Feature::UnevenSplit];

    fn describe(self) -> &'static str {
        match self {
            Feature::NdInput => "an input of more than 2 dimensions (reshape to [M, K] first)",
            Feature::TransposedWeight => "a weight read transposed",
            Feature::KeptInput => "handing back the gathered input (keep_input)",
            Feature::UnevenSplit => "a split other than the even one",
        }
    }
}

/// One row of the table: what `backend` runs of `op`.
struct Row {
    op: &'static str,
    backend: Backend,
    dtypes: &'static [DType],
    features: &'static [Feature],
}

const ALL_DTYPES: &[DType] = &[DType::F32, DType::F64, DType::F16, DType::BF16];
/// The AI cores' cube and vector units have no f64 arithmetic.
const NPU_DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// The public ops the table covers: the fused ops, then the collectives.
pub const OPS: [&str; 9] = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "all_to_all",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all_v",
    "broadcast",
    "redistribute_split",
];

const fn host(op: &'static str) -> Row {
    Row { op, backend: Backend::Host, dtypes: ALL_DTYPES, features: &Feature::ALL }
}

const fn npu(op: &'static str, features: &'static [Feature]) -> Row {
    Row { op, backend: Backend::Ascend, dtypes: NPU_DTYPES, features }
}

const fn gpu(op: &'static str, features: &'static [Feature]) -> Row {
    Row { op, backend: Backend::Cuda, dtypes: ALL_DTYPES, features }
}

/// The table. An (op, backend) pair without a row has no kernel there.
const TABLE: &[Row] = &[
    host("all_gather_matmul"),
    host("matmul_reduce_scatter"),
    host("all_to_all"),
    host("all_gather"),
    host("reduce_scatter"),
    host("all_reduce"),
    host("all_to_all_v"),
    host("broadcast"),
    host("redistribute_split"),
    // The NPU kernels take N-D inputs as rows and read weights in any layout; they do not hand
    // back the gathered input. `all_reduce` runs as `reduce_scatter` then `all_gather`.
    npu("all_gather_matmul", &[Feature::NdInput, Feature::TransposedWeight]),
    npu("matmul_reduce_scatter", &[Feature::NdInput, Feature::TransposedWeight]),
    npu("all_to_all", &[Feature::NdInput, Feature::UnevenSplit]),
    npu("all_gather", &[Feature::UnevenSplit]),
    npu("reduce_scatter", &[Feature::UnevenSplit]),
    npu("all_reduce", &[]),
    npu("all_to_all_v", &[Feature::UnevenSplit]),
    npu("broadcast", &[]),
    npu("redistribute_split", &[Feature::NdInput, Feature::UnevenSplit]),
    // The GPU kernels take [M, K] row-major operands: an N-D input is its rows (a reshape), a
    // transposed weight is transposed on the GPU first (one copy), a kept input is gathered
    // again into a tensor of its own. An uneven re-split gathers the whole tensor and cuts it.
    gpu("all_gather_matmul", &[Feature::NdInput, Feature::TransposedWeight, Feature::KeptInput]),
    gpu("matmul_reduce_scatter", &[Feature::NdInput, Feature::TransposedWeight]),
    gpu("all_to_all", &[Feature::NdInput, Feature::UnevenSplit]),
    gpu("all_gather", &[Feature::NdInput, Feature::UnevenSplit]),
    gpu("reduce_scatter", &[Feature::NdInput, Feature::UnevenSplit]),
    gpu("all_reduce", &[Feature::NdInput]),
    gpu("broadcast", &[Feature::NdInput]),
    gpu("redistribute_split", &[Feature::NdInput, Feature::UnevenSplit]),
];

/// Why `backend` cannot run `op` on `dtype` with `features`, or `None` when it can: the reason
/// an op's agreement exchange carries, so that every rank fails together.
///
/// # Examples
/// ```
/// use dist_tensor::device::capability::{Backend, Feature, refusal};
/// use dist_tensor::tensor::DType;
/// assert_eq!(refusal("all_gather_matmul", Backend::Host, DType::F64, &Feature::ALL), None);
/// let why = refusal("all_gather_matmul", Backend::Ascend, DType::F32, &[Feature::KeptInput]);
/// assert!(why.unwrap().contains("keep_input"));
/// assert!(refusal("broadcast", Backend::Ascend, DType::F64, &[]).unwrap().contains("f64"));
/// ```
pub fn refusal(op: &str, backend: Backend, dtype: DType, features: &[Feature]) -> Option<String> {
    let Some(row) = TABLE.iter().find(|r| r.op == op && r.backend == backend) else {
        let with: Vec<&str> = TABLE.iter().filter(|r| r.backend == backend).map(|r| r.op).collect();
        return Some(format!(
            "{op} has no {} kernel; the ops with one are {}; run {op} on a host world",
            backend.unit(),
            with.join(", ")
        ));
    };
    if !row.dtypes.contains(&dtype) {
        let why = match backend {
            Backend::Ascend => {
                ": the AI cores' cube and vector units have no f64 arithmetic; run f64 on a host \
                 world (World::threads)"
            }
            _ => "",
        };
        return Some(format!("{dtype} has no {} kernel{why}", backend.unit()));
    }
    features.iter().find(|f| !row.features.contains(f)).map(|f| {
        format!(
            "{op} on the {} does not take {}; run it on a host world",
            backend.unit(),
            f.describe()
        )
    })
}

/// The part of [`refusal`] an op checks before its agreement exchange: whether `backend` runs
/// `op` with `features`, whatever the element type.
///
/// # Errors
/// [`Error::DeviceUnavailable`] naming `op`, the backend and the missing feature (or op).
pub fn check_features(op: &'static str, backend: Backend, features: &[Feature]) -> Result<()> {
    let dtype = TABLE
        .iter()
        .find(|r| r.op == op && r.backend == backend)
        .and_then(|r| r.dtypes.first().copied())
        .unwrap_or(DType::F32);
    check(op, backend, dtype, features)
}

/// The part of [`refusal`] an op's agreement exchange carries, so that every rank fails together
/// ([`Error::InvalidArgument`] naming the first rank): whether `backend` runs `op` on `dtype`.
pub fn dtype_problem(op: &str, backend: Backend, dtype: DType) -> Option<String> {
    refusal(op, backend, dtype, &[])
}

/// [`refusal`] as the error an op returns: [`Error::DeviceUnavailable`] naming `op`, the backend
/// and the reason.
///
/// # Examples
/// ```
/// use dist_tensor::device::capability::{Backend, check};
/// use dist_tensor::tensor::DType;
/// use dist_tensor::Error;
/// assert!(check("all_reduce", Backend::Cuda, DType::BF16, &[]).is_ok());
/// let err = check("softmax", Backend::Ascend, DType::F32, &[]).unwrap_err();
/// assert!(matches!(err, Error::DeviceUnavailable { op: "softmax", .. }), "{err}");
/// ```
pub fn check(op: &'static str, backend: Backend, dtype: DType, features: &[Feature]) -> Result<()> {
    match refusal(op, backend, dtype, features) {
        None => Ok(()),
        Some(reason) => Err(Error::DeviceUnavailable { op, device: backend.to_string(), reason }),
    }
}
