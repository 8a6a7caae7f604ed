//! The vendor's fused operators, the comparison path: CANN's MC2 `aclnnAllGatherMatmul` and
//! `aclnnMatmulReduceScatter` (two phases each: workspace size, then execute), called on a
//! [`World::ascend`](crate::World::ascend) world's HCCL communicators. They are reported as the
//! vendor's ([`PathTaken::Vendor`]), never taken for the crate's own kernels.
//!
//! Their limits, as CANN documents them (checked on every rank before the call, so that every
//! rank fails together with the reason): f16 or bf16; two-dimensional operands with
//! `K` in `[256, 65535)`; every rank's `x` of the same shape (for `matmul_reduce_scatter`, with
//! `M` a multiple of the world size); 2, 4 or 8 ranks on Atlas A2 (2 to 32 on A3).

use ndarray::{Array2, ArrayView2};

use std::ffi::c_void;

use super::npu::AscendRank;
use super::result::{self, nnop::Operator};
use super::sys::Nnop;
use super::unfused::{Descriptor, sync, types, workspace};
use super::world::PathTaken;
use crate::shmem::{Call, Rank};
use crate::tensor::Element;
use crate::{DType, Error, Result};

/// The world sizes an MC2 operator takes on this SoC.
fn world_sizes(soc: &str) -> &'static [usize] {
    if soc.starts_with("Ascend910_93") { &[2, 4, 8, 16, 32] } else { &[2, 4, 8] }
}

/// Checks the limits on this rank, exchanges shapes (naming the call, as every collective call
/// does), and checks that every rank agrees; returns every rank's `[m, k, w rows, w cols]`.
fn agree<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    x: &ArrayView2<'_, T>,
    w: &ArrayView2<'_, T>,
) -> Result<Vec<Vec<u64>>> {
    let npu = rank.ascend().ok_or_else(|| Error::DeviceUnavailable {
        op,
        device: "host".into(),
        reason: "the vendor operators run only in a World::ascend world".into(),
    })?;
    let n = rank.num_ranks();
    let sizes = world_sizes(npu.world.soc());
    let k = x.ncols();
    let problem = if !matches!(T::DTYPE, DType::F16 | DType::BF16) {
        Some(format!("{} is not f16 or bf16, the only types {op} takes", T::DTYPE))
    } else if !sizes.contains(&n) {
        Some(format!("{n} ranks; {op} takes {sizes:?} on {}", npu.world.soc()))
    } else if !(256..65_535).contains(&k) {
        Some(format!("K = {k} is outside [256, 65535), the range {op} takes"))
    } else if w.nrows() != k {
        Some(format!(
            "x is {:?} and w is {:?}: their inner dimensions differ",
            x.shape(),
            w.shape()
        ))
    } else {
        None
    };
    let words = [x.nrows(), k, w.nrows(), w.ncols()].map(|v| v as u64);
    let all = rank.exchange(Call::of::<T>(op), &words, problem, &[])?;
    all.agree(op, 0, "rows of x (the operator takes equal shards)")?;
    all.agree(op, 1, "K")?;
    Ok(all.iter().map(<[u64]>::to_vec).collect())
}

/// The communicator's group name, which the operators take.
fn group(npu: &AscendRank<'_>) -> Result<String> {
    let hccl = npu.world.hccl()?;
    // SAFETY: the rank's communicator lives as long as the world.
    unsafe { result::hccl::comm_name(hccl, npu.world.comm(npu.rank.rank())?.0) }
}

/// `all_gather(x) @ w` by CANN's `aclnnAllGatherMatmul`: `x` is this rank's `[m, K]` (the same
/// `m` on every rank), `w` its `[K, n]`; the result is `[m * world, n]`. Collective.
///
/// # Errors
/// On every rank, [`Error::InvalidArgument`] naming the rank whose inputs are outside the
/// operator's limits (see the module's documentation) and [`Error::RanksDisagree`] for shards
/// of different shapes; [`Error::DeviceUnavailable`] on a host world; [`Error::SymbolMissing`]
/// when this CANN lacks the operator; [`Error::DeviceStatus`] with the vendor's message when it
/// fails.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::vendor;
/// use dist_tensor::{Tensor, World};
///
/// // On a host world the vendor path is not there, and says so on every rank.
/// let err = World::threads(2)?.run(|rank| {
///     let x = Tensor::<half::f16>::random(&[4, 256], 1);
///     let w = Tensor::<half::f16>::random(&[256, 8], 2);
///     vendor::all_gather_matmul(rank, x.view2("x")?, w.view2("w")?)
/// }).unwrap_err();
/// assert!(err.to_string().contains("only in a World::ascend world"), "{err}");
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_gather_matmul<T: Element>(
    rank: &Rank<'_>,
    x: ArrayView2<'_, T>,
    w: ArrayView2<'_, T>,
) -> Result<Array2<T>> {
    const OP: &str = "aclnnAllGatherMatmul";
    agree(OP, rank, &x, &w)?;
    let world = rank.num_ranks();
    let (m, k, n) = (x.nrows(), x.ncols(), w.ncols());
    let outputs = [[m * world, n], [m * world, k]]; // the product, and the gathered rows
    run_mc2(rank, OP, Operator::AllGatherMatmul, x, w, &outputs, |npu, nnop, x1, x2, out, group| {
        // SAFETY: the descriptors describe device memory of the bound device, alive until the
        // run synchronises.
        unsafe {
            result::nnop::all_gather_matmul_prepare(
                npu.world.acl(),
                nnop,
                x1,
                x2,
                group,
                out[0],
                out[1],
            )
        }
    })
}

