//! Launches `all_gather_matmul.cpp`: the NPU side of
//! [`fused::all_gather_matmul`](crate::fused::all_gather_matmul) once the ranks have agreed on
//! the shapes.

use ndarray::{Array2, ArrayView2};

use super::{ALL_GATHER_MATMUL, GEMM_BLOCK, KernelArgs, TilePlan, UB_TILE_BYTES, offsets, words};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
use crate::device::ascend::world::PathTaken;
use crate::tensor::Element;

const OP: &str = "all_gather_matmul";

/// Bytes of the Matmul library's system workspace per device (the size Ascend C's platform
/// query reports for the Atlas A2 family).
pub(crate) const MATMUL_WORKSPACE_BYTES: usize = 16 << 20;

/// `all_gather(x) @ w` for every weight, on this rank's NPU: `row_counts[r]` rows came from
/// rank `r`, `k` is every rank's column count. One launch per weight; the first pushes this
/// rank's rows to every peer, the later ones find every shard already gathered.
pub(crate) fn run<T: Element>(
    npu: &AscendRank<'_>,
    row_counts: &[usize],
    k: usize,
    x: ArrayView2<'_, T>,
    weights: &[ArrayView2<'_, T>],
) -> Result<Vec<Array2<T>>> {
    npu.bind()?;
    let (me, n) = (npu.rank.rank(), npu.rank.num_ranks());
    let offs = offsets(row_counts);
    let m_total = offs[n];
    let size = size_of::<T>();
    // Symmetric memory first: it is collective, and every rank reaches it with the same sizes.
    let gathered = npu.symmetric(OP, "all_gather_matmul.gathered", m_total * k * size)?;
    let arrived = npu.signals(OP, n)?;
    let push = |rows: usize| TilePlan::new(rows, k, size, UB_TILE_BYTES);
    let expected = npu.with_counts(OP, n, |counts| {
        for (s, count) in counts.iter_mut().enumerate() {
            if s != me {
                *count += push(row_counts[s]).count() as u64;
            }
        }
        counts.clone()
    });
    let plan = push(row_counts[me]);
    let x = x.as_standard_layout();
    let x_dev = npu.upload("all_gather_matmul.x", x.as_slice().expect("standard layout"))?;
    let mut table = words(&offs);
    table.extend(expected.iter().map(|&e| e as i64));
    let table_dev = npu.upload("all_gather_matmul.table", &table)?;
    let status = npu.status_ptr()?;
    let workspace = npu.buffer("matmul.workspace", MATMUL_WORKSPACE_BYTES)?;
    let (block_m, block_n) = GEMM_BLOCK;
    let mut outputs = Vec::with_capacity(weights.len());
    for (i, w) in weights.iter().enumerate() {
        let nw = w.ncols();
        let w = w.as_standard_layout();
        let w_dev = npu.upload("all_gather_matmul.w", w.as_slice().expect("standard layout"))?;
        let out_dev = npu.buffer("all_gather_matmul.out", m_total * nw * size)?;
        let args = KernelArgs::new(&ALL_GATHER_MATMUL)
            .ptr("x", x_dev)
            .ptr("w", w_dev)
            .ptr("out", out_dev)
            .ptr("gathered", gathered)
            .ptr("arrived", arrived)
            .ptr("row_offsets", table_dev)
            .ptr("expected", table_dev.add::<i64>(n + 1))
            .ptr("status", status)
            .ptr("workspace", workspace)
            .int("rank", me)
            .int("num_ranks", n)
            .int("k", k)
            .int("n", nw)
            .int("push", usize::from(i == 0))
            .int("row_step", plan.row_step)
            .int("col_step", plan.col_step)
            .int("block_m", block_m)
            .int("block_n", block_n)
            .int("timeout_cycles", npu.timeout_cycles());
        npu.launch::<T>(OP, &ALL_GATHER_MATMUL, args)?;
        let data = npu.download::<T>(out_dev, m_total * nw)?;
        outputs.push(Array2::from_shape_vec((m_total, nw), data).expect("M x n_i"));
    }
    npu.took(PathTaken::Kernel(OP));
    Ok(outputs)
}
