//! `perf_report --mesh`: a training step of the MLP of example 08 (forward, backward, gradients
//! averaged over `dp`, plain SGD) on a 2 x 2 mesh beside the same step with tensor parallelism
//! over all 4 ranks (1 x 4) and data parallelism over all 4 (4 x 1); and, on the 2 x 2 mesh, the
//! part of the dp averaging that the backward pass does not hide: the step with the averaging
//! overlapped, minus the step without any averaging, beside the averaging alone (after the
//! backward pass). Medians over the repetitions.
//!
//! The rows run three times: on 4 threads of this host, on 4 processes of this program
//! (`World::local_job`), and, built with feature `mpi`, under mpirun as 4 processes on two fake
//! nodes of 2 ranks (`DIST_TENSOR_RANKS_PER_NODE=2`, TCP between them): the `tp` groups inside a
//! node, the `dp` groups across (their averaging through the world's node routing). A launched
//! rank runs every row on its world and rank 0 prints them.

use std::time::Instant;

use dist_tensor::mesh::{DeviceMesh, data_parallel};
use dist_tensor::nn::{Activation, ColumnParallelLinear, Parameters, RowParallelLinear, mse_loss};
use dist_tensor::shmem::job_env::RANKS_PER_NODE_ENV;
use dist_tensor::{DistTensor, Error, Placement, Result, Split, Tensor, World};

#[path = "../common/mlp.rs"]
mod mlp;

use mlp::{MlpData, share};

/// How a step averages the gradients over dp.
#[derive(Clone, Copy, PartialEq)]
enum Averaging {
    /// In buckets during the backward pass.
    Overlapped,
    /// In the same buckets after it.
    After,
    /// Not at all (what the step costs without data parallelism's communication).
    Skipped,
}

/// Seconds of CPU time this process has used, all its threads together.
fn process_cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Median seconds of a training step on a `dp x tp` mesh of `world`'s 4 ranks (rank 0's), and
/// the CPU seconds rank 0's process used per second of the steps (in a world of threads, every
/// rank's: how many cores the step keeps busy).
fn step_seconds(
    world: &World,
    dp: usize,
    tp: usize,
    averaging: Averaging,
    reps: usize,
) -> Result<(f64, f64)> {
    let MlpData { x, target, w1, b1, w2, b2 } = MlpData::seeded();
    let bucket = 256 << 10;
    let times = world.run(|rank| {
        let mesh = DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
        let (tpr, dpr) = (mesh.rank_of("tp")?, mesh.averager("dp")?);
        let mut fc1 = ColumnParallelLinear::from_global(&tpr, &w1, Some(&b1), Split::Even)?;
        let mut fc2 = RowParallelLinear::from_global(&tpr, &w2, Some(&b2), Split::Even)?;
        let rows = |t: &Tensor<f32>| share(t, dp, mesh.coord("dp")?);
        let xs = DistTensor::from_global(&tpr, &rows(&x)?, Placement::Shard(0))?;
        let ts = DistTensor::from_global(&tpr, &rows(&target)?, Placement::Shard(0))?;
        let mut times = Vec::with_capacity(reps);
        let (mut cpu, mut wall) = (0.0, 0.0);
        for _ in 0..reps + 1 {
            let _ = rank.barrier_all()?;
            let start = Instant::now();
            let cpu_start = process_cpu_seconds();
            let (h, s1) = fc1.forward(&xs)?;
            let a = h.map_local(|t| Activation::Gelu.forward(t))?;
            let (y, s2) = fc2.forward(&a)?;
            let (_, dy) = mse_loss(&y, &ts)?;
            fc1.zero_grad();
            fc2.zero_grad();
            let pre = h.into_local();
            let backward = |buckets: &mut data_parallel::GradBuckets<f32>| {
                let da = fc2.backward(s2, &dy)?;
                buckets.ready_all(&fc2)?;
                let dh = da.try_map_local(|g| Activation::Gelu.backward(&pre, g))?;
                fc1.backward(s1, &dh)?;
                buckets.ready_all(&fc1)
            };
            let grads = match averaging {
                Averaging::Overlapped => data_parallel::overlapped(&dpr, bucket, backward)?.1,
                _ => {
                    let mut local = data_parallel::GradBuckets::collect();
                    backward(&mut local)?;
                    let local = local.into_grads();
                    match averaging {
                        Averaging::After => data_parallel::all_reduce_mean(&dpr, bucket, &local)?,
                        _ => local,
                    }
                }
            };
            let mut params = fc2.parameters_mut();
            params.extend(fc1.parameters_mut());
            for (p, g) in params.into_iter().zip(&grads) {
                let stepped = p.value() - &(g * 1e-3);
                *p.value_mut() = stepped;
            }
            let _ = rank.barrier_all()?;
            times.push(start.elapsed().as_secs_f64());
            if times.len() > 1 {
                cpu += process_cpu_seconds() - cpu_start;
                wall += start.elapsed().as_secs_f64();
            }
        }
        times.remove(0); // the first step sizes the workspaces
        times.sort_by(f64::total_cmp);
        Ok((times[times.len() / 2], cpu / wall))
    })?;
    Ok(times[0])
}

