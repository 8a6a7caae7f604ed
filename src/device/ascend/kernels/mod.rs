//! The tile kernels in Ascend C, one source beside each launcher, and what launching them takes:
//! the sources as the crate embeds them, their parameter lists, how blocks are cut into tasks,
//! the compiled-binary cache, and an argument list checked against the kernel's signature.
//!
//! | kernel (`.cpp`) | launcher (`.rs`) | host twin |
//! | --- | --- | --- |
//! | `all_gather_matmul` | [`all_gather_matmul`] | `fused::all_gather_matmul` |
//! | `matmul_reduce_scatter` | [`matmul_reduce_scatter`] | `fused::matmul_reduce_scatter` |
//! | `all_to_all` | [`all_to_all`] | `fused::all_to_all` |
//! | `all_gather` | [`all_gather`] | `collectives::all_gather_cols` |
//! | `reduce_scatter` | [`reduce_scatter`] | `collectives::reduce_scatter_cols` |
//! | `all_to_all_v` | [`all_to_all_v`] | `collectives::all_to_all_v` |
//! | `broadcast` | [`broadcast`] | `collectives::broadcast` |
//! | `flash_decode` | [`flash_decode`] | `fused::flash_decode` |
//!
//! Each source includes `prelude.h` (the seed's primitives over Ascend C and Ascend SHMEM) and,
//! for the two GEMM kernels, `gemm.h`; the collectives share `collective.h`. `aclrtc` takes no
//! header files, so [`KernelSource::assemble`] pastes them in place of their `#include` lines.
//!
//! None of these sources has been compiled by CANN's compiler: no NPU or CANN was available
//! where they were written. They are run on the CPU, through `World::ascend` over an executing
//! stand-in CANN, in `tests/ascend_run.rs`, and checked for syntax and conventions in
//! `tests/ascend_kernels.rs`.

pub(crate) mod all_gather;
pub(crate) mod all_gather_matmul;
pub(crate) mod all_to_all;
pub(crate) mod all_to_all_v;
pub(crate) mod broadcast;
mod cache;
pub(crate) mod flash_decode;
pub(crate) mod matmul_reduce_scatter;
pub(crate) mod reduce_scatter;

pub(crate) use cache::{KernelArgs, KernelCache};

use crate::device::LaunchMode;
use crate::device::ascend::npu::{AscendRank, Handle};
use crate::device::ascend::world::PathTaken;
use crate::{DType, Element, Error, Result};

/// The headers the kernel sources include, by the name they include them as.
const HEADERS: [(&str, &str); 3] = [
    ("prelude.h", include_str!("prelude.h")),
    ("gemm.h", include_str!("gemm.h")),
    ("collective.h", include_str!("collective.h")),
];

/// Bytes of the unified buffer one tile copy uses (`UB_TILE_BYTES` in `prelude.h`).
pub(crate) const UB_TILE_BYTES: usize = 64 * 1024;
/// Bytes of the unified buffer the reductions carve into `num_ranks + 2` slots
/// (`UB_REDUCE_BYTES` in `prelude.h`).
pub(crate) const UB_REDUCE_BYTES: usize = 160 * 1024;
/// Bytes of a program's status record (eight `int64_t`), where a wait that timed out reports.
pub(crate) const STATUS_BYTES: usize = 64;
/// Rows and columns of the output tiles the GEMM kernels multiply per task.
pub(crate) const GEMM_BLOCK: (usize, usize) = (128, 256);

/// One Ascend C kernel of the crate: its source, as embedded, and how it is launched.
///
/// # Examples
/// ```
/// use dist_tensor::device::ascend::KernelSource;
///
/// let ag = KernelSource::all().iter().find(|k| k.name() == "all_gather_matmul").unwrap();
/// assert_eq!(ag.file(), "all_gather_matmul.cpp");
/// assert!(ag.mix()); // it has a cube part
/// assert_eq!(ag.params()[0], ("x".to_string(), "GM_ADDR".to_string()));
/// assert!(!ag.assemble().contains("#include \"prelude.h\"")); // headers pasted in
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    name: &'static str,
    file: &'static str,
    text: &'static str,
    mode: LaunchMode,
}

macro_rules! kernel {
    ($name:literal, $mode:expr) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".cpp"),
            text: include_str!(concat!($name, ".cpp")),
            mode: $mode,
        }
    };
}

