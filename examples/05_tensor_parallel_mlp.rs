//! 05: a transformer MLP block with tensor parallelism, the library's main job.
//!
//! `y = gelu(x @ w1) @ w2` on a world of ranks, Megatron style: `w1` sharded by columns, `w2` by
//! rows, so the only communication is the gather of `x` fused into the first product and the
//! reduce-scatter fused into the second. The result is checked against the same block computed on
//! one rank in f64, and the fused ops are timed beside the unfused ones (collective, then local
//! product) on the same inputs.
//!
//! Run: `cargo run --release --example 05_tensor_parallel_mlp -- [--world 4] [--tokens 512]
//! [--hidden 1024] [--ffn 4096] [--reps 5] [--processes 4]`
//!
//! `--processes N` runs the ranks as N processes of this program (`World::spawn_local`) instead
//! of threads; under mpirun or torchrun each process is one rank (`World::from_env`):
//! `mpirun -np 4 target/release/examples/05_tensor_parallel_mlp`.

use std::time::{Duration, Instant};

use dist_tensor::{Device, DistTensor, Error, Placement, Rank, Tensor, World};

struct Sizes {
    world: usize,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    reps: usize,
}

fn parse_args(args: Vec<String>) -> Result<Sizes, String> {
    let mut sizes = Sizes { world: 4, tokens: 512, hidden: 1024, ffn: 4096, reps: 5 };
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let value: usize =
            value.parse().map_err(|_| format!("{flag} {value}: not a whole number"))?;
        match flag.as_str() {
            "--world" => sizes.world = value,
            "--tokens" => sizes.tokens = value,
            "--hidden" => sizes.hidden = value,
            "--ffn" => sizes.ffn = value,
            "--reps" => sizes.reps = value.max(1),
            other => {
                return Err(format!(
                    "unknown flag {other}; flags: --world --tokens --hidden --ffn --reps \
                     --processes"
                ));
            }
        }
    }
    Ok(sizes)
}

/// The tanh approximation of GELU, as transformer MLPs use it: the reference's, in f64.
fn gelu(v: f64) -> f64 {
    0.5 * v * (1.0 + (0.797_884_560_802_865_4 * (v + 0.044715 * v * v * v)).tanh())
}

/// One MLP block on this rank: `x` is its rows, `w1` its columns of the first weight, `w2` its
/// rows of the second.
fn mlp<'r>(
    x: &DistTensor<'r, f32>,
    w1: &Tensor<f32>,
    w2: &Tensor<f32>,
    fused: bool,
) -> Result<DistTensor<'r, f32>, Error> {
    let h = if fused { x.all_gather_matmul(w1)? } else { x.all_gather_matmul_unfused(w1)? };
    // GELU is elementwise: each rank applies it to its own columns, no communication.
    let h = h.map_local(|t| t.gelu_tanh())?;
    if fused { h.matmul_reduce_scatter(w2) } else { h.matmul_reduce_scatter_unfused(w2) }
}

fn median(mut t: Vec<Duration>) -> Duration {
    t.sort();
    t[t.len() / 2]
}

fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let threads = args
        .iter()
        .position(|a| a == "--world")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(4);
    let Some(ranks) = World::from_args(&mut args, threads)? else { return Ok(()) };
    let lead = ranks.ranks_here().contains(&0); // rank 0 prints the summary
    let sizes = parse_args(args).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let Sizes { tokens, hidden, ffn, reps, .. } = sizes;
    let world = ranks.num_ranks();
    if lead {
        println!(
            "MLP block: x [{tokens}, {hidden}] @ w1 [{hidden}, {ffn}] -> gelu -> @ w2 [{ffn}, {hidden}], world {world}, f32"
        );
    }
    let x = Tensor::<f32>::random(&[tokens, hidden], 1);
    let w1 = Tensor::<f32>::random(&[hidden, ffn], 2).cast::<f64>();
    let w2 = Tensor::<f32>::random(&[ffn, hidden], 3).cast::<f64>();
    // Scale the weights so activations stay near 1 (as trained weights do).
    let scale = |t: Tensor<f64>, by: f64| (t * by).cast::<f32>();
    let w1 = scale(w1, 1.0 / (hidden as f64).sqrt());
    let w2 = scale(w2, 1.0 / (ffn as f64).sqrt());

    let results = ranks.run(|rank: &Rank<'_>| {
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let w1s = DistTensor::from_global(rank, &w1, Placement::Shard(1))?.into_local();
        let w2s = DistTensor::from_global(rank, &w2, Placement::Shard(0))?.into_local();
        // Where the world keeps it (a GPU world: the rank's GPU), then on the host to check.
        let y = mlp(&xs, &w1s, &w2s, true)?.to_global()?.to_host()?;
        let (mut fused, mut unfused) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            for (is_fused, times) in [(true, &mut fused), (false, &mut unfused)] {
                let _ = rank.barrier_all()?;
                let start = Instant::now();
                drop(mlp(&xs, &w1s, &w2s, is_fused)?);
                // A GPU op returns once queued: wait for the GPU, or the time is the launch's.
                if matches!(rank.device(), Device::Cuda(_)) {
                    dist_tensor::device::cuda::synchronize(rank)?;
                }
                let _ = rank.barrier_all()?;
                times.push(start.elapsed());
            }
        }
        Ok((y, median(fused), median(unfused)))
    })?;

    // The single-rank reference, in f64.
    let h = x.cast::<f64>().matmul(&w1.cast::<f64>())?;
    let h = h.map(gelu);
    let want = h.matmul(&w2.cast::<f64>())?;
    let (y, fused, unfused) = &results[0];
    let worst = y
        .as_slice()
        .iter()
        .zip(want.as_slice())
        .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
    let size = want.as_slice().iter().fold(0.0f64, |m, w| m.max(w.abs()));
    if lead {
        println!(
            "largest difference from the single-rank f64 result: {worst:.2e} (largest value {size:.2e})"
        );
        println!(
            "fused   (all_gather_matmul + matmul_reduce_scatter): {:8.2} ms",
            fused.as_secs_f64() * 1e3
        );
        println!(
            "unfused (collective, then local matmul, each):       {:8.2} ms",
            unfused.as_secs_f64() * 1e3
        );
        println!(
            "fused / unfused: {:.3} (median of {reps})",
            fused.as_secs_f64() / unfused.as_secs_f64()
        );
    }
    // f32 products over `ffn` terms: a few ulps of f32 times the sum's size.
    if worst > 1e-4 * size.max(1.0) {
        eprintln!("the distributed result differs from the single-rank one");
        std::process::exit(1);
    }
    if lead {
        println!("ok");
    }
    Ok(())
}
