//! Launches `all_to_all_v.cpp`: the NPU side of
//! [`collectives::all_to_all_v`](crate::collectives::all_to_all_v) once the ranks have agreed
//! on the counts.

use super::{
    ALL_TO_ALL_V, TilePlan, UB_TILE_BYTES, collective_args, launch_and_fetch, offsets,
    publish_counts, words,
};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
use crate::tensor::Element;

const OP: &str = "all_to_all_v";

/// What this rank receives: `recv[s]` elements from each rank `s`, starting at `send_start[s]`
/// of `s`'s input, in source order; `longest` is the longest input of any rank.
pub(crate) fn run<T: Element>(
    npu: &AscendRank<'_>,
    input: &[T],
    recv: &[usize],
    send_start: &[usize],
    longest: usize,
) -> Result<Vec<T>> {
    npu.bind()?;
    let n = npu.rank.num_ranks();
    let size = size_of::<T>();
    let recv_offsets = offsets(recv);
    let (staging, ready) = super::staging(npu, OP, longest * size)?;
    let ready_at = publish_counts(npu, |_| n > 1);
    let publish = TilePlan::new(1, input.len(), size, UB_TILE_BYTES);
    let mut table = words(recv);
    table.extend(words(send_start));
    table.extend(words(&recv_offsets));
    table.extend(ready_at.iter().map(|&r| r as i64));
    let pieces: Vec<TilePlan> =
        recv.iter().map(|&c| TilePlan::new(1, c, size, UB_TILE_BYTES)).collect();
    table.extend(pieces.iter().map(|p| p.col_step as i64));
    table.extend(pieces.iter().map(|p| p.count() as i64));
    let table_dev = npu.upload("all_to_all_v.table", &table)?;
    let input_dev = npu.upload("all_to_all_v.input", input)?;
    let out_len = recv_offsets[n];
    let out_dev = npu.buffer("all_to_all_v.out", out_len * size)?;
    let args =
        collective_args(npu, &ALL_TO_ALL_V, input_dev, out_dev, (staging, ready), Some(table_dev))?
            .int("in_len", input.len())
            .int("publish_col_step", publish.col_step)
            .int("timeout_cycles", npu.timeout_cycles());
    launch_and_fetch(npu, OP, &ALL_TO_ALL_V, args, out_dev, out_len)
}
