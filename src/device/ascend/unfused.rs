//! The unfused baselines on NPUs, what a CANN user would write without fused kernels: an HCCL
//! collective, then the vendor's GEMM (`aclnnMatmul`), or the GEMM then the collective.

use ndarray::{Array2, ArrayView2};

use super::npu::{AscendRank, Handle};
use super::result::{self, hccl::On, nnop::Operator};
use super::sys::{AclDataType, HcclDataType, Nnop};
use super::world::PathTaken;
use crate::tensor::Element;
use crate::{DType, Result};

/// The HCCL and aclnn names of an element type (f64 never gets here: the ops refuse it first).
pub(crate) fn types(dtype: DType) -> (HcclDataType, AclDataType) {
    match dtype {
        DType::F16 => (HcclDataType::Fp16, AclDataType::Float16),
        DType::BF16 => (HcclDataType::Bf16, AclDataType::Bf16),
        DType::F32 | DType::F64 => (HcclDataType::Fp32, AclDataType::Float),
    }
}

/// An `aclTensor` descriptor, destroyed when dropped.
pub(crate) struct Descriptor<'a> {
    nnop: &'a Nnop,
    pub(crate) handle: Handle,
}

impl<'a> Descriptor<'a> {
    /// A row-major descriptor of `shape` over device memory `data`.
    pub(crate) fn new(
        nnop: &'a Nnop,
        shape: &[usize],
        dtype: AclDataType,
        data: Handle,
    ) -> Result<Self> {
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        // SAFETY: `data` is device memory of the bound device holding `shape`'s elements (the
        // callers size it); the descriptor is dropped before the memory is reused.
        let handle = Handle(unsafe { result::nnop::create_tensor(nnop, &dims, dtype, data.0) }?);
        Ok(Descriptor { nnop, handle })
    }
}

impl Drop for Descriptor<'_> {
    fn drop(&mut self) {
        // SAFETY: made by `create_tensor`, used no more.
        unsafe { result::nnop::destroy_tensor(self.nnop, self.handle.0) }
    }
}

/// `out = a @ b` with `aclnnMatmul` on this rank's stream (not synchronised).
pub(crate) fn matmul(
    npu: &AscendRank<'_>,
    nnop: &Nnop,
    a: &Descriptor<'_>,
    b: &Descriptor<'_>,
    out: &Descriptor<'_>,
) -> Result<()> {
    let acl = npu.world.acl();
    // SAFETY: the descriptors describe device memory of the bound device.
    let prepared =
        unsafe { result::nnop::matmul_prepare(acl, nnop, a.handle.0, b.handle.0, out.handle.0) }?;
    let workspace = workspace(npu, prepared.workspace_bytes)?;
    // SAFETY: the executor came from the first phase just now; the workspace holds its size; all
    // of it stays alive until the caller synchronises the stream.
    unsafe {
        result::nnop::execute(
            acl,
            nnop,
            Operator::Matmul,
            &prepared,
            workspace.0,
            npu.npu().stream.0,
        )
    }
}

/// The vendor operators' workspace: at least `bytes` of device memory (null for none).
pub(crate) fn workspace(npu: &AscendRank<'_>, bytes: u64) -> Result<Handle> {
    if bytes == 0 {
        return Ok(Handle::NULL);
    }
    npu.buffer("aclnn.workspace", usize::try_from(bytes).unwrap_or(usize::MAX))
}

/// Synchronises the rank's stream (with the world's timeout).
pub(crate) fn sync(npu: &AscendRank<'_>) -> Result<()> {
    // SAFETY: the rank's stream lives as long as the world.
    unsafe {
        result::runtime::synchronize_stream(
            npu.world.acl(),
            npu.npu().stream.0,
            npu.world.sync_timeout(),
        )
    }
}

