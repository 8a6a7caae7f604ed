//! [`DistTensor`]: one shard per rank, and how it is made and gathered back.

use ndarray::{ArrayViewD, Axis, Slice};

use super::{Placement, Split};
use crate::collectives;
use crate::device::Device;
use crate::device::to_world_device;
use crate::shmem::{Rank, WordExchange, Workspace, check_agree};
use crate::tensor::{Element, Tensor, array_split, split_offsets};
use crate::{Error, Result};

/// The most dimensions a distributed tensor may have: the fused ops' limit (their shape
/// exchanges are sized for it).
pub use crate::fused::MAX_DIMS;

/// A tensor distributed over the ranks of a world: this rank's local part, how the parts make
/// the whole ([`Placement`]), and the global shape every rank agreed on.
///
/// Made collectively ([`DistTensor::from_local`]) or from a global tensor every rank has
/// ([`DistTensor::from_global`]); its methods that communicate are collective too: every rank calls
/// them, in the same order. Methods that only touch this rank's part ([`map_local`],
/// [`reshape`], [`permute`], [`cast`]) exchange nothing.
///
/// A `DistTensor` borrows its [`Rank`], so it lives inside [`World::run`](crate::World::run) and
/// cannot outlive it: return [`to_global`](DistTensor::to_global), [`local`](DistTensor::local) or
/// [`into_local`](DistTensor::into_local) from the closure instead (tensors, not borrows).
///
/// ```compile_fail,E0521
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let global = Tensor::<f32>::zeros(&[4]);
/// // Does not compile: the DistTensor borrows the rank, which lives only inside `run`.
/// let parts = World::threads(2)?.run(|rank| DistTensor::from_global(rank, &global, Placement::Replicate))?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
///
/// [`map_local`]: DistTensor::map_local
/// [`reshape`]: DistTensor::reshape
/// [`permute`]: DistTensor::permute
/// [`cast`]: DistTensor::cast
///
/// # Examples
/// ```
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
///
/// let global = Tensor::<f32>::random(&[5, 3], 1);
/// let back = World::threads(2)?.run(|rank| {
///     let x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
///     assert_eq!(x.local().shape(), &[3 - rank.rank(), 3]); // array_split: 3 rows, then 2
///     x.to_global()
/// })?;
/// assert!(back.iter().all(|t| t == &global));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Clone)]
pub struct DistTensor<'r, T: Element> {
    pub(crate) rank: &'r Rank<'r>,
    pub(crate) local: Tensor<T>,
    pub(crate) placement: Placement,
    pub(crate) global_shape: Vec<usize>,
    /// For `Shard(d)`: every rank's size along `d`. Empty otherwise.
    pub(crate) splits: Vec<usize>,
    /// The leading dimension, and its split, that an `all_gather_matmul` gathered this tensor's
    /// rows from: the output split a following `matmul_reduce_scatter` gives back by default.
    pub(crate) rows_from: Option<RowSplit>,
}

/// A split of one leading dimension (see `DistTensor::rows_from`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowSplit {
    pub(crate) dim: usize,
    pub(crate) sizes: Vec<usize>,
}

impl RowSplit {
    /// Whether the split still describes dimension `dim` of a tensor of `shape` that is not
    /// sharded on it, and is not its last dimension.
    pub(crate) fn fits(&self, shape: &[usize], placement: Placement, world: usize) -> bool {
        self.dim + 1 < shape.len()
            && placement != Placement::Shard(self.dim)
            && self.sizes.len() == world
            && self.sizes.iter().sum::<usize>() == shape[self.dim]
    }

    /// The split after a local change of shape from `old` to `new`: kept where the dimensions
    /// up to and including its own are unchanged.
    pub(crate) fn after_reshape(self, old: &[usize], new: &[usize]) -> Option<Self> {
        (new.len() > self.dim && new[..=self.dim] == old[..=self.dim]).then_some(self)
    }
}

/// The shape exchange of `from_local`.
struct ShapeExchange(WordExchange);

impl Workspace for ShapeExchange {
    fn symmetric_bytes(&self) -> usize {
        self.0.symmetric_bytes()
    }
}

