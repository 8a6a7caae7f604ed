//! Loading a plain safetensors file (a whole model's weights, as published) straight into a
//! sharded layout: [`SafetensorsFile`] and [`DistTensor::from_safetensors`].

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::agree::agree;
use super::file::MappedFile;
use super::index::from_st;
use super::load::{Source, Target, check_target, load_part, wrap};
use crate::dist_tensor::DistTensor;
use crate::error::{CheckpointError, CheckpointErrorKind};
use crate::shmem::Rank;
use crate::tensor::{DType, Element};
use crate::{Error, Result};

const OP: &str = "DistTensor::from_safetensors";

/// A safetensors file opened on every rank (mapped, its header read), to load tensors from,
/// each rank reading only its part.
///
/// # Examples
/// ```
/// use dist_tensor::checkpoint::{SafetensorsFile, Target};
/// use dist_tensor::{Placement, Tensor, World};
/// # let path = std::env::temp_dir().join(format!("dist-tensor-doc-st-{}.safetensors", std::process::id()));
/// # let w = Tensor::<f32>::random(&[4, 6], 1);
/// # dist_tensor::checkpoint::write_safetensors(&path, &[("w", &w)])?;
/// World::threads(2)?.run(|rank| {
///     let file = SafetensorsFile::open(rank, &path)?;
///     assert_eq!(file.shape("w"), Some(&[4, 6][..]));
///     let w = file.load::<f32>("w", Target::new(Placement::Shard(1)))?;
///     assert_eq!(w.local().shape(), &[4, 3]);
///     assert_eq!(file.bytes_read(), 4 * 3 * 4); // this rank's columns, nothing else
///     Ok(())
/// })?;
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct SafetensorsFile<'r> {
    rank: &'r Rank<'r>,
    path: PathBuf,
    file: Rc<MappedFile>,
    bytes_read: Cell<u64>,
}

impl<'r> SafetensorsFile<'r> {
    /// Opens `path` on every rank. Collective.
    ///
    /// # Errors
    /// On every rank, [`Error::Checkpoint`]: the file missing, unreadable or not a safetensors
    /// file (its header and length disagree: truncated).
    pub fn open(rank: &'r Rank<'r>, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = agree(rank, OP, MappedFile::open(OP, rank.rank(), &path, None))?;
        Ok(SafetensorsFile { rank, path, file: Rc::new(file), bytes_read: Cell::new(0) })
    }

    /// The rank that opened it.
    pub fn rank(&self) -> &'r Rank<'r> {
        self.rank
    }

    /// The names of its tensors, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.file.meta.tensors().keys().cloned().collect();
        names.sort();
        names
    }

    /// The shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.file.info(name).map(|i| i.shape.as_slice())
    }

    /// The element type of tensor `name`, if it is one this crate has.
    pub fn dtype(&self, name: &str) -> Option<DType> {
        self.file.info(name).and_then(|i| from_st(i.dtype))
    }

    /// Bytes this rank has read from the file's tensors so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.get()
    }

    /// Tensor `name` laid out as `target` says: each rank copies only its part out of the
    /// mapping. Collective.
    ///
    /// # Errors
    /// On every rank, [`Error::Checkpoint`] naming the file and the tensor: not found, another
    /// element type (unless the target converts; types other than f32, f64, f16 and bf16 are
    /// refused), another shape than the target requires; [`Error::InvalidArgument`] when the
    /// split does not fit.
    pub fn load<T: Element>(
        &self,
        name: &str,
        target: impl Into<Target>,
    ) -> Result<DistTensor<'r, T>> {
        let target = target.into();
        let loaded = self.load_local::<T>(name, &target);
        let (part, splits, global) = agree(self.rank, OP, loaded)?;
        wrap(self.rank, part, target.placement(), global, splits)
    }

    fn load_local<T: Element>(
        &self,
        name: &str,
        target: &Target,
    ) -> Result<(crate::Tensor<T>, Vec<usize>, Vec<usize>)> {
        let me = self.rank.rank();
        let info = self.file.info(name).ok_or_else(|| {
            Error::from(CheckpointError::new(
                OP,
                me,
                &self.path,
                Some(name),
                CheckpointErrorKind::TensorNotFound,
            ))
        })?;
        let global = info.shape.clone();
        check_target::<T>(
            OP,
            me,
            &self.path,
            name,
            from_st(info.dtype),
            &format!("{:?}", info.dtype),
            &global,
            target,
        )?;
        let sources = [Source {
            file: 0,
            dim: None,
            start: 0,
            len: global.first().copied().unwrap_or(1),
            crcs: None,
        }];
        let open = |_: usize| Ok(Rc::clone(&self.file));
        let (part, splits, read) =
            load_part::<T>(OP, self.rank, name, &global, target, &sources, &open)?;
        self.bytes_read.set(self.bytes_read.get() + read);
        Ok((part, splits, global))
    }
}

