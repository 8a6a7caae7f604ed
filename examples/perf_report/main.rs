//! Prints the performance table: each fused op beside its unfused baseline and the roofline
//! limit of this machine (its measured peak f32 FLOP/s and memory bandwidth), with the CPU it ran
//! on. Every time is a median over interleaved runs (fused, then unfused, right after each other)
//! and every ratio is taken pair by pair, so that drift in the machine's speed cancels.
//!
//! Run: `cargo run --release --example perf_report [-- --quick] [--runs N] [--reps R] [--only TEXT]
//! [--processes]`
//!
//! `--processes` also runs every row with the ranks as processes of this program
//! (`World::local_job`, each process one rank running only that row), right after the threads,
//! and adds the processes' fused time and its ratio to the threads'.
//!
//! `--mpi` (feature `mpi`, with OpenMPI's mpirun) runs rows of its own instead: the fused ops
//! across fake nodes of this host beside the unfused baselines a user of MPI writes, with the
//! transport measured per path and a model fitted (see `mpi.rs`; `--quick`, `--shapes 4x1,4x2`).
//!
//! `--mesh` runs rows of its own instead: a training step on a 2 x 2 mesh beside tensor and data
//! parallelism over all 4 ranks, and the dp averaging the backward pass does not hide (see
//! `mesh.rs`; `--quick`, `--tokens N`).
//!
//! `--decode-model` decodes a Llama-shaped model of 250 M parameters built at random (see
//! `decode.rs`; `--quick` a smaller one) on 1, 2 and 4 ranks: ms/token at batch 1, tokens/s at
//! batch 16, each beside the memory-bandwidth floor.
//!
//! `--all-reduce` prints the latency of all_reduce per message size (1 KiB to 1 MiB), one-shot
//! and two-shot, on 2, 4 and 8 ranks (see `all_reduce.rs`; `--quick`).
//!
//! `--flash-decode` times the sequence-parallel flash-decode fused and unfused on 1, 2 and 4
//! ranks, beside the KV cache's bandwidth floor (see `flash_decode.rs`; `--quick`).
//!
//! `--moe` times an expert-parallel MoE block (dispatch, the experts' SwiGLU, combine) with the
//! fused dispatch and combine against their unfused baselines, balanced and skewed, beside the
//! experts alone (see `moe.rs`; `--quick`).
//!
//! Under the table it prints the host schedule each fused product took on rank 0 and why
//! (`fused::last_schedule`); the rows marked "forced" run the other choice through the call's
//! options, so that the cost of each choice is measured on this machine (`--only forced`).
//!
//! The limits are measured again right before each row, and each row's ratio to its roofline
//! uses those. `--runs N` repeats the whole report N times and prints one table over all of them:
//! medians, and the quartiles of the pair-by-pair ratios.

mod all_reduce;
mod decode;
mod flash_decode;
mod machine;
#[path = "../common/stats.rs"]
mod measure;
mod mesh;
mod moe;
mod mpi;

use std::time::Duration;

use dist_tensor::fused::{AgPath, RsPath};
use dist_tensor::{DType, DistTensor, Element, MatmulOptions, Placement, Result, Tensor, World};
use half::bf16;

use machine::{Cpu, Limits};
use measure::{Pair, Spread};

/// What bounds a row on this machine.
#[derive(Clone, Copy, Debug)]
enum Work {
    /// A product: f32 FLOPs on all cores, and the bytes that must come from memory (every operand
    /// read once by each rank that needs it, the output written once).
    Gemm { flops: f64, bytes: f64 },
    /// A copy of this many bytes (each read once and written once).
    Copy { bytes: f64 },
}

impl Work {
    /// The roofline limit in seconds, and what sets it.
    fn limit(self, l: &Limits) -> (f64, &'static str) {
        match self {
            Work::Gemm { flops, bytes } => {
                let (compute, memory) = (flops / l.flops_all, bytes / l.read_bw);
                if compute >= memory { (compute, "compute") } else { (memory, "memory") }
            }
            Work::Copy { bytes } => (l.copy_seconds(bytes), "copy"),
        }
    }
}

/// One row: a fused op and its unfused baseline on one shape, timed in pairs by `run(reps)`.
struct Case {
    op: &'static str,
    world: usize,
    dtype: DType,
    shape: String,
    work: Work,
    run: Box<dyn Fn(usize) -> Result<Ran>>,
}

