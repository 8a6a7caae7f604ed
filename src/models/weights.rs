//! [`Weights`]: a Hugging Face model directory's safetensors, one `model.safetensors` or the
//! shards a `model.safetensors.index.json` names, opened on every rank and read by tensor name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::checkpoint::{CheckpointError, CheckpointErrorKind, SafetensorsFile, Target};
use crate::dist_tensor::DistTensor;
use crate::shmem::Rank;
use crate::tensor::{DType, Element, Tensor};
use crate::{Error, Placement, Result, Split};

const OP: &str = "models::load";

/// The HF name of a sharded checkpoint's index.
pub const HF_INDEX: &str = "model.safetensors.index.json";
/// The HF name of a one-file checkpoint.
pub const HF_SINGLE: &str = "model.safetensors";

/// The weights of a model directory, opened on every rank (every file mapped, its header read).
pub struct Weights<'r> {
    rank: &'r Rank<'r>,
    /// Where a name that is not there is reported: the index, or the one file.
    listing: PathBuf,
    files: Vec<SafetensorsFile<'r>>,
    /// Tensor name to its file (an index into `files`).
    map: BTreeMap<String, usize>,
}

/// A checkpoint error of the model loader.
pub(crate) fn ck_error(
    rank: usize,
    file: &Path,
    tensor: Option<&str>,
    kind: CheckpointErrorKind,
) -> Error {
    Error::from(CheckpointError::new(OP, rank, file, tensor, kind))
}

impl<'r> Weights<'r> {
    /// Opens the safetensors of `dir`: the sharded index if there is one, else `model.safetensors`.
    /// Collective.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file: neither file there, an index that does not parse,
    /// or a file that does not open (truncated, not safetensors).
    pub fn open(rank: &'r Rank<'r>, dir: &Path) -> Result<Self> {
        let me = rank.rank();
        let index = dir.join(HF_INDEX);
        let single = dir.join(HF_SINGLE);
        if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| {
                ck_error(
                    me,
                    &index,
                    None,
                    CheckpointErrorKind::Io { action: "read".into(), message: e.to_string() },
                )
            })?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let parsed: Index = serde_json::from_str(&text).map_err(|e| {
                ck_error(me, &index, None, CheckpointErrorKind::Malformed { reason: e.to_string() })
            })?;
            let mut names: Vec<String> = parsed.weight_map.values().cloned().collect();
            names.sort();
            names.dedup();
            let mut files = Vec::with_capacity(names.len());
            for name in &names {
                let path = dir.join(name);
                if !path.is_file() {
                    return Err(ck_error(me, &path, None, CheckpointErrorKind::MissingFile));
                }
                files.push(SafetensorsFile::open(rank, &path)?);
            }
            let map = parsed
                .weight_map
                .into_iter()
                .map(|(t, f)| {
                    let i = names.binary_search(&f).expect("every file name was collected");
                    (t, i)
                })
                .collect();
            Ok(Weights { rank, listing: index, files, map })
        } else if single.is_file() {
            let file = SafetensorsFile::open(rank, &single)?;
            let map = file.names().into_iter().map(|n| (n, 0)).collect();
            Ok(Weights { rank, listing: single, files: vec![file], map })
        } else {
            Err(ck_error(me, &single, None, CheckpointErrorKind::MissingFile))
        }
    }

    /// Whether a tensor of this name is there.
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The element type of tensor `name` (the first floating type found when `None`).
    pub fn dtype(&self, name: &str) -> Option<DType> {
        self.map.get(name).and_then(|&i| self.files[i].dtype(name))
    }

    /// Tensor `name`, of global shape `shape`, laid out as `placement` and `split` say and
    /// converted to `T`. Collective.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and tensor: not there, another shape.
    pub fn load<T: Element>(
        &self,
        name: &str,
        shape: &[usize],
        placement: Placement,
        split: Split,
    ) -> Result<DistTensor<'r, T>> {
        let Some(&i) = self.map.get(name) else {
            return Err(ck_error(
                self.rank.rank(),
                &self.listing,
                Some(name),
                CheckpointErrorKind::TensorNotFound,
            ));
        };
        let target = Target::new(placement).split(split).shape(shape).convert_dtype();
        self.files[i].load::<T>(name, target)
    }

    /// This rank's part of tensor `name`, as [`Weights::load`].
    pub fn part<T: Element>(
        &self,
        name: &str,
        shape: &[usize],
        placement: Placement,
        split: Split,
    ) -> Result<Tensor<T>> {
        Ok(self.load::<T>(name, shape, placement, split)?.into_local())
    }

    /// The whole tensor `name` on every rank.
    pub fn whole<T: Element>(&self, name: &str, shape: &[usize]) -> Result<Tensor<T>> {
        self.part(name, shape, Placement::Replicate, Split::Even)
    }
}
