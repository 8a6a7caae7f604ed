//! GPU worlds for the CUDA tests. Each helper returns `None` (or `false`) after printing
//! `SKIPPED <test>: <why>` where this build cannot use a GPU: no GPU on the machine, no driver,
//! or a build without `--features cuda`. The test then passes, having said so.

use std::time::Duration;

use dist_tensor::{Error, World};

/// How many GPUs this build can use here, or `None` after saying why the test is skipped.
pub fn gpu_count(test: &str) -> Option<usize> {
    match dist_tensor::device::cuda::device_count() {
        Ok(count) if count > 0 => Some(count),
        Ok(_) => {
            println!("SKIPPED {test}: no GPU on this machine");
            None
        }
        Err(e) => {
            println!("SKIPPED {test}: {e}");
            None
        }
    }
}

/// Whether this build can use a GPU here; prints why not.
pub fn gpu_here(test: &str) -> bool {
    gpu_count(test).is_some()
}

/// A CUDA world of one rank per entry of `devices` (a device may repeat: ranks sharing that
/// GPU), or `None` after saying why not. Any other failure to make it fails the test.
pub fn cuda_world_on(test: &str, devices: &[usize]) -> Option<World> {
    gpu_count(test)?;
    let built =
        World::builder(devices.len()).cuda(devices).wait_timeout(Duration::from_secs(30)).build();
    match built {
        Ok(world) => Some(world),
        Err(e @ (Error::LibraryNotFound { .. } | Error::DeviceUnavailable { .. })) => {
            println!("SKIPPED {test}: {e}");
            None
        }
        Err(e) => panic!("{test}: World::cuda({devices:?}) failed: {e}"),
    }
}

/// A CUDA world of one rank per GPU, at most `max` of them, or `None` after saying why not.
pub fn cuda_world(test: &str, max: usize) -> Option<World> {
    let count = gpu_count(test)?;
    let devices: Vec<usize> = (0..count.min(max)).collect();
    cuda_world_on(test, &devices)
}
