//! 06: writing your own tile kernel in the seed's conventions.
//!
//! A fused "all_gather + row norms": every rank holds some rows of a matrix (a different number on
//! each rank) and every rank wants the squared norm of every row. The kernel shows the whole
//! model in one place:
//! - a mix launch: vector sub-core 0 of each AI core communicates, the other sub-cores compute;
//! - communication pushes this rank's rows into every peer's symmetric inbox through `symm_at`
//!   (peers in rotated order, so no rank is everyone's first target), one `notify` per block;
//! - computation walks a flattened (source, block) task space grid-stride, its own rows first,
//!   `wait`s for a source's blocks, `consume_token`s, loads tiles with masks (no padding) and
//!   stores the norms with masks;
//! - signals count blocks across calls (an epoch), so calling the kernel again needs no reset.
//!
//! Run: `cargo run --release --example 06_custom_kernel`

use dist_tensor::device::tile::{self, Tile};
use dist_tensor::device::{LaunchMode, launch};
use dist_tensor::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, Scope, SignalOp, WaitCmp, WaitSem, consume_token, symm_at,
};
use dist_tensor::tensor::split_offsets;
use dist_tensor::{Error, Tensor, World};

const D: usize = 37; // row length: deliberately not a multiple of anything
const BLOCK: usize = 16; // rows per task

/// Rows on each rank: uneven, one rank empty.
fn rows_of(rank: usize) -> usize {
    [23, 0, 41, 9][rank % 4]
}

fn main() -> Result<(), Error> {
    // `--processes N` runs the ranks as processes (`World::spawn_local`); under mpirun or
    // torchrun each process is one rank (`World::from_env`); otherwise 4 threads.
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = World::from_args(&mut args, 4)? else { return Ok(()) };
    let lead = world.ranks_here().contains(&0); // rank 0 prints the summary
    let n = world.num_ranks();
    let counts: Vec<usize> = (0..n).map(rows_of).collect();
    let offsets = split_offsets(&counts);
    let total = offsets[n];
    let inputs: Vec<Tensor<f32>> =
        (0..n).map(|r| Tensor::random(&[counts[r], D], r as u64)).collect();

    let results = world.run(|rank| {
        let me = rank.rank();
        let inbox = rank.alloc::<f32>(total * D)?; // every rank's rows, at the same offset everywhere
        let arrived = rank.alloc_signals(n)?; // arrived[s]: blocks of rank s in this rank's inbox
        let blocks: Vec<usize> = counts.iter().map(|&c| c.div_ceil(BLOCK)).collect();
        let x = GlobalPtr::from_slice(inputs[me].as_slice());
        let mut all_norms = Vec::new();

        for call in 1..=2u64 {
            let mut norms = vec![0.0f32; total];
            let out = GlobalPtrMut::from_slice(&mut norms);
            // SAFETY: each rank writes only its own rows of a peer's inbox, before notifying; a
            // program reads a source's rows only after acquiring all of its blocks of this call;
            // every norm is written by one task. Calls are ordered by the barrier below.
            unsafe {
                launch(rank, LaunchMode::Mix, rank.topology().aicore_num(), |p| {
                    if p.sub_vec_id() == 0 {
                        // Communication: (peer, block) flattened, peers rotated.
                        for task in p.tasks((n - 1) * blocks[me]) {
                            let (i, block) = (1 + task / blocks[me], task % blocks[me]);
                            let peer = (me + i) % n;
                            let row = block * BLOCK;
                            let valid = tile::valid_len(row, BLOCK, counts[me]); // the mask
                            let dst = symm_at(&inbox, peer) + (offsets[me] + row) * D;
                            tile::copy_2d(dst, D, x + row * D, D, (valid, D));
                            p.notify(
                                &arrived,
                                me,
                                peer,
                                SignalOp::Add(1),
                                Scope::Peer,
                                NotifySem::Release,
                            )?;
                        }
                    }
                    // Computation on the other sub-cores (on sub-core 0 too, if it is the only one).
                    let first = usize::from(p.sub_vec_num() > 1);
                    let order: Vec<usize> = (0..n).map(|i| (me + i) % n).collect();
                    let starts =
                        split_offsets(&order.iter().map(|&s| blocks[s]).collect::<Vec<_>>());
                    let mut tile = Tile::new(BLOCK, D, 0.0f32);
                    let mut sums = [0.0f32; BLOCK];
                    for task in p.tasks_on_sub_vecs(first, starts[n]) {
                        let i = starts.partition_point(|&s| s <= task) - 1;
                        let (src, row) = (order[i], (task - starts[i]) * BLOCK);
                        let valid = tile::valid_len(row, BLOCK, counts[src]);
                        if src == me {
                            tile::load_2d(x + row * D, D, (valid, D), 0.0, &mut tile);
                        } else {
                            let want = WaitCmp::Ge(call * blocks[src] as u64);
                            let token = p.wait(&arrived, src, want, WaitSem::Acquire)?;
                            let rows = consume_token(inbox.ptr(), token) + (offsets[src] + row) * D;
                            tile::load_2d(rows, D, (valid, D), 0.0, &mut tile);
                        }
                        for (r, sum) in sums.iter_mut().enumerate() {
                            *sum = tile.row(r).iter().map(|v| v * v).sum();
                        }
                        tile::store_1d(out + (offsets[src] + row), &sums, valid);
                    }
                    Ok(())
                })?;
            }
            // The next call overwrites the inboxes: wait until every rank has read this one's.
            let _ = rank.barrier_all()?;
            all_norms.push(norms);
        }
        Ok(all_norms)
    })?;

    let want: Vec<f32> = inputs
        .iter()
        .flat_map(|t| {
            t.as_slice()
                .chunks(D)
                .map(|row| row.iter().map(|v| v * v).sum::<f32>())
                .collect::<Vec<_>>()
        })
        .collect();
    for (rank, calls) in world.ranks_here().zip(&results) {
        for (call, norms) in calls.iter().enumerate() {
            if norms != &want {
                eprintln!("rank {rank}, call {}: wrong norms", call + 1);
                std::process::exit(1);
            }
        }
    }
    if lead {
        println!(
            "{total} row norms from rows spread unevenly over {n} ranks (rows per rank: {counts:?})"
        );
        println!("first norms: {:?}", &want[..4]);
        println!("ok: every rank got every norm, twice, with no reset between the calls");
    }
    Ok(())
}
