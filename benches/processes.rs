//! Ranks as processes against ranks as threads, in one run: a signal round trip between two
//! ranks, and a 16 MiB store into a peer's buffer through `symm_at`. Each measurement is the
//! median over repetitions; each repetition measures threads, then processes (this bench
//! re-executed as the two ranks), and the table shows the medians and the ratio.
//!
//! Run: `cargo bench --bench processes`

use std::time::{Duration, Instant};

use dist_tensor::device::tile;
use dist_tensor::shmem::{GlobalPtr, NotifySem, Scope, SignalOp, WaitCmp, WaitSem, symm_at};
use dist_tensor::{Rank, Result, World};

const ROUND_TRIPS: u64 = 20_000;
const COPY_BYTES: usize = 16 << 20;
const COPIES: usize = 20;
const REPS: usize = 7;

/// Rank 0 sets rank 1's signal, rank 1 answers: the time per round trip, on rank 0.
fn round_trip(rank: &Rank<'_>) -> Result<Duration> {
    let sigs = rank.alloc_signals(1)?;
    let (me, peer) = (rank.rank(), 1 - rank.rank());
    let _ = rank.barrier_all()?;
    let start = Instant::now();
    for i in 1..=ROUND_TRIPS {
        let set = SignalOp::Set(i);
        if me == 0 {
            rank.notify(&sigs, 0, peer, set, Scope::Peer, NotifySem::Release)?;
            let _ = rank.wait(&sigs, 0, WaitCmp::Eq(i), WaitSem::Acquire)?;
        } else {
            let _ = rank.wait(&sigs, 0, WaitCmp::Eq(i), WaitSem::Acquire)?;
            rank.notify(&sigs, 0, peer, set, Scope::Peer, NotifySem::Release)?;
        }
    }
    let elapsed = start.elapsed();
    let _ = rank.barrier_all()?;
    Ok(elapsed / ROUND_TRIPS as u32)
}

/// Rank 0 stores 16 MiB into rank 1's buffer through `symm_at`: the time per copy, on rank 0.
fn remote_copy(rank: &Rank<'_>) -> Result<Duration> {
    let len = COPY_BYTES / size_of::<f32>();
    let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
    let dst = rank.alloc::<f32>(len)?;
    let mut per_copy = Duration::ZERO;
    if rank.rank() == 0 {
        let remote = symm_at(&dst, 1);
        let from = GlobalPtr::from_slice(&src);
        // SAFETY: rank 1 does not touch its buffer until the barrier.
        unsafe { tile::copy_2d(remote, len, from, len, (1, len)) }; // pages touched
        let start = Instant::now();
        for _ in 0..COPIES {
            // SAFETY: as above.
            unsafe { tile::copy_2d(remote, len, from, len, (1, len)) };
        }
        per_copy = start.elapsed() / COPIES as u32;
    }
    let _ = rank.barrier_all()?;
    Ok(per_copy)
}

fn both(rank: &Rank<'_>) -> Result<(Duration, Duration)> {
    Ok((round_trip(rank)?, remote_copy(rank)?))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<()> {
    if World::launched() {
        // One rank of the process world: rank 0 reports.
        let world = World::from_env()?;
        let (trip, copy) = world.run(both)?.remove(0);
        if world.ranks_here().contains(&0) {
            println!("MEASURED {} {}", trip.as_nanos(), copy.as_nanos());
        }
        return Ok(());
    }
    let threads = World::threads(2)?;
    let (mut trips, mut copies) = ((vec![], vec![]), (vec![], vec![]));
    for _ in 0..REPS {
        let (trip, copy) = threads.run(both)?.remove(0);
        trips.0.push(trip);
        copies.0.push(copy);
        let exits = World::local_job(2)
            .args(Vec::<String>::new())
            .timeout(Duration::from_secs(120))
            .run()?;
        let line = exits[0].stdout_text();
        let words: Vec<u64> = line
            .lines()
            .find_map(|l| l.strip_prefix("MEASURED "))
            .unwrap_or_else(|| {
                panic!("rank 0: {}\n{}", exits[0].describe(), exits[0].stderr_text())
            })
            .split_whitespace()
            .map(|w| w.parse().expect("a number"))
            .collect();
        trips.1.push(Duration::from_nanos(words[0]));
        copies.1.push(Duration::from_nanos(words[1]));
    }
    let (tt, tp) = (median(trips.0), median(trips.1));
    let (ct, cp) = (median(copies.0), median(copies.1));
    let gbs = |d: Duration| COPY_BYTES as f64 / d.as_secs_f64() / 1e9;
    println!("medians of {REPS} runs; each run measures threads, then processes");
    println!("| measurement | threads | processes | processes/threads |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| signal round trip | {:.2} us | {:.2} us | {:.3} |",
        tt.as_secs_f64() * 1e6,
        tp.as_secs_f64() * 1e6,
        tp.as_secs_f64() / tt.as_secs_f64()
    );
    println!(
        "| 16 MiB symm_at store | {:.2} ms ({:.1} GB/s) | {:.2} ms ({:.1} GB/s) | {:.3} |",
        ct.as_secs_f64() * 1e3,
        gbs(ct),
        cp.as_secs_f64() * 1e3,
        gbs(cp),
        cp.as_secs_f64() / ct.as_secs_f64()
    );
    Ok(())
}
