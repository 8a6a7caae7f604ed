//! Ranks on many hosts through MPI (feature `mpi`). Each test runs this test binary under
//! `mpirun` as the ranks of a job (the test's own name as the filter): in a rank, `in_rank` runs
//! the body and prints what it found; in the test itself, it starts mpirun with a timeout (a hang
//! fails the test, it does not hang CI) and checks every rank's lines.
//!
//! Three shapes, as the issue asks: one node (ranks share memory, MPI only starts the job);
//! every process its own node (`DIST_TENSOR_RANKS_PER_NODE=1` with `--mca btl self,tcp`: every
//! byte between ranks crosses TCP through the proxies); and nodes of two ranks (shared memory
//! inside a node, TCP between nodes; at 3 processes the nodes differ in size).

use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dist_tensor::collectives::{self, ReduceOp};
use dist_tensor::device::{LaunchMode, launch, tile};
use dist_tensor::shmem::job_env::{RANKS_PER_NODE_ENV, THROTTLE_BANDWIDTH_ENV, THROTTLE_DELAY_ENV};
use dist_tensor::shmem::{
    GlobalPtr, SignalOp, WaitCmp, WaitSem, consume_token, symm_at, try_symm_at,
};
use dist_tensor::{DistTensor, Error, Placement, Rank, Tensor, World, fused};
use half::{bf16, f16};

mod common;
#[path = "../examples/common/mlp.rs"]
mod mlp;

use common::checks::{Checks, summed, ulysses_input, widen};
use common::crossed::{check_crossed, crossed_in_job};
use common::{digest, seeded};
use mlp::{MlpData, share};

/// mpirun is stopped past this: a hang fails the test.
const JOB_TIMEOUT: Duration = Duration::from_secs(240);

/// Where the ranks of a job live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// All on one node: shared memory between every pair.
    OneNode,
    /// Every process its own node, TCP between them.
    OwnNodes,
    /// Two ranks per node, TCP between nodes.
    NodesOfTwo,
}

impl Shape {
    fn args(self) -> Vec<String> {
        let tcp = ["--mca", "btl", "self,tcp"].map(String::from).to_vec();
        match self {
            Shape::OneNode => Vec::new(),
            Shape::OwnNodes => [tcp, vec!["-x".into(), format!("{RANKS_PER_NODE_ENV}=1")]].concat(),
            Shape::NodesOfTwo => {
                [tcp, vec!["-x".into(), format!("{RANKS_PER_NODE_ENV}=2")]].concat()
            }
        }
    }

    /// Whether matmul_reduce_scatter adds in the threads' order at `n` ranks: when no node
    /// after the first holds more than one rank (see `fused`'s reduction order).
    fn same_sum_order(self, n: usize) -> bool {
        match self {
            Shape::OneNode | Shape::OwnNodes => true,
            Shape::NodesOfTwo => n <= 3,
        }
    }
}

/// In a rank (started by mpirun): joins the world, runs `body`, prints `RANK r RESULT <text>` or
/// `RANK r ERROR <error>`, and returns true. In the test itself: returns false.
fn in_rank(body: impl FnOnce(&World) -> dist_tensor::Result<String>) -> bool {
    if std::env::var("OMPI_COMM_WORLD_RANK").is_err() {
        return false;
    }
    let world = match World::from_env() {
        Ok(world) => world,
        Err(err) => {
            println!("RANK ? ERROR {err}");
            return true;
        }
    };
    let me = world.ranks_here().start;
    match body(&world) {
        Ok(text) => println!("RANK {me} RESULT {text}"),
        Err(err) => println!("RANK {me} ERROR {err}"),
    }
    drop(world);
    true
}

/// What a job printed, and how it ended.
struct Job {
    /// What each rank printed (mpirun's `--output-filename`: lines of ranks do not mix).
    ranks: Vec<String>,
    stdout: String,
    stderr: String,
    success: bool,
    elapsed: Duration,
}

impl Job {
    /// What rank `r` printed after `tag`.
    fn printed(&self, r: usize, tag: &str) -> Option<String> {
        let prefix = format!("RANK {r} {tag} ");
        self.ranks[r].lines().find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
    }

    fn result(&self, r: usize) -> String {
        self.printed(r, "RESULT").unwrap_or_else(|| {
            panic!("rank {r} printed no result:\n{}\n{}", self.stdout, self.stderr)
        })
    }
}

/// Runs test `name` as `n` ranks under mpirun in `shape`, with extra `env` and mpirun `extra`
/// arguments.
fn mpirun(name: &str, n: usize, shape: Shape, env: &[(&str, &str)], extra: &[&str]) -> Job {
    // One job at a time: a job is several processes on a machine of few cores, and the throttle
    // test times its ops.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().unwrap();
    let files = std::env::temp_dir().join(format!("dt-mpi-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&files);
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string()]);
    cmd.arg("--output-filename").arg(&files);
    cmd.args(shape.args()).args(extra);
    for (key, value) in env {
        cmd.args(["-x", &format!("{key}={value}")]);
    }
    cmd.arg(exe).args([name, "--exact", "--nocapture", "--test-threads=1", "-q"]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().expect("mpirun (the mpi feature's tests need OpenMPI's mpirun)");
    let reader = common::jobs::read_on_thread(child.stdout.take().unwrap());
    let err_reader = common::jobs::read_on_thread(child.stderr.take().unwrap());
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > JOB_TIMEOUT {
            let pid = rustix::process::Pid::from_child(&child);
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let status = child.wait().unwrap();
            let stdout = reader.join().unwrap();
            panic!("{name} ({shape:?}, {n} ranks) hung: {status}\n{stdout}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    let ranks = (0..n)
        .map(|r| {
            std::fs::read_to_string(files.join(format!("1/rank.{r}/stdout"))).unwrap_or_default()
        })
        .collect();
    let _ = std::fs::remove_dir_all(&files);
    Job {
        ranks,
        stdout: reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
        success: status.success(),
        elapsed,
    }
}

// ---- the same numbers as threads ------------------------------------------------------------

/// Names of results whose sum order depends on the world's shape (matmul_reduce_scatter).
const SHAPE_ORDERED: [&str; 4] = ["rs_fused", "rs_fused_long", "rs_fused_bf16", "mlp"];

/// The largest error of this rank's rows of `sum_s h_s @ w_s` against an f64 reference (the
/// inputs are regenerated for every rank), relative to the largest reference value.
fn rs_error(rank: &Rank<'_>, got: &[f64], (m, k, n): (usize, usize, usize)) -> f64 {
    let world = rank.num_ranks();
    let mut want = vec![0f64; m * n];
    for s in 0..world {
        let h: Vec<f64> = seeded::<f32>(s, m * k, 11).iter().map(|v| f64::from(*v)).collect();
        let w: Vec<f64> = seeded::<f32>(s, k * n, 12).iter().map(|v| f64::from(*v)).collect();
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] += (0..k).map(|q| h[i * k + q] * w[q * n + j]).sum::<f64>();
            }
        }
    }
    let rows = common::pieces(m, world)[rank.rank()].clone();
    let mine = &want[rows.start * n..rows.end * n];
    let scale = want.iter().fold(1.0f64, |a, v| a.max(v.abs()));
    mine.iter().zip(got).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max) / scale
}

