//! Launches `matmul_reduce_scatter.cpp`: the NPU side of
//! [`fused::matmul_reduce_scatter`](crate::fused::matmul_reduce_scatter) once the ranks have
//! agreed on the shapes.

use ndarray::{Array2, ArrayView2};

use super::all_gather_matmul::MATMUL_WORKSPACE_BYTES;
use super::{
    GEMM_BLOCK, KernelArgs, MATMUL_REDUCE_SCATTER, TilePlan, offsets, reduce_slot_bytes, words,
};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
use crate::device::ascend::world::PathTaken;
use crate::tensor::Element;

const OP: &str = "matmul_reduce_scatter";

/// `sum over ranks of x_r @ w_r`, this rank's rows (`row_counts[r]` rows are rank `r`'s), on
/// this rank's NPU.
pub(crate) fn run<T: Element>(
    npu: &AscendRank<'_>,
    row_counts: &[usize],
    n: usize,
    x: ArrayView2<'_, T>,
    w: ArrayView2<'_, T>,
) -> Result<Array2<T>> {
    npu.bind()?;
    let (me, world) = (npu.rank.rank(), npu.rank.num_ranks());
    let offs = offsets(row_counts);
    let (m_total, k) = (offs[world], x.ncols());
    let (block_m, block_n) = GEMM_BLOCK;
    let partials =
        npu.symmetric(OP, "matmul_reduce_scatter.partials", m_total * n * size_of::<f32>())?;
    let signals = npu.signals(OP, 2 * world)?;
    // Tiles of each owner's rows this rank computes (every rank cuts the product the same way),
    // and the calls so far, which every rank's "done" signal to this one reaches.
    let expected = npu.with_counts(OP, world + 1, |counts| {
        for (o, count) in counts.iter_mut().take(world).enumerate() {
            let tiles = row_counts[o].div_ceil(block_m) * n.div_ceil(block_n);
            *count += tiles as u64;
        }
        counts[world] += 1;
        counts.clone()
    });
    // The reduction's chunks: f32 rows that fit one of the unified buffer's world + 2 slots.
    let slot_bytes = reduce_slot_bytes(world);
    let plan = TilePlan::new(row_counts[me], n, size_of::<f32>(), slot_bytes);
    // A rank whose inner shard is empty (k = 0) still owes every owner a partial: zeros. The
    // cube's `Matmul` refuses an empty inner dimension, so that rank multiplies one zero column
    // by one zero row instead, which gives the same exact zeros through the same kernel.
    let (x, w, k) = if k == 0 {
        (
            Array2::from_elem((m_total, 1), T::zero()).into(),
            Array2::from_elem((1, n), T::zero()).into(),
            1,
        )
    } else {
        (x.as_standard_layout(), w.as_standard_layout(), k)
    };
    let x_dev = npu.upload("matmul_reduce_scatter.x", x.as_slice().expect("standard layout"))?;
    let w_dev = npu.upload("matmul_reduce_scatter.w", w.as_slice().expect("standard layout"))?;
    let mut table = words(&offs);
    table.extend(expected.iter().map(|&e| e as i64));
    let table_dev = npu.upload("matmul_reduce_scatter.table", &table)?;
    let out_dev = npu.buffer("matmul_reduce_scatter.out", row_counts[me] * n * size_of::<T>())?;
    let args = KernelArgs::new(&MATMUL_REDUCE_SCATTER)
        .ptr("x", x_dev)
        .ptr("w", w_dev)
        .ptr("out", out_dev)
        .ptr("partials", partials)
        .ptr("signals", signals)
        .ptr("row_offsets", table_dev)
        .ptr("expected", table_dev.add::<i64>(world + 1))
        .ptr("status", npu.status_ptr()?)
        .ptr("workspace", npu.buffer("matmul.workspace", MATMUL_WORKSPACE_BYTES)?)
        .int("rank", me)
        .int("num_ranks", world)
        .int("k", k)
        .int("n", n)
        .int("block_m", block_m)
        .int("block_n", block_n)
        .int("row_step", plan.row_step)
        .int("col_step", plan.col_step)
        .int("slot_bytes", slot_bytes)
        .int("timeout_cycles", npu.timeout_cycles());
    npu.launch::<T>(OP, &MATMUL_REDUCE_SCATTER, args)?;
    let data = npu.download::<T>(out_dev, row_counts[me] * n)?;
    npu.took(PathTaken::Kernel(OP));
    Ok(Array2::from_shape_vec((row_counts[me], n), data).expect("m_r x N"))
}
