//! The statistics every report and bench shares: fused and unfused runs timed in pairs (one right
//! after the other, every rank in step), medians, quartiles, the pairs' ratios, and what else ran
//! on the machine (its load and cores). One module, included by `perf_report` (all its modes),
//! `gpu_report` and `benches/common` (`#[path]`), so every figure they print is computed the same
//! way.

#![allow(dead_code)] // each includer uses part of it

use std::time::Instant;

use dist_tensor::{Rank, Result};

/// One fused run and the unfused run right after it, in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Pair {
    pub fused: f64,
    pub unfused: f64,
}

impl Pair {
    /// Fused over unfused: below 1 when fused is faster.
    pub fn ratio(&self) -> f64 {
        self.fused / self.unfused
    }
}

/// Runs fused and unfused one after the other, `reps` times after one warm-up run of each:
/// both on every rank, started together (a barrier) and ended when all are done (another), so
/// each time is the slowest rank's. Each rank returns the times of its own clock; the callers
/// keep rank 0's.
pub fn pairs(
    rank: &Rank<'_>,
    reps: usize,
    mut fused: impl FnMut() -> Result<()>,
    mut unfused: impl FnMut() -> Result<()>,
) -> Result<Vec<Pair>> {
    // Warm: workspaces sized, buffers cached, pages touched.
    together(rank, &mut fused)?;
    together(rank, &mut unfused)?;
    // Every other pair runs the unfused op first: whichever runs second finds what the first left
    // (the pool's buffers, the weight's tail in the last-level cache), and alternating cancels
    // that in the median ratio instead of crediting it to one side.
    (0..reps)
        .map(|i| {
            Ok(if i % 2 == 0 {
                let fused = together(rank, &mut fused)?;
                Pair { fused, unfused: together(rank, &mut unfused)? }
            } else {
                let unfused = together(rank, &mut unfused)?;
                Pair { fused: together(rank, &mut fused)?, unfused }
            })
        })
        .collect()
}

/// One run of `op` on every rank, from a barrier to a barrier: the slowest rank's time, seconds.
pub fn together(rank: &Rank<'_>, op: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let _ = rank.barrier_all()?;
    let start = Instant::now();
    op()?;
    let _ = rank.barrier_all()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Times `op` alone `reps` times after one warm-up run; seconds.
pub fn times(reps: usize, mut op: impl FnMut()) -> Vec<f64> {
    op();
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            op();
            start.elapsed().as_secs_f64()
        })
        .collect()
}

/// The middle value of `v` once sorted (for an even count, the upper of the two middle ones).
pub fn median(mut v: Vec<f64>) -> f64 {
    assert!(!v.is_empty(), "no values");
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median and the quartiles of some values (linear interpolation between the closest
/// ranks).
#[derive(Clone, Copy, Debug)]
pub struct Spread {
    pub median: f64,
    pub low: f64,
    pub high: f64,
}

impl Spread {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut v: Vec<f64> = values.into_iter().collect();
        assert!(!v.is_empty(), "no values");
        v.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let x = q * (v.len() - 1) as f64;
            let (i, frac) = (x.floor() as usize, x.fract());
            v[i] + (v[(i + 1).min(v.len() - 1)] - v[i]) * frac
        };
        Spread { median: at(0.5), low: at(0.25), high: at(0.75) }
    }

    /// The pairs' ratios (fused / unfused), pair by pair.
    pub fn of_ratios(pairs: &[Pair]) -> Spread {
        Spread::of(pairs.iter().map(Pair::ratio))
    }

    pub fn ratio(&self) -> String {
        format!("{:.3} ({:.3}-{:.3})", self.median, self.low, self.high)
    }
}

/// The load averages over 1, 5 and 15 minutes (`/proc/loadavg`): how busy the machine was with
/// other work.
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "not listed".into())
}

/// The 1-minute load average alone.
pub fn load_1min() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "not listed".to_string())
}

/// The cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |t| t.get())
}
