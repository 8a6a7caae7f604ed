//! The sequence-parallel exchange of a [`DistTensor`]: `all_to_all`.

use super::{DistTensor, Placement};
use crate::fused;
use crate::tensor::Element;
use crate::{Error, Result};

impl<'r, T: Element> DistTensor<'r, T> {
    /// Reshards from `gather_dim` to `scatter_dim` in one fused kernel: `self` must be
    /// `Shard(gather_dim)`; the result is the same global tensor, `Shard(scatter_dim)`, split as
    /// `numpy.array_split`. The Ulysses layout: `[B, s_r, H, D]` `Shard(1)` becomes
    /// `[B, S, h_r, D]` `Shard(2)` with `all_to_all(2, 1)`, and goes back with `all_to_all(1, 2)`.
    /// `S` and `H` need not divide by the world size; with more ranks than heads some ranks get none.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] for a dimension the tensor does not have,
    /// [`Error::UnsupportedPlacement`] unless `self` is `Shard(gather_dim)` (on every rank, as the
    /// ranks agree on shape and placement); [`Error::InvalidArgument`] when the two dimensions are
    /// the same; and as every collective.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let q = Tensor::<f32>::random(&[1, 7, 3, 4], 1); // [B, S, H, D]
    /// World::threads(2)?.run(|rank| {
    ///     let seq = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
    ///     let heads = seq.all_to_all(2, 1)?;
    ///     assert_eq!(heads.local().shape(), &[1, 7, 2 - rank.rank(), 4]);
    ///     let back = heads.all_to_all(1, 2)?;
    ///     assert_eq!(back.local(), seq.local());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn all_to_all(&self, scatter_dim: usize, gather_dim: usize) -> Result<Self> {
        self.reshard(scatter_dim, gather_dim, true)
    }

    /// The unfused baseline of [`DistTensor::all_to_all`]: permute, all_to_all, permute.
    ///
    /// # Errors
    /// As [`DistTensor::all_to_all`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let q = Tensor::<f32>::random(&[1, 7, 3, 4], 1); // [B, S, H, D]
    /// World::threads(2)?.run(|rank| {
    ///     let seq = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
    ///     let unfused = seq.all_to_all_unfused(2, 1)?;
    ///     assert_eq!(unfused.local(), seq.all_to_all(2, 1)?.local());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn all_to_all_unfused(&self, scatter_dim: usize, gather_dim: usize) -> Result<Self> {
        self.reshard(scatter_dim, gather_dim, false)
    }

    fn reshard(&self, scatter_dim: usize, gather_dim: usize, fused: bool) -> Result<Self> {
        const OP: &str = "all_to_all";
        let ndim = self.global_shape.len();
        for dim in [scatter_dim, gather_dim] {
            if dim >= ndim {
                return Err(Error::DimOutOfRange { op: OP, dim, ndim });
            }
        }
        if self.placement != Placement::Shard(gather_dim) {
            return Err(Error::UnsupportedPlacement {
                op: OP,
                placement: self.placement.to_string(),
                expected: format!("Shard({gather_dim}), the gather dimension"),
            });
        }
        if scatter_dim == gather_dim {
            return Err(Error::InvalidArgument {
                op: OP,
                rank: self.rank.rank(),
                reason: format!("scatter and gather dimension are both {scatter_dim}"),
            });
        }
        let out = fused::all_to_all::run(self.rank, &self.local, scatter_dim, gather_dim, fused)?;
        Ok(DistTensor::new(
            self.rank,
            out.output,
            Placement::Shard(scatter_dim),
            self.global_shape.clone(),
            out.scatter_counts,
        ))
    }
}