impl<'r, T: Element> DistTensor<'r, T> {
    pub(crate) fn new(
        rank: &'r Rank<'r>,
        local: Tensor<T>,
        placement: Placement,
        global_shape: Vec<usize>,
        splits: Vec<usize>,
    ) -> Self {
        DistTensor { rank, local, placement, global_shape, splits, rows_from: None }
    }

    /// The same tensor, remembering the split its rows were gathered from.
    pub(crate) fn with_rows_from(mut self, rows_from: Option<RowSplit>) -> Self {
        self.rows_from = rows_from;
        self
    }

    /// Wraps this rank's `local` part. Collective: the ranks exchange their local shapes, so
    /// shards may differ in size (and be empty) along the sharded dimension.
    ///
    /// # Errors
    /// On every rank: [`Error::RanksDisagree`] naming two ranks whose placements, numbers of
    /// dimensions or sizes (other than along a sharded dimension) differ;
    /// [`Error::InvalidArgument`] naming the rank whose shard dimension is out of range or whose
    /// tensor has more than [`MAX_DIMS`] dimensions.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let shapes = World::threads(3)?.run(|rank| {
    ///     let rows = [2, 0, 5][rank.rank()]; // uneven, one empty
    ///     let x = DistTensor::from_local(rank, Tensor::<f64>::zeros(&[rows, 4]), Placement::Shard(0))?;
    ///     Ok(x.global_shape())
    /// })?;
    /// assert_eq!(shapes[0], vec![7, 4]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_local(rank: &'r Rank<'r>, local: Tensor<T>, placement: Placement) -> Result<Self> {
        const OP: &str = "DistTensor::from_local";
        let shape = local.shape();
        let problem = match placement {
            _ if shape.len() > MAX_DIMS => {
                Some(format!("{} dimensions; at most {MAX_DIMS}", shape.len()))
            }
            Placement::Shard(d) if d >= shape.len() => Some(format!(
                "shard dimension {d} is out of range for a tensor of {} dimensions",
                shape.len()
            )),
            _ => None,
        };
        let mut words = placement.code().to_vec();
        words.push(shape.len() as u64);
        words.extend(shape.iter().take(MAX_DIMS).map(|&d| d as u64));
        let all = rank.with_workspace(
            |r| Ok(ShapeExchange(WordExchange::new(r, 3 + MAX_DIMS)?)),
            |ex| ex.0.exchange_typed::<T>(rank, OP, &words, problem),
        )?;
        check_agree(OP, &all, 0, "placement")?;
        check_agree(OP, &all, 1, "placement dimension")?;
        check_agree(OP, &all, 2, "number of dimensions")?;
        let sharded = match placement {
            Placement::Shard(d) => Some(d),
            _ => None,
        };
        for d in (0..shape.len()).filter(|&d| Some(d) != sharded) {
            check_agree(OP, &all, 3 + d, &format!("size of dimension {d}"))?;
        }
        let mut global_shape = shape.to_vec();
        let splits = match sharded {
            Some(d) => {
                let splits: Vec<usize> = all.iter().map(|w| w[3 + d] as usize).collect();
                global_shape[d] = splits.iter().sum();
                splits
            }
            None => Vec::new(),
        };
        let local = to_world_device(rank, local)?;
        Ok(DistTensor::new(rank, local, placement, global_shape, splits))
    }

    /// This rank's part of `global`, which every rank holds: a `numpy.array_split` slice for
    /// `Shard(d)` (the first `len % world` ranks get one more; [`DistTensor::from_global_split`]
    /// cuts otherwise), `global` itself for `Replicate`, and for `Partial` the tensor on rank 0
    /// and zeros elsewhere (their sum is `global`). No communication.
    ///
    /// `Replicate` (and `Partial` on rank 0) share `global`'s elements rather than copying them:
    /// tensors are copy-on-write, so every rank of a world holds one buffer until one of them
    /// writes to its part.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] when the shard dimension is not a dimension of `global`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f32>::random(&[2, 10], 3);
    /// let widths = World::threads(4)?.run(|rank| {
    ///     Ok(DistTensor::from_global(rank, &global, Placement::Shard(1))?.local().shape()[1])
    /// })?;
    /// assert_eq!(widths, vec![3, 3, 2, 2]);
    ///
    /// // Replicated: every rank shares the one buffer.
    /// let shared = World::threads(4)?.run(|rank| {
    ///     let w = DistTensor::from_global(rank, &global, Placement::Replicate)?;
    ///     Ok(w.local().as_slice().as_ptr() == global.as_slice().as_ptr())
    /// })?;
    /// assert_eq!(shared, vec![true; 4]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_global(
        rank: &'r Rank<'r>,
        global: &Tensor<T>,
        placement: Placement,
    ) -> Result<Self> {
        if global.device() != Device::Host || rank.tensor_device() != Device::Host {
            // Split on the host; each part then goes where the world keeps its tensors.
            let host = DistTensor::from_global_host(rank, &global.to_host()?, placement)?;
            let local = to_world_device(rank, host.local)?;
            return Ok(DistTensor { local, ..host });
        }
        Self::from_global_host(rank, global, placement)
    }

    fn from_global_host(
        rank: &'r Rank<'r>,
        global: &Tensor<T>,
        placement: Placement,
    ) -> Result<Self> {
        let shape = global.shape().to_vec();
        match placement {
            Placement::Shard(d) => {
                if d >= shape.len() {
                    return Err(Error::DimOutOfRange {
                        op: "DistTensor::from_global",
                        dim: d,
                        ndim: shape.len(),
                    });
                }
                let splits = array_split(shape[d], rank.num_ranks());
                let local = shard_of(global.view(), d, &splits, rank.rank());
                Ok(DistTensor::new(rank, local, placement, shape, splits))
            }
            // A clone shares the elements (copy-on-write).
            Placement::Replicate => {
                Ok(DistTensor::new(rank, global.clone(), placement, shape, vec![]))
            }
            Placement::Partial => {
                let local = if rank.rank() == 0 { global.clone() } else { Tensor::zeros(&shape) };
                Ok(DistTensor::new(rank, local, placement, shape, vec![]))
            }
        }
    }

    /// This rank's piece of `global` (which every rank holds) sharded on `dim` and cut as
    /// `split` says: in whole units (attention heads), or in explicit sizes. `Shard(dim)`, no
    /// communication; every rank must pass the same split.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] when `dim` is not a dimension of `global`;
    /// [`Error::InvalidArgument`] when the split does not fit its length (see [`Split::sizes`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Split, Tensor, World};
    /// // A [hidden, heads * head_dim] projection: 8 heads of 8 columns on 3 ranks.
    /// let wq = Tensor::<f32>::random(&[16, 64], 1);
    /// let widths = World::threads(3)?.run(|rank| {
    ///     let w = DistTensor::from_global_split(rank, &wq, 1, Split::Units(8))?;
    ///     Ok(w.local().shape()[1])
    /// })?;
    /// assert_eq!(widths, vec![24, 24, 16]); // 3, 3 and 2 whole heads
    ///
    /// let rows = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global_split(rank, &wq, 0, vec![10, 6])?;
    ///     Ok(x.local().shape()[0])
    /// })?;
    /// assert_eq!(rows, vec![10, 6]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_global_split(
        rank: &'r Rank<'r>,
        global: &Tensor<T>,
        dim: usize,
        split: impl Into<Split>,
    ) -> Result<Self> {
        const OP: &str = "DistTensor::from_global_split";
        let shape = global.shape().to_vec();
        if dim >= shape.len() {
            return Err(Error::DimOutOfRange { op: OP, dim, ndim: shape.len() });
        }
        let splits = split.into().sizes_for(OP, rank.rank(), shape[dim], rank.num_ranks())?;
        // Cut on the host; in a GPU world the piece then goes to this rank's GPU.
        let global = global.host_tensor()?;
        let local = to_world_device(rank, shard_of(global.view(), dim, &splits, rank.rank()))?;
        Ok(DistTensor::new(rank, local, Placement::Shard(dim), shape, splits))
    }

    /// The whole tensor, on every rank: an all_gather for `Shard`, an all_reduce for `Partial`, a
    /// copy for `Replicate`. Collective.
    ///
    /// # Errors
    /// As the collectives (a peer that fails, symmetric memory too small).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let sums = World::threads(3)?.run(|rank| {
    ///     let x = DistTensor::from_local(rank, Tensor::<f32>::from_shape_vec(&[1], vec![1.0])?, Placement::Partial)?;
    ///     Ok(x.to_global()?.as_slice()[0])
    /// })?;
    /// assert_eq!(sums, vec![3.0, 3.0, 3.0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn to_global(&self) -> Result<Tensor<T>> {
        match self.placement {
            Placement::Shard(d) => collectives::all_gather_along(
                self.rank,
                &self.local,
                d,
                &self.splits,
                &self.global_shape,
            ),
            Placement::Replicate => Ok(self.local.clone()),
            Placement::Partial => collectives::all_reduce_tensor(self.rank, &self.local),
        }
    }

    /// This rank's part.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f32>::random(&[2, 3], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &global, Placement::Replicate)?;
    ///     assert_eq!(x.local(), &global);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn local(&self) -> &Tensor<T> {
        &self.local
    }

    /// This rank's part, taken out.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f64>::random(&[4, 3], 1);
    /// let shapes = World::threads(2)?.run(|rank| {
    ///     let local = DistTensor::from_global(rank, &global, Placement::Shard(0))?.into_local();
    ///     Ok(local.shape().to_vec())
    /// })?;
    /// assert_eq!(shapes, vec![vec![2, 3], vec![2, 3]]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn into_local(self) -> Tensor<T> {
        self.local
    }

    /// How the parts make the whole.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f32>::random(&[3], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &global, Placement::Partial)?;
    ///     assert_eq!(x.placement(), Placement::Partial);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The shape of the whole tensor.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let shapes = World::threads(2)?.run(|rank| {
    ///     let local = Tensor::<f32>::zeros(&[2, 3]);
    ///     let x = DistTensor::from_local(rank, local, Placement::Shard(1))?;
    ///     Ok(x.global_shape())
    /// })?;
    /// assert_eq!(shapes, vec![vec![2, 6], vec![2, 6]]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn global_shape(&self) -> Vec<usize> {
        self.global_shape.clone()
    }

    /// The shape of the whole tensor, borrowed ([`DistTensor::global_shape`] returns a `Vec`).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f32>::zeros(&[5, 3]);
    /// World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
    ///     assert_eq!(x.global_dims(), &[5, 3]);
    ///     assert_eq!(x.global_dims()[0], x.shard_sizes().iter().sum::<usize>());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn global_dims(&self) -> &[usize] {
        &self.global_shape
    }

    /// For `Shard(d)`, every rank's size along `d`, in rank order; empty for other placements.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f32>::zeros(&[5]);
    /// let splits = World::threads(2)?.run(|rank| {
    ///     Ok(DistTensor::from_global(rank, &global, Placement::Shard(0))?.shard_sizes().to_vec())
    /// })?;
    /// assert_eq!(splits[0], vec![3, 2]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn shard_sizes(&self) -> &[usize] {
        &self.splits
    }

    /// The rank this part lives on.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f32>::zeros(&[4]);
    /// World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
    ///     assert_eq!(x.rank().rank(), rank.rank());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn rank(&self) -> &'r Rank<'r> {
        self.rank
    }
}

impl<T: Element> std::fmt::Debug for DistTensor<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistTensor")
            .field("rank", &self.rank.rank())
            .field("placement", &self.placement)
            .field("global_shape", &self.global_shape)
            .field("local_shape", &self.local.shape())
            .finish()
    }
}

/// Rank `r`'s slice of `global` along `dim`, for the given split sizes.
pub(crate) fn shard_of<T: Element>(
    global: ArrayViewD<'_, T>,
    dim: usize,
    splits: &[usize],
    r: usize,
) -> Tensor<T> {
    let offsets = split_offsets(splits);
    let slice = global.slice_axis(Axis(dim), Slice::from(offsets[r]..offsets[r + 1]));
    Tensor::from_array(slice.to_owned())
}