/// Every collective and fused op, in several element types and odd sizes: `name=digest` pairs.
fn battery(rank: &Rank<'_>) -> dist_tensor::Result<Vec<(String, String)>> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let mut out: Vec<(String, String)> = Vec::new();
    let mut put = |name: &str, d: String| out.push((name.to_string(), d));
    // Every result against an f64 reference too (the threads world could share a bug).
    let mut check = Checks::default();
    let sum_tol = |eps: f64| (n as f64 + 1.0) * eps;
    let f32_eps = f64::from(f32::EPSILON);
    // Ranks of other nodes have no pointer here; the threads' world says what one node gives.
    let local: String = (0..n).map(|p| if rank.is_local(p) { 'L' } else { '-' }).collect();
    put("nodes", format!("{}:{local}", rank.num_nodes()));
    let x: Vec<f32> = seeded(me, 5 + 3 * me, 1);
    let got = collectives::all_gather(rank, &x)?;
    let want = (0..n).flat_map(|r| widen(&seeded::<f32>(r, 5 + 3 * r, 1))).collect();
    check.exact("all_gather", &got, want);
    put("all_gather", digest(&got));
    let same: Vec<f32> = seeded(me, 37, 2);
    let got = collectives::reduce_scatter(rank, &same, ReduceOp::Sum)?;
    check.close("reduce_scatter", &got, summed::<f32>(n, 37, 2, Some(me)), sum_tol(f32_eps));
    put("reduce_scatter", digest(&got));
    let got = collectives::reduce_scatter(rank, &same, ReduceOp::Mean)?;
    let mean = summed::<f32>(n, 37, 2, Some(me)).map(|v| v.iter().map(|x| x / n as f64).collect());
    check.close("reduce_mean", &got, mean, sum_tol(f32_eps) + 1e-7);
    put("reduce_mean", digest(&got));
    let got = collectives::all_reduce(rank, &same)?;
    check.close("all_reduce", &got, summed::<f32>(n, 37, 2, None), sum_tol(f32_eps));
    put("all_reduce", digest(&got));
    let even: Vec<f32> = seeded(me, 3 * n, 3);
    let got = collectives::all_to_all(rank, &even)?;
    let want = (0..n).flat_map(|r| widen(&seeded::<f32>(r, 3 * n, 3)[3 * me..3 * me + 3]));
    check.exact("all_to_all", &got, want.collect());
    put("all_to_all", digest(&got));
    let counts_of = |r: usize| -> Vec<usize> { (0..n).map(|p| (p + r) % 3).collect() };
    let counts = counts_of(me);
    let v: Vec<f64> = seeded(me, counts.iter().sum(), 4);
    let want_v: Vec<f64> = (0..n)
        .flat_map(|r| {
            let c = counts_of(r);
            let from: usize = c[..me].iter().sum();
            seeded::<f64>(r, c.iter().sum(), 4)[from..from + c[me]].to_vec()
        })
        .collect();
    let got = collectives::all_to_all_v(rank, &v, &counts)?;
    check.exact("all_to_all_v", &got, want_v.clone());
    put("all_to_all_v", digest(&got));
    let pushed = collectives::all_to_all_v_tensor(rank, &v, &counts)?;
    check.exact("all_to_all_v_tensor", pushed.as_slice(), want_v);
    put("all_to_all_v_tensor", digest(pushed.as_slice()));
    let got = collectives::broadcast(rank, &seeded::<f64>(me, 11, 5), n - 1)?;
    check.exact("broadcast", &got, seeded(n - 1, 11, 5));
    put("broadcast", digest(&got));
    let got = collectives::all_reduce(rank, &seeded::<f64>(me, 23, 6))?;
    check.close("all_reduce_f64", &got, summed::<f64>(n, 23, 6, None), sum_tol(f64::EPSILON));
    put("all_reduce_f64", digest(&got));
    let got = collectives::all_gather(rank, &seeded::<bf16>(me, 9, 7))?;
    check.exact(
        "all_gather_bf16",
        &got,
        (0..n).flat_map(|r| widen(&seeded::<bf16>(r, 9, 7))).collect(),
    );
    put("all_gather_bf16", digest(&got));
    let got = collectives::all_reduce(rank, &seeded::<f16>(me, 19, 8))?;
    let half_tol = f64::from(f16::EPSILON) / 2.0 + sum_tol(f32_eps);
    check.close("all_reduce_f16", &got, summed::<f16>(n, 19, 8, None), half_tol);
    put("all_reduce_f16", digest(&got));
    let cols: Vec<f32> = seeded(me, 4 * (2 + me), 14);
    put("all_gather_cols", digest(&collectives::all_gather_cols(rank, &cols, 4)?));
    let rs_counts: Vec<usize> = (0..n).map(|r| 1 + r % 2).collect();
    let wide: Vec<f32> = seeded(me, 3 * rs_counts.iter().sum::<usize>(), 15);
    let rs = collectives::reduce_scatter_cols(rank, &wide, 3, &rs_counts, ReduceOp::Sum)?;
    put("reduce_scatter_cols", digest(&rs));
    // Fused ops, f32 and bf16, uneven rows (and rows long enough for tiles per shard).
    for (base, step) in [(13, 1), (300, 7)] {
        let rows_of = |r: usize| base + step * r;
        let rows = rows_of(me);
        let x = Tensor::from_shape_vec(&[rows, 64], seeded::<f32>(me, rows * 64, 9))?;
        let w = Tensor::from_shape_vec(&[64, 24], seeded::<f32>(me, 64 * 24, 10))?;
        let ag = fused::all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?])?;
        let got = ag.outputs[0].as_slice().expect("standard");
        check.gathered_product::<f32>("ag_fused", got, (me, n), rows_of);
        put("ag_fused", digest(got));
        let ag = fused::all_gather_matmul_unfused(rank, x.view2("x")?, &[w.view2("w")?])?;
        let got = ag.outputs[0].as_slice().expect("standard");
        check.gathered_product::<f32>("ag_unfused", got, (me, n), rows_of);
        put("ag_unfused", digest(got));
        // MPI_Allgatherv, then the same local product: the same bits.
        let same = !World::launched() || {
            let mpi = fused::all_gather_matmul_unfused_mpi(rank, x.view2("x")?, &[w.view2("w")?])?;
            mpi == ag
        };
        put("ag_unfused_mpi_same", same.to_string());
        // The gathered input kept beside the product: the same product, and the gathered rows.
        let kept = fused::all_gather_matmul_keep_input(rank, x.view2("x")?, &[w.view2("w")?])?;
        let gathered = kept.gathered.as_ref().expect("kept");
        let want = (0..n).flat_map(|r| widen(&seeded::<f32>(r, rows_of(r) * 64, 9))).collect();
        check.exact("ag_keep_gathered", gathered.as_slice().expect("standard"), want);
        put("ag_keep_gathered", digest(gathered.as_slice().expect("standard")));
        put("ag_keep_same", (kept.outputs == ag.outputs).to_string());
    }
    let x = Tensor::from_shape_vec(&[13 + me, 64], seeded::<f32>(me, (13 + me) * 64, 9))?;
    let w = Tensor::from_shape_vec(&[64, 24], seeded::<f32>(me, 64 * 24, 10))?;
    let (xb, wb) = (x.cast::<bf16>(), w.cast::<bf16>());
    let ag = fused::all_gather_matmul(rank, xb.view2("x")?, &[wb.view2("w")?])?;
    let got = ag.outputs[0].as_slice().expect("standard");
    check.gathered_product::<bf16>("ag_fused_bf16", got, (me, n), |r| 13 + r);
    put("ag_fused_bf16", digest(got));
    for (name, m) in [("rs_fused", 50), ("rs_fused_long", 600)] {
        let (k, nn) = (16, 20);
        let h = Tensor::from_shape_vec(&[m, k], seeded::<f32>(me, m * k, 11))?;
        let w2 = Tensor::from_shape_vec(&[k, nn], seeded::<f32>(me, k * nn, 12))?;
        let rs = fused::matmul_reduce_scatter(rank, h.view2("h")?, w2.view2("w")?)?;
        let got: Vec<f64> = rs.iter().map(|v| f64::from(*v)).collect();
        let err = rs_error(rank, &got, (m, k, nn));
        put(&format!("{name}_close"), (err < 1e-5).to_string());
        put(name, digest(rs.as_slice().expect("standard")));
        let rs = fused::matmul_reduce_scatter_unfused(rank, h.view2("h")?, w2.view2("w")?)?;
        let got = rs.as_slice().expect("standard");
        check.reduce_scattered_product::<f32>("rs_unfused", got, (me, n), (m, k, nn));
        put("rs_unfused", digest(got));
        // MPI_Reduce_scatter sums in MPI's own order: close to the reference.
        let close = !World::launched() || {
            let mpi =
                fused::matmul_reduce_scatter_unfused_mpi(rank, h.view2("h")?, w2.view2("w")?)?;
            let got: Vec<f64> = mpi.iter().map(|v| f64::from(*v)).collect();
            rs_error(rank, &got, (m, k, nn)) < 1e-5
        };
        put("rs_unfused_mpi_close", close.to_string());
        let rs = fused::matmul_reduce_scatter(
            rank,
            h.cast::<bf16>().view2("h")?,
            w2.cast::<bf16>().view2("w")?,
        )?;
        put("rs_fused_bf16", digest(rs.as_slice().expect("standard")));
    }
    // Ulysses all_to_all: [B, s_r, H, D] -> [B, S, h_r, D] and back; S and H not divisible.
    let s_r = 3 + me % 2;
    let q = Tensor::from_shape_vec(&[2, s_r, 7, 8], seeded::<f32>(me, 2 * s_r * 7 * 8, 13))?;
    let heads = fused::all_to_all(rank, &q, 2, 1)?;
    let shape = |r: usize| [2, 3 + r % 2, 7, 8];
    check.heads_all_to_all("ulysses", heads.output.as_slice(), (me, n), shape, 13);
    put("ulysses", digest(heads.output.as_slice()));
    let back = fused::all_to_all(rank, &heads.output, 1, 2)?.output;
    // Back to the sequence, now split as numpy.array_split (not as the input was).
    let inputs: Vec<_> = (0..n).map(|r| ulysses_input(r, shape(r), 13)).collect();
    let views: Vec<_> = inputs.iter().map(|x| x.view()).collect();
    let whole = ndarray::concatenate(ndarray::Axis(1), &views).unwrap();
    let mine = common::pieces(whole.shape()[1], n)[me].clone();
    let want = whole.slice_axis(ndarray::Axis(1), ndarray::Slice::from(mine));
    check.exact("ulysses_back", back.as_slice(), want.iter().copied().collect());
    put("ulysses_back", digest(back.as_slice()));
    let unfused = fused::all_to_all_unfused(rank, &q, 2, 1)?;
    check.heads_all_to_all("ulysses_unfused", unfused.output.as_slice(), (me, n), shape, 13);
    put("ulysses_unfused", digest(unfused.output.as_slice()));
    let same = !World::launched() || fused::all_to_all_unfused_mpi(rank, &q, 2, 1)? == unfused;
    put("ulysses_unfused_mpi_same", same.to_string());
    // Blocks of several copy tasks, on one node and across nodes (tasks to another node are
    // larger): about 9000 rows of 16 to 48 elements per peer.
    let s_r = 9000 + 37 * me;
    let q = Tensor::from_shape_vec(&[1, s_r, 5, 16], seeded::<f32>(me, s_r * 80, 14))?;
    let heads = fused::all_to_all(rank, &q, 2, 1)?;
    let shape = |r: usize| [1, 9000 + 37 * r, 5, 16];
    check.heads_all_to_all("ulysses_large", heads.output.as_slice(), (me, n), shape, 14);
    put("ulysses_large", digest(heads.output.as_slice()));
    put("ulysses_large_same", (heads == fused::all_to_all_unfused(rank, &q, 2, 1)?).to_string());
    // The DistTensor layer: an MLP block end to end.
    let (y, _) = check.run_mlp_block("mlp", rank)?;
    put("mlp", digest(y.as_slice()));
    // What the references found wrong (nothing when all is well); no `;` in it (see `encode`).
    put("reference", check.fails.join(" / "));
    Ok(out)
}

