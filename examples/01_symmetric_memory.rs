//! 01: symmetric memory between ranks: `symm_at`, `notify`, `wait`, `consume_token`.
//!
//! Every rank of a world of four owns an inbox with one row per rank, at the same offset in every
//! rank's heap segment. Each rank writes its row straight into every peer's inbox through the
//! peer's pointer (`symm_at`), then notifies the peer. Each rank waits for every peer's signal and
//! reads its inbox only through the token the wait returned.
//!
//! Run: `cargo run --release --example 01_symmetric_memory`

use dist_tensor::device::tile;
use dist_tensor::shmem::{NotifySem, Scope, SignalOp, WaitCmp, WaitSem, consume_token, symm_at};
use dist_tensor::{Error, World};

const ROW: usize = 5;

fn row_of(rank: usize) -> Vec<f32> {
    (0..ROW).map(|i| (rank * 100 + i) as f32).collect()
}

fn main() -> Result<(), Error> {
    // `--processes 4` runs the ranks as processes (`World::spawn_local`); under mpirun or
    // torchrun each process is one rank (`World::from_env`); otherwise 4 threads.
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = World::from_args(&mut args, 4)? else { return Ok(()) };
    let inboxes = world.run(|rank| {
        let (me, n) = (rank.rank(), rank.num_ranks());
        let inbox = rank.alloc::<f32>(n * ROW)?; // collective: same offset everywhere
        let arrived = rank.alloc_signals(n)?; // signal p: "rank p's row is here"

        let mine = row_of(me);
        for i in 0..n {
            let peer = (me + i) % n; // rotated, so no rank is everyone's first target
            // A remote pointer is a plain pointer: offsets are added after symm_at.
            let dst = symm_at(&inbox, peer) + me * ROW;
            // SAFETY: only this rank writes its row of the peer's inbox, and the peer reads it
            // only after this rank's notify below.
            unsafe { tile::store_1d(dst, &mine, ROW) };
            rank.notify(&arrived, me, peer, SignalOp::Set(1), Scope::Peer, NotifySem::Release)?;
        }

        let mut got = vec![0.0f32; n * ROW];
        for peer in 0..n {
            let token = rank.wait(&arrived, peer, WaitCmp::Eq(1), WaitSem::Acquire)?;
            // The inbox is readable only through the token (rule 3).
            let row = consume_token(inbox.ptr(), token) + peer * ROW;
            // SAFETY: rank `peer` wrote this row before its release notify, acquired above.
            unsafe { tile::load_1d(row, &mut got[peer * ROW..(peer + 1) * ROW], ROW, f32::NAN) };
        }
        let _ = rank.barrier_all()?; // nobody frees its inbox while a peer may still write
        Ok(got)
    })?;

    let want: Vec<f32> = (0..world.num_ranks()).flat_map(row_of).collect();
    for (rank, inbox) in world.ranks_here().zip(&inboxes) {
        println!("rank {rank} inbox: {inbox:?}");
        if inbox != &want {
            eprintln!("rank {rank}: expected {want:?}");
            std::process::exit(1);
        }
    }
    if world.ranks_here().contains(&0) {
        println!("ok: every rank received every row, in place, through symm_at + notify/wait");
    }
    Ok(())
}
