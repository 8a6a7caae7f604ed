//! `perf_report --mpi`: the fused ops across nodes beside the unfused baselines a user of MPI
//! writes (`MPI_Allgatherv` then the local GEMM, the local GEMM then `MPI_Reduce_scatter`, a
//! permute, `MPI_Alltoallv` and a permute back), with the transport measured per path, a model of
//! each op's time (latency plus bytes over bandwidth per step) fitted to it, and a projection to
//! a faster fabric.
//!
//! Started plainly (`perf_report --mpi`), it runs itself under mpirun in three shapes of fake nodes on this host (every
//! process its own node, 2 and 4 nodes; 2 nodes of 2 ranks), with `--mca btl self,tcp` so every
//! byte between nodes crosses loopback TCP, and prints what rank 0 of each printed. Needs the
//! `mpi` feature and OpenMPI's mpirun. `--shapes 4x1,4x2` runs only those shapes (processes x
//! ranks per node).

use std::time::Instant;

use dist_tensor::shmem::job_env::RANKS_PER_NODE_ENV;
use dist_tensor::shmem::{GlobalPtr, SignalOp, WaitCmp, WaitSem};
use dist_tensor::tensor::matmul;
use dist_tensor::{DistTensor, Error, Placement, Rank, Result, Tensor, World, fused};

use super::measure::{self, load, median};

/// The shapes run: processes, ranks per node.
const SHAPES: [(usize, usize); 3] = [(2, 1), (4, 1), (4, 2)];
/// The fabric the projection models.
const FABRIC_ALPHA_US: f64 = 3.0;
const FABRIC_GB_S: f64 = 25.0;
/// What each fused op puts to another node at once, in f32 (256 Ki elements: the library's
/// `REMOTE_CHUNK_ELEMS`, one for every op).
const NODE_CHUNK_BYTES: usize = 256 * 1024 * 4;

/// Runs this program under mpirun in every shape; rank 0 of each prints its tables.
pub fn main(quick: bool) -> Result<()> {
    if World::launched() {
        return rank_main(quick);
    }
    let exe = std::env::current_exe()?;
    println!(
        "# MPI across fake nodes of this host ({} cores), loopback TCP between nodes",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("load average (1, 5, 15 min) before: {}", load());
    // `--shapes 4x1,4x2`: only those (processes x ranks per node).
    let args: Vec<String> = std::env::args().collect();
    let chosen = args.iter().position(|a| a == "--shapes").and_then(|i| args.get(i + 1));
    let shapes: Vec<(usize, usize)> = match chosen {
        Some(list) => list
            .split(',')
            .filter_map(|s| {
                let (np, per) = s.split_once('x')?;
                Some((np.parse().ok()?, per.parse().ok()?))
            })
            .collect(),
        None => SHAPES.to_vec(),
    };
    for (np, per_node) in shapes {
        let mut cmd = std::process::Command::new("mpirun");
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()]);
        cmd.args(["--mca", "btl", "self,tcp", "-x", &format!("{RANKS_PER_NODE_ENV}={per_node}")]);
        cmd.arg(&exe).arg("--mpi");
        if quick {
            cmd.arg("--quick");
        }
        let status = cmd.status().map_err(|e| {
            Error::user(format!("perf_report --mpi runs mpirun (OpenMPI), which failed: {e}"))
        })?;
        if !status.success() {
            return Err(Error::user(format!("mpirun -np {np} ({per_node} per node): {status}")));
        }
    }
    println!("load average (1, 5, 15 min) after: {}", load());
    Ok(())
}

/// One path's transport: one-way times of puts of each size, and the fitted model
/// `t = alpha + bytes / beta`.
struct Path {
    name: &'static str,
    sizes: Vec<(usize, f64)>,
    alpha: f64,
    beta: f64,
}

