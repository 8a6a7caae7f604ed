//! How the host runs a fused product, chosen per call from the machine: overlapping the
//! communication with the product's tiles (the tile kernel), or the unfused shape (one collective,
//! then one GEMM over all rows on the rank's computing cores). The paths are the GPUs' enums
//! ([`AgPath`], [`RsPath`]); a call's options may ask for one
//! ([`MatmulOptions`](crate::MatmulOptions)), else [`all_gather_matmul_path`] picks it from this
//! process's [`HostMachine`] figures.
//!
//! # How the host shares its cores
//! A host world gives each rank `cores / ranks` AI cores (at least one, [`Topology::host_default`]),
//! each with two vector sub-cores; a mix kernel computes on one sub-core per AI core and
//! communicates on the other, so the computing threads of all ranks together fill the cores, and
//! the communicating threads are extra threads on the same cores: when they copy while the tiles
//! compute, the operating system time-slices them with the GEMM. Overlap then hides nothing (the
//! copy takes its time from the GEMM's cores) and the per-shard tiles still cost their packing,
//! so the fused op is slower than the unfused shape. Overlap pays only where the communicating
//! threads have cores of their own: more cores than computing threads (a world whose size does
//! not divide the cores, or a topology of fewer AI cores).
//!
//! `matmul_reduce_scatter`'s tile kernel starts its reduction only once the products for the
//! rank's rows are done (they are computed last), on lanes that were waiting: its communication
//! never runs beside its GEMM, and it reads the peers' partials in place, where the unfused
//! collective first copies them. It stays the default on every machine.
//!
//! The ranks agree on the path: each sends its machine figures in the op's agreement exchange and
//! every rank decides from rank 0's, so processes that measured slightly different figures still
//! take the same path. [`last_schedule`] says which path a rank's last fused product took and why.
//!
//! [`Topology::host_default`]: crate::device::Topology::host_default

use std::sync::OnceLock;
use std::time::Instant;

use super::plan::BLOCK_ROWS;
use crate::Result;
use crate::device::path::{AgPath, RsPath};
use crate::shmem::{Rank, Workspace};

/// Of a product's GEMM time, what its per-shard tiles cost beyond one GEMM over all rows (the
/// weight packed once per tile instead of once per block of the whole product, and the shorter
/// calls): overlap is worth it only when it hides more communication than this. Where the copies
/// had no core of their own (nothing hidden), issue 33's quiet Zen 4 run measured the tile kernel
/// at 1.075 to 1.079 of the unfused op (`perf_report`, world 2, 2048-cubed, f32 and bf16).
pub const TILE_COST: f64 = 0.08;

/// This process's machine, as the schedule sees it: its cores, the rate of one core's f32 GEMM
/// and of one core's copy, measured once per process (a few milliseconds) on the first fused
/// product that needs them.
///
/// # Examples
/// ```
/// use dist_tensor::fused::HostMachine;
/// let m = HostMachine::get();
/// assert!(m.cores >= 1 && m.gemm_flops > 0.0 && m.copy_bytes > 0.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostMachine {
    /// Cores this process may run on.
    pub cores: usize,
    /// f32 FLOP/s of one core's GEMM (a product that fits the cache: the kernel's rate).
    pub gemm_flops: f64,
    /// Bytes a second one core copies (read once, written once) out of the last-level cache.
    pub copy_bytes: f64,
}

impl HostMachine {
    /// The figures, measured on the first call of the process.
    pub fn get() -> HostMachine {
        static MACHINE: OnceLock<HostMachine> = OnceLock::new();
        *MACHINE.get_or_init(HostMachine::measure)
    }

