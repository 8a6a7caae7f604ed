//! The capability table: which op runs on which backend, for which element type and with which
//! features. Every public collective and fused op consults it at its entry, after its world is
//! known and before any work, and refuses with the typed error it promises
//! ([`Error::DeviceUnavailable`] naming the op, the backend and what is missing), so the refusals
//! live in one place; `tests/op_suite.rs` runs every cell against the code.

use super::Device;
use crate::tensor::DType;
use crate::{Error, Result};

/// A public op the capability table covers: the fused ops, then the collectives.
///
/// # Examples
/// ```
/// use dist_tensor::device::capability::Op;
/// assert_eq!(Op::AllGatherMatmul.name(), "all_gather_matmul");
/// assert_eq!(Op::ALL.len(), 12);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`fused::all_gather_matmul`](crate::fused::all_gather_matmul) (and `DistTensor`'s).
    AllGatherMatmul,
    /// [`fused::matmul_reduce_scatter`](crate::fused::matmul_reduce_scatter).
    MatmulReduceScatter,
    /// [`fused::all_to_all`](crate::fused::all_to_all): the sequence-parallel exchange.
    AllToAll,
    /// [`fused::flash_decode`](crate::fused::flash_decode): sequence-parallel decode attention.
    FlashDecode,
    /// [`fused::moe_dispatch`](crate::fused::moe_dispatch): expert-parallel dispatch.
    MoeDispatch,
    /// [`fused::moe_combine`](crate::fused::moe_combine): expert-parallel combine.
    MoeCombine,
    /// [`collectives::all_gather`](crate::collectives::all_gather).
    AllGather,
    /// [`collectives::reduce_scatter`](crate::collectives::reduce_scatter).
    ReduceScatter,
    /// [`collectives::all_reduce`](crate::collectives::all_reduce).
    AllReduce,
    /// [`collectives::all_to_all_v`](crate::collectives::all_to_all_v).
    AllToAllV,
    /// [`collectives::broadcast`](crate::collectives::broadcast).
    Broadcast,
    /// [`DistTensor::redistribute`](crate::DistTensor::redistribute) from one split of a
    /// dimension to another.
    RedistributeSplit,
}

impl Op {
    /// Every op of the table, in its order.
    pub const ALL: [Op; 12] = [
        Op::AllGatherMatmul,
        Op::MatmulReduceScatter,
        Op::AllToAll,
        Op::FlashDecode,
        Op::MoeDispatch,
        Op::MoeCombine,
        Op::AllGather,
        Op::ReduceScatter,
        Op::AllReduce,
        Op::AllToAllV,
        Op::Broadcast,
        Op::RedistributeSplit,
    ];

    /// The features a call of this op can ask for (what its entry checks against the table).
    pub const fn features(self) -> &'static [Feature] {
        match self {
            Op::AllGatherMatmul => {
                &[Feature::NdInput, Feature::TransposedWeight, Feature::KeptInput]
            }
            Op::MatmulReduceScatter => &[Feature::NdInput, Feature::TransposedWeight],
            Op::RedistributeSplit => &[Feature::UnevenSplit],
            _ => &[],
        }
    }

    /// The op's name as errors and reports say it (its function's name).
    pub const fn name(self) -> &'static str {
        match self {
            Op::AllGatherMatmul => "all_gather_matmul",
            Op::MatmulReduceScatter => "matmul_reduce_scatter",
            Op::AllToAll => "all_to_all",
            Op::FlashDecode => "flash_decode",
            Op::MoeDispatch => "moe_dispatch",
            Op::MoeCombine => "moe_combine",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
            Op::AllToAllV => "all_to_all_v",
            Op::Broadcast => "broadcast",
            Op::RedistributeSplit => "redistribute_split",
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What runs a kernel on `device`, as the refusals say it.
fn unit(device: Device) -> &'static str {
    match device {
        Device::Host => "host",
        Device::Cuda(_) => "GPU",
        Device::Ascend(_) => "NPU",
    }
}

