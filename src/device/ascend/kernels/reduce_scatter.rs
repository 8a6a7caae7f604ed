//! Launches `reduce_scatter.cpp`: the NPU side of the column reduce_scatter
//! ([`collectives::reduce_scatter_cols`](crate::collectives::reduce_scatter_cols)) once the ranks
//! have agreed on the lengths.

use super::{
    REDUCE_SCATTER, TilePlan, UB_REDUCE_BYTES, collective_args, launch_and_fetch, offsets,
    publish_counts, reduce_slot_bytes, words,
};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
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
    let args = collective_args(
        npu,
        &REDUCE_SCATTER,
        input_dev,
        out_dev,
        (staging, ready),
        Some(table_dev),
    )?
    .int("rows", rows)
    .int("mean", usize::from(mean))
    .int("publish_row_step", publish.row_step)
    .int("publish_col_step", publish.col_step)
    .int("row_step", reduce.row_step)
    .int("col_step", reduce.col_step)
    .int("slot_bytes", slot_bytes)
    .int("timeout_cycles", npu.timeout_cycles());
    launch_and_fetch(npu, OP, &REDUCE_SCATTER, args, out_dev, out_len)
}
