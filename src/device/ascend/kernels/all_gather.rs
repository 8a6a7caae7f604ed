//! Launches `all_gather.cpp`: the NPU side of the column all_gather
//! ([`collectives::all_gather_cols`](crate::collectives::all_gather_cols)) once the ranks have
//! agreed on the lengths.

use super::{ALL_GATHER, KernelArgs, TilePlan, UB_TILE_BYTES, offsets, publish_counts, words};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
use crate::device::ascend::world::PathTaken;
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
    let (me, n) = (npu.rank.rank(), npu.rank.num_ranks());
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
    let table_dev = npu.upload("all_gather.table", &table)?;
    let input = npu.upload("all_gather.input", local)?;
    let out_dev = npu.buffer("all_gather.out", total * size)?;
    let args = KernelArgs::new(&ALL_GATHER)
        .ptr("input", input)
        .ptr("output", out_dev)
        .ptr("staging", staging)
        .ptr("ready", ready)
        .ptr("table", table_dev)
        .ptr("status", npu.status_ptr()?)
        .int("rank", me)
        .int("num_ranks", n)
        .int("rows", rows)
        .int("timeout_cycles", npu.timeout_cycles());
    npu.launch::<T>(OP, &ALL_GATHER, args)?;
    let out = npu.download::<T>(out_dev, total)?;
    npu.took(PathTaken::Kernel(OP));
    Ok(out)
}
