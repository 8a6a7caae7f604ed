//! The GPU performance report: for each row of the anchor table (the shapes below), bf16, a world
//! of two GPUs: our fused op, our unfused baseline (NCCL, then cuBLASLt) and the one-GPU ceiling
//! (the local GEMM of the same per-GPU work; for the all_to_all, a device copy of the shard),
//! milliseconds, medians of CUDA-event timings after warm-up, each timed iteration started after
//! a device barrier. Inputs are random (never zeros: a GEMM on zeros runs faster).
//!
//! ```text
//! cargo run --release --features cuda --example gpu_report [-- --iters 20 --warmup 5 --stages]
//! ```
//!
//! The last column compares the fused op's output with the unfused one's (max |difference| over
//! max |value|; they round differently, so not zero for the products, zero for the all_to_all).
//! `--stages` adds timings that explain the fused times: the GEMM of one rank's rows (what the
//! chunked paths run per chunk), all_gather_matmul on its other path, and the NVLink bandwidth
//! of the all_to_all. Without two GPUs it says why and exits successfully.
//!
//! `--local` instead times the local ops of a GPU tensor on one GPU against the HBM roofline
//! (see `local.rs`); `--train` one training step of an MLP on one GPU (see `train.rs`); `--gemm`
//! every cuBLASLt candidate for that step's six products, timed under sustained load; `--add`
//! where a same-shape add's time goes (see `add.rs`).

use dist_tensor::device::cuda::{self, Timer};
mod add;
mod local;
#[path = "../common/stats.rs"]
mod stats;
mod train;

use dist_tensor::fused::AgPath;
use dist_tensor::{DistTensor, MatmulOptions, Placement, Rank, Result, Tensor, World};
use half::bf16;

#[derive(Default)]
pub(crate) struct Settings {
    warmup: usize,
    iters: usize,
    stages: bool,
    local: bool,
    train: bool,
    gemm: bool,
    add: bool,
}

fn settings() -> Settings {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    Settings {
        warmup: value("--warmup", 5),
        iters: value("--iters", 20),
        stages: args.iter().any(|a| a == "--stages"),
        local: args.iter().any(|a| a == "--local"),
        train: args.iter().any(|a| a == "--train"),
        gemm: args.iter().any(|a| a == "--gemm"),
        add: args.iter().any(|a| a == "--add"),
    }
}

/// A world of one rank on GPU 0, or `None` after saying why `flag`'s report is skipped.
pub(crate) fn one_gpu(flag: &str) -> Option<World> {
    World::cuda(&[0]).map_err(|e| println!("gpu_report {flag}: skipped, no GPU: {e}")).ok()
}

/// Median milliseconds of `op` on this rank's GPU: `warmup` untimed calls, then `iters` calls
/// each after a device barrier, timed by CUDA events around the call.
pub(crate) fn time<R>(
    rank: &Rank<'_>,
    s: &Settings,
    mut op: impl FnMut() -> Result<R>,
) -> Result<f64> {
    for _ in 0..s.warmup {
        op()?;
    }
    cuda::synchronize(rank)?;
    let mut timers = (0..s.iters).map(|_| Timer::new(rank)).collect::<Result<Vec<_>>>()?;
    for t in &mut timers {
        cuda::barrier(rank)?;
        t.start(rank)?;
        op()?;
        t.stop(rank)?;
    }
    cuda::synchronize(rank)?;
    let ms: Vec<f64> =
        timers.iter().map(|t| t.elapsed_ms().map(f64::from)).collect::<Result<_>>()?;
    Ok(stats::median(ms))
}

/// The slowest rank's median, for each measurement.
fn slowest(per_rank: Vec<Vec<f64>>) -> Vec<f64> {
    (0..per_rank[0].len()).map(|i| per_rank.iter().map(|r| r[i]).fold(0.0, f64::max)).collect()
}

struct Row {
    op: &'static str,
    shape: String,
    path: String,
    fused: f64,
    unfused: f64,
    ceiling: f64,
    /// max |fused - unfused| / max |unfused| over this rank's outputs (the slowest rank's).
    check: f64,
    stages: Vec<(String, f64)>,
}

