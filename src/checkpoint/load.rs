//! [`Checkpoint`]: a checkpoint directory opened on every rank, and the load of one tensor into
//! any placement and split, each rank reading only the slices (and checksum chunks) it needs.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::agree::agree;
use super::file::{BoxCopy, MappedFile, copy_box};
use super::index::{FORMAT, INDEX_FILE, Index, VERSION, dtype_from_name};
use crate::dist_tensor::DistTensor;
use crate::error::{CheckpointError, CheckpointErrorKind};
use crate::shmem::Rank;
use crate::tensor::{DType, Element, Tensor, split_offsets};
use crate::{Error, Placement, Result, Split};

const OP: &str = "checkpoint::load";

/// How a loaded tensor is to be laid out: its placement, the split of a sharded dimension, and
/// optionally the global shape it must have and whether its element type may be converted.
///
/// # Examples
/// ```
/// use dist_tensor::checkpoint::Target;
/// use dist_tensor::{Placement, Split};
/// let t = Target::new(Placement::Shard(1)).split(Split::Units(64)).shape(&[512, 512]).convert_dtype();
/// assert_eq!(t.placement(), Placement::Shard(1));
/// let r: Target = Placement::Replicate.into();
/// assert_eq!(r.placement(), Placement::Replicate);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    placement: Placement,
    split: Split,
    shape: Option<Vec<usize>>,
    convert: bool,
}

impl Target {
    /// This placement, split evenly (`numpy.array_split`) when sharded; `Partial` puts the whole
    /// tensor on rank 0 and zeros elsewhere.
    pub fn new(placement: Placement) -> Self {
        Target { placement, split: Split::Even, shape: None, convert: false }
    }

    /// Cuts the sharded dimension as `split` says.
    pub fn split(mut self, split: impl Into<Split>) -> Self {
        self.split = split.into();
        self
    }

    /// Requires this global shape ([`CheckpointErrorKind::ShapeMismatch`] otherwise).
    pub fn shape(mut self, shape: &[usize]) -> Self {
        self.shape = Some(shape.to_vec());
        self
    }

    /// Converts from the stored element type (rounded once) instead of refusing another one.
    pub fn convert_dtype(mut self) -> Self {
        self.convert = true;
        self
    }

    /// The placement.
    pub fn placement(&self) -> Placement {
        self.placement
    }
}

impl From<Placement> for Target {
    fn from(placement: Placement) -> Self {
        Target::new(placement)
    }
}

/// One stored slab of a tensor: in `file` (an index into the caller's files) under `name`,
/// indices `start..start + len` along `dim` (all of it when `dim` is `None`).
pub(crate) struct Source<'a> {
    pub file: usize,
    pub dim: Option<usize>,
    pub start: usize,
    pub len: usize,
    pub crcs: Option<(&'a [u32], usize)>,
}

/// This rank's part of a tensor of `global` shape stored as `sources`, for `target`: the box
/// the rank needs, filled from every source it meets. Returns the part, the splits and the
/// bytes read.
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_part<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    name: &str,
    global: &[usize],
    target: &Target,
    sources: &[Source<'_>],
    file: &dyn Fn(usize) -> Result<Rc<MappedFile>>,
) -> Result<(Tensor<T>, Vec<usize>, u64)> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let nd = global.len();
    let mut lo = vec![0; nd];
    let mut ext = global.to_vec();
    let mut splits = Vec::new();
    let mut read_any = true;
    match target.placement {
        Placement::Shard(d) => {
            if d >= nd {
                return Err(Error::DimOutOfRange { op, dim: d, ndim: nd });
            }
            splits = target.split.sizes_for(op, me, global[d], n)?;
            lo[d] = split_offsets(&splits)[me];
            ext[d] = splits[me];
        }
        Placement::Replicate => {}
        Placement::Partial => read_any = me == 0,
    }
    // The slices cover the whole tensor (the index is checked), so a part that is read is
    // overwritten entirely; only a `Partial` rank other than 0 keeps zeros.
    let mut part =
        if read_any { Tensor::<T>::scratch(op, &ext)? } else { Tensor::try_zeros(&ext)? };
    let mut read = 0u64;
    if read_any && ext.iter().all(|&e| e > 0) {
        for s in sources {
            let mut src_shape = global.to_vec();
            let (mut s_lo, mut s_hi) = (vec![0; nd], global.to_vec());
            if let Some(d) = s.dim {
                src_shape[d] = s.len;
                s_lo[d] = s.start;
                s_hi[d] = s.start + s.len;
            }
            let i_lo: Vec<usize> = (0..nd).map(|d| s_lo[d].max(lo[d])).collect();
            let i_hi: Vec<usize> = (0..nd).map(|d| s_hi[d].min(lo[d] + ext[d])).collect();
            if (0..nd).any(|d| i_lo[d] >= i_hi[d]) {
                continue;
            }
            let b = BoxCopy {
                src_shape: &src_shape,
                src_lo: (0..nd).map(|d| i_lo[d] - s_lo[d]).collect(),
                dst_shape: &ext,
                dst_lo: (0..nd).map(|d| i_lo[d] - lo[d]).collect(),
                extent: (0..nd).map(|d| i_hi[d] - i_lo[d]).collect(),
            };
            let f = file(s.file)?;
            read += copy_box(op, me, &f, name, &b, s.crcs, part.as_mut_slice())?;
        }
    }
    Ok((part, splits, read))
}

