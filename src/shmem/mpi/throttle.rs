//! A slower network for tests: every put the proxy sends waits a fixed delay and then its turn
//! on a link of capped bandwidth, as if it crossed a slow fabric. Set from the environment
//! (`DIST_TENSOR_MPI_DELAY_US`, `DIST_TENSOR_MPI_BANDWIDTH`); off unless one of them is set. It
//! delays puts and signals only (the MPI collectives of the unfused baselines go untouched).

use std::time::{Duration, Instant};

use crate::shmem::job_env::{THROTTLE_BANDWIDTH_ENV, THROTTLE_DELAY_ENV};
use crate::{Error, Result};

/// The delay and bandwidth cap, and when the simulated link is next free.
#[derive(Debug, Clone)]
pub(crate) struct Throttle {
    delay: Duration,
    bytes_per_second: Option<f64>,
    free_at: Instant,
}

fn read(name: &str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Ok(text) => text.trim().parse().map(Some).map_err(|_| Error::Environment {
            op: "World::from_env",
            reason: format!("{name}={text:?} is not a whole number"),
        }),
        Err(_) => Ok(None),
    }
}

impl Throttle {
    /// The throttle the environment asks for, if any.
    pub(crate) fn from_env() -> Result<Option<Throttle>> {
        let delay = read(THROTTLE_DELAY_ENV)?;
        let bandwidth = read(THROTTLE_BANDWIDTH_ENV)?;
        if bandwidth == Some(0) {
            return Err(Error::Environment {
                op: "World::from_env",
                reason: format!("{THROTTLE_BANDWIDTH_ENV}=0: a link that moves nothing"),
            });
        }
        if delay.is_none() && bandwidth.is_none() {
            return Ok(None);
        }
        Ok(Some(Throttle {
            delay: Duration::from_micros(delay.unwrap_or(0)),
            bytes_per_second: bandwidth.map(|b| b as f64),
            free_at: Instant::now(),
        }))
    }

    /// When a put of `bytes` made now may go: after the delay, and after the puts before it
    /// have had the link for their bytes.
    pub(crate) fn release_at(&mut self, bytes: usize) -> Instant {
        let at = (Instant::now() + self.delay).max(self.free_at);
        let busy = self
            .bytes_per_second
            .map_or(Duration::ZERO, |bps| Duration::from_secs_f64(bytes as f64 / bps));
        self.free_at = at + busy;
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puts_queue_behind_each_other_on_a_capped_link() {
        let mut t = Throttle {
            delay: Duration::from_millis(1),
            bytes_per_second: Some(1e6),
            free_at: Instant::now(),
        };
        let start = Instant::now();
        let a = t.release_at(1000); // 1 ms on the link
        let b = t.release_at(10);
        assert!(a >= start + Duration::from_millis(1));
        assert!(b >= a + Duration::from_millis(1), "{:?}", b - a);
    }
}
