//! [`MeshTensor`]: a tensor distributed over a [`DeviceMesh`], one [`Placement`] per mesh
//! dimension (PyTorch's DTensor over a `DeviceMesh`): `[Replicate, Shard(1)]` on a `[dp, tp]`
//! mesh is a weight whose columns are split over each tp group and repeated on every dp replica.
//!
//! The placements apply in the mesh's order: the first dimension's cuts the global tensor, the
//! next one's cuts that piece, and so on (two dimensions that shard the same tensor dimension
//! split it outer, then inner, each cut as `numpy.array_split` cuts); `Partial` on a dimension
//! means the tensor there is the sum over that dimension's group. Each step of
//! [`MeshTensor::redistribute`] is a [`DistTensor::redistribute`] over one dimension's group
//! (a world of its own), so every collective it uses is the one of a one-dimensional
//! `DistTensor`.

use ndarray::{Axis, Slice};

use super::DeviceMesh;
use crate::collectives::all_gather;
use crate::dist_tensor::MAX_DIMS;
use crate::tensor::array_split;
use crate::{DistTensor, Element, Error, Placement, Result, Tensor};

/// A tensor distributed over a [`DeviceMesh`]: this rank's local part, one [`Placement`] per
/// mesh dimension, and the global shape.
///
/// Its methods that communicate are collective over the mesh: every rank calls them, in the same
/// order. To run a fused op over one dimension's group, take the local part into a
/// [`DistTensor`] on that group's rank ([`DeviceMesh::rank_of`]) with the dimension's placement.
///
/// # Examples
/// ```
/// use dist_tensor::mesh::{DeviceMesh, MeshTensor};
/// use dist_tensor::{Placement::{Partial, Replicate, Shard}, Tensor, World};
///
/// let w = Tensor::<f64>::random(&[4, 6], 1);
/// let out = World::threads(4)?.run(|rank| {
///     let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
///     // Columns split over tp, repeated over dp.
///     let x = MeshTensor::from_global(&mesh, &w, &[Replicate, Shard(1)])?;
///     assert_eq!(x.local().shape(), &[4, 3]);
///     // Rows over dp and columns over tp; then a sum over dp (rank dp=0 keeps the values).
///     let y = x.redistribute(&[Shard(0), Shard(1)])?;
///     assert_eq!(y.local().shape(), &[2, 3]);
///     let z = y.redistribute(&[Partial, Replicate])?;
///     z.to_global()
/// })?;
/// assert!(out.iter().all(|t| t == &w));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Clone)]
pub struct MeshTensor<'m, T: Element> {
    mesh: &'m DeviceMesh<'m>,
    local: Tensor<T>,
    placements: Vec<Placement>,
    global_shape: Vec<usize>,
}

impl<'m, T: Element> MeshTensor<'m, T> {
    /// This rank's part of `global` (which every rank holds) under `placements`, one per mesh
    /// dimension: cut for each `Shard`, whole for `Replicate`, and for `Partial` the values on the
    /// group's first rank and zeros on the others (their sum is the tensor). No communication.
    ///
    /// # Errors
    /// As [`MeshTensor::redistribute`]'s checks of `placements`.
    pub fn from_global(
        mesh: &'m DeviceMesh<'m>,
        global: &Tensor<T>,
        placements: &[Placement],
    ) -> Result<Self> {
        const OP: &str = "MeshTensor::from_global";
        let global = global.to_host()?;
        check_placements(mesh, OP, placements, global.shape().len())?;
        let mut local = global.clone();
        for (d, &p) in placements.iter().enumerate() {
            local = apply(&local, p, mesh.shape()[d], mesh.coords()[d]);
        }
        Ok(MeshTensor {
            mesh,
            local,
            placements: placements.to_vec(),
            global_shape: global.shape().to_vec(),
        })
    }