pub(crate) const ALL_GATHER_MATMUL: KernelSource = kernel!("all_gather_matmul", LaunchMode::Mix);
pub(crate) const MATMUL_REDUCE_SCATTER: KernelSource =
    kernel!("matmul_reduce_scatter", LaunchMode::Mix);
pub(crate) const ALL_TO_ALL: KernelSource = kernel!("all_to_all", LaunchMode::VectorOnly);
pub(crate) const ALL_GATHER: KernelSource = kernel!("all_gather", LaunchMode::VectorOnly);
pub(crate) const REDUCE_SCATTER: KernelSource = kernel!("reduce_scatter", LaunchMode::VectorOnly);
pub(crate) const ALL_TO_ALL_V: KernelSource = kernel!("all_to_all_v", LaunchMode::VectorOnly);
pub(crate) const BROADCAST: KernelSource = kernel!("broadcast", LaunchMode::VectorOnly);
pub(crate) const FLASH_DECODE: KernelSource = kernel!("flash_decode", LaunchMode::VectorOnly);

const ALL: [KernelSource; 8] = [
    ALL_GATHER_MATMUL,
    MATMUL_REDUCE_SCATTER,
    ALL_TO_ALL,
    ALL_GATHER,
    REDUCE_SCATTER,
    ALL_TO_ALL_V,
    BROADCAST,
    FLASH_DECODE,
];

impl KernelSource {
    /// Every kernel of the crate.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::KernelSource;
    /// assert_eq!(KernelSource::all().len(), 8);
    /// ```
    pub fn all() -> &'static [KernelSource] {
        &ALL
    }

    /// The kernel's name: its `extern "C"` entry point, and the name `aclrtc` compiles it as.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::KernelSource;
    /// assert!(KernelSource::all().iter().any(|k| k.name() == "broadcast"));
    /// ```
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The source file, beside this module in `src/device/ascend/kernels/`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::KernelSource;
    /// assert!(KernelSource::all().iter().all(|k| k.file().ends_with(".cpp")));
    /// ```
    pub fn file(&self) -> &'static str {
        self.file
    }

    /// The source text as the file holds it.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::KernelSource;
    /// let k = &KernelSource::all()[0];
    /// assert!(k.text().contains(&format!("void {}(", k.name())));
    /// ```
    pub fn text(&self) -> &'static str {
        self.text
    }

    /// Whether the kernel runs in mix mode (a cube part, cube:vector 1:2, launched on the AI
    /// cores) rather than vector-only (launched on the vector cores).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::KernelSource;
    /// let mixes: Vec<_> = KernelSource::all().iter().filter(|k| k.mix()).map(|k| k.name()).collect();
    /// assert_eq!(mixes, ["all_gather_matmul", "matmul_reduce_scatter"]);
    /// ```
    pub fn mix(&self) -> bool {
        self.mode == LaunchMode::Mix
    }

    /// The source `aclrtc` compiles: the file with every `#include "<header>"` of the crate's
    /// headers replaced by the header's text (each header once; later includes of it become
    /// nothing, as `#pragma once` would have it).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::KernelSource;
    /// for k in KernelSource::all() {
    ///     let src = k.assemble();
    ///     assert!(src.contains("__aicore__ inline __gm__ T *symm_at("));
    ///     assert_eq!(src.matches("namespace dt {").count(), src.matches("}  // namespace dt").count());
    /// }
    /// ```
    pub fn assemble(&self) -> String {
        let mut included: Vec<&str> = Vec::new();
        let mut out = String::with_capacity(self.text.len() * 4);
        paste(self.text, &mut included, &mut out);
        out
    }

    /// The kernel's parameters in order, as `(name, type)`: `GM_ADDR` for device pointers,
    /// `int64_t` for scalars (read from the `extern "C"` signature).
    ///
    /// # Panics
    /// If the source has no `extern "C"` entry point named after the kernel (a defect of the
    /// crate's sources, caught by its tests).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::ascend::KernelSource;
    /// for k in KernelSource::all() {
    ///     let params = k.params();
    ///     assert!(params.iter().all(|(_, ty)| ty == "GM_ADDR" || ty == "int64_t"));
    ///     assert!(params.iter().any(|(name, _)| name == "timeout_cycles"));
    /// }
    /// ```
    #[track_caller]
    pub fn params(&self) -> Vec<(String, String)> {
        let head = format!("void {}(", self.name);
        let start = self.text.find(&head).unwrap_or_else(|| {
            panic!("{} has no entry point `{}`", self.file, head.trim_end_matches('('))
        }) + head.len();
        // The parameter list, comments dropped, up to the closing parenthesis.
        let mut list = String::new();
        for line in self.text[start..].lines() {
            let code = line.split("//").next().unwrap_or("");
            match code.find(')') {
                Some(end) => {
                    list.push_str(&code[..end]);
                    break;
                }
                None => {
                    list.push_str(code);
                    list.push(' ');
                }
            }
        }
        list.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (ty, name) = p.rsplit_once(' ').expect("a parameter has a type and a name");
                (name.trim().to_string(), ty.trim().to_string())
            })
            .collect()
    }
}