/// The backend's name (the device without its index), as the errors say it.
fn backend_name(device: Device) -> &'static str {
    match device {
        Device::Host => "host",
        Device::Cuda(_) => "cuda",
        Device::Ascend(_) => "ascend",
    }
}

/// Whether `a` and `b` are devices of one backend (the index aside).
fn same_backend(a: Device, b: Device) -> bool {
    std::mem::discriminant(&a) == std::mem::discriminant(&b)
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
    op: Op,
    /// The backend (any index of its kind).
    device: Device,
    dtypes: &'static [DType],
    features: &'static [Feature],
}

const ALL_DTYPES: &[DType] = &[DType::F32, DType::F64, DType::F16, DType::BF16];
/// The AI cores' cube and vector units have no f64 arithmetic.
const NPU_DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

const fn host(op: Op) -> Row {
    Row { op, device: Device::Host, dtypes: ALL_DTYPES, features: op.features() }
}

const fn npu(op: Op, features: &'static [Feature]) -> Row {
    Row { op, device: Device::Ascend(0), dtypes: NPU_DTYPES, features }
}

const fn gpu(op: Op, features: &'static [Feature]) -> Row {
    Row { op, device: Device::Cuda(0), dtypes: ALL_DTYPES, features }
}

/// The table. An (op, backend) pair without a row has no kernel there.
const TABLE: &[Row] = &[
    host(Op::AllGatherMatmul),
    host(Op::MatmulReduceScatter),
    host(Op::AllToAll),
    host(Op::FlashDecode),
    host(Op::MoeDispatch),
    host(Op::MoeCombine),
    host(Op::AllGather),
    host(Op::ReduceScatter),
    host(Op::AllReduce),
    host(Op::AllToAllV),
    host(Op::Broadcast),
    host(Op::RedistributeSplit),
    // The NPU kernels take N-D inputs as rows and read weights in any layout; they do not hand
    // back the gathered input. `all_reduce` runs as `reduce_scatter` then `all_gather`.
    npu(Op::AllGatherMatmul, &[Feature::NdInput, Feature::TransposedWeight]),
    npu(Op::MatmulReduceScatter, &[Feature::NdInput, Feature::TransposedWeight]),
    npu(Op::AllToAll, &[]),
    npu(Op::FlashDecode, &[]),
    npu(Op::AllGather, &[]),
    npu(Op::ReduceScatter, &[]),
    npu(Op::AllReduce, &[]),
    npu(Op::AllToAllV, &[]),
    npu(Op::Broadcast, &[]),
    npu(Op::RedistributeSplit, &[Feature::UnevenSplit]),
    // The GPU kernels take [M, K] row-major operands: an N-D input is its rows (a reshape), a
    // transposed weight is transposed on the GPU first (one copy), a kept input is gathered
    // again into a tensor of its own. An uneven re-split gathers the whole tensor and cuts it.
    // No all_to_all_v kernel.
    gpu(Op::AllGatherMatmul, &[Feature::NdInput, Feature::TransposedWeight, Feature::KeptInput]),
    gpu(Op::MatmulReduceScatter, &[Feature::NdInput, Feature::TransposedWeight]),
    gpu(Op::AllToAll, &[]),
    gpu(Op::FlashDecode, &[]),
    gpu(Op::AllGather, &[]),
    gpu(Op::ReduceScatter, &[]),
    gpu(Op::AllReduce, &[]),
    gpu(Op::Broadcast, &[]),
    gpu(Op::RedistributeSplit, &[Feature::UnevenSplit]),
];

