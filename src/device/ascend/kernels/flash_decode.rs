//! Launches `flash_decode.cpp`: the NPU side of [`fused::flash_decode`](crate::fused::flash_decode)
//! once the ranks have agreed on the shapes (the host twin: `device::host::flash_decode`).
//!
//! The kernel's first-phase tasks are (batch, chunk of the rank's keys), and its chunk is cut here,
//! not fixed as the host kernel's: as many keys (at most [`MAX_CHUNK`]) as let the kernel's
//! buffers fit [`UB_DECODE_BYTES`] of the unified buffer. Every rank computes the same cut from
//! the agreed shapes, and so the same chunk counts, record offsets and signal counts.

use super::{FLASH_DECODE, KernelArgs, words};
use crate::device::ascend::npu::AscendRank;
use crate::device::ascend::world::PathTaken;
use crate::device::host::flash_decode::DecodeLayout;
use crate::tensor::Element;
use crate::{Error, Result};

const OP: &str = "flash_decode";

/// Bytes of the unified buffer the kernel carves (`UB_DECODE_BYTES` in `flash_decode.cpp`).
pub(crate) const UB_DECODE_BYTES: usize = 160 * 1024;
/// Most keys per first-phase task (the scores of a chunk: one 64-float repeat of the vector unit).
pub(crate) const MAX_CHUNK: usize = 64;
/// Most records the combine loads at once.
const MAX_RECORD_ROWS: usize = 64;
/// Bytes of an f32.
const F32: usize = 4;

/// The kernel's cuts for one call: keys per first-phase task, records loaded at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DecodePlan {
    pub(crate) chunk: usize,
    pub(crate) record_rows: usize,
}

/// Bytes of `elems` elements of `size` bytes in the unified buffer: whole 32-byte blocks.
fn part(elems: usize, size: usize) -> usize {
    (elems * size).div_ceil(32) * 32
}

/// Elements per UB row of a tile of `cols` elements of `size` bytes (`ub_pitch` in `prelude.h`).
fn pitch(cols: usize, size: usize) -> usize {
    part(cols, size) / size
}

/// The kernel's row pitches and raw-tile size, as `flash_decode.cpp` computes them.
struct Widths {
    group: usize,
    pd: usize,
    pv: usize,
    pr: usize,
    /// Bytes of an element in the raw (unwidened) tiles; 0 where the element is f32 (the tiles
    /// are loaded in place).
    raw: usize,
}

impl Widths {
    fn new(l: &DecodeLayout, elem: usize) -> Widths {
        Widths {
            group: l.heads / l.kv_heads.max(1),
            pd: pitch(l.d, elem),
            pv: pitch(l.dv, elem),
            pr: pitch(l.dv + 1, F32),
            raw: if elem == F32 { 0 } else { elem },
        }
    }

    /// Bytes of the first phase's buffers (`carve_phase1`) for `chunk` keys per task.
    fn phase1(&self, d: usize, chunk: usize) -> usize {
        let raw = |elems: usize| if self.raw == 0 { 0 } else { part(elems, self.raw) };
        let work = d.max(chunk).div_ceil(64).div_ceil(8) * 8;
        part(self.group * self.pd, F32)
            + raw(self.group * self.pd)
            + part(chunk * self.pd, F32)
            + raw(chunk * self.pd)
            + part(chunk * self.pv, F32)
            + raw(chunk * self.pv)
            + part(chunk * self.pd, F32)
            + part(chunk * 8, F32)
            + part(chunk, F32)
            + part(work, F32)
            + part(16, F32)
            + part(self.group * self.pr, F32)
    }

    /// Bytes of the second phase's buffers (`carve_phase2`) for `rows` records at once.
    fn phase2(&self, rows: usize) -> usize {
        let raw = if self.raw == 0 { 0 } else { part(self.pv, self.raw) };
        part(rows * self.pr, F32) + part(self.pv, F32) + raw + part(16, F32) + part(8, F32)
    }
}

impl DecodePlan {
    /// The largest cuts whose buffers fit the unified buffer, for elements of `elem` bytes; `None`
    /// when even one key (or one record) does not fit.
    pub(crate) fn new(l: &DecodeLayout, elem: usize) -> Option<DecodePlan> {
        let w = Widths::new(l, elem);
        let chunk = (1..=MAX_CHUNK).rev().find(|&c| w.phase1(l.d, c) <= UB_DECODE_BYTES)?;
        let record_rows = (1..=MAX_RECORD_ROWS).rev().find(|&r| w.phase2(r) <= UB_DECODE_BYTES)?;
        Some(DecodePlan { chunk, record_rows })
    }
}

