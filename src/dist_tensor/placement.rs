//! [`Placement`]: how a distributed tensor's data is laid out over the ranks.

use std::fmt;

/// How a [`DistTensor`](crate::DistTensor) is laid out over the ranks of a world.
///
/// # Examples
/// ```
/// use dist_tensor::Placement;
/// assert_eq!(Placement::Shard(1).to_string(), "Shard(1)");
/// assert_ne!(Placement::Replicate, Placement::Partial);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split along a dimension: each rank holds a slice, sizes may differ (and be zero).
    Shard(usize),
    /// Every rank holds the whole tensor.
    Replicate,
    /// Every rank holds a tensor of the whole shape; the global tensor is their sum.
    Partial,
}

impl Placement {
    /// The placement as two words, for the shape exchange.
    pub(crate) fn code(self) -> [u64; 2] {
        match self {
            Placement::Shard(d) => [0, d as u64],
            Placement::Replicate => [1, 0],
            Placement::Partial => [2, 0],
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::Replicate => f.write_str("Replicate"),
            Placement::Partial => f.write_str("Partial"),
        }
    }
}