/// max |a - b| / max |b|, on the host.
fn difference(a: &Tensor<bf16>, b: &Tensor<bf16>) -> Result<f64> {
    let (a, b) = (a.to_host()?, b.to_host()?);
    let scale = b.as_slice().iter().fold(0.0f64, |m, v| m.max(v.to_f64().abs()));
    let diff = a
        .as_slice()
        .iter()
        .zip(b.as_slice())
        .fold(0.0f64, |m, (x, y)| m.max((x.to_f64() - y.to_f64()).abs()));
    Ok(if scale == 0.0 { diff } else { diff / scale })
}

fn all_gather_matmul_row(world: &World, s: &Settings, m: usize, k: usize, n: usize) -> Result<Row> {
    let p = world.num_ranks();
    let rows = m / p;
    let path = cuda::all_gather_matmul_path(&vec![rows; p]);
    let other = if path == AgPath::Gather { AgPath::Overlap } else { AgPath::Gather };
    let times = world.run(|rank| {
        let seed = 10 * rank.rank() as u64;
        let x = DistTensor::from_local(
            rank,
            cuda::random::<bf16>(rank, &[rows, k], seed + 1)?,
            Placement::Shard(0),
        )?;
        let w = cuda::random::<bf16>(rank, &[k, n], seed + 2)?;
        let a = cuda::random::<bf16>(rank, &[m, k], seed + 3)?;
        let check =
            difference(x.all_gather_matmul(&w)?.local(), x.all_gather_matmul_unfused(&w)?.local())?;
        let mut t = vec![
            time(rank, s, || x.all_gather_matmul(&w))?,
            time(rank, s, || x.all_gather_matmul_unfused(&w))?,
            time(rank, s, || a.matmul(&w))?,
            check,
        ];
        if s.stages {
            t.push(time(rank, s, || x.local().matmul(&w))?);
            // The other path, through the call's options (every rank asks for the same).
            let opts = MatmulOptions::new().all_gather_matmul_path(other);
            t.push(time(rank, s, || x.all_gather_matmul_with(&[&w], &opts))?);
        }
        Ok(t)
    })?;
    let t = slowest(times);
    Ok(Row {
        op: "all_gather_matmul",
        shape: format!("M={m} K={k} N_local={n}"),
        path: path.to_string(),
        fused: t[0],
        unfused: t[1],
        ceiling: t[2],
        check: t[3],
        stages: if s.stages {
            vec![
                (format!("GEMM of one rank's {rows} rows"), t[4]),
                (format!("fused, {other} path"), t[5]),
            ]
        } else {
            vec![]
        },
    })
}

fn matmul_reduce_scatter_row(
    world: &World,
    s: &Settings,
    m: usize,
    k: usize,
    n: usize,
) -> Result<Row> {
    let p = world.num_ranks();
    let times = world.run(|rank| {
        let seed = 10 * rank.rank() as u64;
        let h = DistTensor::from_local(
            rank,
            cuda::random::<bf16>(rank, &[m, k], seed + 1)?,
            Placement::Shard(1),
        )?;
        let w = cuda::random::<bf16>(rank, &[k, n], seed + 2)?;
        let check = difference(
            h.matmul_reduce_scatter(&w)?.local(),
            h.matmul_reduce_scatter_unfused(&w)?.local(),
        )?;
        let mut t = vec![
            time(rank, s, || h.matmul_reduce_scatter(&w))?,
            time(rank, s, || h.matmul_reduce_scatter_unfused(&w))?,
            time(rank, s, || h.local().matmul(&w))?,
            check,
        ];
        if s.stages {
            let part = cuda::random::<bf16>(rank, &[m / p, k], seed + 3)?;
            t.push(time(rank, s, || part.matmul(&w))?);
        }
        Ok(t)
    })?;
    let t = slowest(times);
    Ok(Row {
        op: "matmul_reduce_scatter",
        shape: format!("M={m} K_local={k} N={n}"),
        path: cuda::matmul_reduce_scatter_path(&vec![m / p; p]).to_string(),
        fused: t[0],
        unfused: t[1],
        ceiling: t[2],
        check: t[3],
        stages: t
            .get(4)
            .map(|&v| vec![(format!("GEMM of one rank's {} rows", m / p), v)])
            .unwrap_or_default(),
    })
}

