//! [`DeviceWorld`]: where a world's ranks run their kernels, set once when the world is made.
//!
//! This is the one field every dispatch reads (`Rank::device_world`): each public collective and
//! fused op matches on it once, at its entry, so every rank of a world takes the same branch
//! whatever device a given tensor happens to live on. The runtime knows the device backends only
//! through this enum's hooks: what a failure must end on the devices, and what a rank's part of a
//! run must wait for before it returns.

use std::sync::Arc;

use crate::Result;
use crate::device::Device;
use crate::device::ascend::world::AscendWorld;
use crate::device::cuda::{self, CudaWorld};

/// Where a world's ranks run their kernels.
#[derive(Clone)]
pub(crate) enum DeviceWorld {
    /// The host simulation of an NPU: every world of threads, processes or MPI ranks.
    Host,
    /// NVIDIA GPUs, one per rank ([`World::cuda`](crate::World::cuda)).
    Cuda(Arc<CudaWorld>),
    /// Ascend NPUs, one per rank ([`World::ascend`](crate::World::ascend)).
    Ascend(Arc<AscendWorld>),
}

impl DeviceWorld {
    /// Where rank `rank`'s tensors live: its GPU in a CUDA world; the host otherwise (an Ascend
    /// world's ops copy their operands to the NPU and back).
    pub(crate) fn tensor_device(&self, rank: usize) -> Device {
        match self {
            DeviceWorld::Cuda(gpus) => Device::Cuda(cuda::ordinal_of(gpus, rank) as u32),
            DeviceWorld::Host | DeviceWorld::Ascend(_) => Device::Host,
        }
    }

    /// The device rank `rank` runs on.
    pub(crate) fn device_of(&self, rank: usize) -> Device {
        match self {
            DeviceWorld::Host => Device::Host,
            DeviceWorld::Cuda(gpus) => Device::Cuda(cuda::ordinal_of(gpus, rank) as u32),
            DeviceWorld::Ascend(npus) => Device::Ascend(npus.ranks[rank].device),
        }
    }

    /// Hook: rank `rank` failed with `reason`; device kernels that wait on device signals (not
    /// on the control block) must end too.
    pub(crate) fn failed(&self, rank: usize, reason: &str) {
        match self {
            DeviceWorld::Cuda(gpus) => cuda::world_failed(gpus, rank, reason),
            DeviceWorld::Host | DeviceWorld::Ascend(_) => {}
        }
    }

    /// Hook: rank `rank`'s closure returned; its part of the run ends once its device work is
    /// done (no kernel outlives the run, and a failure on the device is the run's error).
    pub(crate) fn finish_rank(&self, rank: usize) -> Result<()> {
        match self {
            DeviceWorld::Cuda(gpus) => cuda::finish_rank(gpus, rank),
            DeviceWorld::Host | DeviceWorld::Ascend(_) => Ok(()),
        }
    }
}

impl std::fmt::Debug for DeviceWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceWorld::Host => write!(f, "Host"),
            DeviceWorld::Cuda(_) => write!(f, "Cuda"),
            DeviceWorld::Ascend(npus) => write!(f, "Ascend({} NPUs)", npus.ranks.len()),
        }
    }
}
