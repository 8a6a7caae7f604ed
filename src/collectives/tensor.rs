//! The collectives on tensors where the world keeps them (a CUDA world's GPUs, the host
//! otherwise): what [`DistTensor`](crate::DistTensor)'s placements need. Each is one function with
//! one `match` on the world's backend; a GPU world's tensors stay on their GPUs throughout.

use super::{ReduceOp, all_gather_cols, all_reduce, reduce_scatter_cols};
use crate::Result;
use crate::device::DeviceWorld;
use crate::device::cuda;
use crate::device::{device_data, to_world_device};
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor, array_split, split_offsets};

/// Every rank's `local` concatenated along `dim` in rank order (rank `r`'s has `splits[r]` there,
/// which every rank knows): the whole tensor, of `shape`, on every rank. Collective.
pub(crate) fn all_gather_along<T: Element>(
    rank: &Rank<'_>,
    local: &Tensor<T>,
    dim: usize,
    splits: &[usize],
    shape: &[usize],
) -> Result<Tensor<T>> {
    let local = to_world_device(rank, local.clone())?;
    match rank.device_world() {
        DeviceWorld::Host | DeviceWorld::Ascend(_) => {
            let rows: usize = shape[..dim].iter().product();
            let data = all_gather_cols(rank, local.as_slice(), rows)?;
            Tensor::from_shape_vec(shape, data)
        }
        DeviceWorld::Cuda(gpus) => cuda::all_gather(gpus, rank, device_data(&local), dim, splits)
            .map(Tensor::from_device_storage),
    }
}

/// The sum over every rank of `local`, in rank order, on every rank: where the world keeps its
/// tensors (on each rank's GPU in a [`World::cuda`](crate::World::cuda) world, the host
/// otherwise). Collective; every rank passes the same shape.
///
/// # Errors
/// As [`all_reduce`]: [`Error::RanksDisagree`](crate::Error::RanksDisagree) for shapes that
/// differ, and as every collective.
///
/// # Examples
/// ```
/// use dist_tensor::{Device, Tensor, World, collectives};
/// let sums = World::threads(3)?.run(|rank| {
///     let x = Tensor::<f32>::from_shape_vec(&[2], vec![rank.rank() as f32, 1.0])?;
///     let sum = collectives::all_reduce_tensor(rank, &x)?;
///     assert_eq!(sum.device(), Device::Host); // a world of threads computes on the host
///     Ok(sum.as_slice().to_vec())
/// })?;
/// assert_eq!(sums[0], vec![3.0, 3.0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn all_reduce_tensor<T: Element>(rank: &Rank<'_>, local: &Tensor<T>) -> Result<Tensor<T>> {
    let local = to_world_device(rank, local.clone())?;
    match rank.device_world() {
        DeviceWorld::Host | DeviceWorld::Ascend(_) => {
            let data = all_reduce(rank, local.as_slice())?;
            Tensor::from_shape_vec(local.shape(), data)
        }
        DeviceWorld::Cuda(gpus) => {
            cuda::reduce_sum(gpus, rank, device_data(&local), None).map(Tensor::from_device_storage)
        }
    }
}

/// The sum over every rank of `local` (every rank's of `shape`), this rank keeping its
/// `numpy.array_split` share of `dim`. Collective.
pub(crate) fn reduce_scatter_along<T: Element>(
    rank: &Rank<'_>,
    local: &Tensor<T>,
    dim: usize,
    shape: &[usize],
) -> Result<Tensor<T>> {
    let local = to_world_device(rank, local.clone())?;
    match rank.device_world() {
        DeviceWorld::Host | DeviceWorld::Ascend(_) => {
            let splits = array_split(shape[dim], rank.num_ranks());
            let rows: usize = shape[..dim].iter().product();
            let inner: usize = shape[dim + 1..].iter().product();
            let counts: Vec<usize> = splits.iter().map(|&s| s * inner).collect();
            let data = reduce_scatter_cols(rank, local.as_slice(), rows, &counts, ReduceOp::Sum)?;
            let mut local_shape = shape.to_vec();
            local_shape[dim] = splits[rank.rank()];
            Tensor::from_shape_vec(&local_shape, data)
        }
        DeviceWorld::Cuda(gpus) => cuda::reduce_sum(gpus, rank, device_data(&local), Some(dim))
            .map(Tensor::from_device_storage),
    }
}

/// This rank's part of `whole` (which every rank holds) along `dim`, cut as `splits`: where the
/// world keeps its tensors. Not collective.
pub(crate) fn slice_along<T: Element>(
    rank: &Rank<'_>,
    whole: &Tensor<T>,
    dim: usize,
    splits: &[usize],
) -> Result<Tensor<T>> {
    let me = rank.rank();
    let start = split_offsets(splits)[me];
    match rank.device_world() {
        DeviceWorld::Host | DeviceWorld::Ascend(_) => {
            let whole = to_world_device(rank, whole.clone())?;
            let view = whole.view();
            let rows = ndarray::Slice::from(start..start + splits[me]);
            Ok(Tensor::from_array(view.slice_axis(ndarray::Axis(dim), rows).to_owned()))
        }
        DeviceWorld::Cuda(gpus) => {
            let whole = to_world_device(rank, whole.clone())?;
            cuda::slice(gpus, rank, device_data(&whole), dim, start, splits[me])
                .map(Tensor::from_device_storage)
        }
    }
}