    /// Wraps this rank's `local` part under `placements`. Collective over the mesh: the ranks
    /// of each dimension's group exchange their shapes, so shards may differ in size (and be
    /// empty).
    ///
    /// # Errors
    /// [`Error::RanksDisagree`] naming two world ranks of one group whose placements, numbers of
    /// dimensions or sizes (other than along the group's sharded dimension) differ; as
    /// [`MeshTensor::redistribute`]'s checks of `placements`; as the all-gather of the shapes.
    pub fn from_local(
        mesh: &'m DeviceMesh<'m>,
        local: Tensor<T>,
        placements: &[Placement],
    ) -> Result<Self> {
        const OP: &str = "MeshTensor::from_local";
        let local = local.to_host()?;
        let ndim = local.shape().len();
        check_placements(mesh, OP, placements, ndim)?;
        // From the innermost dimension out: each group's shapes make the shape one level up.
        let mut shape = local.shape().to_vec();
        for d in (0..placements.len()).rev() {
            let name = &mesh.names()[d];
            let group = mesh.rank_of(name)?;
            let members = mesh.members(name)?;
            let mut words: Vec<f64> =
                placements.iter().flat_map(|p| p.code()).map(|w| w as f64).collect();
            words.push(ndim as f64);
            words.extend(shape.iter().map(|&s| s as f64));
            let all = all_gather(&group, &words)?;
            let at = |m: usize| &all[m * words.len()..(m + 1) * words.len()];
            let sharded = match placements[d] {
                Placement::Shard(k) => Some(2 * placements.len() + 1 + k),
                _ => None,
            };
            for m in 1..members.len() {
                if (0..words.len()).any(|i| Some(i) != sharded && at(m)[i] != at(0)[i]) {
                    let show = |m: usize| format!("placements and shape {:?}", at(m));
                    return Err(Error::RanksDisagree {
                        op: OP,
                        rank_a: members[0],
                        value_a: show(0),
                        rank_b: members[m],
                        value_b: show(m),
                    });
                }
            }
            if let (Placement::Shard(k), Some(i)) = (placements[d], sharded) {
                shape[k] = (0..members.len()).map(|m| at(m)[i] as usize).sum();
            }
        }
        Ok(MeshTensor { mesh, local, placements: placements.to_vec(), global_shape: shape })
    }

    /// The same global tensor under `to`, one placement per mesh dimension. Collective over the
    /// mesh.
    ///
    /// Each dimension whose placement changes is changed over its own group by
    /// [`DistTensor::redistribute`]: the changing dimensions (and any later one that shards the
    /// same tensor dimension, as its cut depends on theirs) go to `Replicate` from the last one
    /// up, then to their new placements from the first one down; the first of them goes straight
    /// from its old placement to its new one (a reduce-scatter for `Partial` to `Shard`, an
    /// all-to-all for `Shard(i)` to `Shard(j)`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `to` does not have one placement per mesh dimension;
    /// [`Error::DimOutOfRange`] for a shard dimension that is not one of the tensor's; as
    /// [`DeviceMesh::rank_of`] (a dimension without a group) and the collectives.
    pub fn redistribute(&self, to: &[Placement]) -> Result<Self> {
        const OP: &str = "MeshTensor::redistribute";
        check_placements(self.mesh, OP, to, self.global_shape.len())?;
        let from = &self.placements;
        let dims = from.len();
        // The dimensions to change, and those whose cut depends on a changed one's.
        let mut changed: Vec<bool> = (0..dims).map(|d| from[d] != to[d]).collect();
        let shards = |p: Placement| match p {
            Placement::Shard(k) => Some(k),
            _ => None,
        };
        let mut grew = true;
        while grew {
            grew = false;
            for d in 0..dims {
                if !changed[d] {
                    continue;
                }
                for later in d + 1..dims {
                    let same = shards(from[later])
                        .is_some_and(|k| Some(k) == shards(from[d]) || Some(k) == shards(to[d]));
                    if same && !changed[later] {
                        changed[later] = true;
                        grew = true;
                    }
                }
            }
        }
        let Some(first) = changed.iter().position(|&c| c) else {
            return Ok(self.clone());
        };
        let mut local = self.local.clone();
        let mut now = from.clone();
        for d in (first + 1..dims).rev().filter(|&d| changed[d]) {
            local = self.step(local, d, now[d], Placement::Replicate)?;
            now[d] = Placement::Replicate;
        }
        for d in (first..dims).filter(|&d| changed[d]) {
            local = self.step(local, d, now[d], to[d])?;
            now[d] = to[d];
        }
        Ok(MeshTensor {
            mesh: self.mesh,
            local,
            placements: to.to_vec(),
            global_shape: self.global_shape.clone(),
        })
    }

