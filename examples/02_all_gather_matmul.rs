//! 02: `all_gather_matmul`, the first half of a tensor-parallel layer.
//!
//! The activations `x` are sharded by rows over the ranks (`Shard(0)`), the weight `w` by columns
//! (`Shard(1)`): each rank needs every row of `x` for its columns of `x @ w`. The fused op gathers
//! the rows and multiplies in one kernel, starting on its own rows before the others arrive. The
//! result is the product sharded by columns, checked here against the product on one rank.
//!
//! Run: `cargo run --release --example 02_all_gather_matmul`

use dist_tensor::{DistTensor, Error, Placement, Tensor, World};

fn main() -> Result<(), Error> {
    let (m, k, n) = (301, 256, 190); // 301 rows do not divide by 4 ranks: shards of 76, 75, 75, 75
    let x = Tensor::<f32>::random(&[m, k], 1);
    let w = Tensor::<f32>::random(&[k, n], 2);
    let want = x.matmul(&w)?;

    // `--processes N` runs the ranks as processes (`World::spawn_local`); under mpirun or
    // torchrun each process is one rank (`World::from_env`); otherwise threads.
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = World::from_args(&mut args, 4)? else { return Ok(()) };
    let lead = world.ranks_here().contains(&0); // rank 0 prints the summary
    let got = world.run(|rank| {
        let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?; // [m_r, K]
        let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?; // [K, n_r]
        let h = x.all_gather_matmul(w.local())?; // [M, n_r], Shard(1)
        println!(
            "rank {}: x rows {:>3} -> h {:?} of global {:?}",
            rank.rank(),
            x.local().shape()[0],
            h.local().shape(),
            h.global_shape()
        );
        h.to_global()
    })?;

    let worst = max_relative_error(&got[0], &want);
    if lead {
        println!("largest relative difference from the single-rank product: {worst:.2e}");
    }
    if worst > 1e-5 {
        eprintln!("too far from the reference");
        std::process::exit(1);
    }
    if lead {
        println!("ok");
    }
    Ok(())
}

fn max_relative_error(got: &Tensor<f32>, want: &Tensor<f32>) -> f64 {
    let scale = want.as_slice().iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
    let diff = got
        .as_slice()
        .iter()
        .zip(want.as_slice())
        .fold(0.0f64, |m, (g, w)| m.max((g - w).abs() as f64));
    diff / scale
}