/// A row's pairs (rank 0's), and the schedule its fused op took on rank 0
/// (`fused::last_schedule`), for the products.
type Ran = (Vec<Pair>, Option<String>);

/// Rank 0's pairs and schedule, from every rank's.
fn first(ran: Vec<Ran>) -> Ran {
    ran.into_iter().next().expect("rank 0")
}

/// The schedule the last fused product took on this rank, as the report prints it.
fn schedule(rank: &dist_tensor::Rank<'_>) -> Result<Option<String>> {
    Ok(dist_tensor::fused::last_schedule(rank)?.map(|s| s.to_string()))
}

fn gemm_work<T: Element>(world: usize, (m, k, n): (usize, usize, usize), gathered: bool) -> Work {
    let e = size_of::<T>() as f64;
    let (m, k, n, w) = (m as f64, k as f64, n as f64, world as f64);
    // all_gather_matmul: every rank reads all of x; matmul_reduce_scatter: x is read once.
    let x_reads = if gathered { w } else { 1.0 };
    Work::Gemm { flops: 2.0 * m * k * n, bytes: e * (x_reads * m * k + k * n + m * n) }
}

fn all_gather_matmul<T: Element>(world: usize, shape: (usize, usize, usize)) -> Case {
    all_gather_matmul_on::<T>(world, shape, None)
}

/// An all_gather_matmul row; with `path`, its fused side runs that host path (the other choice
/// of the schedule, measured against the same unfused baseline).
fn all_gather_matmul_on<T: Element>(
    world: usize,
    (m, k, n): (usize, usize, usize),
    path: Option<AgPath>,
) -> Case {
    let op = match path {
        None => "all_gather_matmul",
        Some(AgPath::Overlap) => "all_gather_matmul, overlap forced",
        Some(AgPath::Gather) => "all_gather_matmul, gather forced",
        Some(AgPath::Local) => "all_gather_matmul, local forced",
    };
    let opts =
        path.map_or_else(MatmulOptions::new, |p| MatmulOptions::new().all_gather_matmul_path(p));
    Case {
        op,
        world,
        dtype: T::DTYPE,
        shape: format!("M={m} K={k} N={n}"),
        work: gemm_work::<T>(world, (m, k, n), true),
        run: Box::new(move |reps| {
            let x = Tensor::<T>::random(&[m, k], 1);
            let w = Tensor::<T>::random(&[k, n], 2);
            let pairs = world_of(world)?.run(|rank| {
                let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
                let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?.into_local();
                let pairs = measure::pairs(
                    rank,
                    reps,
                    || x.all_gather_matmul_with(&[&w], &opts).map(drop),
                    || x.all_gather_matmul_unfused(&w).map(drop),
                )?;
                Ok((pairs, schedule(rank)?))
            })?;
            Ok(first(pairs))
        }),
    }
}

fn matmul_reduce_scatter<T: Element>(world: usize, shape: (usize, usize, usize)) -> Case {
    matmul_reduce_scatter_on::<T>(world, shape, None)
}

/// A matmul_reduce_scatter row; with `path`, its fused side runs that host path.
fn matmul_reduce_scatter_on<T: Element>(
    world: usize,
    (m, k, n): (usize, usize, usize),
    path: Option<RsPath>,
) -> Case {
    let op = match path {
        None => "matmul_reduce_scatter",
        Some(RsPath::Single) => "matmul_reduce_scatter, single forced",
        Some(RsPath::Chunked) => "matmul_reduce_scatter, chunked forced",
        Some(RsPath::Local) => "matmul_reduce_scatter, local forced",
    };
    let opts = path
        .map_or_else(MatmulOptions::new, |p| MatmulOptions::new().matmul_reduce_scatter_path(p));
    Case {
        op,
        world,
        dtype: T::DTYPE,
        shape: format!("M={m} K={k} N={n}"),
        work: gemm_work::<T>(world, (m, k, n), false),
        run: Box::new(move |reps| {
            let h = Tensor::<T>::random(&[m, k], 1);
            let w = Tensor::<T>::random(&[k, n], 2);
            let pairs = world_of(world)?.run(|rank| {
                let h = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
                let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?.into_local();
                let pairs = measure::pairs(
                    rank,
                    reps,
                    || h.matmul_reduce_scatter_with(&w, &opts).map(drop),
                    || h.matmul_reduce_scatter_unfused(&w).map(drop),
                )?;
                Ok((pairs, schedule(rank)?))
            })?;
            Ok(first(pairs))
        }),
    }
}

