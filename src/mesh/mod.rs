//! Meshes of ranks: a world's ranks laid out as an n-dimensional array with named dimensions
//! (`[dp, tp]`, `[pp, dp, tp]`), and one [`Group`] per dimension for each rank: the ranks that
//! share every coordinate but that one. Tensor parallelism runs over the last dimension's group,
//! data parallelism over another's ([`data_parallel`]).
//!
//! The layout keeps the last dimension inside a node: the world's ranks are ordered by node
//! (then by rank) and laid out row-major, so each last-dimension group is consecutive ranks of one
//! node whenever the node's size is a multiple of that dimension's. A layout that puts such a
//! group across nodes is allowed (its members reach each other through the MPI proxy, as the
//! world's ranks of different nodes do), and [`DeviceMesh::layout_warning`] says which groups do.
//!
//! Each group is a world of its own (see [`Rank::split`]): every collective, fused op and
//! [`DistTensor`](crate::DistTensor) runs over it through [`DeviceMesh::rank_of`], and calls on
//! different groups run at once, independently.
//!
//! A [`MeshTensor`] places a tensor over the whole mesh, one [`Placement`](crate::Placement) per
//! dimension (`[Replicate, Shard(1)]` on `[dp, tp]`), and redistributes it dimension by
//! dimension over the groups.

pub mod data_parallel;
mod replicas;
mod tensor;
pub mod zero;

pub use replicas::{DEFAULT_CHECK_EVERY, DataParallel};
pub use tensor::MeshTensor;

use crate::collectives::{all_gather, all_reduce};
use crate::shmem::Group;
use crate::{Element, Error, Rank, Result};

/// A world's ranks as a mesh with named dimensions, seen from one rank: its coordinates and its
/// group along each dimension.
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, mesh::DeviceMesh, World};
///
/// // A 2 x 2 mesh: the `tp` groups are ranks {0, 1} and {2, 3}, the `dp` groups {0, 2} and {1, 3}.
/// let out = World::threads(4)?.run(|rank| {
///     let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
///     let tp = mesh.rank_of("tp")?;
///     let dp = mesh.rank_of("dp")?;
///     let over_tp = collectives::all_reduce(&tp, &[rank.rank() as f64])?;
///     let over_dp = collectives::all_reduce(&dp, &[rank.rank() as f64])?;
///     Ok((mesh.coords().to_vec(), over_tp[0], over_dp[0]))
/// })?;
/// assert_eq!(out[1], (vec![0, 1], 1.0, 4.0));
/// assert_eq!(out[2], (vec![1, 0], 5.0, 2.0));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct DeviceMesh<'w> {
    names: Vec<String>,
    shape: Vec<usize>,
    coords: Vec<usize>,
    /// The world's rank at each mesh position, row-major.
    ranks: Vec<usize>,
    /// This rank's group along each dimension.
    groups: Vec<Group<'w>>,
    warning: Option<String>,
}

impl<'w> DeviceMesh<'w> {
    /// Lays the world's ranks out as a mesh of `dims` (name, size), the last dimension inside a
    /// node, and makes this rank's group along every dimension. Collective: every rank calls it
    /// with the same dimensions.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the sizes' product is not the world's size, a size is
    /// zero, or a name is empty or given twice (on every rank); as [`Rank::split`].
    pub fn new(rank: &Rank<'w>, dims: &[(&str, usize)]) -> Result<DeviceMesh<'w>> {
        const OP: &str = "DeviceMesh::new";
        let bad = |reason: String| Error::InvalidArgument { op: OP, rank: rank.rank(), reason };
        let n = rank.num_ranks();
        let shape: Vec<usize> = dims.iter().map(|d| d.1).collect();
        let names: Vec<String> = dims.iter().map(|d| d.0.to_string()).collect();
        let described = || {
            dims.iter().map(|(name, size)| format!("{name}={size}")).collect::<Vec<_>>().join(" x ")
        };
        if dims.is_empty() || shape.contains(&0) || shape.iter().product::<usize>() != n {
            return Err(bad(format!(
                "a mesh [{}] of {} ranks on a world of {n}: the sizes' product must be the world",
                described(),
                shape.iter().product::<usize>()
            )));
        }
        for (i, name) in names.iter().enumerate() {
            if name.is_empty() || names[..i].contains(name) {
                return Err(bad(format!(
                    "mesh [{}]: names must be distinct, not empty",
                    described()
                )));
            }
        }
        // Ranks by node, then rank: the last dimension's groups are consecutive in this order.
        let mut ranks: Vec<usize> = (0..n).collect();
        ranks.sort_by_key(|&r| (rank.node_of(r), r));
        let me = ranks.iter().position(|&r| r == rank.rank()).expect("every rank is laid out");
        let coords = unravel(me, &shape);
        let mut groups = Vec::with_capacity(shape.len());
        for d in 0..shape.len() {
            // Ranks that share every other coordinate: the position with this one zeroed.
            let mut base = coords.clone();
            base[d] = 0;
            let color = ravel(&base, &shape) as u64;
            groups.push(rank.split(color, coords[d] as u64)?);
        }
        let warning = cross_node_groups(rank, &ranks, &shape, &names);
        Ok(DeviceMesh { names, shape, coords, ranks, groups, warning })
    }

    /// The dimensions' names.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The dimensions' sizes.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// This rank's coordinate along every dimension.
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }

    /// The index of the dimension called `name`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the mesh's dimensions when none is called `name`.
    pub fn dim(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| Error::InvalidArgument {
            op: "DeviceMesh::dim",
            rank: self.ranks[ravel(&self.coords, &self.shape)],
            reason: format!("no dimension {name:?} in a mesh of {:?}", self.names),
        })
    }

    /// This rank's coordinate along the dimension `name`.
    ///
    /// # Errors
    /// As [`DeviceMesh::dim`].
    pub fn coord(&self, name: &str) -> Result<usize> {
        Ok(self.coords[self.dim(name)?])
    }

    /// The size of the dimension `name`.
    ///
    /// # Errors
    /// As [`DeviceMesh::dim`].
    pub fn size(&self, name: &str) -> Result<usize> {
        Ok(self.shape[self.dim(name)?])
    }

    /// This rank's group along the dimension `name`.
    ///
    /// # Errors
    /// As [`DeviceMesh::dim`].
    pub fn group(&self, name: &str) -> Result<&Group<'w>> {
        Ok(&self.groups[self.dim(name)?])
    }

    /// The world's ranks of this rank's group along `name`, in the group's order.
    ///
    /// # Errors
    /// As [`DeviceMesh::dim`].
    pub fn members(&self, name: &str) -> Result<Vec<usize>> {
        let d = self.dim(name)?;
        Ok((0..self.shape[d])
            .map(|k| {
                let mut c = self.coords.clone();
                c[d] = k;
                self.ranks[ravel(&c, &self.shape)]
            })
            .collect())
    }

    /// What averages over this rank's group along `name` (the data-parallel dimension): the
    /// group's all-reduce.
    ///
    /// # Errors
    /// As [`DeviceMesh::dim`].
    pub fn averager(&self, name: &str) -> Result<Averager<'_>> {
        Ok(Averager::Group(self.group(name)?.rank()))
    }

    /// This rank's handle in its group along `name`: what collectives, fused ops and
    /// [`DistTensor`](crate::DistTensor) take to run over that group.
    ///
    /// # Errors
    /// As [`DeviceMesh::dim`].
    pub fn rank_of(&self, name: &str) -> Result<Rank<'_>> {
        Ok(self.group(name)?.rank())
    }

    /// The world's rank at mesh coordinates `coords`.
    ///
    /// # Panics
    /// If `coords` is not a position of the mesh.
    pub fn world_rank(&self, coords: &[usize]) -> usize {
        assert!(
            coords.len() == self.shape.len() && coords.iter().zip(&self.shape).all(|(c, s)| c < s),
            "{coords:?} is not a position of a mesh of {:?}",
            self.shape
        );
        self.ranks[ravel(coords, &self.shape)]
    }

    /// Which groups of the last dimension (the tensor-parallel one) cross nodes, if any: such a
    /// layout works, but its fused ops go over the network.
    pub fn layout_warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }
}

/// Averages values over one group of a mesh (see [`DeviceMesh::averager`]).
#[derive(Debug)]
pub enum Averager<'m> {
    /// Over the group, a world of its own (on several MPI nodes too).
    Group(Rank<'m>),
}

impl Averager<'_> {
    /// Number of ranks averaged over.
    pub fn size(&self) -> usize {
        match self {
            Averager::Group(rank) => rank.num_ranks(),
        }
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        match self {
            Averager::Group(rank) => rank.rank(),
        }
    }

    /// The sum of `values` over the group's ranks (in the group's order), divided by its size.
    /// Collective over the group.
    ///
    /// # Errors
    /// As [`all_reduce`].
    pub fn mean<T: Element>(&self, values: &[T]) -> Result<Vec<T>> {
        let size = self.size() as f64;
        let sum: Vec<f64> = match self {
            Averager::Group(rank) => all_reduce(rank, values)?.iter().map(|v| v.to_f64()).collect(),
        };
        Ok(sum.into_iter().map(|s| T::from_f64(s / size)).collect())
    }
}

impl Averager<'_> {
    /// Every rank's `values`, concatenated in the group's order (the lengths may differ).
    /// Collective over the group.
    ///
    /// # Errors
    /// As [`all_gather`].
    pub fn all_gather<T: Element>(&self, values: &[T]) -> Result<Vec<T>> {
        match self {
            Averager::Group(rank) => all_gather(rank, values),
        }
    }
}

impl std::fmt::Debug for DeviceMesh<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMesh")
            .field("names", &self.names)
            .field("shape", &self.shape)
            .field("coords", &self.coords)
            .finish()
    }
}

/// The row-major position of `coords` in `shape`.
fn ravel(coords: &[usize], shape: &[usize]) -> usize {
    coords.iter().zip(shape).fold(0, |at, (c, s)| at * s + c)
}

/// The coordinates of row-major position `at` in `shape`.
fn unravel(mut at: usize, shape: &[usize]) -> Vec<usize> {
    let mut coords = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        coords[d] = at % shape[d];
        at /= shape[d];
    }
    coords
}

/// A sentence naming the last dimension's groups that span nodes, or `None`.
fn cross_node_groups(
    rank: &Rank<'_>,
    ranks: &[usize],
    shape: &[usize],
    names: &[String],
) -> Option<String> {
    let last = *shape.last()?;
    let crossing: Vec<String> = ranks
        .chunks(last)
        .filter(|g| g.iter().any(|&r| rank.node_of(r) != rank.node_of(g[0])))
        .map(|g| format!("{g:?}"))
        .collect();
    (!crossing.is_empty()).then(|| {
        format!(
            "the {:?} groups {} span nodes (nodes of {} ranks): their ops go over the network",
            names.last().expect("a dimension"),
            crossing.join(", "),
            rank.node_ranks(rank.node_of(rank.rank())).len()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{ravel, unravel};

    #[test]
    fn positions_ravel_and_unravel() {
        let shape = [2, 3, 4];
        for at in 0..24 {
            assert_eq!(ravel(&unravel(at, &shape), &shape), at);
        }
        assert_eq!(unravel(7, &shape), vec![0, 1, 3]);
    }
}
