//! Where an op's inputs live: [`to_world_device`], the one move of an input to the device its
//! world computes on, and [`device_data`], the GPU data of a tensor so moved.

use crate::Result;
use crate::device::cuda;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};

/// `t` where `rank`'s world keeps its tensors (its GPU in a CUDA world, the host otherwise):
/// moved once if it lives elsewhere, as it is otherwise.
pub(crate) fn to_world_device<T: Element>(rank: &Rank<'_>, t: Tensor<T>) -> Result<Tensor<T>> {
    if t.device() == rank.tensor_device() { Ok(t) } else { t.to_rank(rank) }
}

/// The device data of a tensor the op moved to its world's device.
pub(crate) fn device_data<T: Element>(t: &Tensor<T>) -> &cuda::DeviceStorage<T> {
    cuda::storage_of(t).expect("moved to the world's device at the op's entry")
}
