//! Prints the performance table: each fused op beside its unfused baseline and the machine's
//! ceiling (the `gemm` crate on the same total work with all cores, or memcpy of the same bytes
//! split over all cores), medians of several runs, all measured in this one process.
//!
//! Run: `cargo run --release --example perf_report [-- --quick] [--processes]`
//!
//! `--processes` measures every row twice, one right after the other: with the ranks as threads
//! (as without it), then as processes of this program (`World::local_job`, each process one rank
//! running only that row), and adds the processes' fused time and the ratio of the two.

use std::time::{Duration, Instant};

use dist_tensor::{DType, DistTensor, Element, Placement, Rank, Result, Tensor, World};
use half::bf16;
use rayon::prelude::*;

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Medians of one case: times, and ratios taken run by run (the machine is shared and noisy;
/// a ratio of two runs made one right after the other is steadier than a ratio of medians).
struct Measured {
    fused: Duration,
    unfused: Duration,
    fused_over_unfused: f64,
    fused_over_ceiling: f64,
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs fused, unfused and the ceiling one after the other, `reps` times: fused and unfused on
/// every rank, started together (a barrier) and ended when all are done (another); the ceiling
/// on rank 0 alone while the other ranks wait, blocked, at a barrier.
fn measure(
    rank: &Rank<'_>,
    reps: usize,
    mut fused: impl FnMut() -> Result<()>,
    mut unfused: impl FnMut() -> Result<()>,
    mut ceiling: impl FnMut(),
) -> Result<Measured> {
    let timed = |op: &mut dyn FnMut() -> Result<()>| -> Result<Duration> {
        let _ = rank.barrier_all()?;
        let start = Instant::now();
        op()?;
        let _ = rank.barrier_all()?;
        Ok(start.elapsed())
    };
    timed(&mut fused)?; // warm: workspaces sized, buffers cached, pages touched
    timed(&mut unfused)?;
    let mut ceiling_run = || {
        if rank.rank() == 0 {
            ceiling();
        }
        Ok(())
    };
    timed(&mut ceiling_run)?;
    let (mut f, mut u, mut fu, mut fc) = (vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        let tf = timed(&mut fused)?;
        let tu = timed(&mut unfused)?;
        let tc = timed(&mut ceiling_run)?;
        fu.push(tf.as_secs_f64() / tu.as_secs_f64());
        fc.push(tf.as_secs_f64() / tc.as_secs_f64());
        f.push(tf);
        u.push(tu);
    }
    Ok(Measured {
        fused: median(f),
        unfused: median(u),
        fused_over_unfused: median_f64(fu),
        fused_over_ceiling: median_f64(fc),
    })
}

/// The world a row runs on: this process's rank of a job when started as one (a row of
/// `--processes`), else `n` threads.
fn world_of(n: usize) -> Result<World> {
    if World::launched() { World::from_env() } else { World::threads(n) }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |t| t.get())
}

/// The `gemm` crate on `[m, k] x [k, n]` in f32 with every core, into a reused output.
fn gemm_ceiling(m: usize, k: usize, n: usize) -> impl FnMut() {
    let a = Tensor::<f32>::random(&[m, k], 1);
    let b = Tensor::<f32>::random(&[k, n], 2);
    let mut c = vec![0.0f32; m * n];
    move || {
        // SAFETY: row-major operands of the stated shapes; `c` is a separate m x n buffer.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_slice().as_ptr(),
                1,
                k as isize,
                b.as_slice().as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(cores()),
            )
        }
    }
}

/// Copying `bytes` once, split over every core.
fn memcpy_ceiling(bytes: usize) -> impl FnMut() {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(cores()).max(1);
    move || {
        dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s))
    }
}

struct Row {
    op: &'static str,
    world: usize,
    dtype: DType,
    shape: String,
    measured: Measured,
    ceiling_name: &'static str,
}

