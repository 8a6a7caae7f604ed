//! Launches `broadcast.cpp`: the NPU side of [`collectives::broadcast`](crate::collectives::broadcast)
//! once the ranks have agreed on the root and the length.

use super::{
    BROADCAST, TilePlan, UB_TILE_BYTES, collective_args, launch_and_fetch, publish_counts,
};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
use crate::tensor::Element;

const OP: &str = "broadcast";

/// The root's `len` elements (`data` on the root; ignored elsewhere), on every rank's NPU.
pub(crate) fn run<T: Element>(
    npu: &AscendRank<'_>,
    data: &[T],
    root: usize,
    len: usize,
) -> Result<Vec<T>> {
    npu.bind()?;
    let (me, n) = (npu.rank.rank(), npu.rank.num_ranks());
    let size = size_of::<T>();
    let (staging, ready) = super::staging(npu, OP, len * size)?;
    let ready_at = publish_counts(npu, |p| n > 1 && p == root);
    let plan = TilePlan::new(1, len, size, UB_TILE_BYTES);
    let input_dev = npu.upload("broadcast.input", if me == root { data } else { &[] })?;
    let out_dev = npu.buffer("broadcast.out", len * size)?;
    let args = collective_args(npu, &BROADCAST, input_dev, out_dev, (staging, ready), None)?
        .int("root", root)
        .int("len", len)
        .int("col_step", plan.col_step)
        .int("ready_at", ready_at[root] as usize)
        .int("timeout_cycles", npu.timeout_cycles());
    launch_and_fetch(npu, OP, &BROADCAST, args, out_dev, len)
}