/// Wraps a loaded part as a distributed tensor (on the rank's GPU in a GPU world).
pub(crate) fn wrap<'r, T: Element>(
    rank: &'r Rank<'r>,
    part: Tensor<T>,
    placement: Placement,
    global: Vec<usize>,
    splits: Vec<usize>,
) -> Result<DistTensor<'r, T>> {
    if rank.cuda_world().is_some() {
        // `from_local` places the part on the rank's GPU (one exchange of shapes).
        return DistTensor::from_local(rank, part, placement);
    }
    Ok(DistTensor::new(rank, part, placement, global, splits))
}

/// Checks a stored tensor's type and shape against what `target` asks for `T`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_target<T: Element>(
    op: &'static str,
    me: usize,
    file: &Path,
    name: &str,
    stored: Option<DType>,
    stored_name: &str,
    global: &[usize],
    target: &Target,
) -> Result<DType> {
    let fail = |kind| Error::from(CheckpointError::new(op, me, file, Some(name), kind));
    let stored = match stored {
        Some(d) if d == T::DTYPE || target.convert => d,
        _ => {
            return Err(fail(CheckpointErrorKind::DtypeMismatch {
                expected: T::DTYPE.to_string(),
                found: stored_name.to_string(),
            }));
        }
    };
    if let Some(want) = &target.shape
        && want.as_slice() != global
    {
        return Err(fail(CheckpointErrorKind::ShapeMismatch {
            expected: want.clone(),
            found: global.to_vec(),
        }));
    }
    Ok(stored)
}

/// A checkpoint directory, opened on every rank of a world: its index read and checked. Loads
/// are collective and each rank reads only what its part needs, memory-mapped.
///
/// # Examples
/// ```
/// use dist_tensor::checkpoint::{self, Checkpoint, Entry, Target};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let dir = std::env::temp_dir().join(format!("dist-tensor-doc-ck-{}", std::process::id()));
/// let w = Tensor::<f64>::random(&[7, 5], 3);
/// World::threads(4)?.run(|rank| {
///     let x = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
///     checkpoint::save(rank, &dir, &[Entry::new("w", &x)?])?;
///     Ok(())
/// })?;
/// // On 3 ranks, by rows, cut as asked.
/// let parts = World::threads(3)?.run(|rank| {
///     let ck = Checkpoint::open(rank, &dir)?;
///     assert_eq!(ck.shape("w"), Some(&[7, 5][..]));
///     assert!(ck.load::<f64>("nope", Placement::Replicate).is_err()); // on every rank
///     let x = ck.load::<f64>("w", Target::new(Placement::Shard(0)).split(vec![1, 6, 0]))?;
///     Ok(x.into_local())
/// })?;
/// assert_eq!(parts[1].shape(), &[6, 5]);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Checkpoint<'r> {
    rank: &'r Rank<'r>,
    dir: PathBuf,
    index: Index,
    files: RefCell<BTreeMap<usize, Rc<MappedFile>>>,
    bytes_read: Cell<u64>,
}

impl<'r> Checkpoint<'r> {
    /// Opens the checkpoint in `dir` on every rank. Collective.
    ///
    /// # Errors
    /// On every rank, [`Error::Checkpoint`] with [`CheckpointErrorKind::NoIndex`] when `dir`
    /// has no index (not a checkpoint, or a save that did not finish), or
    /// [`CheckpointErrorKind::Malformed`] when the index cannot be read.
    pub fn open(rank: &'r Rank<'r>, dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index = agree(rank, OP, read_index(rank.rank(), &dir))?;
        Ok(Checkpoint {
            rank,
            dir,
            index,
            files: RefCell::new(BTreeMap::new()),
            bytes_read: Cell::new(0),
        })
    }

    /// The rank it was opened on.
    pub fn rank(&self) -> &'r Rank<'r> {
        self.rank
    }

    /// The names of its tensors, in order.
    pub fn names(&self) -> Vec<&str> {
        self.index.tensors.keys().map(String::as_str).collect()
    }