fn all_gather_matmul<T: Element>(
    world: usize,
    (m, k, n): (usize, usize, usize),
    reps: usize,
) -> Result<Row> {
    let x = Tensor::<T>::random(&[m, k], 1);
    let w = Tensor::<T>::random(&[k, n], 2);
    let times = world_of(world)?.run(|rank| {
        let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?.into_local();
        measure(
            rank,
            reps,
            || x.all_gather_matmul(&w).map(drop),
            || x.all_gather_matmul_unfused(&w).map(drop),
            gemm_ceiling(m, k, n),
        )
    })?;
    Ok(Row {
        op: "all_gather_matmul",
        world,
        dtype: T::DTYPE,
        shape: format!("M={m} K={k} N={n}"),
        measured: times.into_iter().next().expect("rank 0"),
        ceiling_name: "gemm f32",
    })
}

fn matmul_reduce_scatter<T: Element>(
    world: usize,
    (m, k, n): (usize, usize, usize),
    reps: usize,
) -> Result<Row> {
    let h = Tensor::<T>::random(&[m, k], 1);
    let w = Tensor::<T>::random(&[k, n], 2);
    let times = world_of(world)?.run(|rank| {
        let h = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
        let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?.into_local();
        measure(
            rank,
            reps,
            || h.matmul_reduce_scatter(&w).map(drop),
            || h.matmul_reduce_scatter_unfused(&w).map(drop),
            gemm_ceiling(m, k, n),
        )
    })?;
    Ok(Row {
        op: "matmul_reduce_scatter",
        world,
        dtype: T::DTYPE,
        shape: format!("M={m} K={k} N={n}"),
        measured: times.into_iter().next().expect("rank 0"),
        ceiling_name: "gemm f32",
    })
}

fn ulysses(world: usize, (b, s, h, d): (usize, usize, usize, usize), reps: usize) -> Result<Row> {
    let q = Tensor::<f32>::random(&[b, s, h, d], 1);
    let times = world_of(world)?.run(|rank| {
        let q = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
        measure(
            rank,
            reps,
            || q.all_to_all(2, 1).map(drop),
            || q.all_to_all_unfused(2, 1).map(drop),
            memcpy_ceiling(b * s * h * d * size_of::<f32>()),
        )
    })?;
    Ok(Row {
        op: "all_to_all (Ulysses)",
        world,
        dtype: DType::F32,
        shape: format!("B={b} S={s} H={h} D={d}"),
        measured: times.into_iter().next().expect("rank 0"),
        ceiling_name: "memcpy",
    })
}

/// One training step of a tensor-parallel MLP (`dist_tensor::nn::ParallelMlp`: forward, mean
/// squared error, backward, Adam), the layers on the fused ops against the same layers on the
/// unfused baselines; the ceiling is the `gemm` crate on the step's six products (forward, input
/// gradient and weight gradient of each layer, each `2 M E F` FLOP) with every core.
fn train_step(world: usize, (m, e, f): (usize, usize, usize), reps: usize) -> Result<Row> {
    use dist_tensor::nn::{Activation, Adam, ParallelMlp, Parameters, mse_loss};
    let x = Tensor::<f32>::random(&[m, e], 1);
    let target = Tensor::<f32>::random(&[m, e], 2);
    let times = world_of(world)?.run(|rank| {
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let ts = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
        let model = |fused| {
            ParallelMlp::<f32>::new(rank, e, f, Activation::Gelu, 3).map(|m| m.fused(fused))
        };
        let (mut fused, mut unfused) =
            ((model(true)?, Adam::new(1e-4)), (model(false)?, Adam::new(1e-4)));
        let step = |(mlp, adam): &mut (ParallelMlp<f32>, Adam<f32>)| -> Result<()> {
            let (y, saved) = mlp.forward(&xs)?;
            let (_, dy) = mse_loss(&y, &ts)?;
            mlp.zero_grad();
            mlp.backward(saved, &dy)?;
            adam.step(mlp.parameters_mut())
        };
        let mut products = gemm_ceiling(m, e, f);
        measure(
            rank,
            reps,
            || step(&mut fused),
            || step(&mut unfused),
            || (0..6).for_each(|_| products()),
        )
    })?;
    Ok(Row {
        op: "train step (MLP fwd+bwd+Adam)",
        world,
        dtype: DType::F32,
        shape: format!("M={m} E={e} F={f}"),
        measured: times.into_iter().next().expect("rank 0"),
        ceiling_name: "gemm f32, 6 products",
    })
}