fn encode(results: &[(String, String)]) -> String {
    results.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(";")
}

fn decode(text: &str) -> Vec<(String, String)> {
    text.split(';')
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("name=value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// The rank body of the battery tests: the battery in two runs of the world (the second must
/// give the same bits), printed once.
fn battery_twice(world: &World) -> dist_tensor::Result<String> {
    let first = world.run(battery)?.remove(0);
    let second = world.run(battery)?.remove(0);
    if first != second {
        let differ: Vec<&String> =
            first.iter().zip(&second).filter(|(a, b)| a != b).map(|(a, _)| &a.0).collect();
        return Err(Error::user(format!("a second run gave other bits for {differ:?}")));
    }
    Ok(encode(&first))
}

/// Runs the battery as `n` ranks in `shape` and compares every rank's results with a world of
/// threads: bitwise, but for the sums whose order the shape changes (then checked against an f64
/// reference inside the rank, and bitwise from run to run).
fn battery_matches_threads(name: &str, n: usize, shape: Shape) {
    let threads = World::threads(n).unwrap().run(battery).unwrap();
    let job = mpirun(name, n, shape, &[], &[]);
    assert!(job.success, "{name}: mpirun failed:\n{}\n{}", job.stdout, job.stderr);
    println!("{name}: mpirun took {:?}\n{}", job.elapsed, job.stdout);
    for (r, want) in threads.iter().enumerate() {
        let got = decode(&job.result(r));
        assert_eq!(got.len(), want.len(), "rank {r}");
        for ((name_got, got), (name_want, want)) in got.iter().zip(want) {
            assert_eq!(name_got, name_want);
            if SHAPE_ORDERED.contains(&name_got.as_str()) && !shape.same_sum_order(n) {
                continue; // compared with the f64 reference (`*_close`) and run to run
            }
            if name_got == "reference" {
                assert_eq!(want, "", "threads, {n} ranks, rank {r}: against the f64 references");
                assert_eq!(got, "", "{shape:?}, {n} ranks, rank {r}: against the f64 references");
                continue;
            }
            if name_got == "nodes" {
                assert_eq!(got, &expected_nodes(shape, n, r), "rank {r}");
                continue;
            }
            assert_eq!(got, want, "{shape:?}, {n} ranks, rank {r}: {name_got} differs");
        }
    }
}

/// What `battery`'s `nodes` entry says for rank `r` of `n` in `shape`.
fn expected_nodes(shape: Shape, n: usize, r: usize) -> String {
    let per = match shape {
        Shape::OneNode => n,
        Shape::OwnNodes => 1,
        Shape::NodesOfTwo => 2,
    };
    let local: String = (0..n).map(|p| if p / per == r / per { 'L' } else { '-' }).collect();
    format!("{}:{local}", n.div_ceil(per))
}

macro_rules! battery_tests {
    ($($name:ident: $n:expr, $shape:expr;)*) => {
        $(
            #[test]
            fn $name() {
                if in_rank(battery_twice) {
                    return;
                }
                battery_matches_threads(stringify!($name), $n, $shape);
            }
        )*
    };
}

battery_tests! {
    one_node_2_ranks_every_op_matches_threads: 2, Shape::OneNode;
    one_node_3_ranks_every_op_matches_threads: 3, Shape::OneNode;
    one_node_4_ranks_every_op_matches_threads: 4, Shape::OneNode;
    own_nodes_over_tcp_2_ranks_every_op_matches_threads: 2, Shape::OwnNodes;
    own_nodes_over_tcp_3_ranks_every_op_matches_threads: 3, Shape::OwnNodes;
    own_nodes_over_tcp_4_ranks_every_op_matches_threads: 4, Shape::OwnNodes;
    nodes_of_two_2_ranks_every_op_matches_threads: 2, Shape::NodesOfTwo;
    nodes_of_two_3_ranks_every_op_matches_threads: 3, Shape::NodesOfTwo;
    nodes_of_two_4_ranks_every_op_matches_threads: 4, Shape::NodesOfTwo;
}

// ---- pointers and puts across nodes ----------------------------------------------------------

#[test]
fn a_peer_of_another_node_has_no_pointer_and_puts_reach_every_peer() {
    if in_rank(|world| {
        let out = world.run(|rank| {
            let (me, n) = (rank.rank(), rank.num_ranks());
            let buf = rank.alloc::<u64>(n)?;
            let sig = rank.alloc_signals(1)?;
            // A put from every rank to every rank, its own element.
            let mine = [me as u64 * 10 + 1];
            for peer in 0..n {
                // SAFETY: each rank writes only its own element; `mine` lives until quiet().
                unsafe {
                    rank.put_signal_nbi(
                        buf.ptr() + me,
                        peer,
                        GlobalPtr::from_slice(&mine),
                        1,
                        (&sig, 0),
                        SignalOp::Add(1),
                    )?
                };
            }
            rank.quiet()?;
            let token = rank.wait(&sig, 0, WaitCmp::Ge(n as u64), WaitSem::Acquire)?;
            let mut got = vec![0u64; n];
            // SAFETY: every rank's put is complete (its signal was acquired).
            unsafe { tile::load_1d(consume_token(buf.ptr(), token), &mut got, n, 0) };
            // symm_at: a pointer for this node, a typed error for another.
            let peer = (me + 1) % n;
            let tried = match try_symm_at(&buf, peer) {
                Ok(_) => "pointer".to_string(),
                Err(e @ Error::PeerNotLocal { .. }) => format!("not local: {e}"),
                Err(e) => format!("other error: {e}"),
            };
            let _ = rank.barrier_all()?;
            Ok(format!("{got:?} | {tried}"))
        })?;
        // A kernel that takes symm_at on a peer of another node fails the world, typed.
        let err = world
            .run(|rank| {
                let buf = rank.alloc::<f32>(4)?;
                launch(rank, LaunchMode::VectorOnly, 1, |p| {
                    let peer = (0..p.num_ranks()).find(|&q| !p.is_local(q)).expect("a remote peer");
                    let _ = symm_at(&buf, peer);
                    Ok(())
                })
            })
            .unwrap_err();
        // The rank that failed first has its error typed; every rank names the cause.
        let me = world.ranks_here().start;
        let first = matches!(&err, Error::RankFailed { rank, .. } if *rank == me);
        let typed = !first || matches!(err.rank_error(), Error::PeerNotLocal { .. });
        Ok(format!("{} | typed {typed}: {err}", out[0]))
    }) {
        return;
    }
    let name = "a_peer_of_another_node_has_no_pointer_and_puts_reach_every_peer";
    let job = mpirun(name, 3, Shape::OwnNodes, &[], &[]);
    for r in 0..3 {
        let text = job.result(r);
        assert!(text.starts_with("[1, 11, 21] | not local: symm_at: rank"), "rank {r}: {text}");
        assert!(text.contains(&format!("rank {} is on another node", (r + 1) % 3)), "{text}");
        assert!(text.contains("| typed true:"), "rank {r}: {text}");
        assert!(text.contains("has no pointer to rank"), "rank {r}: {text}");
    }
    let job = mpirun(name, 4, Shape::NodesOfTwo, &[], &[]);
    for r in 0..4 {
        let text = job.result(r);
        let first = if r % 2 == 0 { "pointer" } else { "not local" };
        assert!(text.starts_with(&format!("[1, 11, 21, 31] | {first}")), "rank {r}: {text}");
    }
}

// ---- faults across nodes ---------------------------------------------------------------------

/// How long a fault on another node may take to end every other rank.
const FAULT_BOUND: Duration = Duration::from_secs(2);

/// The body of the fault tests: rank 1 does `fault` after a first collective; the others go into
/// an all_gather that needs it, then try a barrier, and print how long the pending one took to
/// fail, and both errors. Rank 1 may fail before another rank has left the first collective: that
/// one is then the pending one.
fn fault_body(
    world: &World,
    fault: impl Fn(&Rank<'_>) -> dist_tensor::Result<()> + Sync,
) -> dist_tensor::Result<String> {
    let out = world.run(|rank| {
        let mut start = Instant::now();
        let first = collectives::all_gather(rank, &[rank.rank() as f32]).map(drop);
        if rank.rank() == 1 {
            first?;
            fault(rank)?;
            return Ok("rank 1 went on".to_string());
        }
        let pending = match first {
            Ok(()) => {
                start = Instant::now();
                collectives::all_gather(rank, &[1.0f32]).map(drop).unwrap_err()
            }
            Err(err) => err,
        };
        let ms = start.elapsed().as_millis();
        let next = rank.barrier_all().map(drop).unwrap_err();
        Ok(format!("{ms} ms | {pending} | {next}"))
    })?;
    Ok(out[0].clone())
}

/// Checks the ranks other than 1: each ended its pending wait within the bound, naming rank 1
/// and saying `says`.
fn check_fault(job: &Job, n: usize, says: &str) {
    for r in (0..n).filter(|&r| r != 1) {
        let text = job.result(r);
        let ms: u128 = text.split(" ms").next().unwrap().parse().unwrap();
        assert!(ms < FAULT_BOUND.as_millis(), "rank {r}: {text}");
        let (pending, next) = text.split_once(" | ").unwrap().1.split_once(" | ").unwrap();
        for err in [pending, next] {
            assert!(err.contains("rank 1"), "rank {r}: {err}");
            assert!(err.contains(says), "rank {r}: {err}");
        }
    }
    assert!(job.elapsed < JOB_TIMEOUT, "the job ended");
}

#[test]
fn a_killed_process_on_another_node_ends_every_rank_with_an_error_naming_it() {
    if in_rank(|world| fault_body(world, |_| common::jobs::kill_self())) {
        return;
    }
    let name = "a_killed_process_on_another_node_ends_every_rank_with_an_error_naming_it";
    // mpirun would otherwise kill the survivors itself as soon as it sees the death; with
    // recovery on, they must end on their own, through the library's failure detection.
    for (n, shape) in [(3, Shape::OwnNodes), (4, Shape::NodesOfTwo)] {
        let job = mpirun(name, n, shape, &[], &["--enable-recovery"]);
        // Seen from another node: its connection ended; from its own node: its pid.
        check_fault(&job, n, "ended without");
    }
}

#[test]
fn a_rank_that_fails_on_another_node_ends_every_rank_with_what_it_said() {
    if in_rank(|world| fault_body(world, |_| Err(Error::user("disk full on rank one")))) {
        return;
    }
    let name = "a_rank_that_fails_on_another_node_ends_every_rank_with_what_it_said";
    let job = mpirun(name, 3, Shape::OwnNodes, &[], &[]);
    check_fault(&job, 3, "disk full on rank one");
    assert!(job.printed(1, "ERROR").is_some_and(|e| e.contains("disk full")), "{}", job.stdout);
}

#[test]
fn a_panic_on_another_node_ends_every_rank_naming_it() {
    if in_rank(|world| fault_body(world, |_| panic!("rank one gives up"))) {
        return;
    }
    let name = "a_panic_on_another_node_ends_every_rank_naming_it";
    let job = mpirun(name, 4, Shape::NodesOfTwo, &[], &[]);
    check_fault(&job, 4, "rank one gives up");
}

// ---- a slow network --------------------------------------------------------------------------

/// Median of `times`.
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Milliseconds per call of `op`, over `reps` calls back to back (ranks out of step by a
/// barrier's skew matter less than in one call).
fn per_call(
    rank: &Rank<'_>,
    reps: usize,
    mut op: impl FnMut() -> dist_tensor::Result<()>,
) -> dist_tensor::Result<f64> {
    let _ = rank.barrier_all()?;
    let t = Instant::now();
    for _ in 0..reps {
        op()?;
    }
    let _ = rank.barrier_all()?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / reps as f64)
}

/// The fused ops over a throttled proxy: the same results, and still faster than unfused, as
/// they move data while they compute. Prints `same`, the ratios of medians, and the times.
fn throttled_body(world: &World) -> dist_tensor::Result<String> {
    let out = world.run(|rank| {
        let me = rank.rank();
        let (m, k, n) = (256, 1024, 512);
        let x = Tensor::from_shape_vec(&[m, k], seeded::<f32>(me, m * k, 21))?;
        let w = Tensor::from_shape_vec(&[k, n], seeded::<f32>(me, k * n, 22))?;
        let (xv, wv) = (x.view2("x")?, w.view2("w")?);
        let h = Tensor::from_shape_vec(&[m * 3, k], seeded::<f32>(me, 3 * m * k, 23))?;
        let hv = h.view2("h")?;
        // The same results (one rank per node: the same order of the sum, the same bits).
        let mut same = fused::all_gather_matmul(rank, xv, &[wv])?
            == fused::all_gather_matmul_unfused(rank, xv, &[wv])?;
        same &= fused::matmul_reduce_scatter(rank, hv, wv)?
            == fused::matmul_reduce_scatter_unfused(rank, hv, wv)?;
        let q =
            Tensor::from_shape_vec(&[2, 5 + me, 6, 16], seeded::<f32>(me, 2 * (5 + me) * 96, 24))?;
        same &= fused::all_to_all(rank, &q, 2, 1)? == fused::all_to_all_unfused(rank, &q, 2, 1)?;
        // Fused and unfused in pairs, one right after the other (the machine's load drifts):
        // the median of the pairs' ratios.
        let (mut ag, mut rs, mut ms) = (Vec::new(), Vec::new(), [(); 4].map(|_| Vec::new()));
        for _ in 0..11 {
            let f = per_call(rank, 1, || fused::all_gather_matmul(rank, xv, &[wv]).map(drop))?;
            let u =
                per_call(rank, 1, || fused::all_gather_matmul_unfused(rank, xv, &[wv]).map(drop))?;
            ag.push(f / u);
            ms[0].push(f);
            ms[1].push(u);
            let f = per_call(rank, 1, || fused::matmul_reduce_scatter(rank, hv, wv).map(drop))?;
            let u =
                per_call(rank, 1, || fused::matmul_reduce_scatter_unfused(rank, hv, wv).map(drop))?;
            rs.push(f / u);
            ms[2].push(f);
            ms[3].push(u);
        }
        // The two halves alone, to show the balance when a ratio misses: the gather of x
        // through the throttled proxy, and the product on all gathered rows.
        let gathered = Tensor::from_shape_vec(
            &[m * rank.num_ranks(), k],
            collectives::all_gather(rank, x.as_slice())?,
        )?;
        let gv = gathered.view2("gathered")?;
        let threads = rank.topology().aicore_num();
        let (mut comm, mut compute) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            comm.push(per_call(rank, 1, || collectives::all_gather(rank, x.as_slice()).map(drop))?);
            compute.push(per_call(rank, 1, || {
                dist_tensor::tensor::matmul(gv, wv, threads).map(drop)
            })?);
        }
        let [ag_f, ag_u, rs_f, rs_u] = ms.map(median);
        Ok(format!(
            "same {same} | ag {:.3} | rs {:.3} | ms ag {ag_f:.1}/{ag_u:.1} rs {rs_f:.1}/{rs_u:.1} \
             | alone ms gather {:.1} product {:.1}",
            median(ag),
            median(rs),
            median(comm),
            median(compute),
        ))
    })?;
    Ok(out[0].clone())
}

#[test]
fn over_a_throttled_network_the_fused_ops_give_the_same_results_and_still_overlap() {
    if in_rank(throttled_body) {
        return;
    }
    let name = "over_a_throttled_network_the_fused_ops_give_the_same_results_and_still_overlap";
    // 200 MB/s: gathering x (2 MiB into each rank) takes somewhat longer than the product on
    // the gathered rows with three ranks sharing this 2-core machine (printed as `alone`; since
    // the throttle charges each put its own bytes, the gather measured 14.5 to 15.6 ms, the
    // product 13 to 17 ms; ag 0.74 to 0.86, rs 0.97 to 1.03). At 100 MB/s the gather took 3
    // times the product, and the few ms that overlap could win drowned in the noise of a loaded
    // machine.
    let env = [(THROTTLE_DELAY_ENV, "100"), (THROTTLE_BANDWIDTH_ENV, "200000000")];
    // Results must agree on every attempt; the overlap must show on one of three whole jobs:
    // a timing on a shared 2-core machine can lose to a burst of other work, while a fused path
    // that does not overlap at all loses every time.
    let mut misses = Vec::new();
    for attempt in 1..=3 {
        let job = mpirun(name, 3, Shape::OwnNodes, &env, &[]);
        let mut overlapped = true;
        for r in 0..3 {
            let text = job.result(r);
            println!("attempt {attempt}, rank {r}: {text}");
            assert!(text.starts_with("same true"), "rank {r}: {text}");
            let ratio = |key: &str| -> f64 {
                text.split(&format!("{key} "))
                    .nth(1)
                    .unwrap()
                    .split(' ')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            // all_gather_matmul must overlap (0.74 to 0.86 here); matmul_reduce_scatter gains
            // less (its reduction waits for the rank's own rows: 0.89 to 1.00 in six attempts on
            // a 2-core Intel Xeon, 2026-12-02) and must only not lose to its baseline.
            if ratio("ag") >= 1.0 || ratio("rs") >= 1.05 {
                overlapped = false;
                misses.push(format!("attempt {attempt}, rank {r}: {text}"));
            }
        }
        if overlapped {
            return;
        }
    }
    panic!(
        "ag not below 1 or rs not below 1.05 (fused over unfused) in any of 3 attempts:\n{}",
        misses.join("\n")
    );
}

// ---- data parallelism over a slow network ------------------------------------------------------

/// One training step's gradients of the MLP of example 08 on this rank's `mesh` (`dp x tp`; no
/// update, so every step computes the same ones), averaged over `dp` in buckets during the
/// backward pass (`overlap`) or in the same buckets after it; with the step's milliseconds.
fn dp_step(
    mesh: &dist_tensor::mesh::DeviceMesh<'_>,
    layers: &mut (
        dist_tensor::nn::ColumnParallelLinear<f32>,
        dist_tensor::nn::RowParallelLinear<f32>,
    ),
    xs: &DistTensor<'_, f32>,
    ts: &DistTensor<'_, f32>,
    overlap: bool,
) -> dist_tensor::Result<(Vec<Tensor<f32>>, f64)> {
    use dist_tensor::mesh::data_parallel;
    use dist_tensor::nn::{Activation, Module, mse_loss};
    let (fc1, fc2) = layers;
    let dp = mesh.averager("dp")?;
    // Buckets of 256 KiB: fc2's gradients (half a MiB) go while fc1's backward runs.
    let bucket = 256 << 10;
    let _ = xs.rank().barrier_all()?;
    let start = Instant::now();
    let (h, s1) = fc1.forward(xs)?;
    let a = h.map_local(|t| Activation::Gelu.forward(t))?;
    let (y, s2) = fc2.forward(&a)?;
    let (_, dy) = mse_loss(&y, ts)?;
    fc1.zero_grad();
    fc2.zero_grad();
    let pre = h.into_local();
    // Each gradient handed in as soon as it is complete (fc1's weight before its input gradient).
    let backward = |buckets: &mut data_parallel::GradBuckets<f32>| {
        let da = fc2.backward_hooked(s2, &dy, buckets)?;
        let dh = da.try_map_local(|g| Activation::Gelu.backward(&pre, g))?;
        fc1.backward_hooked(s1, &dh, buckets).map(drop)
    };
    let grads = if overlap {
        data_parallel::overlapped(&dp, bucket, backward)?.1
    } else {
        let mut local = data_parallel::GradBuckets::collect();
        backward(&mut local)?;
        data_parallel::all_reduce_mean(&dp, bucket, &local.into_grads())?
    };
    let _ = xs.rank().barrier_all()?;
    Ok((grads, start.elapsed().as_secs_f64() * 1e3))
}

/// DP training steps on a 2 x 2 mesh whose `dp` groups cross the nodes: overlapped and after the
/// backward pass in pairs. Prints whether every step's gradients were the same bits, their
/// digest (a dp group's members must agree), the median of the pairs' ratios and the times.
fn dp_overlap_body(world: &World) -> dist_tensor::Result<String> {
    use dist_tensor::mesh::DeviceMesh;
    use dist_tensor::nn::{ColumnParallelLinear, RowParallelLinear};
    let MlpData { x, target, w1, b1, w2, b2 } = MlpData::seeded();
    let out = world.run(|rank| {
        let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
        let tp = mesh.rank_of("tp")?;
        let mut layers = (
            ColumnParallelLinear::from_global(&tp, &w1, Some(&b1), dist_tensor::Split::Even)?,
            RowParallelLinear::from_global(&tp, &w2, Some(&b2), dist_tensor::Split::Even)?,
        );
        let rows = |t: &Tensor<f32>| share(t, 2, mesh.coord("dp")?);
        let xs = DistTensor::from_global(&tp, &rows(&x)?, Placement::Shard(0))?;
        let ts = DistTensor::from_global(&tp, &rows(&target)?, Placement::Shard(0))?;
        let digest_of = |grads: &[Tensor<f32>]| {
            grads.iter().map(|g| digest(g.as_slice())).collect::<Vec<_>>().join(",")
        };
        // The first step sizes the workspaces; its gradients are what every step must give.
        let first = digest_of(&dp_step(&mesh, &mut layers, &xs, &ts, true)?.0);
        let mut same = true;
        let (mut ratios, mut over, mut after) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..9 {
            let (g, o) = dp_step(&mesh, &mut layers, &xs, &ts, true)?;
            same &= digest_of(&g) == first;
            let (g, a) = dp_step(&mesh, &mut layers, &xs, &ts, false)?;
            same &= digest_of(&g) == first;
            ratios.push(o / a);
            over.push(o);
            after.push(a);
        }
        // A rank that drops its world while its last puts are still in a throttled proxy was
        // seen to end its peer's wait for them ("rank 1 dropped its world while rank 3 waits on
        // signal 1", after the last all-gather; after a barrier, "while rank 0 waits in
        // barrier_all"): the notice of leaving overtakes the throttled data. Until the world
        // waits for its puts to land before it leaves, the ranks meet, then give the proxies
        // time to deliver (a barrier's few bytes take well under a millisecond here).
        let _ = rank.barrier_all()?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(format!(
            "same {same} | ratio {:.3} | ms {:.1}/{:.1} | grads {first}",
            median(ratios),
            median(over),
            median(after)
        ))
    })?;
    Ok(out[0].clone())
}

/// The test whose ranks run [`dp_overlap_body`] (for the ignored timing test too: a rank started
/// by name would skip an ignored test).
const DP_OVERLAP_TEST: &str =
    "over_a_throttled_network_dp_averaging_across_nodes_is_the_same_overlapped_or_not";

/// One job of [`dp_overlap_body`]: every rank's line, checked for correctness (the same
/// gradients on every step and within each dp group), and the mean of the ranks' ratios
/// (overlapped over after).
fn dp_overlap_job(attempt: usize) -> (f64, String) {
    // The dp groups {0, 2} and {1, 3} cross the two nodes, so their averaging goes through the
    // throttled proxies; the tp groups stay inside a node.
    let env = [(THROTTLE_DELAY_ENV, "100"), (THROTTLE_BANDWIDTH_ENV, "200000000")];
    let job = mpirun(DP_OVERLAP_TEST, 4, Shape::NodesOfTwo, &env, &[]);
    let texts: Vec<String> = (0..4).map(|r| job.result(r)).collect();
    for (r, text) in texts.iter().enumerate() {
        println!("attempt {attempt}, rank {r}: {text}");
        assert!(text.starts_with("same true"), "rank {r}: {text}");
    }
    // A dp group's members hold the same averaged gradients; the two tp ranks different shards.
    let grads = |r: usize| texts[r].split("grads ").nth(1).unwrap().to_string();
    assert_eq!(grads(0), grads(2), "dp group {{0, 2}}");
    assert_eq!(grads(1), grads(3), "dp group {{1, 3}}");
    assert_ne!(grads(0), grads(1));
    let ratios: Vec<f64> = texts
        .iter()
        .map(|t| t.split("ratio ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap())
        .collect();
    let mean = ratios.iter().sum::<f64>() / 4.0;
    (mean, format!("ratios {ratios:?}, mean {mean:.3}"))
}

#[test]
fn over_a_throttled_network_dp_averaging_across_nodes_is_the_same_overlapped_or_not() {
    if in_rank(dp_overlap_body) {
        return;
    }
    let (_, ratios) = dp_overlap_job(1);
    println!("{ratios}");
}

/// The timing of the overlap: ignored in CI, as on this 2-core host shared with other builds the
/// gain (fc2's averaging hidden behind fc1's backward; the proxies need the same cores) came
/// and went with the load: means of 0.78 to 0.89 on some runs, 0.98 to 1.06 on others, where
/// a path without overlap measured 0.95 to 1.02. Run with `--ignored` on a quiet machine.
#[test]
#[ignore = "timing: needs a host whose cores are not shared with other work"]
fn over_a_throttled_network_dp_buckets_overlap_the_backward_pass() {
    // Correct on every attempt; faster on one of five jobs (see the fused ops' throttle test:
    // the gain here is smaller, fc2's averaging hidden behind fc1's backward, so more tries).
    let mut misses = Vec::new();
    for attempt in 1..=5 {
        let (mean, ratios) = dp_overlap_job(attempt);
        // Without overlap both ways are the same work and the ratios are about 1: their mean
        // must be clearly below.
        if mean < 0.95 {
            return;
        }
        misses.push(format!("attempt {attempt}: {ratios}"));
    }
    panic!("overlapped dp steps not faster in any of 5 attempts:\n{}", misses.join("\n"));
}

/// Every op over every group of `meshes` (dp x tp) on `world`, and each mesh's report of tp
/// groups that cross nodes: `dp x tp: <failures> warning=<yes|no>` per mesh; with `nested`, the
/// ops over a group split from a group, both across nodes, too.
fn mesh_groups_body(
    world: &World,
    meshes: &[(usize, usize)],
    nested: bool,
) -> dist_tensor::Result<String> {
    let out = world.run(|rank| {
        let mut lines = Vec::new();
        for &(dp, tp) in meshes {
            let mut fails = common::mesh_ops::mesh_ops(rank, dp, tp)?;
            let mesh = dist_tensor::mesh::DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
            // The baselines on MPI's own collectives run over the world's communicator only: on
            // a group, a typed error on every rank (no group has a communicator of its own).
            let x = ndarray::Array2::<f32>::zeros((2, 3));
            for dim in ["dp", "tp"] {
                let group = mesh.rank_of(dim)?;
                match fused::all_gather_matmul_unfused_mpi(&group, x.view(), &[x.t()]) {
                    Err(Error::InvalidArgument { reason, .. })
                        if reason.contains("not over a group") => {}
                    other => fails.push(format!("unfused_mpi on {dim}: {:?}", other.map(drop))),
                }
            }
            let warned = if mesh.layout_warning().is_some() { "yes" } else { "no" };
            lines.push(format!("{dp}x{tp}: {fails:?} warning={warned}"));
        }
        if nested {
            // A group of a group, both across the nodes: the whole world as a group, then its
            // even and odd ranks (world ranks 0, 2 and 1, 3: one on each node of two).
            let all = rank.split(0, rank.rank() as u64)?;
            let half = all.rank().split((rank.rank() % 2) as u64, 0)?;
            let members: Vec<usize> = half.members().iter().map(|&m| all.members()[m]).collect();
            let fails = common::mesh_ops::group_ops::<f64>(&half.rank(), &members, 60);
            lines.push(format!("nested {members:?}: {fails:?}"));
        }
        Ok(lines.join("; "))
    })?;
    Ok(out[0].clone())
}

/// Groups whose members are on different nodes: a 2 x 2 mesh on nodes of one rank (every tp
/// and dp group crosses nodes, and the mesh reports the tp groups), and on nodes of two ranks a
/// 2 x 2 mesh (tp inside the nodes, dp across) and a 1 x 4 one (one tp group of both nodes: two
/// members by pointer, two through the proxy), and a group split from a group across nodes.
/// Every collective and fused op over every group, in every dtype, against f64, and the dp and
/// tp groups at once.
#[test]
fn groups_across_nodes_run_every_op_on_every_group() {
    const NAME: &str = "groups_across_nodes_run_every_op_on_every_group";
    let shape = std::env::var("MESH_SHAPE").ok();
    if in_rank(|world| match shape.as_deref() {
        Some("own") => mesh_groups_body(world, &[(2, 2)], false),
        _ => mesh_groups_body(world, &[(2, 2), (1, 4)], true),
    }) {
        return;
    }
    for (shape, tag, want) in
        [(Shape::OwnNodes, "own", "2x2: [] warning=yes"), (Shape::NodesOfTwo, "two", "")]
    {
        let job = mpirun(NAME, 4, shape, &[("MESH_SHAPE", tag)], &[]);
        assert!(job.success, "{shape:?}: mpirun failed:\n{}\n{}", job.stdout, job.stderr);
        println!("{shape:?}: mpirun took {:?}", job.elapsed);
        for r in 0..4 {
            let want = match want {
                "" => format!(
                    "2x2: [] warning=no; 1x4: [] warning=yes; nested {:?}: []",
                    [r % 2, r % 2 + 2]
                ),
                want => want.to_string(),
            };
            assert_eq!(job.result(r), want, "{shape:?}, rank {r}");
        }
    }
}

/// Calls that cross on the groups of a 2 x 2 mesh of one node (rank 0 in its tp group's call
/// waits for rank 1, in its dp group's, and so on round): every rank fails within seconds with
/// the mismatch, not at the wait timeout; correct calls that wait on each other across groups
/// for longer are unaffected.
#[test]
fn one_node_crossed_calls_on_different_groups_fail_every_rank_with_op_mismatch() {
    const NAME: &str =
        "one_node_crossed_calls_on_different_groups_fail_every_rank_with_op_mismatch";
    let slow = std::env::var("CROSSED_SLOW").is_ok();
    if in_rank(|world| crossed_in_job(world, slow)) {
        return;
    }
    for slow in [false, true] {
        let mut env = vec![("DIST_TENSOR_WAIT_TIMEOUT_MS", "20000")];
        if slow {
            env.push(("CROSSED_SLOW", "1"));
        }
        let job = mpirun(NAME, 4, Shape::OneNode, &env, &[]);
        let outcomes: Vec<String> = (0..4).map(|r| job.result(r)).collect();
        check_crossed(&outcomes, slow);
    }
}

/// The same crossed calls on two nodes of two ranks: the tp groups inside the nodes, the dp
/// groups across, so the cycle 0 -> 1 -> 3 -> 2 -> 0 passes through the other node twice (the
/// proxies relay the posts of calls that wait); and on nodes of one rank, every link of it.
#[test]
fn crossed_calls_through_other_nodes_fail_every_rank_with_op_mismatch() {
    const NAME: &str = "crossed_calls_through_other_nodes_fail_every_rank_with_op_mismatch";
    let slow = std::env::var("CROSSED_SLOW").is_ok();
    if in_rank(|world| crossed_in_job(world, slow)) {
        return;
    }
    for (shape, slow) in
        [(Shape::NodesOfTwo, false), (Shape::NodesOfTwo, true), (Shape::OwnNodes, false)]
    {
        let mut env = vec![("DIST_TENSOR_WAIT_TIMEOUT_MS", "20000")];
        if slow {
            env.push(("CROSSED_SLOW", "1"));
        }
        let job = mpirun(NAME, 4, shape, &env, &[]);
        println!("{shape:?}, slow {slow}: mpirun took {:?}", job.elapsed);
        let outcomes: Vec<String> = (0..4).map(|r| job.result(r)).collect();
        check_crossed(&outcomes, slow);
    }
}