/// This rank's `[batch, heads, dv]` output and `[batch, heads]` log-sum-exp (f32), the same on
/// every rank, from its keys and values, on its NPU.
///
/// # Errors
/// [`Error::InvalidArgument`] (on every rank alike) when `d` or `dv` is too wide for one key's
/// buffers in the unified buffer; the launch's errors.
pub(crate) fn run<T: Element>(
    npu: &AscendRank<'_>,
    l: &DecodeLayout,
    q: &[T],
    k: &[T],
    v: &[T],
) -> Result<(Vec<T>, Vec<f32>)> {
    npu.bind()?;
    let (me, n) = (npu.rank.rank(), npu.rank.num_ranks());
    let size = size_of::<T>();
    let plan = DecodePlan::new(l, size).ok_or_else(|| Error::InvalidArgument {
        op: OP,
        rank: me,
        reason: format!(
            "d = {} and dv = {} with {} query heads per kv head do not fit the NPU kernel's {} KiB \
             of unified buffer",
            l.d,
            l.dv,
            l.heads / l.kv_heads.max(1),
            UB_DECODE_BYTES / 1024
        ),
    })?;
    let chunks: Vec<usize> = l.keys.iter().map(|&keys| keys.div_ceil(plan.chunk)).collect();
    let tasks = |r: usize| (l.batch * chunks[r]) as u64;
    let mut offsets = vec![0usize];
    for &c in &chunks {
        let last = *offsets.last().expect("starts with 0");
        offsets.push(last + l.batch * c * l.heads * (l.dv + 1));
    }
    let recv = npu.symmetric(OP, "flash_decode.recv", offsets[n].max(1) * F32)?;
    let arrived = npu.signals(OP, n)?;
    // Every source's programs add its task count to every rank's signal for it, this one's too.
    let expected = npu.with_counts(OP, n, |counts| {
        for (src, count) in counts.iter_mut().enumerate() {
            *count += tasks(src);
        }
        counts.clone()
    });
    let mut table = words(&chunks);
    table.extend(words(&offsets));
    table.extend(expected.iter().map(|&e| e as i64));
    let table_dev = npu.upload("flash_decode.table", &table)?;
    let q_dev = npu.upload("flash_decode.q", q)?;
    let k_dev = npu.upload("flash_decode.k", k)?;
    let v_dev = npu.upload("flash_decode.v", v)?;
    let rows = l.batch * l.heads;
    let out_dev = npu.buffer("flash_decode.out", rows * l.dv * size)?;
    let lse_dev = npu.buffer("flash_decode.lse", rows * F32)?;
    let scale_bits = (l.scale as f32).to_bits() as usize;
    let args = KernelArgs::new(&FLASH_DECODE)
        .ptr("q", q_dev)
        .ptr("k", k_dev)
        .ptr("v", v_dev)
        .ptr("out", out_dev)
        .ptr("lse", lse_dev)
        .ptr("recv", recv)
        .ptr("arrived", arrived)
        .ptr("table", table_dev)
        .ptr("status", npu.status_ptr()?)
        .int("rank", me)
        .int("num_ranks", n)
        .int("batch", l.batch)
        .int("heads", l.heads)
        .int("kv_heads", l.kv_heads)
        .int("d", l.d)
        .int("dv", l.dv)
        .int("keys", l.keys[me])
        .int("chunk", plan.chunk)
        .int("record_rows", plan.record_rows)
        .int("scale_bits", scale_bits)
        .int("timeout_cycles", npu.timeout_cycles());
    npu.launch::<T>(OP, &FLASH_DECODE, args)?;
    let out = npu.download::<T>(out_dev, rows * l.dv)?;
    let lse = npu.download::<f32>(lse_dev, rows)?;
    npu.took(PathTaken::Kernel(OP));
    Ok((out, lse))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(heads: usize, kv_heads: usize, d: usize, dv: usize) -> DecodeLayout {
        DecodeLayout { batch: 2, heads, kv_heads, d, dv, keys: vec![3, 0], scale: 0.5 }
    }

    #[test]
    fn the_ub_budget_matches_the_source() {
        let src = include_str!("flash_decode.cpp");
        let want = format!("UB_DECODE_BYTES = {} * 1024;", UB_DECODE_BYTES / 1024);
        assert!(src.contains(&want), "flash_decode.cpp does not say `{want}`");
    }

    #[test]
    fn plans_fit_the_unified_buffer_and_shrink_with_the_widths() {
        for elem in [2, 4] {
            let small = DecodePlan::new(&layout(6, 2, 7, 5), elem).unwrap();
            assert_eq!(small, DecodePlan { chunk: MAX_CHUNK, record_rows: MAX_RECORD_ROWS });
            let l = layout(32, 4, 256, 256);
            let wide = DecodePlan::new(&l, elem).unwrap();
            let w = Widths::new(&l, elem);
            assert!(wide.chunk < MAX_CHUNK && w.phase1(256, wide.chunk) <= UB_DECODE_BYTES);
            assert!(w.phase1(256, wide.chunk + 1) > UB_DECODE_BYTES);
            assert!(DecodePlan::new(&layout(64, 1, 8192, 8), elem).is_none());
        }
    }
}
