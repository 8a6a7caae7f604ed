//! `perf_report --mesh`: a training step of the MLP of example 08 (forward, backward, gradients
//! averaged over `dp`, plain SGD) on a 2 x 2 mesh beside the same step with tensor parallelism
//! over all 4 ranks (1 x 4) and data parallelism over all 4 (4 x 1); and, on the 2 x 2 mesh, the
//! part of the dp averaging that the backward pass does not hide: the step with the averaging
//! overlapped, less the step without any averaging, beside the averaging alone (the step with
//! it after the backward pass, less the step without). The kinds of step take turns, step by
//! step, in one run; each difference is taken round by round, and its median (and quartiles)
//! printed. Overlapped, the layers' `backward_hooked` hand each gradient to the buckets the
//! moment it is complete (fc1's weight before fc1's input gradient); the same line gives the
//! step with each layer's gradients handed in after its `backward` (`ready_all`), and the next
//! splits the unhidden part into the backward pass made longer (the averaging's work on the
//! cores the pass needs) and the wait for the buckets after it, with the CPU time of a step.
//!
//! The rows run on 4 threads of this host, on 4 processes of this program (`World::local_job`),
//! and, built with feature `mpi`, under mpirun as 4 processes on two fake nodes of 2 ranks
//! (`DIST_TENSOR_RANKS_PER_NODE=2`, TCP between them): the `tp` groups inside a node, the `dp`
//! groups across (their averaging through the world's node routing), with a line for an
//! all-reduce over a dp group alone. Then once more on those nodes with the network throttled
//! ([`THROTTLE`]): there the averaging is time on the wire, which the backward pass can hide,
//! where on the host it is copies and sums that need the cores the backward pass keeps busy. A
//! launched rank runs every row on its world and rank 0 prints them.
//!
//! The batch is [`TOKENS`] tokens (`--tokens N` for another), not the 256 of the tests: a
//! rank's gradients (1 MiB) do not depend on the batch, the backward pass's work does, and at
//! 256 tokens the backward pass after the first bucket is sent is shorter than the throttled
//! all-reduce alone, so no overlap could hide most of it (the figure would measure the model's
//! smallness). 2048 is the smallest power of two at which it is longer (19 to 32 ms against 11
//! to 18 on a 2-core host), and the averaging alone is then about a fifth of the step, a
//! data-parallel job's proportions.

use std::time::Instant;

use dist_tensor::collectives::all_reduce;
use dist_tensor::mesh::{DeviceMesh, data_parallel};
use dist_tensor::nn::{Activation, ColumnParallelLinear, Module, RowParallelLinear, mse_loss};
use dist_tensor::shmem::job_env::{RANKS_PER_NODE_ENV, THROTTLE_BANDWIDTH_ENV, THROTTLE_DELAY_ENV};
use dist_tensor::{DistTensor, Error, Placement, Result, Split, Tensor, World};

#[path = "../common/mlp.rs"]
mod mlp;

use mlp::{FFN, HIDDEN, MlpData, share};

use super::measure::{Spread, median};

/// Tokens of the global batch of the mesh rows (see the module docs for why).
const TOKENS: usize = 2048;