fn ulysses(world: usize, (b, s, h, d): (usize, usize, usize, usize)) -> Case {
    Case {
        op: "all_to_all (Ulysses)",
        world,
        dtype: DType::F32,
        shape: format!("B={b} S={s} H={h} D={d}"),
        work: Work::Copy { bytes: (b * s * h * d * size_of::<f32>()) as f64 },
        run: Box::new(move |reps| {
            let q = Tensor::<f32>::random(&[b, s, h, d], 1);
            let pairs = world_of(world)?.run(|rank| {
                let q = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
                let pairs = measure::pairs(
                    rank,
                    reps,
                    || q.all_to_all(2, 1).map(drop),
                    || q.all_to_all_unfused(2, 1).map(drop),
                )?;
                Ok((pairs, None))
            })?;
            Ok(first(pairs))
        }),
    }
}

/// One training step of a tensor-parallel MLP (`dist_tensor::nn::ParallelMlp`, `[M, E] -> [M, F]
/// -> [M, E]`: forward, mean squared error, backward, Adam) with its layers on the fused ops,
/// against the same step on the unfused baselines. The work is the step's six products: each
/// layer's forward product, input gradient and weight gradient.
fn train_step(world: usize, (m, e, f): (usize, usize, usize)) -> Case {
    let products = [
        gemm_work::<f32>(world, (m, e, f), true), // fc1 forward: all_gather_matmul
        gemm_work::<f32>(world, (m, f, e), false), // fc2 forward: matmul_reduce_scatter
        gemm_work::<f32>(world, (m, e, f), true), // fc2 input gradient: all_gather_matmul
        gemm_work::<f32>(world, (f, m, e), false), // fc2 weight gradient, local
        gemm_work::<f32>(world, (m, f, e), false), // fc1 input gradient: matmul_reduce_scatter
        gemm_work::<f32>(world, (e, m, f), false), // fc1 weight gradient, local
    ];
    let (flops, bytes) = products.iter().fold((0.0, 0.0), |(fl, by), w| match w {
        Work::Gemm { flops, bytes } => (fl + flops, by + bytes),
        Work::Copy { bytes } => (fl, by + bytes),
    });
    Case {
        op: "train step (MLP fwd+bwd+Adam)",
        world,
        dtype: DType::F32,
        shape: format!("M={m} E={e} F={f}"),
        work: Work::Gemm { flops, bytes },
        run: Box::new(move |reps| {
            use dist_tensor::nn::{Activation, Adam, Module, ParallelMlp, mse_loss};
            let x = Tensor::<f32>::random(&[m, e], 1);
            let target = Tensor::<f32>::random(&[m, e], 2);
            let pairs = world_of(world)?.run(|rank| {
                let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
                let ts = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
                let model = |fused| {
                    let mlp = ParallelMlp::<f32>::new(rank, e, f, Activation::Gelu, 3)?;
                    Ok::<_, dist_tensor::Error>((mlp.fused(fused), Adam::new(1e-4)))
                };
                let (mut fused, mut unfused) = (model(true)?, model(false)?);
                let step = |(mlp, adam): &mut (ParallelMlp<f32>, Adam<f32>)| -> Result<()> {
                    let (y, saved) = mlp.forward(&xs)?;
                    let (_, dy) = mse_loss(&y, &ts)?;
                    mlp.zero_grad();
                    mlp.backward(saved, &dy)?;
                    adam.step(mlp.parameters_mut())
                };
                let pairs = measure::pairs(rank, reps, || step(&mut fused), || step(&mut unfused))?;
                // The step's last fused product: the input gradient of its first layer.
                Ok((pairs, schedule(rank)?))
            })?;
            Ok(first(pairs))
        }),
    }
}

