//! `reshape` and `permute` of a [`DistTensor`]: local, with the placement following the data.

use super::tensor::RowSplit;
use super::{DistTensor, Placement};
use crate::tensor::Element;
use crate::{Error, Result};

/// Where a dimension sharded as `splits` lands when `old` is reshaped to `new`, and its new
/// splits; `None` when some rank's piece would not be a slab of a dimension of `new`.
///
/// Row-major, `old` is `[A, old[d], B]` with `A` and `B` the products of the dimensions before
/// and after `d`, and rank `r` holds the run of `splits[r] * B` elements at
/// `offset[r] * B` inside each of the `A` outer blocks. In `new`, a dimension `d'` whose
/// preceding dimensions also multiply to `A` holds those runs as whole slices when every
/// `splits[r] * B` is a multiple of `B'`, the product of the dimensions after `d'`. Among
/// several such dimensions (dimensions of length 1 around it), the first longer than 1 wins.
/// When no dimension does but at most one rank holds anything (a world of one), that rank holds
/// all of the new first dimension.
pub(crate) fn reshape_shard(
    old: &[usize],
    d: usize,
    splits: &[usize],
    new: &[usize],
) -> Option<(usize, Vec<usize>)> {
    let a: usize = old[..d].iter().product();
    let b: usize = old[d + 1..].iter().product();
    let candidates = (0..new.len()).filter(|&nd| new[..nd].iter().product::<usize>() == a);
    let fits = |nd: usize| -> Option<(usize, Vec<usize>)> {
        let b_new: usize = new[nd + 1..].iter().product();
        if b == 0 || b_new == 0 {
            // No elements: only the dimension itself can say where the split goes.
            return (new[nd] == old[d]).then(|| (nd, splits.to_vec()));
        }
        let sizes: Option<Vec<usize>> = splits
            .iter()
            .map(|&s| (s * b).is_multiple_of(b_new).then_some(s * b / b_new))
            .collect();
        sizes.filter(|s| s.iter().sum::<usize>() == new[nd]).map(|s| (nd, s))
    };
    let found: Vec<(usize, Vec<usize>)> = candidates.filter_map(fits).collect();
    let longer = found.iter().position(|(nd, _)| new[*nd] != 1).unwrap_or(0);
    let owners: Vec<usize> = (0..splits.len()).filter(|&r| splits[r] > 0).collect();
    match found.into_iter().nth(longer) {
        Some(found) => Some(found),
        None if owners.len() <= 1 && !new.is_empty() => {
            let mut sizes = vec![0; splits.len()];
            sizes[owners.first().copied().unwrap_or(0)] = new[0];
            Some((0, sizes))
        }
        None => None,
    }
}

