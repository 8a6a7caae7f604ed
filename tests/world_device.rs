//! `Rank::device()` in every kind of world: it reads the one field that says where a world runs
//! (set when the world is made), so it must name the host for threads and processes, each rank's
//! NPU in an Ascend world, and each rank's GPU in a CUDA world.

#![cfg(target_os = "linux")]

mod cann_stand_in;
mod common;

use std::time::Duration;

use dist_tensor::device::ascend::{Ascend, AscendWorldBuilder};
use dist_tensor::{Device, World};

#[test]
fn a_world_of_threads_runs_on_the_host() {
    for n in [1, 3] {
        let devices = World::threads(n).unwrap().run(|rank| Ok(rank.device())).unwrap();
        assert_eq!(devices, vec![Device::Host; n]);
    }
}

#[test]
fn a_world_of_processes_runs_on_the_host() {
    // In a child of the job below: one rank, which prints its device.
    if common::jobs::in_rank(|world| Ok(world.run(|rank| Ok(rank.device()))?[0].to_string())) {
        return;
    }
    for exit in &common::jobs::run_job("a_world_of_processes_runs_on_the_host", 2, &[]) {
        assert!(exit.success(), "rank {}: {}", exit.rank, exit.stderr_text());
        assert_eq!(common::jobs::result(exit), "host", "rank {}", exit.rank);
    }
}

#[test]
fn an_ascend_world_runs_each_rank_on_its_own_npu() {
    let cann = cann_stand_in::CannStandIn::build(
        &cann_stand_in::scratch_dir("world_device"),
        cann_stand_in::Variant::Full,
    );
    cann.acl.reset();
    cann.acl.set_device_count(8);
    // SAFETY: the stand-in exports the AscendCL symbols with the headers' C signatures.
    let runtime = unsafe { Ascend::open_path(&cann.acl.path) }.unwrap();
    // Devices 5 and 2: rank r is on devices[r], not on NPU r.
    let world = AscendWorldBuilder::new(&[5, 2])
        .runtime(runtime)
        .heap_bytes(16 << 20)
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let devices = world.run(|rank| Ok(rank.device())).unwrap();
    assert_eq!(devices, vec![Device::Ascend(5), Device::Ascend(2)]);
}

#[cfg(feature = "cuda")]
#[test]
fn a_cuda_world_runs_each_rank_on_its_own_gpu() {
    let count = match dist_tensor::device::cuda::device_count() {
        Ok(count) if count > 0 => count,
        Ok(_) => return eprintln!("skipped: no GPU on this machine"),
        Err(e) => return eprintln!("skipped: no CUDA driver ({e})"),
    };
    // The last GPU first: rank r is on devices[r], not on GPU r.
    let devices: Vec<usize> = (0..count.min(2)).rev().collect();
    let world = World::cuda(&devices).unwrap();
    let seen = world.run(|rank| Ok(rank.device())).unwrap();
    let want: Vec<Device> = devices.iter().map(|&d| Device::Cuda(d as u32)).collect();
    assert_eq!(seen, want);
}