/// How a step averages the gradients over dp.
#[derive(Clone, Copy, PartialEq)]
enum Averaging {
    /// In buckets during the backward pass, each parameter's gradient handed in the moment it is
    /// complete (the layers' `backward_hooked`).
    Overlapped,
    /// In buckets during the backward pass, each layer's gradients handed in once the layer's
    /// backward is done (`ready_all`).
    ByLayer,
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

/// Training steps on a `dp x tp` mesh of `world`'s 4 ranks with a batch of `tokens`, for each
/// way of averaging in `ways` (see [`Steps`]). The ways take turns step by step, so that a
/// change of the host's load falls on all of them alike.
fn step_seconds(
    world: &World,
    tokens: usize,
    dp: usize,
    tp: usize,
    ways: &[Averaging],
    reps: usize,
) -> Result<Steps> {
    let MlpData { x, target, w1, b1, w2, b2 } = MlpData::with_tokens(tokens);
    let bucket = 256 << 10;
    let times = world.run(|rank| {
        let mesh = DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
        let (tpr, dpr) = (mesh.rank_of("tp")?, mesh.averager("dp")?);
        let mut fc1 = ColumnParallelLinear::from_global(&tpr, &w1, Some(&b1), Split::Even)?;
        let mut fc2 = RowParallelLinear::from_global(&tpr, &w2, Some(&b2), Split::Even)?;
        let rows = |t: &Tensor<f32>| share(t, dp, mesh.coord("dp")?);
        let xs = DistTensor::from_global(&tpr, &rows(&x)?, Placement::Shard(0))?;
        let ts = DistTensor::from_global(&tpr, &rows(&target)?, Placement::Shard(0))?;
        let mut times = vec![Vec::with_capacity(reps); ways.len()];
        let mut ends = vec![Vec::with_capacity(reps); ways.len()];
        let mut cpus = vec![Vec::with_capacity(reps); ways.len()];
        let (mut cpu, mut wall) = (0.0, 0.0);
        // The first round sizes the workspaces.
        for round in 0..reps + 1 {
            for (way, &averaging) in ways.iter().enumerate() {
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
                // Each parameter's gradient handed in as soon as it is complete (the weights
                // first); for ByLayer, each layer's once its backward is done.
                let hooked = averaging != Averaging::ByLayer;
                let ended = std::cell::Cell::new(start);
                let backward = |buckets: &mut data_parallel::GradBuckets<f32>| {
                    let da = if hooked {
                        fc2.backward_hooked(s2, &dy, buckets)?
                    } else {
                        let da = fc2.backward(s2, &dy)?;
                        buckets.ready_all(&fc2)?;
                        da
                    };
                    let dh = da.try_map_local(|g| Activation::Gelu.backward(&pre, g))?;
                    if hooked {
                        fc1.backward_hooked(s1, &dh, buckets)?;
                    } else {
                        fc1.backward(s1, &dh)?;
                        buckets.ready_all(&fc1)?;
                    }
                    ended.set(Instant::now());
                    Ok(())
                };
                let grads = match averaging {
                    Averaging::Overlapped | Averaging::ByLayer => {
                        data_parallel::overlapped(&dpr, bucket, backward)?.1
                    }
                    _ => {
                        let mut local = data_parallel::GradBuckets::collect();
                        backward(&mut local)?;
                        let local = local.into_grads();
                        match averaging {
                            Averaging::After => {
                                data_parallel::all_reduce_mean(&dpr, bucket, &local)?
                            }
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
                if round > 0 {
                    times[way].push(start.elapsed().as_secs_f64());
                    ends[way].push((ended.get() - start).as_secs_f64());
                    cpus[way].push(process_cpu_seconds() - cpu_start);
                    cpu += process_cpu_seconds() - cpu_start;
                    wall += start.elapsed().as_secs_f64();
                }
            }
        }
        Ok(Steps { step: times, backward_end: ends, cpu: cpus, busy: cpu / wall })
    })?;
    Ok(times.into_iter().next().expect("rank 0"))
}

/// What [`step_seconds`] measures on rank 0, per way of averaging and round: the seconds of a
/// step, of its start to the end of its backward pass (the buckets may still be on their way
/// then), and of CPU time its process used in the step (in a world of threads, every rank's);
/// and the CPU seconds per second of all the steps (in a world of threads, how many cores the
/// steps keep busy).
struct Steps {
    step: Vec<Vec<f64>>,
    backward_end: Vec<Vec<f64>>,
    cpu: Vec<Vec<f64>>,
    busy: f64,
}

impl Steps {
    /// The median step of way `way`.
    fn median(&self, way: usize) -> f64 {
        median(self.step[way].clone())
    }
}

/// Way `a`'s values less way `b`'s, round by round (the ways of a round ran one after the
/// other, so a change of the host's load falls on both).
fn paired(values: &[Vec<f64>], a: usize, b: usize) -> Spread {
    Spread::of(values[a].iter().zip(&values[b]).map(|(x, y)| x - y))
}

/// Floats of one rank's gradients on the 2 x 2 mesh (both layers' weights and biases, the
/// hidden layer split over `tp`): what its dp averaging all-reduces.
const GRAD_FLOATS: usize = (HIDDEN * FFN + FFN) / 2 + FFN * HIDDEN / 2 + HIDDEN;

/// One line: the median time of an all-reduce of [`GRAD_FLOATS`] `f32` over a `dp` group of the
/// 2 x 2 mesh (across the nodes on MPI), and the bytes each rank sums over that time.
fn all_reduce_line(world: &World, kind: &str, reps: usize) -> Result<String> {
    let times = world.run(|rank| {
        let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
        let dp = mesh.rank_of("dp")?;
        let values = vec![1.0f32; GRAD_FLOATS];
        let mut times = Vec::with_capacity(reps);
        for round in 0..reps + 1 {
            let _ = dp.barrier_all()?;
            let start = Instant::now();
            let sum = all_reduce(&dp, &values)?;
            if round > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
            if sum[GRAD_FLOATS - 1] != 2.0 {
                return Err(Error::user(format!("the all-reduce summed to {}", sum[0])));
            }
        }
        Ok(median(times))
    })?;
    let bytes = GRAD_FLOATS * size_of::<f32>();
    Ok(format!(
        "{kind}: all-reduce over a dp group of 2 (across the nodes): {bytes} bytes, {:.3} ms, \
         {:.3} GB/s (bytes over time)",
        times[0] * 1e3,
        bytes as f64 / times[0] * 1e-9
    ))
}

/// The part of the 2 x 2 mesh's dp averaging the backward pass does not hide, as two lines:
/// the step without averaging, the averaging after the backward pass alone and the part of it
/// not hidden overlapped (hooked, and layer by layer); where the unhidden part went, and the
/// CPU time of the steps.
fn unhidden_line(world: &World, kind: &str, reps: usize, tokens: usize) -> Result<String> {
    let ways = [Averaging::Overlapped, Averaging::ByLayer, Averaging::After, Averaging::Skipped];
    let steps = step_seconds(world, tokens, 2, 2, &ways, reps)?;
    // Each against the step without averaging of its own round.
    let (t, e, c) = (&steps.step, &steps.backward_end, &steps.cpu);
    let [unhidden, by_layer, alone] = [0, 1, 2].map(|way| paired(t, way, 3));
    // Where the overlapped step's unhidden part went: a longer backward pass (the averaging's
    // work on the cores the pass needs), and the wait for the last buckets after it.
    let slower = paired(e, 0, 3).median;
    let tail = unhidden.median - slower;
    let ms =
        |s: Spread| format!("{:.3} ms ({:.3} to {:.3})", s.median * 1e3, s.low * 1e3, s.high * 1e3);
    let share = |s: Spread| 100.0 * s.median / alone.median;
    let cpu = |way: usize| median(c[way].clone()) * 1e3;
    Ok(format!(
        "{kind}: 2x2: step {:.3} ms without averaging; dp averaging after the backward pass {}; \
         overlapped, the part not hidden {} = {:.0}% of it alone (each layer's gradients handed \
         in after its backward: {}, {:.0}%)\n{kind}: 2x2 overlapped: the backward pass {:.3} ms \
         longer, {:.3} ms waiting for the buckets after it; CPU time of a step (rank 0's \
         process) {:.1} ms without averaging, {:.1} overlapped, {:.1} after",
        steps.median(3) * 1e3,
        ms(alone),
        ms(unhidden),
        share(unhidden),
        ms(by_layer),
        share(by_layer),
        slower * 1e3,
        tail * 1e3,
        cpu(3),
        cpu(0),
        cpu(2)
    ))
}

/// The rows on `world` (4 ranks), as lines.
fn rows(world: &World, kind: &str, reps: usize, tokens: usize) -> Result<Vec<String>> {
    let mesh = step_seconds(world, tokens, 2, 2, &[Averaging::Overlapped], reps)?.median(0);
    let tp = step_seconds(world, tokens, 1, 4, &[Averaging::Overlapped], reps)?.median(0);
    let dp = step_seconds(world, tokens, 4, 1, &[Averaging::Overlapped], reps)?.median(0);
    let unhidden = unhidden_line(world, kind, reps, tokens)?;
    // On the host the averaging is CPU work (copies and sums through shared memory): it can
    // only hide behind the backward pass on cores the pass leaves idle. In a world of threads
    // the process's CPU time is every rank's, so this says how many are left.
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let busy_line = if kind == "threads" {
        let busy = step_seconds(world, tokens, 2, 2, &[Averaging::Skipped], reps)?.busy;
        Some(format!(
            "{kind}: 2x2 without averaging keeps {busy:.2} of the host's {cores} cores busy \
             (CPU time over wall time of the steps)"
        ))
    } else {
        None
    };
    let mpi_line =
        if kind.starts_with("mpi") { Some(all_reduce_line(world, kind, reps)?) } else { None };
    Ok(vec![
        format!("{kind}: mesh 2x2 (dp averaged during backward): {:8.3} ms", mesh * 1e3),
        format!("{kind}: tp over 4 (1x4):                        {:8.3} ms", tp * 1e3),
        format!("{kind}: dp over 4 (4x1, averaged during bwd):   {:8.3} ms", dp * 1e3),
        unhidden,
    ]
    .into_iter()
    .chain(busy_line)
    .chain(mpi_line)
    .collect())
}

/// The rows of a throttled network, on MPI fake nodes: the cross-node all-reduce alone and the
/// part of the dp averaging the backward pass does not hide.
fn throttled_rows(world: &World, kind: &str, reps: usize, tokens: usize) -> Result<Vec<String>> {
    Ok(vec![all_reduce_line(world, kind, reps)?, unhidden_line(world, kind, reps, tokens)?])
}

/// The program's arguments for a launched rank.
fn rank_args(quick: bool, kind: &str, tokens: usize) -> Vec<String> {
    let mut args = vec!["--mesh".to_string(), "--mesh-kind".into(), kind.into()];
    args.extend(["--tokens".to_string(), tokens.to_string()]);
    if quick {
        args.push("--quick".into());
    }
    args
}

/// The throttled network of the last MPI rows: each process's link to the other node moves
/// 125 MB/s (1 Gbit/s Ethernet) after 50 us of latency per message, so that the averaging of a
/// rank's gradients (about 1 MB) alone is a sizeable part of the step, as it is for a model on
/// accelerators behind a network of its time.
const THROTTLE: [(&str, &str); 2] =
    [(THROTTLE_BANDWIDTH_ENV, "125000000"), (THROTTLE_DELAY_ENV, "50")];
const THROTTLED_KIND: &str = "mpi, 1 Gbit/s + 50 us";

/// Runs this program's mesh rows under mpirun as 4 processes on two fake nodes of 2, with `env`
/// added.
fn mpirun(quick: bool, kind: &str, tokens: usize, env: &[(&str, &str)]) -> Result<()> {
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "4", "--mca", "btl", "self,tcp"])
        .args(["-x", &format!("{RANKS_PER_NODE_ENV}=2")]);
    for (key, value) in env {
        cmd.args(["-x", &format!("{key}={value}")]);
    }
    let status =
        cmd.arg(std::env::current_exe()?).args(rank_args(quick, kind, tokens)).status().map_err(
            |e| Error::user(format!("perf_report --mesh runs mpirun, which failed: {e}")),
        )?;
    if !status.success() {
        return Err(Error::user(format!("perf_report --mesh under mpirun ({kind}): {status}")));
    }
    Ok(())
}

/// Prints the mesh rows: threads, processes, and MPI fake nodes where built with `mpi` (on
/// TCP as it is, then throttled).
pub fn main(quick: bool) -> Result<()> {
    let reps = if quick { 5 } else { 15 };
    let argv: Vec<String> = std::env::args().collect();
    let tokens = match argv.iter().position(|a| a == "--tokens") {
        Some(i) => argv.get(i + 1).and_then(|t| t.parse().ok()).filter(|t| t % 4 == 0).ok_or_else(
            || Error::user("perf_report --mesh --tokens N: N a whole number, a multiple of 4"),
        )?,
        None => TOKENS,
    };
    if World::launched() {
        // One rank of the processes' or MPI's job: every row, rank 0 prints them.
        let kind = argv.iter().position(|a| a == "--mesh-kind").and_then(|i| argv.get(i + 1));
        let world = World::from_env()?;
        let kind = kind.map_or("launched", |k| k.as_str());
        let lines = if kind == THROTTLED_KIND {
            // More steps: the share is a ratio of medians of differences.
            let lines = throttled_rows(&world, kind, 3 * reps, tokens)?;
            // Puts still in a throttled proxy when a rank drops its world were seen to be
            // overtaken by its notice of leaving (see tests/mpi.rs): meet, then let them land.
            let _ = world.run(|rank| rank.barrier_all().map(drop));
            std::thread::sleep(std::time::Duration::from_millis(300));
            lines
        } else {
            rows(&world, kind, reps, tokens)?
        };
        if world.ranks_here().start == 0 {
            lines.iter().for_each(|l| println!("{l}"));
        }
        return Ok(());
    }
    println!(
        "training step of the MLP ({tokens} tokens, {HIDDEN} -> {FFN} -> {HIDDEN}, f32) on 4 ranks, \
         median of {reps} steps; load {}",
        super::measure::load_1min()
    );
    for line in rows(&World::threads(4)?, "threads", reps, tokens)? {
        println!("{line}");
    }
    let exits = World::local_job(4)
        .args(rank_args(quick, "processes", tokens))
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
        mpirun(quick, "mpi 2 nodes of 2", tokens, &[])?;
        println!(
            "{THROTTLED_KIND}: each process's link to the other node throttled ({}={}, {}={}); \
             median of {} steps",
            THROTTLE[0].0,
            THROTTLE[0].1,
            THROTTLE[1].0,
            THROTTLE[1].1,
            3 * reps
        );
        mpirun(quick, THROTTLED_KIND, tokens, &THROTTLE)?;
    } else {
        println!("mpi: not built (build with --features mpi for the rows on fake MPI nodes)");
    }
    Ok(())
}
