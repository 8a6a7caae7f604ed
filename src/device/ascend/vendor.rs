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

use super::npu::AscendRank;
use super::result::{self, nnop::Operator};
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
    let npu = rank.ascend().expect("agree() checked the world");
    npu.bind()?;
    let nnop = npu.world.nnop()?;
    let (_, acl_type) = types(T::DTYPE);
    let (m, k, n, world) = (x.nrows(), x.ncols(), w.ncols(), rank.num_ranks());
    let size = size_of::<T>();
    let x = x.as_standard_layout();
    let w = w.as_standard_layout();
    let x_dev = npu.upload("vendor.x", x.as_slice().expect("standard layout"))?;
    let w_dev = npu.upload("vendor.w", w.as_slice().expect("standard layout"))?;
    let out_dev = npu.buffer("vendor.out", m * world * n * size)?;
    let gather_dev = npu.buffer("vendor.gather_out", m * world * k * size)?;
    let group = group(&npu)?;
    let acl = npu.world.acl();
    {
        let x1 = Descriptor::new(&nnop, &[m, k], acl_type, x_dev)?;
        let x2 = Descriptor::new(&nnop, &[k, n], acl_type, w_dev)?;
        let out = Descriptor::new(&nnop, &[m * world, n], acl_type, out_dev)?;
        let gather_out = Descriptor::new(&nnop, &[m * world, k], acl_type, gather_dev)?;
        // SAFETY: the descriptors describe device memory of the bound device, alive until the
        // synchronisation below.
        let prepared = unsafe {
            result::nnop::all_gather_matmul_prepare(
                acl,
                &nnop,
                x1.handle.0,
                x2.handle.0,
                &group,
                out.handle.0,
                gather_out.handle.0,
            )
        }?;
        let ws = workspace(&npu, prepared.workspace_bytes)?;
        // SAFETY: the executor is this call's, the workspace holds its size, the stream is the
        // rank's; everything lives until the synchronisation.
        unsafe {
            result::nnop::execute(
                acl,
                &nnop,
                Operator::AllGatherMatmul,
                &prepared,
                ws.0,
                npu.npu().stream.0,
            )
        }?;
        sync(&npu)?;
    }
    let data = npu.download::<T>(out_dev, m * world * n)?;
    npu.took(PathTaken::Vendor(OP));
    Ok(Array2::from_shape_vec((m * world, n), data).expect("M x n"))
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
    if m % world != 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            rank: rank.rank(),
            reason: format!("M = {m} is not a multiple of the {world} ranks, as {OP} needs"),
        });
    }
    let npu = rank.ascend().expect("agree() checked the world");
    npu.bind()?;
    let nnop = npu.world.nnop()?;
    let (_, acl_type) = types(T::DTYPE);
    let (k, n) = (x.ncols(), w.ncols());
    let size = size_of::<T>();
    let x = x.as_standard_layout();
    let w = w.as_standard_layout();
    let x_dev = npu.upload("vendor.x", x.as_slice().expect("standard layout"))?;
    let w_dev = npu.upload("vendor.w", w.as_slice().expect("standard layout"))?;
    let mine = m / world;
    let out_dev = npu.buffer("vendor.out", mine * n * size)?;
    let group = group(&npu)?;
    let acl = npu.world.acl();
    {
        let x1 = Descriptor::new(&nnop, &[m, k], acl_type, x_dev)?;
        let x2 = Descriptor::new(&nnop, &[k, n], acl_type, w_dev)?;
        let out = Descriptor::new(&nnop, &[mine, n], acl_type, out_dev)?;
        // SAFETY: as in `all_gather_matmul`.
        let prepared = unsafe {
            result::nnop::matmul_reduce_scatter_prepare(
                acl,
                &nnop,
                x1.handle.0,
                x2.handle.0,
                &group,
                out.handle.0,
            )
        }?;
        let ws = workspace(&npu, prepared.workspace_bytes)?;
        // SAFETY: as in `all_gather_matmul`.
        unsafe {
            result::nnop::execute(
                acl,
                &nnop,
                Operator::MatmulReduceScatter,
                &prepared,
                ws.0,
                npu.npu().stream.0,
            )
        }?;
        sync(&npu)?;
    }
    let data = npu.download::<T>(out_dev, mine * n)?;
    npu.took(PathTaken::Vendor(OP));
    Ok(Array2::from_shape_vec((mine, n), data).expect("M / world x N"))
}
