//! A slower network for tests: every put the proxy sends waits its turn on a link of capped
//! bandwidth, its own bytes' time on it, and then a fixed delay (the latency), as if it crossed a
//! slow fabric. Set from the environment
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

    /// When a put of `bytes` made now may go: once the puts before it have had the link for
    /// their bytes, it has had it for its own, and the delay has passed. The put's own bytes
    /// count too: the proxy hands it to MPI whole at that moment, so a put released before its
    /// bytes' time (as a first version did) crossed a link of the stated bandwidth in no time,
    /// and a lone put paid the delay only.
    pub(crate) fn release_at(&mut self, bytes: usize) -> Instant {
        let busy = self
            .bytes_per_second
            .map_or(Duration::ZERO, |bps| Duration::from_secs_f64(bytes as f64 / bps));
        self.free_at = Instant::now().max(self.free_at) + busy;
        self.free_at + self.delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn throttle(delay_ms: u64, bytes_per_second: f64) -> Throttle {
        Throttle {
            delay: Duration::from_millis(delay_ms),
            bytes_per_second: Some(bytes_per_second),
            free_at: Instant::now(),
        }
    }

    #[test]
    fn a_lone_put_pays_its_bytes_and_the_delay() {
        let mut t = throttle(1, 1e6);
        let start = Instant::now();
        let at = t.release_at(3000); // 3 ms on the link, then 1 ms of delay
        assert!(at >= start + Duration::from_millis(4), "{:?}", at - start);
        assert!(at < start + Duration::from_millis(50), "{:?}", at - start);
    }

    #[test]
    fn puts_queue_behind_each_other_on_a_capped_link() {
        let mut t = throttle(1, 1e6);
        let a = t.release_at(1000); // 1 ms on the link
        let b = t.release_at(2000); // 2 ms more, after a's
        let c = t.release_at(10);
        assert!(b >= a + Duration::from_millis(2), "{:?}", b - a);
        // The delay is latency: puts in a row pay it once each, overlapped, not one after another.
        assert!(c < b + Duration::from_millis(1), "{:?}", c - b);
        assert!(c >= b + Duration::from_micros(10), "{:?}", c - b);
    }
}