/// Copies `text` into `out`, pasting each crate header the first time it is included.
fn paste<'a>(text: &'a str, included: &mut Vec<&'a str>, out: &mut String) {
    for line in text.lines() {
        let header = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'))
            .and_then(|name| HEADERS.iter().find(|(h, _)| *h == name));
        match header {
            Some((name, body)) => {
                if !included.contains(name) {
                    included.push(name);
                    out.push_str(&format!("// ---- {name} (pasted by dist-tensor) ----\n"));
                    paste(body, included, out);
                    out.push_str(&format!("// ---- end of {name} ----\n"));
                }
            }
            None if line.trim() == "#pragma once" => {}
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

/// The type name a kernel is compiled for (`-DDT_ELEM=`): the NPU's types for f16, bf16 and
/// f32; f64 has no NPU kernel (the cube unit has no f64).
pub(crate) fn elem_type_name(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F16 => Ok("half"),
        DType::BF16 => Ok("bfloat16_t"),
        DType::F32 => Ok("float"),
        DType::F64 => Err(Error::DeviceUnavailable {
            op,
            device: "Ascend".into(),
            reason: "f64 has no NPU kernel: the AI cores' cube and vector units have no f64 \
                     arithmetic; run f64 on a host world (World::threads)"
                .into(),
        }),
    }
}

/// A block of `rows` x `cols` elements cut into tasks of whole rows of at most `col_step`
/// columns, at most `row_step` rows each, so that one task's rows (each rounded up to the
/// 32-byte granule the unified buffer lays rows out in) fit `budget` bytes. The kernels' `Chunk`
/// (`prelude.h`) decodes a task index the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TilePlan {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_step: usize,
    pub(crate) col_step: usize,
}

impl TilePlan {
    pub(crate) fn new(rows: usize, cols: usize, elem_bytes: usize, budget: usize) -> TilePlan {
        let max_cols = (budget / elem_bytes).max(1);
        let col_step = cols.clamp(1, max_cols);
        let pitch = (col_step * elem_bytes).div_ceil(32) * 32;
        let row_step = (budget / pitch).clamp(1, rows.max(1));
        TilePlan { rows, cols, row_step, col_step }
    }

    /// Tasks in the block (as the kernels' `chunk_count`).
    pub(crate) fn count(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return 0;
        }
        self.rows.div_ceil(self.row_step) * self.cols.div_ceil(self.col_step)
    }
}

/// The shape of a kernel's launch on a device of `aicore_num` AI cores with `sub_vec_num`
/// vector sub-cores each: mix kernels get one block per AI core, vector-only kernels one per
/// vector core. Counts come from the device, never constants.
pub(crate) fn blocks(source: &KernelSource, aicore_num: usize, sub_vec_num: usize) -> u32 {
    let blocks = if source.mix() { aicore_num } else { aicore_num * sub_vec_num };
    u32::try_from(blocks).expect("a device has fewer cores than u32::MAX")
}

/// Where each rank's part starts, and the total last (`numpy.cumsum` with a leading 0).
pub(crate) fn offsets(counts: &[usize]) -> Vec<usize> {
    crate::tensor::split_offsets(counts)
}

/// Counts as the kernels' `int64_t` table entries.
pub(crate) fn words(values: &[usize]) -> Vec<i64> {
    values.iter().map(|&v| i64::try_from(v).unwrap_or(i64::MAX)).collect()
}