/// Least squares of `t = alpha + bytes / beta`.
fn fit(points: &[(usize, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(a, b), &(x, y)| (a + x as f64, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for &(x, y) in points {
        sxy += (x as f64 - mx) * (y - my);
        sxx += (x as f64 - mx) * (x as f64 - mx);
    }
    let slope = (sxy / sxx).max(1e-15);
    ((my - slope * mx).max(0.0), 1.0 / slope)
}

/// Ping-pong of puts between rank 0 and `peer` (the others wait): one-way time per size.
fn ping_pong(rank: &Rank<'_>, peer: usize, sizes: &[usize], reps: usize) -> Result<Vec<f64>> {
    let me = rank.rank();
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let buf = rank.alloc::<u8>(largest)?;
    let sig = rank.alloc_signals(1)?;
    let src = vec![1u8; largest];
    let mut count = 0u64;
    let mut times = Vec::new();
    for &bytes in sizes {
        let _ = rank.barrier_all()?;
        let mut start = Instant::now();
        if me == 0 || me == peer {
            let other = if me == 0 { peer } else { 0 };
            let send = || -> Result<()> {
                // SAFETY: the other side reads the bytes only after the signal, and writes this
                // side's buffer only after this side's put arrived (ping-pong); `src` is not
                // changed.
                unsafe {
                    rank.put_signal(
                        buf.ptr(),
                        other,
                        GlobalPtr::from_slice(&src),
                        bytes,
                        (&sig, 0),
                        SignalOp::Add(1),
                    )
                }
            };
            // One warm-up round trip, then `reps` timed ones.
            for i in 0..=reps {
                if i == 1 {
                    start = Instant::now();
                }
                if me == 0 {
                    send()?;
                    count += 1;
                    let _ = rank.wait(&sig, 0, WaitCmp::Ge(count), WaitSem::Acquire)?;
                } else {
                    count += 1;
                    let _ = rank.wait(&sig, 0, WaitCmp::Ge(count), WaitSem::Acquire)?;
                    send()?;
                }
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        times.push(elapsed / reps as f64 / 2.0);
    }
    let _ = rank.barrier_all()?;
    Ok(times)
}

/// The paths of rank 0 that exist in this world: to a rank of its node, to one of another.
fn transport(rank: &Rank<'_>, quick: bool) -> Result<Vec<Path>> {
    let n = rank.num_ranks();
    let sizes = [8usize, 4 << 10, 64 << 10, 1 << 20, 8 << 20];
    let reps = if quick { 10 } else { 40 };
    let local = (1..n).find(|&p| rank.node_of(p) == rank.node_of(0));
    let remote = (1..n).find(|&p| rank.node_of(p) != rank.node_of(0));
    let mut paths = Vec::new();
    for (name, peer) in [("shared memory", local), ("MPI (TCP)", remote)] {
        let Some(peer) = peer else { continue };
        let times = ping_pong(rank, peer, &sizes, reps)?;
        let points: Vec<(usize, f64)> = sizes.iter().copied().zip(times).collect();
        let (alpha, beta) = fit(&points);
        paths.push(Path { name, sizes: points, alpha, beta });
    }
    Ok(paths)
}

/// One op's measured and modelled times, in seconds.
struct Row {
    op: String,
    fused: f64,
    mpi: f64,
    ratio: f64,
    local: f64,
    model: (f64, f64),
    projected: (f64, f64),
}

/// The model of the design note: fused ~ max(local, intra + inter) + first chunk, unfused ~ the
/// sum; `inter = (nodes - 1)(alpha + bytes / beta)` for `bytes` a rank gets from each other node.
fn model(
    local: f64,
    intra: f64,
    per_node: usize,
    chunk: usize,
    nodes: usize,
    net: (f64, f64),
) -> (f64, f64) {
    let (alpha, beta) = net;
    let inter = (nodes - 1) as f64 * (alpha + per_node as f64 / beta);
    let first = if nodes > 1 { alpha + chunk.min(per_node) as f64 / beta } else { 0.0 };
    (local.max(intra + inter) + first, local + intra + inter)
}

/// Fused and unfused (MPI) in pairs, one right after the other, every rank in step (barriers):
/// medians of the times and of the pairs' ratios.
fn pairs(
    rank: &Rank<'_>,
    reps: usize,
    fused: impl FnMut() -> Result<()>,
    mpi: impl FnMut() -> Result<()>,
) -> Result<(f64, f64, f64)> {
    let pairs = measure::pairs(rank, reps, fused, mpi)?;
    let each = |f: fn(&measure::Pair) -> f64| median(pairs.iter().map(f).collect());
    Ok((each(|p| p.fused), each(|p| p.unfused), each(measure::Pair::ratio)))
}

/// Median time of `op` run by every rank at once (as the ops' local work is), from barrier to
/// barrier.
fn together(rank: &Rank<'_>, reps: usize, mut op: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut t = Vec::new();
    for _ in 0..reps + 1 {
        t.push(measure::together(rank, &mut op)?);
    }
    Ok(median(t[1..].to_vec()))
}

fn rank_main(quick: bool) -> Result<()> {
    let world = World::from_env()?;
    let reps = if quick { 3 } else { 7 };
    let lines = world.run(|rank| {
        let (n, nodes) = (rank.num_ranks(), rank.num_nodes());
        let per_node = rank.node_ranks(0).len();
        let mut out = vec![format!(
            "\n## {n} processes, {nodes} nodes of {per_node} (rank 0's view; load {})",
            load()
        )];
        let paths = transport(rank, quick)?;
        out.push("| path | 8 B one way | 4 KiB | 64 KiB | 1 MiB | 8 MiB | fit: alpha | fit: beta |".into());
        out.push("| --- | --- | --- | --- | --- | --- | --- | --- |".into());
        for p in &paths {
            let cells: Vec<String> =
                p.sizes.iter().map(|&(_, t)| format!("{:.1} us", t * 1e6)).collect();
            out.push(format!(
                "| {} | {} | {:.1} us | {:.2} GB/s |",
                p.name,
                cells.join(" | "),
                p.alpha * 1e6,
                p.beta / 1e9
            ));
        }
        let shm = paths.iter().find(|p| p.name == "shared memory").map(|p| (p.alpha, p.beta));
        let net = paths.iter().find(|p| p.name != "shared memory").map_or((0.0, 1.0), |p| (p.alpha, p.beta));
        let intra_of = |bytes: usize| shm.map_or(0.0, |(a, b)| a + bytes as f64 / b);
        let local_peers = per_node - 1;
        let mut rows = Vec::new();

        // all_gather_matmul: x [M, K] rows sharded, w [K, N] columns sharded.
        let (m, k, nn) = if quick { (1024, 1024, 512) } else { (2048, 2048, 1024) };
        let x = Tensor::<f32>::random(&[m, k], 1);
        let w = Tensor::<f32>::random(&[k, nn], 2);
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let ws = DistTensor::from_global(rank, &w, Placement::Shard(1))?.into_local();
        let (xv, wv) = (xs.local().view2("x")?, ws.view2("w")?);
        let (tf, tu, ratio) = pairs(
            rank,
            reps,
            || xs.all_gather_matmul(&ws).map(drop),
            || fused::all_gather_matmul_unfused_mpi(rank, xv, &[wv]).map(drop),
        )?;
        let full = Tensor::<f32>::random(&[m, k], 3);
        let threads = rank.topology().aicore_num();
        let local = together(rank, reps, || {
            matmul(full.view2("x")?, ws.view2("w")?, threads).map(drop)
        })?;
        let shard = m.div_ceil(n) * k * 4;
        let intra = intra_of(shard * local_peers * nodes);
        let chunk = NODE_CHUNK_BYTES;
        rows.push(Row {
            op: format!("all_gather_matmul M={m} K={k} N={nn}"),
            fused: tf,
            mpi: tu,
            ratio,
            local,
            model: model(local, intra, shard, chunk, nodes, net),
            projected: model(local, intra, shard, chunk, nodes, (FABRIC_ALPHA_US * 1e-6, FABRIC_GB_S * 1e9)),
        });

        // matmul_reduce_scatter: h [M, K] columns sharded, w [K, N] rows sharded.
        let h = Tensor::<f32>::random(&[m, k], 4);
        let w2 = Tensor::<f32>::random(&[k, nn], 5);
        let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
        let w2s = DistTensor::from_global(rank, &w2, Placement::Shard(0))?.into_local();
        let (hv, w2v) = (hs.local().view2("h")?, w2s.view2("w")?);
        let (tf, tu, ratio) = pairs(
            rank,
            reps,
            || hs.matmul_reduce_scatter(&w2s).map(drop),
            || fused::matmul_reduce_scatter_unfused_mpi(rank, hv, w2v).map(drop),
        )?;
        let local = together(rank, reps, || matmul(hv, w2v, threads).map(drop))?;
        let rows_bytes = m.div_ceil(n) * nn * 4;
        let intra = intra_of(rows_bytes * local_peers * nodes);
        rows.push(Row {
            op: format!("matmul_reduce_scatter M={m} K={k} N={nn}"),
            fused: tf,
            mpi: tu,
            ratio,
            local,
            model: model(local, intra, rows_bytes * per_node, NODE_CHUNK_BYTES, nodes, net),
            projected: model(local, intra, rows_bytes * per_node, NODE_CHUNK_BYTES, nodes, (FABRIC_ALPHA_US * 1e-6, FABRIC_GB_S * 1e9)),
        });

        // Ulysses all_to_all: [B, S, H, D] sequence sharded -> heads sharded.
        let (b, s, hh, d) = if quick { (1, 1024, 16, 64) } else { (1, 4096, 16, 128) };
        let q = Tensor::<f32>::random(&[b, s, hh, d], 6);
        let qs = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
        let (tf, tu, ratio) = pairs(
            rank,
            reps,
            || qs.all_to_all(2, 1).map(drop),
            || fused::all_to_all_unfused_mpi(rank, qs.local(), 2, 1).map(drop),
        )?;
        // The local work of a move: copying this rank's part once.
        let local = together(rank, reps, || {
            let _ = std::hint::black_box(qs.local().as_slice().to_vec());
            Ok(())
        })?;
        let pair_bytes = b * s * hh * d * 4 / (n * n);
        let intra = intra_of(pair_bytes * local_peers);
        rows.push(Row {
            op: format!("all_to_all (Ulysses) B={b} S={s} H={hh} D={d}"),
            fused: tf,
            mpi: tu,
            ratio,
            local,
            model: model(local, intra, pair_bytes * per_node, NODE_CHUNK_BYTES, nodes, net),
            projected: model(local, intra, pair_bytes * per_node, NODE_CHUNK_BYTES, nodes, (FABRIC_ALPHA_US * 1e-6, FABRIC_GB_S * 1e9)),
        });

        out.push(format!(
            "\n| op (f32) | fused ms | MPI unfused ms | fused/unfused | local work ms | model fused | model unfused | model: {FABRIC_GB_S} GB/s, {FABRIC_ALPHA_US} us fused | unfused |"
        ));
        out.push("| --- | --- | --- | --- | --- | --- | --- | --- | --- |".into());
        let ms = |t: f64| format!("{:.2}", t * 1e3);
        for r in &rows {
            out.push(format!(
                "| {} | {} | {} | {:.3} | {} | {} | {} | {} | {} |",
                r.op,
                ms(r.fused),
                ms(r.mpi),
                r.ratio,
                ms(r.local),
                ms(r.model.0),
                ms(r.model.1),
                ms(r.projected.0),
                ms(r.projected.1)
            ));
        }
        Ok(out.join("\n"))
    })?;
    if world.ranks_here().start == 0 {
        println!("{}", lines[0]);
    }
    Ok(())
}
