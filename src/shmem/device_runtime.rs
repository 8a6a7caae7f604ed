//! [`DeviceRuntime`]: what the runtime needs of a world whose ranks run their kernels on a
//! device (GPUs, NPUs) rather than the host simulation.
//!
//! The runtime names no backend: a device backend (`device::cuda`, `device::ascend`) implements
//! this trait for its world and hands it to the world when the world is made; a world of the host
//! simulation has none. Every op's dispatch asks the device layer which backend a rank's world
//! runs on (`device::DeviceWorld`), which looks here and downcasts.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use super::ProcessJob;
use crate::Result;
use crate::tensor::Device;

/// The device side of a world: which device each rank runs on, and the hooks the runtime calls
/// when a rank fails or returns.
pub(crate) trait DeviceRuntime: Send + Sync + 'static {
    /// The device rank `rank` runs on.
    fn device_of(&self, rank: usize) -> Device;

    /// Where rank `rank`'s tensors live: the device itself by default (an NPU world overrides it:
    /// its ops copy host operands to the NPU and back).
    fn tensor_device(&self, rank: usize) -> Device {
        self.device_of(rank)
    }

    /// Rank `rank` failed with `reason`: device kernels that wait on device signals (not on the
    /// control block) must end too.
    fn failed(&self, _rank: usize, _reason: &str) {}

    /// Rank `rank`'s closure returned: its part of the run ends once its device work is done
    /// (no kernel outlives the run, and a failure on the device is the run's error).
    fn finish_rank(&self, _rank: usize) -> Result<()> {
        Ok(())
    }

    /// Whether host failures must be carried to the device by a watch thread (kernels whose
    /// waits read device memory, which a failed peer's process cannot write).
    fn watches_host_failures(&self) -> bool {
        false
    }

    /// The backend's own type, for its downcast.
    fn as_any(&self) -> &dyn Any;
}

/// Opens the device side of a world of threads of `num_ranks` ranks whose waits give a peer
/// `wait_timeout`: what a device backend hands [`WorldBuilder`](super::WorldBuilder).
pub(crate) type OpenDevice =
    Arc<dyn Fn(usize, Duration) -> Result<Arc<dyn DeviceRuntime>> + Send + Sync>;

/// Opens this process's part of the device side of a world of processes, after the host
/// rendezvous.
pub(crate) type OpenProcessDevice = fn(&ProcessJob<'_>) -> Result<Arc<dyn DeviceRuntime>>;