    fn measure() -> HostMachine {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // The best of a few trials: a busy machine only makes a trial slower.
        let best = |trial: &mut dyn FnMut() -> f64| (0..3).map(|_| trial()).fold(0.0, f64::max);
        let (m, k, n) = (96, 256, 256);
        let a = ndarray::Array2::<f32>::from_elem((m, k), 0.5);
        let b = ndarray::Array2::<f32>::from_elem((k, n), 0.25);
        let mut c = ndarray::Array2::<f32>::zeros((m, n));
        let gemm_flops = best(&mut || {
            let start = Instant::now();
            for _ in 0..4 {
                let _ = crate::tensor::matmul_into(c.view_mut(), a.view(), b.view(), false, 1);
            }
            (8 * m * k * n) as f64 / start.elapsed().as_secs_f64().max(1e-9)
        });
        // 16 MiB each way: past a core's caches on the machines this runs on.
        let words = 4 << 20;
        let src = vec![1.0f32; words];
        let mut dst = vec![0.0f32; words];
        let copy_bytes = best(&mut || {
            let start = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            (words * 4) as f64 / start.elapsed().as_secs_f64().max(1e-9)
        });
        HostMachine { cores, gemm_flops, copy_bytes }
    }

    /// The figures as agreement words (whole MFLOP/s and MB/s).
    pub(crate) fn words(&self) -> [u64; 3] {
        [self.cores as u64, (self.gemm_flops / 1e6) as u64, (self.copy_bytes / 1e6) as u64]
    }

    /// The figures back from agreement words.
    pub(crate) fn from_words(w: &[u64]) -> HostMachine {
        HostMachine {
            cores: (w[0] as usize).max(1),
            gemm_flops: (w[1] as f64 * 1e6).max(1.0),
            copy_bytes: (w[2] as f64 * 1e6).max(1.0),
        }
    }
}

/// What an `all_gather_matmul` call looks like to the schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct AgShape<'a> {
    /// Rows of each rank.
    pub rows: &'a [usize],
    /// Columns of x.
    pub k: usize,
    /// Columns of this rank's weights, all together.
    pub n: usize,
    /// Bytes of one gathered element (the accumulator type's).
    pub elem_bytes: usize,
    /// The rank choosing.
    pub rank: usize,
    /// Ranks sharing this host's cores.
    pub ranks_here: usize,
    /// Computing threads of each rank.
    pub compute_lanes: usize,
    /// Communicating threads of each rank that run beside the computing ones.
    pub comm_lanes: usize,
    /// Shards this short or shorter make the kernel tile over all gathered rows.
    pub min_shard_rows: usize,
}

