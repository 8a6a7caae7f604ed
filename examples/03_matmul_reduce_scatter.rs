//! 03: `matmul_reduce_scatter`, the second half of a tensor-parallel layer.
//!
//! The hidden activations are sharded by columns (`Shard(1)`), the weight by rows (`Shard(0)`):
//! each rank's product is a partial sum of the whole result. The fused op computes the partial
//! products, the rows other ranks need first, and each rank pulls and adds its own rows in rank
//! order, so the result is the same bits on every run. Checked against the product on one rank,
//! and run twice to show the determinism.
//!
//! Run: `cargo run --release --example 03_matmul_reduce_scatter`

use dist_tensor::{DistTensor, Error, Placement, Tensor, World};

fn main() -> Result<(), Error> {
    let (m, k, n) = (123, 512, 97);
    let h = Tensor::<f32>::random(&[m, k], 1);
    let w = Tensor::<f32>::random(&[k, n], 2);
    let want = h.matmul(&w)?;

    // `--processes N` runs the ranks as processes (`World::spawn_local`); under mpirun or
    // torchrun each process is one rank (`World::from_env`); otherwise threads.
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = World::from_args(&mut args, 3)? else { return Ok(()) };
    let lead = world.ranks_here().contains(&0); // rank 0 prints the summary
    let outs = world.run(|rank| {
        let h = DistTensor::from_global(rank, &h, Placement::Shard(1))?; // [M, k_r]
        let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?; // [k_r, N]
        let first = h.matmul_reduce_scatter(w.local())?; // [m_r, N], Shard(0)
        let second = h.matmul_reduce_scatter(w.local())?;
        let same_bits = first
            .local()
            .as_slice()
            .iter()
            .zip(second.local().as_slice())
            .all(|(a, b)| a.to_bits() == b.to_bits());
        println!(
            "rank {}: rows {:?}, same bits twice: {same_bits}",
            rank.rank(),
            first.local().shape()
        );
        Ok((first.to_global()?, same_bits))
    })?;

    let (got, _) = &outs[0];
    let scale = want.as_slice().iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst =
        got.as_slice().iter().zip(want.as_slice()).fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
    if lead {
        println!("largest relative difference from the single-rank product: {:.2e}", worst / scale);
    }
    if worst / scale > 1e-5 || !outs.iter().all(|(_, same)| *same) {
        eprintln!("wrong result, or not deterministic");
        std::process::exit(1);
    }
    if lead {
        println!("ok");
    }
    Ok(())
}