/// The unfused all_gather_matmul: `HcclAllGatherV` of the rows, then one `aclnnMatmul` per
/// weight.
pub(crate) fn all_gather_matmul<T: Element>(
    npu: &AscendRank<'_>,
    row_counts: &[usize],
    k: usize,
    x: ArrayView2<'_, T>,
    weights: &[ArrayView2<'_, T>],
) -> Result<Vec<Array2<T>>> {
    npu.bind()?;
    let (me, n) = (npu.rank.rank(), npu.rank.num_ranks());
    let hccl = npu.world.hccl()?;
    let nnop = npu.world.nnop()?;
    let (hccl_type, acl_type) = types(T::DTYPE);
    let size = size_of::<T>();
    let offs = super::kernels::offsets(row_counts);
    let m_total = offs[n];
    let x = x.as_standard_layout();
    let x_dev = npu.upload("unfused.x", x.as_slice().expect("standard layout"))?;
    let gathered = npu.buffer("unfused.gathered", m_total * k * size)?;
    let counts: Vec<u64> = row_counts.iter().map(|&m| (m * k) as u64).collect();
    let displs: Vec<u64> = offs[..n].iter().map(|&o| (o * k) as u64).collect();
    let on = On { comm: npu.world.comm(me)?.0, stream: npu.npu().stream.0 };
    // SAFETY: `x_dev` holds this rank's rows and `gathered` every rank's, on this device; both
    // stay alive until the synchronisation below.
    unsafe {
        result::hccl::all_gather_v(
            hccl, x_dev.0, counts[me], gathered.0, &counts, &displs, hccl_type, on,
        )
    }?;
    let a = Descriptor::new(&nnop, &[m_total, k], acl_type, gathered)?;
    let mut outputs = Vec::with_capacity(weights.len());
    for w in weights {
        let nw = w.ncols();
        let w = w.as_standard_layout();
        let w_dev = npu.upload("unfused.w", w.as_slice().expect("standard layout"))?;
        let out_dev = npu.buffer("unfused.out", m_total * nw * size)?;
        let b = Descriptor::new(&nnop, &[k, nw], acl_type, w_dev)?;
        let c = Descriptor::new(&nnop, &[m_total, nw], acl_type, out_dev)?;
        matmul(npu, &nnop, &a, &b, &c)?;
        sync(npu)?;
        let data = npu.download::<T>(out_dev, m_total * nw)?;
        outputs.push(Array2::from_shape_vec((m_total, nw), data).expect("M x n_i"));
    }
    npu.took(PathTaken::Unfused("all_gather_matmul"));
    Ok(outputs)
}

/// The unfused matmul_reduce_scatter: `aclnnMatmul` of the local product, then
/// `HcclReduceScatterV` of its rows.
pub(crate) fn matmul_reduce_scatter<T: Element>(
    npu: &AscendRank<'_>,
    row_counts: &[usize],
    n: usize,
    x: ArrayView2<'_, T>,
    w: ArrayView2<'_, T>,
) -> Result<Array2<T>> {
    npu.bind()?;
    let (me, world) = (npu.rank.rank(), npu.rank.num_ranks());
    let hccl = npu.world.hccl()?;
    let nnop = npu.world.nnop()?;
    let (hccl_type, acl_type) = types(T::DTYPE);
    let size = size_of::<T>();
    let offs = super::kernels::offsets(row_counts);
    let (m_total, k) = (offs[world], x.ncols());
    let x = x.as_standard_layout();
    let w = w.as_standard_layout();
    let x_dev = npu.upload("unfused.x", x.as_slice().expect("standard layout"))?;
    let w_dev = npu.upload("unfused.w", w.as_slice().expect("standard layout"))?;
    let partial = npu.buffer("unfused.partial", m_total * n * size)?;
    let out_dev = npu.buffer("unfused.out", row_counts[me] * n * size)?;
    {
        let a = Descriptor::new(&nnop, &[m_total, k], acl_type, x_dev)?;
        let b = Descriptor::new(&nnop, &[k, n], acl_type, w_dev)?;
        let c = Descriptor::new(&nnop, &[m_total, n], acl_type, partial)?;
        matmul(npu, &nnop, &a, &b, &c)?;
    }
    let counts: Vec<u64> = row_counts.iter().map(|&m| (m * n) as u64).collect();
    let displs: Vec<u64> = offs[..world].iter().map(|&o| (o * n) as u64).collect();
    let on = On { comm: npu.world.comm(me)?.0, stream: npu.npu().stream.0 };
    // SAFETY: `partial` holds the whole product and `out_dev` this rank's rows, on this device,
    // alive until the synchronisation below (the stream orders the GEMM before the collective).
    unsafe {
        result::hccl::reduce_scatter_v(
            hccl, partial.0, &counts, &displs, out_dev.0, counts[me], hccl_type, on,
        )
    }?;
    sync(npu)?;
    let data = npu.download::<T>(out_dev, row_counts[me] * n)?;
    npu.took(PathTaken::Unfused("matmul_reduce_scatter"));
    Ok(Array2::from_shape_vec((row_counts[me], n), data).expect("m_r x N"))
}
