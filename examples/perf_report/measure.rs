//! Timing: fused and unfused runs interleaved, and the statistics of many such pairs.

use std::time::Instant;

use dist_tensor::{Rank, Result};

/// One fused run and the unfused run right after it, in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Pair {
    pub fused: f64,
    pub unfused: f64,
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
    let timed = |op: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let _ = rank.barrier_all()?;
        let start = Instant::now();
        op()?;
        let _ = rank.barrier_all()?;
        Ok(start.elapsed().as_secs_f64())
    };
    // Warm: workspaces sized, buffers cached, pages touched.
    timed(&mut fused)?;
    timed(&mut unfused)?;
    (0..reps)
        .map(|_| Ok(Pair { fused: timed(&mut fused)?, unfused: timed(&mut unfused)? }))
        .collect()
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

/// The median and the quartiles of some values.
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
            // Linear interpolation between the closest ranks.
            let x = q * (v.len() - 1) as f64;
            let (i, frac) = (x.floor() as usize, x.fract());
            v[i] + (v[(i + 1).min(v.len() - 1)] - v[i]) * frac
        };
        Spread { median: at(0.5), low: at(0.25), high: at(0.75) }
    }

    pub fn ratio(&self) -> String {
        format!("{:.3} ({:.3}-{:.3})", self.median, self.low, self.high)
    }
}
