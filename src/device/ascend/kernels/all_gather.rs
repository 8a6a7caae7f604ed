//! Launches `all_gather.cpp`: the NPU side of the column all_gather
//! ([`collectives::all_gather_cols`](crate::collectives::all_gather_cols)) once the ranks have
//! agreed on the lengths.

use super::{
    ALL_GATHER, TilePlan, UB_TILE_BYTES, collective_args, launch_and_fetch, offsets,
    publish_counts, words,
};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
use crate::tensor::Element;

const OP: &str = "all_gather";

/// Every rank's `[rows, cols[r]]` block side by side, `[rows, sum of cols]`, on this rank's NPU.
pub(crate) fn run<T: Element>(
    npu: &AscendRank<'_>,
    local: &[T],
    rows: usize,
    cols: &[usize],
) -> Result<Vec<T>> {
    npu.bind()?;
    let n = npu.rank.num_ranks();
    let size = size_of::<T>();
    let col_offsets = offsets(cols);
    let total = rows * col_offsets[n];
    let widest = cols.iter().map(|&c| rows * c).max().unwrap_or(0);
    let (staging, ready) = super::staging(npu, OP, widest * size)?;
    let ready_at = publish_counts(npu, |_| n > 1);
    let plans: Vec<TilePlan> =
        cols.iter().map(|&c| TilePlan::new(rows, c, size, UB_TILE_BYTES)).collect();
    let mut table = words(cols);
    table.extend(words(&col_offsets));
    table.extend(ready_at.iter().map(|&r| r as i64));
    table.extend(plans.iter().map(|p| p.row_step as i64));
    table.extend(plans.iter().map(|p| p.col_step as i64));
    table.extend(plans.iter().map(|p| p.count() as i64));
    let table_dev = npu.upload("all_gather.table", &table)?;
    let input = npu.upload("all_gather.input", local)?;
    let out_dev = npu.buffer("all_gather.out", total * size)?;
    let args =
        collective_args(npu, &ALL_GATHER, input, out_dev, (staging, ready), Some(table_dev))?
            .int("rows", rows)
            .int("timeout_cycles", npu.timeout_cycles());
    launch_and_fetch(npu, OP, &ALL_GATHER, args, out_dev, total)
}
