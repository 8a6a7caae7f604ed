//! Launches `reduce_scatter.cpp`: the NPU side of the column reduce_scatter
//! ([`collectives::reduce_scatter_cols`](crate::collectives::reduce_scatter_cols)) once the ranks
//! have agreed on the lengths.

use super::{
    KernelArgs, REDUCE_SCATTER, TilePlan, UB_REDUCE_BYTES, offsets, publish_counts,
    reduce_slot_bytes, words,
};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
use crate::device::ascend::world::PathTaken;
use crate::tensor::Element;

const OP: &str = "reduce_scatter";

/// This rank's `[rows, counts[me]]` of the sum (or the mean, when `mean`) over ranks of their
/// `[rows, sum of counts]` inputs, on its NPU.
pub(crate) fn run<T: Element>(
    npu: &AscendRank<'_>,
    input: &[T],
    rows: usize,
    counts: &[usize],
    mean: bool,
) -> Result<Vec<T>> {
    npu.bind()?;
    let (me, n) = (npu.rank.rank(), npu.rank.num_ranks());
    let size = size_of::<T>();
    let col_offsets = offsets(counts);
    let total = col_offsets[n];
    let (staging, ready) = super::staging(npu, OP, rows * total * size)?;
    let ready_at = publish_counts(npu, |_| n > 1);
    let publish = TilePlan::new(rows, total, size, UB_REDUCE_BYTES);
    // The unified buffer is carved into n + 2 equal slots (a part per rank, the f32 sum, the
    // rounded tile); a chunk's f32 rows fit one slot.
    let slot_bytes = reduce_slot_bytes(n);
    let reduce = TilePlan::new(rows, counts[me], size_of::<f32>(), slot_bytes);
    let mut table = words(counts);
    table.extend(words(&col_offsets));
    table.extend(ready_at.iter().map(|&r| r as i64));
    let table_dev = npu.upload("reduce_scatter.table", &table)?;
    let input_dev = npu.upload("reduce_scatter.input", input)?;
    let out_len = rows * counts[me];
    let out_dev = npu.buffer("reduce_scatter.out", out_len * size)?;
    let args = KernelArgs::new(&REDUCE_SCATTER)
        .ptr("input", input_dev)
        .ptr("output", out_dev)
        .ptr("staging", staging)
        .ptr("ready", ready)
        .ptr("table", table_dev)
        .ptr("status", npu.status_ptr()?)
        .int("rank", me)
        .int("num_ranks", n)
        .int("rows", rows)
        .int("mean", usize::from(mean))
        .int("publish_row_step", publish.row_step)
        .int("publish_col_step", publish.col_step)
        .int("row_step", reduce.row_step)
        .int("col_step", reduce.col_step)
        .int("slot_bytes", slot_bytes)
        .int("timeout_cycles", npu.timeout_cycles());
    npu.launch::<T>(OP, &REDUCE_SCATTER, args)?;
    let out = npu.download::<T>(out_dev, out_len)?;
    npu.took(PathTaken::Kernel(OP));
    Ok(out)
}