fn all_to_all_row(
    world: &World,
    s: &Settings,
    b: usize,
    seq: usize,
    h: usize,
    d: usize,
) -> Result<Row> {
    let p = world.num_ranks();
    let times = world.run(|rank| {
        let x = cuda::random::<bf16>(rank, &[b, seq / p, h, d], 7 + rank.rank() as u64)?;
        let x = DistTensor::from_local(rank, x, Placement::Shard(1))?;
        let check = difference(x.all_to_all(2, 1)?.local(), x.all_to_all_unfused(2, 1)?.local())?;
        Ok(vec![
            time(rank, s, || x.all_to_all(2, 1))?,
            time(rank, s, || x.all_to_all_unfused(2, 1))?,
            time(rank, s, || cuda::device_copy(rank, x.local()))?,
            check,
        ])
    })?;
    let t = slowest(times);
    // Bytes each GPU receives over NVLink.
    let remote = (b * seq * h * d * 2) as f64 * (p - 1) as f64 / (p * p) as f64;
    Ok(Row {
        op: "Ulysses all_to_all",
        shape: format!("B={b} S={seq} H={h} D={d}"),
        path: "pull kernel".to_string(),
        fused: t[0],
        unfused: t[1],
        ceiling: t[2],
        check: t[3],
        stages: vec![(
            format!(
                "NVLink in: {:.0} MiB at {:.0} GB/s",
                remote / (1 << 20) as f64,
                remote / (t[0] * 1e-3) / 1e9
            ),
            t[0],
        )],
    })
}

fn main() -> Result<()> {
    let s = settings();
    if s.local {
        return local::report(&s);
    }
    if s.train {
        return train::report(&s);
    }
    if s.gemm {
        return train::candidates();
    }
    if s.add {
        return add::report();
    }
    let world = match World::cuda(&[0, 1]) {
        Ok(w) => w,
        Err(e) => {
            println!("gpu_report: skipped, no world of two GPUs: {e}");
            return Ok(());
        }
    };
    let info = world.run(cuda::gpu_info)?;
    println!(
        "# gpu_report: {} x {} ({} SMs, sm_{}{}), bf16, world 2, ms (median of {} after {} warm-up)",
        info.len(),
        info[0].name,
        info[0].multiprocessors,
        info[0].compute_capability.0,
        info[0].compute_capability.1,
        s.iters,
        s.warmup
    );
    let mut rows = Vec::new();
    for (m, k, n) in
        [(8192, 8192, 14336), (4096, 12288, 24576), (16384, 8192, 4096), (256, 8192, 14336)]
    {
        rows.push(all_gather_matmul_row(&world, &s, m, k, n)?);
    }
    for (m, k, n) in
        [(8192, 14336, 8192), (4096, 24576, 12288), (16384, 4096, 8192), (256, 14336, 8192)]
    {
        rows.push(matmul_reduce_scatter_row(&world, &s, m, k, n)?);
    }
    for (b, seq, h, d) in [(1, 32768, 32, 128), (4, 8192, 64, 128)] {
        rows.push(all_to_all_row(&world, &s, b, seq, h, d)?);
    }
    println!();
    println!(
        "| op | shape | path | ours fused | ours unfused (NCCL + cuBLASLt) | ceiling | fused / ceiling | fused / unfused | max diff fused vs unfused |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1e} |",
            r.op,
            r.shape,
            r.path,
            r.fused,
            r.unfused,
            r.ceiling,
            r.fused / r.ceiling,
            r.fused / r.unfused,
            r.check
        );
    }
    if s.stages {
        println!();
        println!("| op | shape | stage | ms |");
        println!("| --- | --- | --- | --- |");
        for r in &rows {
            for (what, ms) in &r.stages {
                println!("| {} | {} | {what} | {ms:.3} |", r.op, r.shape);
            }
        }
    }
    Ok(())
}