    /// `local`, placed `from` over dimension `d`'s group, redistributed there to `to`.
    fn step(
        &self,
        local: Tensor<T>,
        d: usize,
        from: Placement,
        to: Placement,
    ) -> Result<Tensor<T>> {
        if from == to {
            return Ok(local);
        }
        let group = self.mesh.rank_of(&self.mesh.names()[d])?;
        let along = DistTensor::from_local(&group, local, from)?;
        Ok(along.redistribute(to)?.into_local())
    }

    /// The whole tensor, on every rank. Collective over the mesh.
    ///
    /// # Errors
    /// As [`MeshTensor::redistribute`].
    pub fn to_global(&self) -> Result<Tensor<T>> {
        let replicated = vec![Placement::Replicate; self.placements.len()];
        Ok(self.redistribute(&replicated)?.local)
    }

    /// This rank's part.
    pub fn local(&self) -> &Tensor<T> {
        &self.local
    }

    /// This rank's part, taken.
    pub fn into_local(self) -> Tensor<T> {
        self.local
    }

    /// The placement along each mesh dimension.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// The shape of the whole tensor.
    pub fn global_shape(&self) -> &[usize] {
        &self.global_shape
    }

    /// The mesh it is distributed over.
    pub fn mesh(&self) -> &'m DeviceMesh<'m> {
        self.mesh
    }
}

impl<T: Element> std::fmt::Debug for MeshTensor<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTensor")
            .field("coords", &self.mesh.coords())
            .field("placements", &self.placements)
            .field("global_shape", &self.global_shape)
            .field("local_shape", &self.local.shape())
            .finish()
    }
}

/// One placement per mesh dimension, each shard dimension one of the tensor's.
fn check_placements(
    mesh: &DeviceMesh<'_>,
    op: &'static str,
    placements: &[Placement],
    ndim: usize,
) -> Result<()> {
    if placements.len() != mesh.shape().len() {
        return Err(Error::InvalidArgument {
            op,
            rank: mesh.world_rank(mesh.coords()),
            reason: format!(
                "{} placements for a mesh of {} dimensions {:?}",
                placements.len(),
                mesh.shape().len(),
                mesh.names()
            ),
        });
    }
    if ndim > MAX_DIMS {
        return Err(Error::InvalidArgument {
            op,
            rank: mesh.world_rank(mesh.coords()),
            reason: format!("{ndim} dimensions; at most {MAX_DIMS}"),
        });
    }
    match placements.iter().find_map(|p| match *p {
        Placement::Shard(k) if k >= ndim => Some(k),
        _ => None,
    }) {
        Some(dim) => Err(Error::DimOutOfRange { op, dim, ndim }),
        None => Ok(()),
    }
}

/// The part of `t` that coordinate `at` of a dimension of `size` holds under `p`.
fn apply<T: Element>(t: &Tensor<T>, p: Placement, size: usize, at: usize) -> Tensor<T> {
    match p {
        Placement::Replicate => t.clone(),
        Placement::Partial if at == 0 => t.clone(),
        Placement::Partial => Tensor::zeros(t.shape()),
        Placement::Shard(k) => {
            let sizes = array_split(t.shape()[k], size);
            let start: usize = sizes[..at].iter().sum();
            let view = t.view();
            Tensor::from_array(
                view.slice_axis(Axis(k), Slice::from(start..start + sizes[at])).to_owned(),
            )
        }
    }
}
