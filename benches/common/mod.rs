//! What the fused-op benches share: timing an op inside a world, and the ceilings.

#![allow(dead_code)] // each bench uses part of it

use std::time::{Duration, Instant};

use dist_tensor::{Rank, Result, Tensor, World};
use rayon::prelude::*;

/// Runs `body` on every rank of `world`; returns rank 0's answer (a time).
pub fn on_ranks(world: &World, body: impl Fn(&Rank<'_>) -> Result<Duration> + Sync) -> Duration {
    world.run(body).expect("the benchmarked op")[0]
}

/// Calls `op` once to warm up, then `iters` times between two barriers: the time covers the
/// slowest rank.
pub fn timed(rank: &Rank<'_>, iters: u64, mut op: impl FnMut() -> Result<()>) -> Result<Duration> {
    op()?;
    let _ = rank.barrier_all()?;
    let start = Instant::now();
    for _ in 0..iters {
        op()?;
    }
    let _ = rank.barrier_all()?;
    Ok(start.elapsed())
}

/// The statistics the reports use too (medians, quartiles, pairs, load, cores).
#[path = "../../examples/common/stats.rs"]
pub mod stats;

pub use stats::cores;

/// The `gemm` crate on `[m, k] x [k, n]` f32 with every core into a reused output, `iters` times.
pub fn gemm_f32(m: usize, k: usize, n: usize, iters: u64) -> Duration {
    let a = Tensor::<f32>::random(&[m, k], 1);
    let b = Tensor::<f32>::random(&[k, n], 2);
    let mut c = vec![0.0f32; m * n];
    let start = Instant::now();
    for _ in 0..iters {
        // SAFETY: row-major operands of the stated shapes; `c` is a separate m x n buffer.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_slice().as_ptr(),
                1,
                k as isize,
                b.as_slice().as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(cores()),
            )
        }
    }
    start.elapsed()
}

/// Copying `bytes` once, split over every core, `iters` times.
pub fn memcpy(bytes: usize, iters: u64) -> Duration {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(cores()).max(1);
    let start = Instant::now();
    for _ in 0..iters {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
    start.elapsed()
}

pub fn config() -> criterion::Criterion {
    criterion::Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
}