/// The rows on `world` (4 ranks), as lines. `tp_over_all` false skips tensor parallelism over
/// all 4 ranks (on two MPI nodes its groups would cross them, which groups cannot yet).
fn rows(world: &World, kind: &str, reps: usize, tp_over_all: bool) -> Result<Vec<String>> {
    let (mesh, _) = step_seconds(world, 2, 2, Averaging::Overlapped, reps)?;
    let tp = if tp_over_all {
        step_seconds(world, 1, 4, Averaging::Overlapped, reps)?.0
    } else {
        f64::NAN
    };
    let (dp, _) = step_seconds(world, 4, 1, Averaging::Overlapped, reps)?;
    let (after, _) = step_seconds(world, 2, 2, Averaging::After, reps)?;
    let (none, busy) = step_seconds(world, 2, 2, Averaging::Skipped, reps)?;
    let (alone, unhidden) = (after - none, mesh - none);
    // On the host the averaging is CPU work (copies and sums through shared memory): it can
    // only hide behind the backward pass on cores the pass leaves idle. In a world of threads
    // the process's CPU time is every rank's, so this says how many are left.
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let busy_line = (kind == "threads").then(|| {
        format!(
            "{kind}: 2x2 without averaging keeps {busy:.2} of the host's {cores} cores busy \
             (CPU time over wall time of the steps)"
        )
    });
    Ok(vec![
        format!("{kind}: mesh 2x2 (dp averaged during backward): {:8.3} ms", mesh * 1e3),
        if tp_over_all {
            format!("{kind}: tp over 4 (1x4):                        {:8.3} ms", tp * 1e3)
        } else {
            format!("{kind}: tp over 4 (1x4): not run (its tp groups would cross the nodes)")
        },
        format!("{kind}: dp over 4 (4x1, averaged during bwd):   {:8.3} ms", dp * 1e3),
        format!(
            "{kind}: 2x2: dp averaging after the backward pass {:.3} ms; overlapped, the part \
             not hidden {:.3} ms ({:.0}% of it alone)",
            alone * 1e3,
            unhidden * 1e3,
            100.0 * unhidden / alone
        ),
    ]
    .into_iter()
    .chain(busy_line)
    .collect())
}

/// The program's arguments for a launched rank.
fn rank_args(quick: bool, kind: &str) -> Vec<String> {
    let mut args = vec!["--mesh".to_string(), "--mesh-kind".into(), kind.into()];
    if quick {
        args.push("--quick".into());
    }
    args
}

/// Prints the mesh rows: threads, processes, and MPI fake nodes where built with `mpi`.
pub fn main(quick: bool) -> Result<()> {
    let reps = if quick { 3 } else { 15 };
    if World::launched() {
        // One rank of the processes' or MPI's job: every row, rank 0 prints them.
        let argv: Vec<String> = std::env::args().collect();
        let kind = argv.iter().position(|a| a == "--mesh-kind").and_then(|i| argv.get(i + 1));
        let world = World::from_env()?;
        let kind = kind.map_or("launched", |k| k.as_str());
        let lines = rows(&world, kind, reps, !kind.starts_with("mpi"))?;
        if world.ranks_here().start == 0 {
            lines.iter().for_each(|l| println!("{l}"));
        }
        return Ok(());
    }
    println!(
        "training step of the MLP (256 tokens, 256 -> 1024 -> 256, f32) on 4 ranks, median of \
         {reps} steps; load {}",
        super::measure::load_1min()
    );
    for line in rows(&World::threads(4)?, "threads", reps, true)? {
        println!("{line}");
    }
    let exits = World::local_job(4)
        .args(rank_args(quick, "processes"))
        .timeout(std::time::Duration::from_secs(600))
        .run()?;
    if let Some(bad) = exits.iter().find(|e| !e.success()) {
        return Err(Error::user(format!(
            "perf_report --mesh, rank {} of the processes: {}\n{}",
            bad.rank,
            bad.describe(),
            bad.stderr_text()
        )));
    }
    print!("{}", exits[0].stdout_text());
    if cfg!(feature = "mpi") {
        let status = std::process::Command::new("mpirun")
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                "4",
                "--mca",
                "btl",
                "self,tcp",
            ])
            .args(["-x", &format!("{RANKS_PER_NODE_ENV}=2")])
            .arg(std::env::current_exe()?)
            .args(rank_args(quick, "mpi 2 nodes of 2"))
            .status()
            .map_err(|e| {
                Error::user(format!("perf_report --mesh runs mpirun, which failed: {e}"))
            })?;
        if !status.success() {
            return Err(Error::user(format!("perf_report --mesh under mpirun: {status}")));
        }
    } else {
        println!("mpi: not built (build with --features mpi for the rows on fake MPI nodes)");
    }
    Ok(())
}
