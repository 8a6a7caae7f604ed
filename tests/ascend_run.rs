//! The Ascend C kernels RUN, on the CPU, through `World::ascend` over the executing stand-in CANN
//! (`tests/cann_stand_in/`, built with `-DSTANDIN_EXECUTE`): the backend compiles each kernel
//! source with `aclrtc` (here the host C++ compiler against `ascendc_cpu/`, a CPU implementation
//! of the Ascend C subset the kernels use), loads it on every device and launches it, and the
//! stand-in runs it on one thread per core with the device's core counts, its copies and vector
//! ops queued per pipe until the kernel synchronises, its bounds and communication rules checked.
//! Every result is checked against an f64 host reference (and, where the host kernel sums in the
//! same order, against the host kernel's bits).
//!
//! What this proves: the kernels' logic, indexing, masks, pipe synchronisation, signal counts and
//! the host code around them. What it does not: CANN's compiler, the NPU's timing, the cube
//! unit's exact rounding, hardware memory ordering. Nothing here has run on an NPU.
//!
//! One stand-in per test binary, shared by the tests, which run one at a time.
#![cfg(target_os = "linux")]

mod cann_stand_in;

use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use cann_stand_in::CannStandIn;
use dist_tensor::device::ascend::{Ascend, AscendWorldBuilder, PathTaken, last_path};
use dist_tensor::{Element, Error, Result, Tensor, World, collectives};
use half::{bf16, f16};

static SERIAL: Mutex<()> = Mutex::new(());
static STAND_IN: OnceLock<CannStandIn> = OnceLock::new();

/// The shared executing stand-in, reset, with 8 devices of `ai` AI cores and `sub` vector
/// sub-cores each; held while a test runs.
fn stand_in(ai: i64, sub: i64) -> (MutexGuard<'static, ()>, &'static CannStandIn) {
    let guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let cann = STAND_IN.get_or_init(|| {
        CannStandIn::build_executing(&cann_stand_in::scratch_dir("run"))
    });
    cann.acl.reset();
    cann.acl.set_device_count(8);
    cann.acl.set_cores(ai, ai * sub);
    cann.shmem_process_global(false);
    (guard, cann)
}

fn world(cann: &CannStandIn, ranks: usize, timeout: Duration) -> Result<World> {
    let devices: Vec<u32> = (0..ranks as u32).collect();
    // SAFETY: the stand-in exports the AscendCL symbols with the headers' C signatures.
    let runtime = unsafe { Ascend::open_path(&cann.acl.path) }?;
    AscendWorldBuilder::new(&devices)
        .runtime(runtime)
        .heap_bytes(16 << 20)
        .wait_timeout(timeout)
        .build()
}

/// Seeded values of every magnitude sign, exact in every element type (multiples of 1/64 below
/// 4), so that copies and sums can be compared bit for bit.
fn values<T: Element>(len: usize, seed: u64) -> Vec<T> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64(((s % 512) as f64 - 256.0) / 64.0)
        })
        .collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

mod ascend {
    use super::*;

    fn all_gather_case<T: Element>(
        cann: &CannStandIn,
        n: usize,
        rows: usize,
        cols: &[usize],
    ) -> Result<()> {
        let world = world(cann, n, Duration::from_secs(10))?;
        let inputs: Vec<Vec<T>> =
            (0..n).map(|r| values::<T>(rows * cols[r], 100 + r as u64)).collect();
        let total: usize = cols.iter().sum();
        let mut expected = vec![0.0f64; rows * total];
        let mut at = 0;
        for (r, c) in cols.iter().enumerate() {
            for i in 0..rows {
                for j in 0..*c {
                    expected[i * total + at + j] = inputs[r][i * c + j].to_f64();
                }
            }
            at += c;
        }
        for call in 0..2 {
            let outs = world.run(|rank| {
                let out = collectives::all_gather_cols(rank, &inputs[rank.rank()], rows)?;
                assert_eq!(last_path(rank), Some(PathTaken::Kernel("all_gather")));
                Ok(out)
            })?;
            for (r, out) in outs.iter().enumerate() {
                assert_eq!(
                    bits(out),
                    expected,
                    "all_gather {} world {n} rows {rows} cols {cols:?} rank {r} call {call}",
                    std::any::type_name::<T>()
                );
            }
        }
        Ok(())
    }

    #[test]
    fn ascend_all_gather_runs_on_the_cpu_stand_in() -> Result<()> {
        let (_serial, cann) = stand_in(20, 2);
        all_gather_case::<f32>(cann, 2, 3, &[5, 7])?;
        Ok(())
    }
}