    /// Whether it holds a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.index.tensors.contains_key(name)
    }

    /// The global shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.index.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// The element type tensor `name` was saved in.
    pub fn dtype(&self, name: &str) -> Option<DType> {
        self.index.tensors.get(name).and_then(|t| dtype_from_name(&t.dtype))
    }

    /// The number of ranks that saved it.
    pub fn saved_world(&self) -> usize {
        self.index.world
    }

    /// Bytes this rank has read from the checkpoint's files so far (the slices its parts
    /// needed, rounded out to the checksum chunks they touch).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.get()
    }

    /// Tensor `name` laid out as `target` says, in a world of any size: each rank reads the
    /// parts of the saved slices that overlap its own part, checking their checksums.
    /// Collective: every rank loads the same names in the same order.
    ///
    /// # Errors
    /// On every rank, [`Error::Checkpoint`] naming the rank that found it, the file and the
    /// tensor: [`TensorNotFound`](CheckpointErrorKind::TensorNotFound),
    /// [`DtypeMismatch`](CheckpointErrorKind::DtypeMismatch) (unless the target converts),
    /// [`ShapeMismatch`](CheckpointErrorKind::ShapeMismatch), a missing, truncated or malformed
    /// file, a [`ChecksumMismatch`](CheckpointErrorKind::ChecksumMismatch);
    /// [`Error::InvalidArgument`] when the target's split does not fit.
    pub fn load<T: Element>(
        &self,
        name: &str,
        target: impl Into<Target>,
    ) -> Result<DistTensor<'r, T>> {
        let target = target.into();
        let loaded = self.load_local::<T>(name, &target);
        let (part, splits, global) = agree(self.rank, OP, loaded)?;
        wrap(self.rank, part, target.placement, global, splits)
    }

    fn load_local<T: Element>(
        &self,
        name: &str,
        target: &Target,
    ) -> Result<(Tensor<T>, Vec<usize>, Vec<usize>)> {
        let me = self.rank.rank();
        let index_path = self.dir.join(INDEX_FILE);
        let entry = self.index.tensors.get(name).ok_or_else(|| {
            Error::from(CheckpointError::new(
                OP,
                me,
                &index_path,
                Some(name),
                CheckpointErrorKind::TensorNotFound,
            ))
        })?;
        check_target::<T>(
            OP,
            me,
            &index_path,
            name,
            dtype_from_name(&entry.dtype),
            &entry.dtype,
            &entry.shape,
            target,
        )?;
        let chunk = self.index.chunk_bytes;
        let sources: Vec<Source<'_>> = entry
            .slices
            .iter()
            .map(|s| Source {
                file: s.file,
                dim: entry.dim,
                start: s.start,
                len: s.len,
                crcs: Some((s.crc32.as_slice(), chunk)),
            })
            .collect();
        let open = |f: usize| self.file(f);
        let (part, splits, read) =
            load_part::<T>(OP, self.rank, name, &entry.shape, target, &sources, &open)?;
        self.bytes_read.set(self.bytes_read.get() + read);
        Ok((part, splits, entry.shape.clone()))
    }

    /// File `f` of the index, mapped once.
    fn file(&self, f: usize) -> Result<Rc<MappedFile>> {
        if let Some(m) = self.files.borrow().get(&f) {
            return Ok(Rc::clone(m));
        }
        let me = self.rank.rank();
        let entry = self.index.files.get(f).ok_or_else(|| {
            Error::from(CheckpointError::malformed(
                OP,
                me,
                self.dir.join(INDEX_FILE),
                None,
                format!("a slice in file {f}, the index names {}", self.index.files.len()),
            ))
        })?;
        let mapped =
            Rc::new(MappedFile::open(OP, me, &self.dir.join(&entry.name), Some(entry.bytes))?);
        self.files.borrow_mut().insert(f, Rc::clone(&mapped));
        Ok(mapped)
    }
}

/// Reads and checks the index of `dir`.
fn read_index(me: usize, dir: &Path) -> Result<Index> {
    let path = dir.join(INDEX_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        let kind = if e.kind() == std::io::ErrorKind::NotFound {
            CheckpointErrorKind::NoIndex
        } else {
            CheckpointErrorKind::Io { action: "read".into(), message: e.to_string() }
        };
        Error::from(CheckpointError::new(OP, me, &path, None, kind))
    })?;
    let bad = |reason: String| Error::from(CheckpointError::malformed(OP, me, &path, None, reason));
    let index: Index = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if index.format != FORMAT || index.version != VERSION {
        return Err(bad(format!(
            "format {:?} version {}; this crate reads {FORMAT:?} version {VERSION}",
            index.format, index.version
        )));
    }
    if index.chunk_bytes == 0 {
        return Err(bad("chunk_bytes is 0".into()));
    }
    for (name, t) in &index.tensors {
        let covered: usize = t.slices.iter().map(|s| s.len).sum();
        let whole = match t.dim {
            Some(d) if d < t.shape.len() => t.shape[d],
            Some(d) => return Err(bad(format!("{name:?}: dimension {d} of {:?}", t.shape))),
            None => t.shape.first().copied().unwrap_or(1),
        };
        let complete = match t.dim {
            Some(_) => covered == whole,
            None => t.slices.len() == 1 && covered == whole,
        };
        if !complete {
            return Err(bad(format!(
                "{name:?}: its slices cover {covered} of {whole} along dimension {:?}",
                t.dim
            )));
        }
    }
    Ok(index)
}