impl<'r, T: Element> DistTensor<'r, T> {
    /// The same global tensor under another shape of equal size, the sharding following the
    /// data: `[S, H * D]` sharded on dimension 1 in whole heads becomes `[S, H, D]` sharded on
    /// dimension 1 (`H` split), and back. No communication; each rank reshapes its own part
    /// (sharing its elements, no copy).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the sizes differ, or when the new shape would split the
    /// sharded dimension so that some rank's part is no longer a slab of one dimension (`[S, 6]`
    /// sharded `[4, 2]` on dimension 1 cannot become `[S, 2, 3]`: rank 0's 4 columns are one head
    /// and a third). The same on every rank: every rank knows every rank's split.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
    /// let q = Tensor::<f32>::random(&[5, 3 * 4], 1); // [S, H * D], 3 heads of 4
    /// World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global_split(rank, &q, 1, Split::Units(4))?; // 2 heads, 1 head
    ///     let heads = x.reshape(&[5, 3, 4])?;
    ///     assert_eq!(heads.placement(), Placement::Shard(1));
    ///     assert_eq!(heads.shard_sizes(), &[2, 1]);
    ///     assert_eq!(heads.reshape(&[5, 12])?.local(), x.local());
    ///     // Columns cut in the middle of a head cannot become heads.
    ///     let torn = DistTensor::from_global(rank, &q, Placement::Shard(1))?; // 6 and 6 columns
    ///     assert!(torn.reshape(&[5, 3, 4]).is_err());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        const OP: &str = "DistTensor::reshape";
        let old = &self.global_shape;
        if shape.iter().product::<usize>() != old.iter().product::<usize>() {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!("cannot reshape {old:?} into {shape:?}: the sizes differ"),
            });
        }
        let (placement, splits, local_shape) = match self.placement {
            Placement::Shard(d) => {
                let (nd, splits) = reshape_shard(old, d, &self.splits, shape).ok_or_else(|| {
                    Error::InvalidShape {
                        op: OP,
                        reason: format!(
                            "reshaping {old:?} sharded on dimension {d} as {:?} into {shape:?} \
                             would split the sharded dimension: some rank's part would not be \
                             whole slices of one dimension",
                            self.splits
                        ),
                    }
                })?;
                let mut local_shape = shape.to_vec();
                local_shape[nd] = splits[self.rank.rank()];
                (Placement::Shard(nd), splits, local_shape)
            }
            other => (other, Vec::new(), shape.to_vec()),
        };
        let local = self.local.reshape(&local_shape)?;
        let rows_from = self.rows_from.clone().and_then(|r| r.after_reshape(old, shape));
        Ok(DistTensor::new(self.rank, local, placement, shape.to_vec(), splits)
            .with_rows_from(rows_from))
    }

    /// Reorders the axes, the sharded dimension moving with them: axis `i` of the result is
    /// axis `axes[i]` of `self`, so `Shard(d)` becomes `Shard(i)` where `axes[i] == d`. No
    /// communication; each rank permutes its own part (a copy; on the host in a GPU world).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `axes` is not a permutation of the dimensions.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f32>::random(&[2, 7, 3], 1); // [B, S, H]
    /// let outs = World::threads(3)?.run(|rank| {
    ///     let seq = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
    ///     let t = seq.permute(&[1, 0, 2])?; // [S, B, H]
    ///     assert_eq!(t.placement(), Placement::Shard(0));
    ///     t.to_global()
    /// })?;
    /// assert_eq!(outs[0], x.permute(&[1, 0, 2])?);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn permute(&self, axes: &[usize]) -> Result<Self> {
        let part = self.local.host_tensor()?;
        let local = part.permute(axes).map_err(|_| Error::InvalidShape {
            op: "DistTensor::permute",
            reason: format!("{axes:?} is not a permutation of the axes of {:?}", self.global_shape),
        })?;
        let local = crate::device::to_world_device(self.rank, local)?;
        let moved = |d: usize| axes.iter().position(|&a| a == d).expect("a permutation");
        let placement = match self.placement {
            Placement::Shard(d) => Placement::Shard(moved(d)),
            other => other,
        };
        let global = axes.iter().map(|&a| self.global_shape[a]).collect();
        let rows_from =
            self.rows_from.clone().map(|r| RowSplit { dim: moved(r.dim), sizes: r.sizes });
        Ok(DistTensor::new(self.rank, local, placement, global, self.splits.clone())
            .with_rows_from(rows_from))
    }
}

#[cfg(test)]
mod tests {
    use super::reshape_shard;

    #[test]
    fn the_sharded_dimension_follows_a_reshape_or_refuses_to_split() {
        // Heads split whole: [S, H*D] -> [S, H, D].
        assert_eq!(reshape_shard(&[5, 12], 1, &[8, 4], &[5, 3, 4]), Some((1, vec![2, 1])));
        // And merged back.
        assert_eq!(reshape_shard(&[5, 3, 4], 1, &[2, 1], &[5, 12]), Some((1, vec![8, 4])));
        // A head torn in two.
        assert_eq!(reshape_shard(&[5, 12], 1, &[6, 6], &[5, 3, 4]), None);
        // Rows merged with the inner dimensions: [B=1, S, H] -> [S, H] and [S*H].
        assert_eq!(reshape_shard(&[1, 7, 3], 1, &[4, 3], &[7, 3]), Some((0, vec![4, 3])));
        assert_eq!(reshape_shard(&[7, 3], 0, &[4, 3], &[21]), Some((0, vec![12, 9])));
        // Sharded on S with B > 1: [B, S, H] -> [B*S, H] would interleave the ranks' rows.
        assert_eq!(reshape_shard(&[2, 7, 3], 1, &[4, 3], &[14, 3]), None);
        // Dimensions of 1 around: the longer one is chosen.
        assert_eq!(reshape_shard(&[4, 6], 1, &[6, 0], &[4, 1, 6]), Some((2, vec![6, 0])));
        // Empty tensors keep the split where the dimension is unchanged.
        assert_eq!(reshape_shard(&[0, 6], 1, &[3, 3], &[0, 6, 1]), Some((1, vec![3, 3])));
        // One rank holding everything can take any shape.
        assert_eq!(reshape_shard(&[2, 7, 3], 1, &[7], &[42]), Some((0, vec![42])));
        assert_eq!(reshape_shard(&[2, 7, 3], 1, &[0, 7, 0], &[6, 7]), Some((0, vec![0, 6, 0])));
        assert_eq!(reshape_shard(&[2, 7, 3], 1, &[7], &[]), None);
    }
}
