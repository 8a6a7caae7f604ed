//! The host backend: the tile model (`program`: a program's context and task loops; `tile`: masked
//! tile operations; `launch`: a kernel run as a grid of programs) and the simulation of an NPU it
//! runs on: every program instance of a launch is a thread of its own, resident in a per-rank
//! pool between launches.
//!
//! Threads, not a work-stealing pool: kernels spin-wait on each other, and a pool that runs a
//! waiting consumer before its producer would deadlock. Waits block after a brief spin (see
//! `shmem::sync`), so instances that only wait give their core back.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

pub(crate) mod all_gather_matmul;
pub(crate) mod all_to_all;
pub(crate) mod flash_decode;
pub(crate) mod launch;
pub(crate) mod matmul_reduce_scatter;
pub(crate) mod moe_combine;
pub(crate) mod moe_dispatch;
pub(crate) mod moe_experts;
pub(crate) mod plan;
mod pool;
pub(crate) mod program;
pub(crate) mod routing;
pub(crate) mod schedule;
pub mod tile;

use pool::ProgramPool;

use crate::device::Program;
use crate::error::ProgramLabel;
use crate::shmem::{Rank, panic_message};
use crate::{Error, Result};

/// Runs `grid x sub_vec_num` instances of `kernel` on `rank`, all at once, and joins them.
pub(crate) fn run_programs<F>(
    rank: &Rank<'_>,
    grid: usize,
    sub_vec_num: usize,
    kernel: &F,
) -> Result<()>
where
    F: Fn(&Program<'_>) -> Result<()> + Sync,
{
    let instance = |program_id: usize, sub_vec_id: usize| -> Result<()> {
        let program = Program { rank, program_id, num_programs: grid, sub_vec_id, sub_vec_num };
        let outcome = catch_unwind(AssertUnwindSafe(|| kernel(&program)));
        let result = match outcome {
            Ok(result) => result,
            // A typed panic (`symm_at` on a peer of another node) stays typed.
            Err(panic) => match panic.downcast::<Error>() {
                Ok(err) => Err(*err),
                Err(panic) => Err(Error::KernelPanicked {
                    rank: rank.rank(),
                    program: ProgramLabel::Program { id: program_id, sub_vec: sub_vec_id },
                    message: panic_message(&*panic),
                }),
            },
        };
        if let Err(err) = &result {
            rank.fail_with(err);
        }
        result
    };
    let instances = grid * sub_vec_num;
    let results: Vec<Mutex<Result<()>>> = (0..instances).map(|_| Mutex::new(Ok(()))).collect();
    let job = |i: usize| {
        let outcome = instance(i / sub_vec_num, i % sub_vec_num);
        *results[i].lock().unwrap_or_else(|e| e.into_inner()) = outcome;
    };
    // A program thread that cannot start fails the world: the peers wait for this launch.
    rank.with_workspace(ProgramPool::new, |pool| pool.run(instances, &job))
        .inspect_err(|e| rank.fail_with(e))?;
    let results = results.into_iter().map(|r| r.into_inner().unwrap_or_else(|e| e.into_inner()));
    // Report this rank's own failure before a "stopped because a peer failed".
    let mut errors: Vec<Error> = results.filter_map(Result::err).collect();
    errors.sort_by_key(|e| matches!(e, Error::PeerFailed { .. }));
    match errors.into_iter().next() {
        Some(err) => Err(err),
        None => Ok(()),
    }
}
