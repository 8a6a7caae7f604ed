//! `redistribute`: from any placement to any other.

use ndarray::{ArrayD, Axis, IxDyn, Slice};

use super::tensor::shard_of;
use super::{DistTensor, Placement, Split};
use crate::collectives::{self, ReduceOp};
use crate::device::capability::{self, Feature, Op};
use crate::device::to_world_device;
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
        if let Placement::Shard(d) = to
            && d >= ndim
        {
            return Err(Error::DimOutOfRange { op: "DistTensor::redistribute", dim: d, ndim });
        }
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
                // Local: the shard in place, zeros around it (built on the host, then where the
                // world keeps its tensors: a change of representation, not a hot path).
                let mut whole = ArrayD::from_elem(IxDyn(&shape), T::zero());
                let start = split_offsets(&self.splits)[me];
                whole
                    .slice_axis_mut(Axis(i), Slice::from(start..start + self.splits[me]))
                    .assign(&self.local.to_host()?.view());
                let local = to_world_device(rank, Tensor::from_array(whole))?;
                Ok(DistTensor::new(rank, local, to, shape, vec![]))
            }
            (Placement::Replicate, Placement::Shard(j)) => {
                let splits = array_split(shape[j], n);
                let local = collectives::slice_along(rank, &self.local, j, &splits)?;
                Ok(DistTensor::new(rank, local, to, shape, splits))
            }
            (Placement::Replicate, Placement::Partial) => {
                let local = if me == 0 {
                    self.local.clone()
                } else {
                    to_world_device(rank, Tensor::zeros(&shape))?
                };
                Ok(DistTensor::new(rank, local, to, shape, vec![]))
            }
            (Placement::Partial, Placement::Shard(j)) => {
                let splits = array_split(shape[j], n);
                let local = collectives::reduce_scatter_along(rank, &self.local, j, &shape)?;
                Ok(DistTensor::new(rank, local, to, shape, splits))
            }
            (Placement::Partial, Placement::Replicate) => {
                Ok(DistTensor::new(rank, self.to_global()?, to, shape, vec![]))
            }
            (from, to) => unreachable!("{from} -> {to} is covered above"),
        }
    }

    /// The same global tensor sharded on `dim` and cut as `split` says: from another split of
    /// the same dimension (one all_to_all of the rows that change rank), or from any placement
    /// (as [`DistTensor::redistribute`] to `Shard(dim)`, then a re-split where `split` is not
    /// the even one). Collective; every rank must pass the same split.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] when `dim` is not a dimension of the tensor;
    /// [`Error::InvalidArgument`] when the split does not fit its length (see [`Split::sizes`]);
    /// otherwise as the collectives.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Split, Tensor, World};
    /// let global = Tensor::<f32>::random(&[16, 4], 1);
    /// let outs = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global_split(rank, &global, 0, vec![10, 6])?;
    ///     let even = x.redistribute_split(0, Split::Even)?;
    ///     assert_eq!(even.shard_sizes(), &[8, 8]);
    ///     let back = even.redistribute_split(0, x.shard_sizes())?; // line up with x again
    ///     assert_eq!(back.local(), x.local());
    ///     back.to_global()
    /// })?;
    /// assert_eq!(outs[0], global);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn redistribute_split(&self, dim: usize, split: impl Into<Split>) -> Result<Self> {
        const OP: &str = "DistTensor::redistribute_split";
        let ndim = self.global_shape.len();
        if dim >= ndim {
            return Err(Error::DimOutOfRange { op: OP, dim, ndim });
        }
        let (rank, len) = (self.rank, self.global_shape[dim]);
        let (me, n) = (rank.rank(), rank.num_ranks());
        let sizes = split.into().sizes_for(OP, me, len, n)?;
        let already = self.placement == Placement::Shard(dim) && self.splits == sizes;
        if already {
            return Ok(self.clone());
        }
        if self.placement != Placement::Shard(dim) && sizes == array_split(len, n) {
            // The even split from another placement: what `redistribute` does.
            return self.redistribute(Placement::Shard(dim));
        }
        // Any other split is cut from this rank's part on the host.
        capability::check_features(Op::RedistributeSplit, rank.device(), &[Feature::UnevenSplit])?;
        if !self.local.is_on_host() {
            return self.resplit_on_device(dim, sizes);
        }
        match self.placement {
            Placement::Shard(d) if d == dim => {
                if self.splits == sizes {
                    return Ok(self.clone());
                }
                self.resplit(dim, sizes)
            }
            Placement::Replicate => {
                let local = shard_of(self.local.view(), dim, &sizes, me);
                Ok(DistTensor::new(
                    rank,
                    local,
                    Placement::Shard(dim),
                    self.global_shape.clone(),
                    sizes,
                ))
            }
            Placement::Partial => {
                let rows: usize = self.global_shape[..dim].iter().product();
                let inner: usize = self.global_shape[dim + 1..].iter().product();
                let counts: Vec<usize> = sizes.iter().map(|&s| s * inner).collect();
                let data = collectives::reduce_scatter_cols(
                    rank,
                    self.local.as_slice(),
                    rows,
                    &counts,
                    ReduceOp::Sum,
                )?;
                let mut local_shape = self.global_shape.clone();
                local_shape[dim] = sizes[me];
                let local = Tensor::from_shape_vec(&local_shape, data)?;
                Ok(DistTensor::new(
                    rank,
                    local,
                    Placement::Shard(dim),
                    self.global_shape.clone(),
                    sizes,
                ))
            }
            Placement::Shard(_) => {
                let even = self.redistribute(Placement::Shard(dim))?;
                even.redistribute_split(dim, Split::Sizes(sizes))
            }
        }
    }

    /// Any placement to `Shard(dim)` split as `to`, for a part on a GPU: the whole tensor on every
    /// rank (an all_gather of the shards, uneven as they are, or an all_reduce of partial sums,
    /// on the GPU), then this rank's rows cut out. The whole tensor passes through every rank,
    /// `n` times the traffic of the host's `all_to_all_v` (which the GPU has no kernel for); the
    /// re-splits this serves (Ulysses' uneven sequence, heads in whole units) are small.
    fn resplit_on_device(&self, dim: usize, to: Vec<usize>) -> Result<Self> {
        let rank = self.rank;
        let whole = match self.placement {
            Placement::Replicate => self.local.clone(),
            _ => self.redistribute(Placement::Replicate)?.into_local(),
        };
        let host = whole.to_host()?;
        let local = to_world_device(rank, shard_of(host.view(), dim, &to, rank.rank()))?;
        Ok(DistTensor::new(rank, local, Placement::Shard(dim), self.global_shape.clone(), to))
    }

    /// From `Shard(dim)` split as now to `Shard(dim)` split as `to`: each rank sends every peer
    /// the rows of its part that fall in the peer's new range, in one all_to_all.
    fn resplit(&self, dim: usize, to: Vec<usize>) -> Result<Self> {
        let (rank, shape) = (self.rank, &self.global_shape);
        let (me, n) = (rank.rank(), rank.num_ranks());
        let (from_at, to_at) = (split_offsets(&self.splits), split_offsets(&to));
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        // Rows `lo..hi` (global indices along `dim`) that rank `src` holds now and `dst` will;
        // `None` when there are none.
        let overlap = |src: usize, dst: usize| {
            let lo = from_at[src].max(to_at[dst]);
            let hi = from_at[src + 1].min(to_at[dst + 1]);
            (lo < hi).then_some((lo, hi))
        };
        const OP: &str = "DistTensor::redistribute_split";
        let view = self.local.view();
        let mut send = Vec::new();
        send.try_reserve_exact(self.local.len()).map_err(|_| Error::OutOfMemory {
            op: OP,
            bytes: self.local.len().saturating_mul(size_of::<T>()),
            what: "the rows to send".to_string(),
        })?;
        let mut counts = Vec::with_capacity(n);
        for dst in 0..n {
            let Some((lo, hi)) = overlap(me, dst) else {
                counts.push(0);
                continue;
            };
            let rows = Slice::from(lo - from_at[me]..hi - from_at[me]);
            send.extend(view.slice_axis(Axis(dim), rows).iter().copied());
            counts.push(outer * (hi - lo) * inner);
        }
        let received = collectives::all_to_all_v(rank, &send, &counts)?;
        let mut local_shape = shape.clone();
        local_shape[dim] = to[me];
        // Every row is written below: the pieces cover this rank's new range.
        let mut whole = Tensor::<T>::scratch(OP, &local_shape)?;
        let mut at = 0;
        for (lo, hi) in (0..n).filter_map(|src| overlap(src, me)) {
            let mut piece_shape = local_shape.clone();
            piece_shape[dim] = hi - lo;
            let len = outer * (hi - lo) * inner;
            let piece =
                ndarray::ArrayViewD::from_shape(IxDyn(&piece_shape), &received[at..at + len])
                    .expect("the piece's length is its shape's");
            at += len;
            let rows = Slice::from(lo - to_at[me]..hi - to_at[me]);
            whole.view_mut().slice_axis_mut(Axis(dim), rows).assign(&piece);
        }
        Ok(DistTensor::new(rank, whole, self.placement, shape.clone(), to))
    }
}
