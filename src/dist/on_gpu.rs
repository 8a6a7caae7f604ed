//! The `DistTensor` methods on a GPU world ([`World::cuda`](crate::World::cuda)): each rank's part
//! lives on its GPU and the ops run there (`device::cuda`). The methods in the other files of this
//! module call these when their rank is in a GPU world; nothing here runs otherwise.

use super::{DistTensor, Placement};
use crate::device::cuda::{self, CudaWorld, DeviceStorage};
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor, array_split, split_offsets};
use crate::{Error, Result};

/// `t` on `rank`'s device: moved to its GPU in a GPU world (a tensor already there stays), as it
/// is otherwise.
pub(crate) fn place<T: Element>(rank: &Rank<'_>, t: Tensor<T>) -> Result<Tensor<T>> {
    if rank.cuda_world().is_some() && t.device() != rank.device() { t.to_rank(rank) } else { Ok(t) }
}

/// The GPU storage of `t`, moved to `rank`'s GPU first if it is elsewhere.
fn on_rank<T: Element>(rank: &Rank<'_>, t: &Tensor<T>) -> Result<Tensor<T>> {
    if t.device() == rank.device() { Ok(t.clone()) } else { t.to_rank(rank) }
}

fn storage<T: Element>(t: &Tensor<T>) -> &DeviceStorage<T> {
    t.device_storage().expect("placed on the rank's GPU")
}

impl<'r, T: Element> DistTensor<'r, T> {
    /// The GPU world of this tensor's rank, if it is one.
    pub(crate) fn gpus(&self) -> Option<&'r CudaWorld> {
        self.rank.cuda_world()
    }

    fn local_on_gpu(&self) -> Result<Tensor<T>> {
        on_rank(self.rank, &self.local)
    }

    /// `to_global` on GPUs.
    pub(crate) fn gpu_to_global(&self, world: &CudaWorld) -> Result<Tensor<T>> {
        let local = self.local_on_gpu()?;
        let r = self.rank.rank();
        let out = match self.placement {
            Placement::Shard(d) => cuda::all_gather(world, r, storage(&local), d, &self.splits)?,
            Placement::Partial => cuda::reduce_sum(world, r, storage(&local), None)?,
            Placement::Replicate => return Ok(local),
        };
        Ok(Tensor::from_device_storage(out))
    }

    /// `all_gather_matmul(_many)` and its unfused baseline on GPUs.
    pub(crate) fn gpu_gather_products(
        &self,
        world: &CudaWorld,
        ws: &[&Tensor<T>],
        fused: bool,
    ) -> Result<Vec<Self>> {
        let x = self.local_on_gpu()?;
        let ws: Vec<Tensor<T>> = ws.iter().map(|w| on_rank(self.rank, w)).collect::<Result<_>>()?;
        let refs: Vec<&DeviceStorage<T>> = ws.iter().map(storage).collect();
        let outs = cuda::all_gather_matmul(
            world,
            self.rank.rank(),
            storage(&x),
            &self.splits,
            &refs,
            fused,
        )?;
        let m = self.global_shape[0];
        // Every rank's output widths, for the Shard(1) splits.
        let cols: Vec<usize> = outs.iter().map(|o| o.shape()[1]).collect();
        let all = cuda::exchange_counts(world, self.rank.rank(), &cols)?;
        Ok(outs
            .into_iter()
            .enumerate()
            .map(|(j, out)| {
                let widths: Vec<usize> = all.iter().map(|c| c[j]).collect();
                let global = vec![m, widths.iter().sum()];
                DistTensor::new(
                    self.rank,
                    Tensor::from_device_storage(out),
                    Placement::Shard(1),
                    global,
                    widths,
                )
            })
            .collect())
    }

    /// `matmul_reduce_scatter` and its unfused baseline on GPUs.
    /// `splits`: the output rows each rank keeps.
    pub(crate) fn gpu_reduce_product(
        &self,
        world: &CudaWorld,
        w: &Tensor<T>,
        fused: bool,
        splits: Vec<usize>,
    ) -> Result<Self> {
        let x = self.local_on_gpu()?;
        let w = on_rank(self.rank, w)?;
        let m = self.global_shape[0];
        let out = cuda::matmul_reduce_scatter(
            world,
            self.rank.rank(),
            storage(&x),
            storage(&w),
            &splits,
            fused,
        )?;
        let global = vec![m, out.shape()[1]];
        Ok(DistTensor::new(
            self.rank,
            Tensor::from_device_storage(out),
            Placement::Shard(0),
            global,
            splits,
        ))
    }

    /// `all_to_all` and its unfused baseline on GPUs (`self` is `Shard(gather_dim)`).
    pub(crate) fn gpu_all_to_all(
        &self,
        world: &CudaWorld,
        scatter_dim: usize,
        gather_dim: usize,
        fused: bool,
    ) -> Result<Self> {
        let x = self.local_on_gpu()?;
        let out = cuda::all_to_all(
            world,
            self.rank.rank(),
            storage(&x),
            scatter_dim,
            gather_dim,
            &self.splits,
            fused,
        )?;
        let splits = array_split(self.global_shape[scatter_dim], self.rank.num_ranks());
        Ok(DistTensor::new(
            self.rank,
            Tensor::from_device_storage(out),
            Placement::Shard(scatter_dim),
            self.global_shape.clone(),
            splits,
        ))
    }

    /// `redistribute` on GPUs.
    pub(crate) fn gpu_redistribute(&self, world: &CudaWorld, to: Placement) -> Result<Self> {
        let (rank, shape) = (self.rank, self.global_shape.clone());
        let (me, n) = (rank.rank(), rank.num_ranks());
        let local = self.local_on_gpu()?;
        let device = |data: DeviceStorage<T>| Tensor::from_device_storage(data);
        match (self.placement, to) {
            (from, to) if from == to => Ok(self.clone()),
            (Placement::Shard(i), Placement::Shard(j)) => self.gpu_all_to_all(world, j, i, true),
            (_, Placement::Replicate) => {
                Ok(DistTensor::new(rank, self.gpu_to_global(world)?, to, shape, vec![]))
            }
            (Placement::Replicate, Placement::Shard(j)) => {
                let splits = array_split(shape[j], n);
                let start = split_offsets(&splits)[me];
                let part = cuda::slice(world, me, storage(&local), j, start, splits[me])?;
                Ok(DistTensor::new(rank, device(part), to, shape, splits))
            }
            (Placement::Partial, Placement::Shard(j)) => {
                let splits = array_split(shape[j], n);
                let part = cuda::reduce_sum(world, me, storage(&local), Some(j))?;
                Ok(DistTensor::new(rank, device(part), to, shape, splits))
            }
            (Placement::Shard(_) | Placement::Replicate, Placement::Partial) => {
                // Local: this rank's part in place, zeros around it (built on the host: a change
                // of representation, not a hot path).
                let host = DistTensor::new(
                    rank,
                    local.to_host()?,
                    self.placement,
                    shape.clone(),
                    self.splits.clone(),
                );
                let partial = host.host_redistribute(to)?;
                let local = partial.local.to_rank(rank)?;
                Ok(DistTensor::new(rank, local, to, shape, vec![]))
            }
            (from, to) => Err(Error::UnsupportedPlacement {
                op: "DistTensor::redistribute",
                placement: from.to_string(),
                expected: format!("a placement that can become {to}"),
            }),
        }
    }
}