fn cases() -> Vec<Case> {
    let square = (2048, 2048, 2048);
    let decode = (16, 4096, 4096);
    let sequence = (1, 8192, 32, 128);
    vec![
        all_gather_matmul::<f32>(2, square),
        all_gather_matmul::<f32>(4, square),
        matmul_reduce_scatter::<f32>(2, square),
        matmul_reduce_scatter::<f32>(4, square),
        all_gather_matmul::<f32>(2, decode),
        all_gather_matmul::<f32>(4, decode),
        all_gather_matmul::<bf16>(2, square),
        ulysses(2, sequence),
        ulysses(4, sequence),
        train_step(2, (2048, 1024, 4096)),
        // The other choice of each host schedule, on the large rows and decode (`--only forced`).
        all_gather_matmul_on::<f32>(2, square, Some(AgPath::Overlap)),
        all_gather_matmul_on::<f32>(4, square, Some(AgPath::Overlap)),
        all_gather_matmul_on::<f32>(2, decode, Some(AgPath::Overlap)),
        all_gather_matmul_on::<f32>(4, decode, Some(AgPath::Overlap)),
        matmul_reduce_scatter_on::<f32>(2, square, Some(RsPath::Single)),
        matmul_reduce_scatter_on::<f32>(4, square, Some(RsPath::Single)),
    ]
}

/// The local product on one core, against one core's measured peak.
struct CoreGemm {
    seconds: Vec<f64>,
}

impl CoreGemm {
    fn measure((m, k, n): (usize, usize, usize), reps: usize) -> Result<CoreGemm> {
        let a = Tensor::<f32>::random(&[m, k], 1);
        // Weights larger than a few MiB come from memory: several copies, used in turn, so
        // that none is still in the last-level cache when it comes round again.
        let copies: usize = if k * n * 4 > (8 << 20) { 4 } else { 1 };
        let b: Vec<Tensor<f32>> =
            (0..copies).map(|c| Tensor::random(&[k, n], 2 + c as u64)).collect();
        // Enough calls per timing to last a few milliseconds.
        let calls = (2e7 / (2 * m * k * n) as f64).ceil().max(1.0) as usize;
        let mut failed = None;
        let mut turn = 0;
        let seconds = measure::times(reps, || {
            for _ in 0..calls {
                turn = (turn + 1) % copies;
                if let Err(e) = a.matmul_threads(&b[turn], 1) {
                    failed = Some(e);
                }
            }
        });
        let seconds = seconds.into_iter().map(|s| s / calls as f64).collect();
        failed.map_or(Ok(CoreGemm { seconds }), Err)
    }
}

/// The world a row runs on: this process's rank of a job when started as one (a row of
/// `--processes`), else `n` threads.
fn world_of(n: usize) -> Result<World> {
    if World::launched() { World::from_env() } else { World::threads(n) }
}

/// Runs row `i` with its ranks as processes of this program (`World::local_job`); returns rank
/// 0's fused median in seconds.
fn row_as_processes(case: &Case, i: usize, reps: usize, only: Option<&str>) -> Result<f64> {
    let mut args =
        vec!["--row".to_string(), (i + 1).to_string(), "--reps".into(), reps.to_string()];
    if let Some(only) = only {
        args.extend(["--only".to_string(), only.to_string()]);
    }
    let exits = World::local_job(case.world).args(args).timeout(Duration::from_secs(600)).run()?;
    if let Some(bad) = exits.iter().find(|e| !e.success()) {
        eprintln!("row {i}, rank {}: {}\n{}", bad.rank, bad.describe(), bad.stderr_text());
        std::process::exit(1);
    }
    let fused =
        exits[0].stdout_text().lines().find_map(|l| l.strip_prefix("ROW ")?.trim().parse().ok());
    Ok(fused.expect("rank 0 reports its row"))
}

struct Args {
    reps: usize,
    runs: usize,
    /// Only the rows whose op (or shape) contains this text.
    only: Option<String>,
    /// Also run every row with the ranks as processes of this program.
    processes: bool,
    /// In a process of `--processes`: the row to run.
    row: Option<usize>,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let quick = argv.iter().any(|a| a == "--quick");
    let value = |flag: &str| {
        argv.iter().position(|a| a == flag).map(|i| {
            argv.get(i + 1).and_then(|v| v.parse::<usize>().ok()).filter(|&v| v > 0).unwrap_or_else(
                || {
                    eprintln!("{flag} takes a positive number");
                    std::process::exit(2)
                },
            )
        })
    };
    Args {
        reps: value("--reps").unwrap_or(if quick { 3 } else { 9 }),
        runs: value("--runs").unwrap_or(1),
        only: argv.iter().position(|a| a == "--only").and_then(|i| argv.get(i + 1).cloned()),
        processes: argv.iter().any(|a| a == "--processes"),
        row: value("--row").map(|r| r - 1),
    }
}