/// Why `device`'s backend cannot run `op` on `dtype` with `features`, or `None` when it can:
/// the reason an op's agreement exchange carries, so that every rank fails together. Only the
/// device's kind counts (`cuda:0` and `cuda:3` are one column).
///
/// # Examples
/// ```
/// use dist_tensor::device::Device;
/// use dist_tensor::device::capability::{Feature, Op, refusal};
/// use dist_tensor::tensor::DType;
/// assert_eq!(refusal(Op::AllGatherMatmul, Device::Host, DType::F64, Op::AllGatherMatmul.features()), None);
/// let why = refusal(Op::AllGatherMatmul, Device::Ascend(0), DType::F32, &[Feature::KeptInput]);
/// assert!(why.unwrap().contains("keep_input"));
/// assert!(refusal(Op::Broadcast, Device::Ascend(1), DType::F64, &[]).unwrap().contains("f64"));
/// assert!(refusal(Op::AllToAllV, Device::Cuda(0), DType::F32, &[]).is_some());
/// ```
pub fn refusal(op: Op, device: Device, dtype: DType, features: &[Feature]) -> Option<String> {
    let Some(row) = row(op, device) else {
        let with: Vec<&str> =
            TABLE.iter().filter(|r| same_backend(r.device, device)).map(|r| r.op.name()).collect();
        return Some(format!(
            "{op} has no {} kernel; the ops with one are {}; run {op} on a host world",
            unit(device),
            with.join(", ")
        ));
    };
    if !row.dtypes.contains(&dtype) {
        let why = match device {
            Device::Ascend(_) => {
                ": the AI cores' cube and vector units have no f64 arithmetic; run f64 on a host \
                 world (World::threads)"
            }
            _ => "",
        };
        return Some(format!("{dtype} has no {} kernel{why}", unit(device)));
    }
    features.iter().find(|f| !row.features.contains(f)).map(|f| {
        format!(
            "{op} on the {} does not take {}; run it on a host world",
            unit(device),
            f.describe()
        )
    })
}

/// The table's row for `op` on `device`'s backend.
fn row(op: Op, device: Device) -> Option<&'static Row> {
    TABLE.iter().find(|r| r.op == op && same_backend(r.device, device))
}

/// The part of [`refusal`] an op checks before its agreement exchange: whether `device`'s
/// backend runs `op` with `features`, whatever the element type.
///
/// # Errors
/// [`Error::DeviceUnavailable`] naming `op`, the backend and the missing feature (or op).
pub fn check_features(op: Op, device: Device, features: &[Feature]) -> Result<()> {
    let dtype = row(op, device).and_then(|r| r.dtypes.first().copied()).unwrap_or(DType::F32);
    check(op, device, dtype, features)
}

/// The part of [`refusal`] an op's agreement exchange carries, so that every rank fails together
/// ([`Error::InvalidArgument`] naming the first rank): whether `device`'s backend runs `op` on
/// `dtype`.
pub fn dtype_problem(op: Op, device: Device, dtype: DType) -> Option<String> {
    refusal(op, device, dtype, &[])
}

/// [`refusal`] as the error an op returns: [`Error::DeviceUnavailable`] naming `op`, the backend
/// (`host`, `cuda` or `ascend`) and the reason.
///
/// # Examples
/// ```
/// use dist_tensor::device::Device;
/// use dist_tensor::device::capability::{Op, check};
/// use dist_tensor::tensor::DType;
/// use dist_tensor::Error;
/// assert!(check(Op::AllReduce, Device::Cuda(0), DType::BF16, &[]).is_ok());
/// let err = check(Op::AllToAllV, Device::Cuda(1), DType::F32, &[]).unwrap_err();
/// assert!(matches!(err, Error::DeviceUnavailable { op: "all_to_all_v", .. }), "{err}");
/// ```
pub fn check(op: Op, device: Device, dtype: DType, features: &[Feature]) -> Result<()> {
    match refusal(op, device, dtype, features) {
        None => Ok(()),
        Some(reason) => Err(Error::DeviceUnavailable {
            op: op.name(),
            device: backend_name(device).to_string(),
            reason,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row lists only features its op can be asked for (else the walk over
    /// [`Op::features`] in `tests/op_suite.rs` would never reach them), and every op has a
    /// host row.
    #[test]
    fn rows_list_only_the_features_their_op_checks() {
        for row in TABLE {
            for f in row.features {
                assert!(
                    row.op.features().contains(f),
                    "{} on {:?} lists {f:?}",
                    row.op,
                    row.device
                );
            }
        }
        for op in Op::ALL {
            assert!(row(op, Device::Host).is_some(), "{op} has no host row");
        }
    }
}
