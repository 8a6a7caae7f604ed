//! `redistribute`: from any placement to any other.

use ndarray::{ArrayD, Axis, IxDyn, Slice};

use super::dist_tensor::shard_of;
use super::{DistTensor, Placement};
use crate::collectives::{self, ReduceOp};
use crate::fused;
use crate::tensor::{Element, Tensor, array_split, split_offsets};
use crate::{Error, Result};

impl<'r, T: Element> DistTensor<'r, T> {
    /// The same global tensor under another placement. Collective.
    ///
    /// | from \ to | `Shard(j)` | `Replicate` | `Partial` |
    /// | --- | --- | --- | --- |
    /// | `Shard(i)` | all_to_all (fused), or nothing if `i == j` | all_gather | local: the shard in place, zeros around it |
    /// | `Replicate` | local slice | nothing | local: rank 0 keeps it, zeros elsewhere |
    /// | `Partial` | reduce_scatter | all_reduce | nothing |
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] for a shard dimension that is not one of the tensor's (on every
    /// rank, as they agree on the shape); otherwise as the collectives.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f32>::random(&[4, 6], 5);
    /// World::threads(3)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
    ///     let y = x.redistribute(Placement::Shard(1))?.redistribute(Placement::Partial)?;
    ///     assert_eq!(y.placement(), Placement::Partial);
    ///     assert_eq!(y.redistribute(Placement::Replicate)?.local(), &global);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn redistribute(&self, to: Placement) -> Result<Self> {
        let ndim = self.global_shape.len();
        if let Placement::Shard(d) = to {
            if d >= ndim {
                return Err(Error::DimOutOfRange { op: "DistTensor::redistribute", dim: d, ndim });
            }
        }
        match self.gpus() {
            Some(world) => self.gpu_redistribute(world, to),
            None => self.host_redistribute(to),
        }
    }

    /// `redistribute` with this rank's part on the host.
    pub(crate) fn host_redistribute(&self, to: Placement) -> Result<Self> {
        let (rank, shape) = (self.rank, self.global_shape.clone());
        let (me, n) = (rank.rank(), rank.num_ranks());
        match (self.placement, to) {
            (from, to) if from == to => Ok(self.clone()),
            (Placement::Shard(i), Placement::Shard(j)) => {
                let out = fused::all_to_all(rank, &self.local, j, i)?;
                Ok(DistTensor::new(rank, out.output, to, shape, out.scatter_counts))
            }
            (Placement::Shard(_), Placement::Replicate) => {
                Ok(DistTensor::new(rank, self.to_global()?, to, shape, vec![]))
            }
            (Placement::Shard(i), Placement::Partial) => {
                let mut whole = ArrayD::from_elem(IxDyn(&shape), T::zero());
                let start = split_offsets(&self.splits)[me];
                whole
                    .slice_axis_mut(Axis(i), Slice::from(start..start + self.splits[me]))
                    .assign(&self.local.view());
                Ok(DistTensor::new(rank, Tensor::from_array(whole), to, shape, vec![]))
            }
            (Placement::Replicate, Placement::Shard(j)) => {
                let splits = array_split(shape[j], n);
                let local = shard_of(self.local.view(), j, &splits, me);
                Ok(DistTensor::new(rank, local, to, shape, splits))
            }
            (Placement::Replicate, Placement::Partial) => {
                let local = if me == 0 { self.local.clone() } else { Tensor::zeros(&shape) };
                Ok(DistTensor::new(rank, local, to, shape, vec![]))
            }
            (Placement::Partial, Placement::Shard(j)) => {
                let splits = array_split(shape[j], n);
                let rows: usize = shape[..j].iter().product();
                let inner: usize = shape[j + 1..].iter().product();
                let counts: Vec<usize> = splits.iter().map(|&s| s * inner).collect();
                let data = collectives::reduce_scatter_cols(
                    rank,
                    self.local.as_slice(),
                    rows,
                    &counts,
                    ReduceOp::Sum,
                )?;
                let mut local_shape = shape.clone();
                local_shape[j] = splits[me];
                let local = Tensor::from_shape_vec(&local_shape, data)?;
                Ok(DistTensor::new(rank, local, to, shape, splits))
            }
            (Placement::Partial, Placement::Replicate) => {
                Ok(DistTensor::new(rank, self.to_global()?, to, shape, vec![]))
            }
            (from, to) => unreachable!("{from} -> {to} is covered above"),
        }
    }
}
