//! 04: the sequence-parallel (Ulysses) exchange around attention.
//!
//! Queries `[B, S, H, D]` arrive sharded by sequence (`Shard(1)`). Attention needs the whole
//! sequence for each head, so `all_to_all(2, 1)` turns them into `[B, S, h_r, D]`, sharded by
//! heads (`Shard(2)`), and `all_to_all(1, 2)` turns the attention output back. Neither `S` nor `H`
//! needs to divide by the world size. Checked: the heads each rank gets are the right slice of the
//! global tensor, and the round trip is exactly the identity.
//!
//! Run: `cargo run --release --example 04_ulysses_all_to_all`

use dist_tensor::{DistTensor, Error, Placement, Tensor, World};
use ndarray::{Axis, Slice};

fn main() -> Result<(), Error> {
    let (b, s, h, d) = (2, 1021, 6, 64);
    let q = Tensor::<f32>::random(&[b, s, h, d], 7);
    // `--processes N` runs the ranks as processes (`World::spawn_local`); under mpirun or
    // torchrun each process is one rank (`World::from_env`); otherwise threads.
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = World::from_args(&mut args, 4)? else { return Ok(()) };
    let lead = world.ranks_here().contains(&0); // rank 0 prints the summary
    let ok = world.run(|rank| {
        let seq = DistTensor::from_global(rank, &q, Placement::Shard(1))?; // [B, s_r, H, D]
        let heads = seq.all_to_all(2, 1)?; // [B, S, h_r, D]
        let back = heads.all_to_all(1, 2)?; // [B, s_r, H, D]

        let start: usize = heads.shard_sizes()[..rank.rank()].iter().sum();
        let mine = q.view().slice_axis(Axis(2), Slice::from(start..start + heads.local().shape()[2])).to_owned();
        let right_heads = heads.local().to_array() == mine;
        let round_trip = back.local() == seq.local();
        println!(
            "rank {}: {:?} -> {:?} (heads {start}..{}), right heads: {right_heads}, round trip exact: {round_trip}",
            rank.rank(),
            seq.local().shape(),
            heads.local().shape(),
            start + heads.local().shape()[2],
        );
        Ok(right_heads && round_trip)
    })?;
    if !ok.iter().all(|&o| o) {
        eprintln!("wrong exchange");
        std::process::exit(1);
    }
    if lead {
        println!("ok");
    }
    Ok(())
}