/// The collectives' shared staging buffer (at least `bytes`) and `ready` signals, as the host
/// collectives share theirs: one of each per world, whatever the collective.
pub(crate) fn staging(
    npu: &AscendRank<'_>,
    op: &'static str,
    bytes: usize,
) -> Result<(crate::device::ascend::npu::Handle, crate::device::ascend::npu::Handle)> {
    let n = npu.rank.num_ranks();
    let staging = npu.symmetric(op, "collectives.staging", bytes)?;
    let ready = npu.signals("collectives", n)?;
    Ok((staging, ready))
}

/// The arguments every collective kernel takes first, in its order: its input and output, the
/// shared staging buffer and `ready` signals, its table (all but `broadcast`), the status record,
/// the rank and the world's size.
pub(crate) fn collective_args(
    npu: &AscendRank<'_>,
    source: &KernelSource,
    input: Handle,
    output: Handle,
    (staging, ready): (Handle, Handle),
    table: Option<Handle>,
) -> Result<KernelArgs> {
    let args = KernelArgs::new(source)
        .ptr("input", input)
        .ptr("output", output)
        .ptr("staging", staging)
        .ptr("ready", ready);
    let args = match table {
        Some(table) => args.ptr("table", table),
        None => args,
    };
    Ok(args
        .ptr("status", npu.status_ptr()?)
        .int("rank", npu.rank.rank())
        .int("num_ranks", npu.rank.num_ranks()))
}

/// Launches `source` and copies its `len` output elements back: the end of every launcher.
pub(crate) fn launch_and_fetch<T: Element>(
    npu: &AscendRank<'_>,
    op: &'static str,
    source: &KernelSource,
    args: KernelArgs,
    output: Handle,
    len: usize,
) -> Result<Vec<T>> {
    npu.launch::<T>(op, source, args)?;
    let out = npu.download::<T>(output, len)?;
    npu.took(PathTaken::Kernel(op));
    Ok(out)
}

/// Bytes of one of the `num_ranks + 2` slots the reductions carve the unified buffer into.
pub(crate) fn reduce_slot_bytes(num_ranks: usize) -> usize {
    ((UB_REDUCE_BYTES / (num_ranks + 2)) / 32 * 32).max(32)
}

/// Records that the ranks for which `publishers` holds publish in this call (every program of
/// a vector-only launch adds one to every peer's `ready`); returns, per rank, the count that
/// means its publication of this call is complete.
pub(crate) fn publish_counts(npu: &AscendRank<'_>, publishers: impl Fn(usize) -> bool) -> Vec<u64> {
    let topology = npu.rank.topology();
    let grid = blocks(&ALL_GATHER, topology.aicore_num(), topology.sub_vec_num()) as u64;
    npu.with_counts("collectives", npu.rank.num_ranks(), |counts| {
        for (p, count) in counts.iter_mut().enumerate() {
            if publishers(p) {
                *count += grid;
            }
        }
        counts.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ub_budgets_match_the_sources() {
        let prelude = HEADERS[0].1;
        assert!(prelude.contains(&format!("UB_TILE_BYTES = {} * 1024;", UB_TILE_BYTES / 1024)));
        assert!(prelude.contains(&format!("UB_REDUCE_BYTES = {} * 1024;", UB_REDUCE_BYTES / 1024)));
    }

    #[test]
    fn tile_plans_fit_the_budget_and_cover_the_block_once() {
        for (rows, cols, elem) in [(1, 1, 2), (7, 13, 4), (3, 100_000, 2), (1000, 3, 4), (0, 5, 2)]
        {
            let plan = TilePlan::new(rows, cols, elem, UB_TILE_BYTES);
            assert!(plan.row_step * (plan.col_step * elem).div_ceil(32) * 32 <= UB_TILE_BYTES);
            let per_row = cols.div_ceil(plan.col_step);
            let mut hits = vec![0u8; rows * cols];
            for t in 0..plan.count() {
                let (row, col) = ((t / per_row) * plan.row_step, (t % per_row) * plan.col_step);
                let r = plan.row_step.min(rows - row);
                let c = plan.col_step.min(cols - col);
                for i in row..row + r {
                    for j in col..col + c {
                        hits[i * cols + j] += 1;
                    }
                }
            }
            assert!(hits.iter().all(|&h| h == 1), "{rows} x {cols}");
        }
    }

    #[test]
    fn every_kernel_has_a_parsable_signature() {
        for k in ALL {
            let params = k.params();
            assert!(params.len() >= 5, "{}: {params:?}", k.name);
            assert_eq!(params.last().unwrap().0, "timeout_cycles");
        }
    }
}