fn main() -> Result<()> {
    if std::env::args().any(|a| a == "--mpi") {
        return mpi::main(std::env::args().any(|a| a == "--quick"));
    }
    if std::env::args().any(|a| a == "--mesh") {
        return mesh::main(std::env::args().any(|a| a == "--quick"));
    }
    if std::env::args().any(|a| a == "--all-reduce") {
        return all_reduce::main(std::env::args().any(|a| a == "--quick"));
    }
    if std::env::args().any(|a| a == "--flash-decode") {
        return flash_decode::main(std::env::args().any(|a| a == "--quick"));
    }
    if std::env::args().any(|a| a == "--moe") {
        return moe::main(std::env::args().any(|a| a == "--quick"));
    }
    if std::env::args().any(|a| a == "--decode-model") {
        return decode::main(std::env::args().any(|a| a == "--quick"));
    }
    let Args { reps, runs, only, processes, row } = args();
    let load_before = measure::load_1min();
    let cases: Vec<Case> = cases()
        .into_iter()
        .filter(|c| {
            only.as_ref().is_none_or(|o| c.op.contains(o.as_str()) || c.shape.contains(o.as_str()))
        })
        .collect();
    if World::launched() {
        // One rank of one row of `--processes`: it runs the row and reports its fused median
        // (the parent reads rank 0's, as a thread world reports rank 0's).
        let case = &cases[row.unwrap_or(0)];
        let (pairs, _) = (case.run)(reps)?;
        println!("ROW {}", Spread::of(pairs.iter().map(|p| p.fused)).median);
        return Ok(());
    }
    let mut limits = Vec::new();
    // Per case and run, with --processes: the fused median with the ranks as processes.
    let mut as_processes: Vec<Vec<f64>> = cases.iter().map(|_| Vec::new()).collect();
    // Per case: each run's limit (seconds) and pairs.
    let mut results: Vec<Vec<(f64, Vec<Pair>)>> = cases.iter().map(|_| Vec::new()).collect();
    // Per case: the schedule its fused op took on rank 0 in each run.
    let mut schedules: Vec<Vec<String>> = cases.iter().map(|_| Vec::new()).collect();
    // One core: a large product, and decode's per-rank product with its weight in L2, from
    // memory, and from memory with rows that are not a power of two apart (cache aliasing).
    let core_shapes = [(2048, 2048, 2048), (16, 256, 1024), (16, 4096, 2048), (16, 4096, 2304)];
    let mut core: Vec<Vec<f64>> = vec![Vec::new(); core_shapes.len()];
    for run in 0..runs {
        eprintln!("run {} of {runs}", run + 1);
        for (i, (case, out)) in cases.iter().zip(&mut results).enumerate() {
            eprintln!("  {} world {} {} {}", case.op, case.world, case.dtype, case.shape);
            // The limits right before each row: the machine is shared, its speed drifts.
            let l = Limits::measure();
            limits.push(l);
            // The buffer cache keeps what earlier rows gave back: a row's first calls evict it
            // (least recently used first), as in a program that moves from one op to another.
            let (pairs, ran) = (case.run)(reps)?;
            out.push((case.work.limit(&l).0, pairs));
            if let Some(ran) = ran {
                schedules[i].push(ran);
            }
            if processes {
                as_processes[i].push(row_as_processes(case, i, reps, only.as_deref())?);
            }
        }
        for (shape, out) in core_shapes.iter().zip(&mut core) {
            out.extend(CoreGemm::measure(*shape, reps)?.seconds);
        }
    }

    if limits.is_empty() {
        limits.push(Limits::measure()); // no rows chosen: the limits still head the report
    }
    let cpu = Cpu::read();
    let median_limit = |f: fn(&Limits) -> f64| Spread::of(limits.iter().map(f)).median;
    let l = Limits {
        flops_core: median_limit(|l| l.flops_core),
        flops_all: median_limit(|l| l.flops_all),
        clock_hz: median_limit(|l| l.clock_hz),
        read_bw_core: median_limit(|l| l.read_bw_core),
        read_bw: median_limit(|l| l.read_bw),
        copy_bw: median_limit(|l| l.copy_bw),
        stream_bw: median_limit(|l| l.stream_bw),
        isa: limits[0].isa,
    };
    println!("CPU: {}", cpu.describe());
    println!(
        "load average (1 min, {} cores): {load_before} before the report, {} after",
        measure::cores(),
        measure::load_1min()
    );
    println!("{} (medians of {} measurements, one before each row)", l.describe(), limits.len());
    println!(
        "{runs} run(s) of {reps} fused/unfused pairs per row; times are medians over all pairs; \
         ratios are taken pair by pair: median (quartiles)"
    );
    println!(
        "roofline: the larger of FLOPs / all-core peak and compulsory bytes / all-core read \
         bandwidth; for copies, bytes / the faster all-core copy (per rank the same: the ranks \
         split the work and the cores evenly)"
    );
    println!();
    let (extra_head, extra_rule) = if processes {
        (" fused ms, processes | processes/threads |", " --- | --- |")
    } else {
        ("", "")
    };
    println!(
        "| op | world | dtype | shape | fused ms | unfused ms | roofline ms (bound) | fused/unfused \
         | fused/roofline |{extra_head}"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |{extra_rule}");
    for ((case, runs), procs) in cases.iter().zip(&results).zip(&as_processes) {
        let all = || runs.iter().flat_map(|(_, pairs)| pairs.iter());
        let fused = Spread::of(all().map(|p| p.fused)).median;
        let unfused = Spread::of(all().map(|p| p.unfused)).median;
        let over_unfused = Spread::of(all().map(|p| p.fused / p.unfused));
        let over_limit = Spread::of(
            runs.iter().flat_map(|(lim, pairs)| pairs.iter().map(move |p| p.fused / lim)),
        );
        let limit = Spread::of(runs.iter().map(|(lim, _)| *lim)).median;
        let bound = case.work.limit(&l).1;
        let extra = if procs.is_empty() {
            String::new()
        } else {
            let p = Spread::of(procs.iter().copied()).median;
            format!(" {:.2} | {:.3} |", p * 1e3, p / fused)
        };
        println!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} ({bound}) | {} | {} |{extra}",
            case.op,
            case.world,
            case.dtype,
            case.shape,
            fused * 1e3,
            unfused * 1e3,
            limit * 1e3,
            over_unfused.ratio(),
            over_limit.ratio(),
        );
    }
    println!();
    let machine = dist_tensor::fused::HostMachine::get();
    println!(
        "Schedules (fused::last_schedule on rank 0; the host chooses from {} cores, a {:.1} GFLOP/s \
         one-core GEMM and a {:.1} GB/s one-core copy, measured once by this process):",
        machine.cores,
        machine.gemm_flops / 1e9,
        machine.copy_bytes / 1e9
    );
    for (case, ran) in cases.iter().zip(&schedules) {
        let mut distinct: Vec<&String> = ran.iter().collect();
        distinct.dedup();
        let what = if distinct.is_empty() {
            "one tiled copy kernel (no schedule to choose)".to_string()
        } else {
            distinct.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("; then ")
        };
        println!("- {} world {} {} {}: {what}", case.op, case.world, case.dtype, case.shape);
    }
    println!();
    println!(
        "| local matmul, one core, f32 | ms | GFLOP/s | of one core's peak | weight GB/s | of one \
         core's read |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (&(m, k, n), seconds) in core_shapes.iter().zip(&core) {
        let t = Spread::of(seconds.iter().copied()).median;
        let flops = 2.0 * (m * k * n) as f64;
        let weight_bw = (k * n * 4) as f64 / t;
        println!(
            "| M={m} K={k} N={n} | {:.3} | {:.1} | {:.3} | {:.1} | {:.3} |",
            t * 1e3,
            flops / t / 1e9,
            flops / t / l.flops_core,
            weight_bw / 1e9,
            weight_bw / l.read_bw_core,
        );
    }
    Ok(())
}