/// The path `all_gather_matmul` takes on the host for `shape` on `machine`, and why.
///
/// One rank: [`AgPath::Local`]. Where the ranks' computing threads fill the cores, whatever the
/// shape: [`AgPath::Gather`], the collective, then one GEMM over all rows (the unfused code).
/// Otherwise, shards shorter than the kernel's per-shard tiles (decoding): [`AgPath::Overlap`],
/// the tile kernel, which then gathers every row and tiles over all of them in one launch (the
/// unfused shape without a second launch); longer shards: [`AgPath::Overlap`] only when the
/// copies it hides take longer than the tiles cost ([`TILE_COST`] of the GEMM), else
/// [`AgPath::Gather`].
///
/// Decoding takes the same rule as long shards, so that where the cores are full the fused op is
/// the unfused code: on 2 cores (Zen 4, 2 and 4 ranks) the one-launch kernel and the unfused op
/// run level (perf_report's decode rows with the other choice forced: 1.005 and 0.994), the
/// same product kernel behind both.
///
/// # Examples
/// ```
/// use dist_tensor::fused::{AgPath, AgShape, HostMachine, all_gather_matmul_path};
/// let machine = HostMachine { cores: 2, gemm_flops: 100e9, copy_bytes: 10e9 };
/// let shape = AgShape {
///     rows: &[1024, 1024], k: 2048, n: 1024, elem_bytes: 4, rank: 0,
///     ranks_here: 2, compute_lanes: 1, comm_lanes: 1, min_shard_rows: 256,
/// };
/// // Two ranks' computing threads fill both cores: the copies would take the GEMM's time.
/// assert_eq!(all_gather_matmul_path(&machine, &shape).0, AgPath::Gather);
/// // With 8 cores the copies have cores of their own, and hide more than the tiles cost.
/// let big = HostMachine { cores: 8, copy_bytes: 1e9, ..machine };
/// assert_eq!(all_gather_matmul_path(&big, &shape).0, AgPath::Overlap);
/// // Decoding (8 rows a rank): the unfused code where the cores are full, one launch elsewhere.
/// let decode = AgShape { rows: &[8, 8], k: 4096, n: 2048, ..shape.clone() };
/// assert_eq!(all_gather_matmul_path(&machine, &decode).0, AgPath::Gather);
/// assert_eq!(all_gather_matmul_path(&big, &decode).0, AgPath::Overlap);
/// ```
pub fn all_gather_matmul_path(machine: &HostMachine, shape: &AgShape<'_>) -> (AgPath, String) {
    let ranks = shape.rows.len();
    if ranks <= 1 {
        return (AgPath::Local, "one rank: one GEMM".into());
    }
    let total: usize = shape.rows.iter().sum();
    let mine = shape.rows[shape.rank];
    let compute = shape.ranks_here * shape.compute_lanes;
    let spare = machine.cores.saturating_sub(compute);
    let gemm = 2.0 * (total * shape.k * shape.n) as f64
        / (machine.gemm_flops * shape.compute_lanes.min(machine.cores).max(1) as f64);
    let comm = ((total - mine) * shape.k * shape.elem_bytes) as f64 / machine.copy_bytes;
    let ms = |s: f64| s * 1e3;
    if spare < shape.ranks_here * shape.comm_lanes {
        return (
            AgPath::Gather,
            format!(
                "{} ranks x {} computing threads on {} cores leave no core for the copies \
                 ({:.2} ms would share the GEMM's {:.1} ms)",
                shape.ranks_here,
                shape.compute_lanes,
                machine.cores,
                ms(comm),
                ms(gemm)
            ),
        );
    }
    if shape.rows.iter().any(|&m| m > 0 && m < shape.min_shard_rows) {
        return (
            AgPath::Overlap,
            format!(
                "shards under {} rows on spare cores: the kernel gathers every row and tiles \
                 over all of them, one launch",
                shape.min_shard_rows
            ),
        );
    }
    if comm > TILE_COST * gemm {
        (
            AgPath::Overlap,
            format!(
                "copies on spare cores hide {:.2} ms, more than the tiles cost ({:.2} ms of a \
                 {:.1} ms GEMM)",
                ms(comm),
                ms(TILE_COST * gemm),
                ms(gemm)
            ),
        )
    } else {
        (
            AgPath::Gather,
            format!(
                "copies of {:.2} ms would hide less than the tiles cost ({:.2} ms of a {:.1} ms \
                 GEMM)",
                ms(comm),
                ms(TILE_COST * gemm),
                ms(gemm)
            ),
        )
    }
}

/// The path `matmul_reduce_scatter` takes on the host for `ranks` ranks, and why: one rank,
/// [`RsPath::Local`]; otherwise [`RsPath::Chunked`], the tile kernel, whose reduction never runs
/// beside its GEMM (see the module docs).
///
/// # Examples
/// ```
/// use dist_tensor::fused::{RsPath, matmul_reduce_scatter_path};
/// assert_eq!(matmul_reduce_scatter_path(1).0, RsPath::Local);
/// assert_eq!(matmul_reduce_scatter_path(4).0, RsPath::Chunked);
/// ```
pub fn matmul_reduce_scatter_path(ranks: usize) -> (RsPath, String) {
    if ranks <= 1 {
        (RsPath::Local, "one rank: one GEMM".into())
    } else {
        (
            RsPath::Chunked,
            "the reduction starts after the GEMM, on waiting lanes, and reads partials in place"
                .into(),
        )
    }
}

