//! Ranks as processes against ranks as threads, on GPUs: what a world of processes costs where
//! it differs from the one-process world, measured with the same ranks on the same GPUs.
//!
//! - the GPU barrier (`cuda::barrier`, then waiting for it): a signal round trip between ranks,
//!   with the host's agreement step; host wall time, median, microseconds;
//! - a copy rank 0 pulls from rank 1's memory (`cuda::broadcast` from rank 1, 256 MiB by
//!   default): host wall time on rank 0 from an idle GPU to the copy's end, median, GB/s of
//!   bytes moved. (Not CUDA events: a world whose ranks share a GPU refuses `cuda::Timer`, and
//!   on one GPU both sides of the comparison are such worlds.)
//!
//! ```text
//! cargo run --release --features cuda --example gpu_processes -- [--ranks 2] [--mib 256] [--reps 30]
//! ```
//!
//! The one-process world puts rank `r` on GPU `r % device count` (ranks share a GPU where there
//! are fewer GPUs than ranks, if this build supports that; otherwise that side says why it is
//! missing); the processes take their GPU by local rank the same way.

use std::time::Instant;

use dist_tensor::device::DEVICE_ENV;
use dist_tensor::device::cuda;
use dist_tensor::{Error, Rank, Result, World};

struct Args {
    ranks: usize,
    mib: usize,
    reps: usize,
}

fn parse(args: &[String]) -> std::result::Result<Args, String> {
    let mut out = Args { ranks: 2, mib: 256, reps: 30 };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value: usize = it
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{flag} needs a whole number"))?;
        match flag.as_str() {
            "--ranks" => out.ranks = value.max(2),
            "--mib" => out.mib = value.max(1),
            "--reps" => out.reps = value.max(3),
            other => return Err(format!("unknown flag {other}; flags: --ranks --mib --reps")),
        }
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// This rank's medians: (barrier microseconds, pulled copy GB/s).
fn measure(rank: &Rank<'_>, args: &Args) -> Result<(f64, f64)> {
    let elems = args.mib << 18; // f32
    let t = cuda::random::<f32>(rank, &[elems], 1)?;
    let mut barrier = Vec::new();
    let mut copy = Vec::new();
    for rep in 0..args.reps + 3 {
        cuda::synchronize(rank)?;
        let start = Instant::now();
        cuda::barrier(rank)?;
        cuda::synchronize(rank)?;
        let us = start.elapsed().as_secs_f64() * 1e6;
        let start = Instant::now();
        let got = cuda::broadcast(rank, &t, 1)?;
        cuda::synchronize(rank)?;
        let seconds = start.elapsed().as_secs_f64();
        drop(got);
        if rep >= 3 {
            barrier.push(us);
            copy.push((elems * 4) as f64 / (seconds * 1e9));
        }
    }
    Ok((median(barrier), median(copy)))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = parse(&args).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    if World::launched() {
        let world = World::from_env()?;
        let out = world.run(|rank| measure(rank, &parsed))?;
        if world.ranks_here().contains(&0) {
            println!("RESULT {} {}", out[0].0, out[0].1);
        }
        return Ok(());
    }
    let count = cuda::device_count()?;
    let devices: Vec<usize> = (0..parsed.ranks).map(|r| r % count).collect();
    println!(
        "{} ranks on GPUs {devices:?}, a {} MiB pull from rank 1, {} reps (medians)",
        parsed.ranks, parsed.mib, parsed.reps
    );
    let threads = match World::cuda(&devices) {
        Ok(world) => Some(world.run(|rank| measure(rank, &parsed))?[0]),
        Err(e) => {
            println!("one process: unavailable here: {e}");
            None
        }
    };
    let exits = World::local_job(parsed.ranks).env(DEVICE_ENV, "cuda").run()?;
    let processes = exits[0]
        .stdout_text()
        .lines()
        .find_map(|l| l.strip_prefix("RESULT ").map(str::to_string))
        .and_then(|l| {
            let mut w = l.split(' ').map(|v| v.parse::<f64>().ok());
            Some((w.next()??, w.next()??))
        });
    let Some(processes) = processes else {
        let failed: Vec<String> =
            exits.iter().map(|e| format!("rank {}: {}", e.rank, e.stderr_text())).collect();
        return Err(Error::user(format!("the processes printed no result: {}", failed.join("; "))));
    };
    let row = |name: &str, (us, gbps): (f64, f64)| {
        println!("{name:12} barrier {us:9.1} us   pull {gbps:8.1} GB/s");
    };
    if let Some(t) = threads {
        row("one process", t);
    }
    row("processes", processes);
    if let Some(t) = threads {
        println!(
            "processes / one process: barrier {:.3}x, pull time {:.3}x",
            processes.0 / t.0,
            t.1 / processes.1
        );
    }
    Ok(())
}