/// `reduce_scatter(x @ w)` summed by CANN's `aclnnMatmulReduceScatter`: `x` is this rank's
/// `[M, k_r]` (the same `M`, a multiple of the world size, on every rank), `w` its `[k_r, N]`;
/// the result is this rank's `[M / world, N]`. Collective.
///
/// # Errors
/// As [`all_gather_matmul`], and [`Error::InvalidArgument`] on every rank when `M` is not a
/// multiple of the world size.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::vendor;
/// use dist_tensor::{Tensor, World};
///
/// let err = World::threads(2)?.run(|rank| {
///     let x = Tensor::<half::bf16>::random(&[8, 256], 1);
///     let w = Tensor::<half::bf16>::random(&[256, 4], 2);
///     vendor::matmul_reduce_scatter(rank, x.view2("x")?, w.view2("w")?)
/// }).unwrap_err();
/// assert!(err.to_string().contains("World::ascend"), "{err}");
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn matmul_reduce_scatter<T: Element>(
    rank: &Rank<'_>,
    x: ArrayView2<'_, T>,
    w: ArrayView2<'_, T>,
) -> Result<Array2<T>> {
    const OP: &str = "aclnnMatmulReduceScatter";
    let all = agree(OP, rank, &x, &w)?;
    let world = rank.num_ranks();
    let m = all[0][0] as usize;
    if !m.is_multiple_of(world) {
        return Err(Error::InvalidArgument {
            op: OP,
            rank: rank.rank(),
            reason: format!("M = {m} is not a multiple of the {world} ranks, as {OP} needs"),
        });
    }
    let outputs = [[m / world, w.ncols()]];
    run_mc2(
        rank,
        OP,
        Operator::MatmulReduceScatter,
        x,
        w,
        &outputs,
        |npu, nnop, x1, x2, out, group| {
            // SAFETY: as in `all_gather_matmul`.
            unsafe {
                result::nnop::matmul_reduce_scatter_prepare(
                    npu.world.acl(),
                    nnop,
                    x1,
                    x2,
                    group,
                    out[0],
                )
            }
        },
    )
}

/// Runs an MC2 operator on this rank's NPU: uploads `x` and `w`, describes them and the
/// `outputs` (the first is the result), runs the first phase (`prepare`, given the descriptors
/// and the group name), the second with a workspace of the size it asked for, synchronises, and
/// copies the result back.
fn run_mc2<T: Element>(
    rank: &Rank<'_>,
    op: &'static str,
    operator: Operator,
    x: ArrayView2<'_, T>,
    w: ArrayView2<'_, T>,
    outputs: &[[usize; 2]],
    prepare: impl FnOnce(
        &AscendRank<'_>,
        &Nnop,
        *mut c_void,
        *mut c_void,
        &[*mut c_void],
        &str,
    ) -> Result<result::nnop::Prepared>,
) -> Result<Array2<T>> {
    let npu = rank.ascend().expect("agree() checked the world");
    npu.bind()?;
    let nnop = npu.world.nnop()?;
    let (_, acl_type) = types(T::DTYPE);
    let size = size_of::<T>();
    let x = x.as_standard_layout();
    let w = w.as_standard_layout();
    let x_dev = npu.upload("vendor.x", x.as_slice().expect("standard layout"))?;
    let w_dev = npu.upload("vendor.w", w.as_slice().expect("standard layout"))?;
    let roles = ["vendor.out", "vendor.gather_out"];
    let out_devs: Vec<_> = outputs
        .iter()
        .zip(roles)
        .map(|(&[r, c], role)| npu.buffer(role, r * c * size))
        .collect::<Result<_>>()?;
    let group = group(&npu)?;
    {
        let x1 = Descriptor::new(&nnop, x.shape(), acl_type, x_dev)?;
        let x2 = Descriptor::new(&nnop, w.shape(), acl_type, w_dev)?;
        let outs: Vec<Descriptor<'_>> = outputs
            .iter()
            .zip(&out_devs)
            .map(|(shape, &dev)| Descriptor::new(&nnop, shape, acl_type, dev))
            .collect::<Result<_>>()?;
        let handles: Vec<*mut c_void> = outs.iter().map(|d| d.handle.0).collect();
        let prepared = prepare(&npu, &nnop, x1.handle.0, x2.handle.0, &handles, &group)?;
        let ws = workspace(&npu, prepared.workspace_bytes)?;
        // SAFETY: the executor is this call's, the workspace holds its size, the stream is the
        // rank's; everything lives until the synchronisation below.
        unsafe {
            result::nnop::execute(
                npu.world.acl(),
                &nnop,
                operator,
                &prepared,
                ws.0,
                npu.npu().stream.0,
            )
        }?;
        sync(&npu)?;
    }
    let [rows, cols] = outputs[0];
    let data = npu.download::<T>(out_devs[0], rows * cols)?;
    npu.took(PathTaken::Vendor(op));
    Ok(Array2::from_shape_vec((rows, cols), data).expect("the result's shape"))
}
