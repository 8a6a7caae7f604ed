//! Launches `all_to_all.cpp`: the NPU side of [`fused::all_to_all`](crate::fused::all_to_all)
//! once the ranks have agreed on the shapes.

use super::{ALL_TO_ALL, KernelArgs, UB_TILE_BYTES, launch_and_fetch, words};
use crate::Result;
use crate::device::ascend::npu::AscendRank;
use crate::tensor::Element;

const OP: &str = "all_to_all";

/// The tensor as `[A, X, Bm, Y, C]` (the scatter and gather dimensions are X and Y), as the
/// host kernel's layout has it.
pub(crate) struct Layout<'a> {
    pub(crate) a: usize,
    pub(crate) bm: usize,
    pub(crate) c: usize,
    pub(crate) gather_first: bool,
    pub(crate) scatter_len: usize,
    pub(crate) gathers: &'a [usize],
    pub(crate) gather_offsets: &'a [usize],
    pub(crate) scatters: &'a [usize],
    pub(crate) scatter_offsets: &'a [usize],
}

impl Layout<'_> {
    /// Rows and columns of the block rank `src` sends rank `dst` for one (a, b).
    fn block(&self, src: usize, dst: usize) -> (usize, usize) {
        if self.gather_first {
            (self.gathers[src], self.scatters[dst] * self.c)
        } else {
            (self.scatters[dst], self.gathers[src] * self.c)
        }
    }

    /// Elements of rank `r`'s output.
    fn output_len(&self, r: usize) -> usize {
        self.a * self.bm * self.c * self.gather_offsets[self.gathers.len()] * self.scatters[r]
    }
}

/// Rows per task of a block of `cols` elements per row: as many as fit the unified buffer.
fn rows_per_task(cols: usize, elem: usize) -> usize {
    (UB_TILE_BYTES / ((cols * elem).div_ceil(32) * 32).max(32)).max(1)
}

/// This rank's shard of the resharded tensor (`input` is its shard before), on its NPU.
pub(crate) fn run<T: Element>(
    npu: &AscendRank<'_>,
    layout: &Layout<'_>,
    input: &[T],
) -> Result<Vec<T>> {
    npu.bind()?;
    let (me, n) = (npu.rank.rank(), npu.rank.num_ranks());
    let size = size_of::<T>();
    let recv_len = (0..n).map(|r| layout.output_len(r)).max().unwrap_or(0);
    let recv = npu.symmetric(OP, "all_to_all.recv", recv_len * size)?;
    let arrived = npu.signals(OP, n)?;
    let ab = layout.a * layout.bm;
    let tasks = |src: usize, dst: usize| {
        let (rows, cols) = layout.block(src, dst);
        if cols == 0 { 0 } else { rows.div_ceil(rows_per_task(cols, size)) * ab }
    };
    let expected = npu.with_counts(OP, n, |counts| {
        for (src, count) in counts.iter_mut().enumerate() {
            if src != me {
                *count += tasks(src, me) as u64;
            }
        }
        counts.clone()
    });
    let mut table = words(layout.gathers);
    table.extend(words(layout.gather_offsets));
    table.extend(words(layout.scatters));
    table.extend(words(layout.scatter_offsets));
    table.extend((0..n).map(|dst| rows_per_task(layout.block(me, dst).1, size) as i64));
    table.extend((0..n).map(|src| rows_per_task(layout.block(src, me).1, size) as i64));
    table.extend(expected.iter().map(|&e| e as i64));
    table.extend((0..n).map(|dst| tasks(me, dst) as i64));
    table.extend((0..n).map(|src| tasks(src, me) as i64));
    let table_dev = npu.upload("all_to_all.table", &table)?;
    let x_dev = npu.upload("all_to_all.x", input)?;
    let out_len = layout.output_len(me);
    let out_dev = npu.buffer("all_to_all.out", out_len * size)?;
    let args = KernelArgs::new(&ALL_TO_ALL)
        .ptr("x", x_dev)
        .ptr("out", out_dev)
        .ptr("recv", recv)
        .ptr("arrived", arrived)
        .ptr("table", table_dev)
        .ptr("status", npu.status_ptr()?)
        .int("rank", me)
        .int("num_ranks", n)
        .int("a", layout.a)
        .int("bm", layout.bm)
        .int("c", layout.c)
        .int("gather_first", usize::from(layout.gather_first))
        .int("scatter_len", layout.scatter_len)
        .int("timeout_cycles", npu.timeout_cycles());
    launch_and_fetch(npu, OP, &ALL_TO_ALL, args, out_dev, out_len)
}