/// The value after `flag` in the arguments.
fn arg_value(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let processes = std::env::args().any(|a| a == "--processes");
    let reps = if quick { 3 } else { 9 };
    let square = (2048, 2048, 2048);
    type RowFn = Box<dyn Fn() -> Result<Row>>;
    let row_fns: Vec<(usize, RowFn)> = vec![
        (2, Box::new(move || all_gather_matmul::<f32>(2, square, reps))),
        (2, Box::new(move || matmul_reduce_scatter::<f32>(2, square, reps))),
        (2, Box::new(move || all_gather_matmul::<f32>(2, (16, 4096, 4096), reps))),
        (4, Box::new(move || all_gather_matmul::<f32>(4, square, reps))),
        (4, Box::new(move || matmul_reduce_scatter::<f32>(4, square, reps))),
        (2, Box::new(move || all_gather_matmul::<bf16>(2, square, reps))),
        (4, Box::new(move || ulysses(4, (1, 8192, 32, 128), reps))),
        (2, Box::new(move || train_step(2, (2048, 1024, 4096), reps))),
    ];
    if World::launched() {
        // One rank of one row of `--processes`: it reports its medians (the parent reads rank
        // 0's, as a thread world reports rank 0's).
        let i: usize = arg_value("--row").and_then(|v| v.parse().ok()).unwrap_or(0);
        let row = row_fns[i].1()?;
        println!("ROW {}", row.measured.fused.as_nanos());
        return Ok(());
    }
    let mut rows = Vec::new();
    let mut as_processes = Vec::new();
    for (i, (world, row)) in row_fns.iter().enumerate() {
        rows.push(row()?);
        if processes {
            let mut args = vec!["--row".to_string(), i.to_string()];
            if quick {
                args.push("--quick".into());
            }
            let exits =
                World::local_job(*world).args(args).timeout(Duration::from_secs(600)).run()?;
            let fused_ns: Option<u64> = exits[0]
                .stdout_text()
                .lines()
                .find_map(|l| l.strip_prefix("ROW ")?.trim().parse().ok());
            if let Some(bad) = exits.iter().find(|e| !e.success()) {
                eprintln!("row {i}, rank {}: {}\n{}", bad.rank, bad.describe(), bad.stderr_text());
                std::process::exit(1);
            }
            as_processes.push(Duration::from_nanos(fused_ns.expect("rank 0 reports its row")));
        }
    }
    println!(
        "{} cores; medians of {reps} runs, ratios taken run by run; ceiling: the gemm crate on the \
         same total work with all cores, or memcpy of the same bytes split over all cores",
        cores()
    );
    if processes {
        println!(
            "| op | world | dtype | shape | fused ms | unfused ms | fused/unfused | fused/ceiling \
             | fused ms, processes | processes/threads |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    } else {
        println!(
            "| op | world | dtype | shape | fused ms | unfused ms | fused/unfused | fused/ceiling |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    }
    for (i, r) in rows.into_iter().enumerate() {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let m = &r.measured;
        let extra = as_processes.get(i).map_or(String::new(), |p| {
            format!(" {:.2} | {:.3} |", ms(*p), p.as_secs_f64() / m.fused.as_secs_f64())
        });
        println!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.3} | {:.3} ({}) |{extra}",
            r.op,
            r.world,
            r.dtype,
            r.shape,
            ms(m.fused),
            ms(m.unfused),
            m.fused_over_unfused,
            m.fused_over_ceiling,
            r.ceiling_name,
        );
    }
    Ok(())
}