/// [`matmul_reduce_scatter_path`] on the host for a product of `m` rows, `transposed` when some
/// rank's weight is a transposed (column-major) view, as in a backward pass: then one GEMM and
/// the reduce-scatter ([`RsPath::Single`]) where the product has more rows than one tile. The
/// tiles of [`RsPath::Chunked`] pack each block of such a weight once per block of rows (or copy
/// it into row-major order first), which cost more than the overlap of the reduction saved: on a
/// 2-core Intel Xeon the chunked form ran 1.04 to 1.12 of the unfused form at world 2, the copy
/// alone 5 ms of a 60 ms product (a `[2048, 2048] x [2048, 1024]` f32 one).
pub(crate) fn host_rs_path(ranks: usize, m: usize, transposed: bool) -> (RsPath, String) {
    if ranks > 1 && transposed && m > BLOCK_ROWS {
        return (
            RsPath::Single,
            format!(
                "a transposed weight and {m} rows: one GEMM packs each block of it once, where \
                 tiles of {BLOCK_ROWS} rows would pack it once per block of rows"
            ),
        );
    }
    matmul_reduce_scatter_path(ranks)
}

/// Which path a fused product took on a rank, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathTaken {
    /// An `all_gather_matmul`'s path.
    AllGatherMatmul(AgPath),
    /// A `matmul_reduce_scatter`'s path.
    MatmulReduceScatter(RsPath),
}

/// A fused product's schedule on the host: the path, and why it was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// The path that ran.
    pub path: PathTaken,
    /// Why: "asked for by the call's options", or the machine's reason.
    pub why: String,
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.path {
            PathTaken::AllGatherMatmul(p) => write!(f, "{p}: {}", self.why),
            PathTaken::MatmulReduceScatter(p) => write!(f, "{p}: {}", self.why),
        }
    }
}

/// The last schedule of a rank, kept as a workspace of its own (no symmetric memory).
#[derive(Default)]
struct LastSchedule(Option<Schedule>);

impl Workspace for LastSchedule {
    fn symmetric_bytes(&self) -> usize {
        0
    }
}

pub(crate) fn record(rank: &Rank<'_>, schedule: Schedule) -> Result<()> {
    rank.with_workspace(
        |_| Ok(LastSchedule::default()),
        |last| {
            last.0 = Some(schedule);
            Ok(())
        },
    )
}

/// The schedule of the last `all_gather_matmul` or `matmul_reduce_scatter` this rank ran on the
/// host (its fused form; the unfused baselines record none), or `None` before any.
///
/// # Errors
/// As [`Rank::with_workspace`]: when called while a collective of this rank is in progress.
///
/// # Examples
/// ```
/// use dist_tensor::fused::{AgPath, PathTaken, all_gather_matmul, last_schedule};
/// use dist_tensor::World;
/// use ndarray::array;
/// let paths = World::threads(1)?.run(|rank| {
///     all_gather_matmul(rank, array![[1.0f32]].view(), &[array![[2.0f32]].view()])?;
///     Ok(last_schedule(rank)?.map(|s| s.path))
/// })?;
/// assert_eq!(paths[0], Some(PathTaken::AllGatherMatmul(AgPath::Local)));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn last_schedule(rank: &Rank<'_>) -> Result<Option<Schedule>> {
    rank.with_workspace(|_| Ok(LastSchedule::default()), |last| Ok(last.0.clone()))
}

/// The problem of a call whose options ask the host for the one-rank path (`Local`) in a world
/// of several ranks: it travels in the op's agreement exchange, so that every rank fails together
/// with [`Error::InvalidArgument`](crate::Error::InvalidArgument) and the world stays usable.
pub(crate) fn local_problem(rank: &Rank<'_>, local_asked: bool) -> Option<String> {
    let host = matches!(rank.device_world(), crate::device::DeviceWorld::Host);
    (host && local_asked && rank.num_ranks() > 1).then(|| {
        format!(
            "the call's options ask for the local path, which runs one rank only; this world has \
             {} ranks",
            rank.num_ranks()
        )
    })
}