impl<'r, T: Element> DistTensor<'r, T> {
    /// Tensor `name` of the safetensors file `path` (a published model's weights), laid out as
    /// `target` says: each rank maps the file and copies only its own part (a column-sharded
    /// weight reads each row's columns of this rank, nothing else). Collective. For several
    /// tensors of one file, [`SafetensorsFile`] reads the header once.
    ///
    /// # Errors
    /// As [`SafetensorsFile::open`] and [`SafetensorsFile::load`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::checkpoint::Target;
    /// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
    /// let path = std::env::temp_dir().join(format!("dist-tensor-doc-fs-{}.safetensors", std::process::id()));
    /// let w = Tensor::<f32>::random(&[8, 6], 2);
    /// dist_tensor::checkpoint::write_safetensors(&path, &[("layer.weight", &w)])?;
    /// let back = World::threads(3)?.run(|rank| {
    ///     let w = DistTensor::<f64>::from_safetensors(rank, &path, "layer.weight",
    ///         Target::new(Placement::Shard(0)).split(Split::Units(2)).convert_dtype())?;
    ///     w.to_global()
    /// })?;
    /// assert_eq!(back[0], w.cast::<f64>());
    /// # std::fs::remove_file(&path).ok();
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_safetensors(
        rank: &'r Rank<'r>,
        path: impl AsRef<Path>,
        name: &str,
        target: impl Into<Target>,
    ) -> Result<Self> {
        SafetensorsFile::open(rank, path)?.load(name, target)
    }
}

/// A host tensor's bytes as a safetensors view.
struct HostView<'a> {
    dtype: safetensors::Dtype,
    shape: &'a [usize],
    bytes: &'a [u8],
}

impl safetensors::View for HostView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes whole host tensors into one plain safetensors file at `path` (what a published model
/// is; no index, no checksums), from one process: to export weights, or to make a file for
/// [`SafetensorsFile`] to load. Written to a temporary name, synced, renamed.
///
/// # Errors
/// [`Error::Checkpoint`] (rank 0) when writing fails; as [`crate::Tensor::to_host`].
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// let path = std::env::temp_dir().join(format!("dist-tensor-doc-ws-{}.safetensors", std::process::id()));
/// dist_tensor::checkpoint::write_safetensors(&path, &[("b", &Tensor::<f32>::from(vec![1.0, 2.0]))])?;
/// assert_eq!(std::fs::metadata(&path)?.len() % 8, 0);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn write_safetensors<T: Element>(
    path: impl AsRef<Path>,
    tensors: &[(&str, &crate::Tensor<T>)],
) -> Result<()> {
    const WOP: &str = "checkpoint::write_safetensors";
    let path = path.as_ref();
    let hosts: Vec<(String, crate::Tensor<T>)> =
        tensors.iter().map(|(n, t)| Ok((n.to_string(), t.to_host()?))).collect::<Result<_>>()?;
    let views = hosts.iter().map(|(n, t)| {
        let view = HostView {
            dtype: super::index::to_st(T::DTYPE),
            shape: t.shape(),
            bytes: super::file::as_bytes(t.as_slice()),
        };
        (n.as_str(), view)
    });
    let fail = |action: &str, e: std::io::Error| {
        Error::from(CheckpointError::io(WOP, 0, path, None, action, &e))
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    safetensors::serialize_to_file(views, None, &tmp).map_err(|e| {
        Error::from(CheckpointError::malformed(WOP, 0, &tmp, None, format!("{e:?}")))
    })?;
    std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| fail("sync", e))?;
    std::fs::rename(&tmp, path).map_err(|e| fail("rename into place", e))?;
    Ok(())
}
