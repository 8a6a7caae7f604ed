//! [`Split`]: how a sharded dimension is cut between the ranks.

use crate::tensor::array_split;
use crate::{Error, Result};

/// How the length of a sharded dimension is cut into one piece per rank.
///
/// The library's own default everywhere is [`Split::Even`], as `numpy.array_split` cuts. A model
/// often needs another cut: attention heads must not be torn apart ([`Split::Units`] with the
/// head size), and a residual must line up with the rows some other op produced
/// ([`Split::Sizes`], for example the [`shard_sizes`](crate::DistTensor::shard_sizes) of that
/// tensor).
///
/// # Examples
/// ```
/// use dist_tensor::Split;
/// // 64 columns on 3 ranks.
/// assert_eq!(Split::Even.sizes(64, 3)?, vec![22, 21, 21]);
/// // 8 heads of 8 columns on 3 ranks: 3, 3 and 2 whole heads.
/// assert_eq!(Split::Units(8).sizes(64, 3)?, vec![24, 24, 16]);
/// assert_eq!(Split::Sizes(vec![10, 6]).sizes(16, 2)?, vec![10, 6]);
/// assert!(Split::Units(6).sizes(64, 3).is_err()); // 64 is not whole units of 6
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Split {
    /// As `numpy.array_split`: the first `len % world` ranks get one more.
    #[default]
    Even,
    /// Whole units of this many elements (a head's columns, for example), the units cut as
    /// `numpy.array_split` cuts them. The length must be a multiple of the unit.
    Units(usize),
    /// Exactly these sizes, one per rank in rank order, adding up to the length.
    Sizes(Vec<usize>),
}

impl Split {
    /// Each rank's piece of `len` for a world of `world` ranks.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (naming rank 0: the sizes are the same on every rank) when a
    /// unit is 0 or does not divide `len`, or the sizes do not have one entry per rank or do
    /// not add up to `len`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Split;
    /// assert_eq!(Split::Even.sizes(2, 4)?, vec![1, 1, 0, 0]);
    /// assert!(Split::Sizes(vec![3, 3]).sizes(5, 2).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn sizes(&self, len: usize, world: usize) -> Result<Vec<usize>> {
        self.sizes_for("Split::sizes", 0, len, world)
    }

    /// [`Split::sizes`] with the op and rank to name in an error.
    pub(crate) fn sizes_for(
        &self,
        op: &'static str,
        rank: usize,
        len: usize,
        world: usize,
    ) -> Result<Vec<usize>> {
        let invalid = |reason: String| Error::InvalidArgument { op, rank, reason };
        if world == 0 {
            return Err(invalid("a split between zero ranks".to_string()));
        }
        match self {
            Split::Even => Ok(array_split(len, world)),
            Split::Units(0) => Err(invalid("a split in units of 0 elements".to_string())),
            Split::Units(unit) if !len.is_multiple_of(*unit) => {
                Err(invalid(format!("a length of {len} is not a whole number of units of {unit}")))
            }
            Split::Units(unit) => {
                Ok(array_split(len / unit, world).iter().map(|u| u * unit).collect())
            }
            Split::Sizes(sizes) if sizes.len() != world => Err(invalid(format!(
                "{} sizes {sizes:?} for a world of {world} ranks",
                sizes.len()
            ))),
            Split::Sizes(sizes) if sizes.iter().sum::<usize>() != len => Err(invalid(format!(
                "sizes {sizes:?} add up to {}, not the length {len}",
                sizes.iter().sum::<usize>()
            ))),
            Split::Sizes(sizes) => Ok(sizes.clone()),
        }
    }
}

impl From<Vec<usize>> for Split {
    /// Explicit sizes, one per rank.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Split;
    /// assert_eq!(Split::from(vec![3, 1]), Split::Sizes(vec![3, 1]));
    /// ```
    fn from(sizes: Vec<usize>) -> Self {
        Split::Sizes(sizes)
    }
}

impl From<&[usize]> for Split {
    /// Explicit sizes, one per rank (another tensor's
    /// [`shard_sizes`](crate::DistTensor::shard_sizes), say).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Split;
    /// assert_eq!(Split::from(&[3, 1][..]), Split::Sizes(vec![3, 1]));
    /// ```
    fn from(sizes: &[usize]) -> Self {
        Split::Sizes(sizes.to_vec())
    }
}
