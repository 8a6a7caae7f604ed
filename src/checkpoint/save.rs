//! [`save`]: every rank writes the slices it owns into its own safetensors file; rank 0 then
//! writes the index that names them.
//!
//! # Crash safety
//!
//! A save never changes a file that an existing index names. Each save has a new *generation*
//! (rank 0's clock, agreed by all ranks), and its files are named by it
//! (`rank-00002.<generation>.safetensors`). Each rank writes its file to `<name>.tmp`, syncs it
//! (`fsync`) and renames it into place. Only when every rank has done so does rank 0 read back
//! every file's header (checking its generation, rank and length), write the index to
//! `index.json.tmp`, sync it, rename it over `index.json` and sync the directory: that rename is
//! the one moment the checkpoint changes. Files of older generations are deleted only after it.
//! A crash at any earlier point leaves the previous index, naming the previous files, intact; a
//! crash after it leaves the new checkpoint complete. A save into a new directory that did not
//! finish leaves no index there, and loading it fails with
//! [`CheckpointErrorKind::NoIndex`](super::CheckpointErrorKind::NoIndex).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};

use super::agree::agree;
use super::file::{MappedFile, as_bytes};
use super::index::{
    CHUNK_BYTES, FILE_META_KEY, FORMAT, FileEntry, FileMeta, FileSlice, INDEX_FILE, Index,
    SliceEntry, TensorEntry, VERSION, chunk_crcs, dtype_name, dtype_size, file_name, generation_of,
    placement_name, to_st,
};
use crate::dist_tensor::DistTensor;
use crate::error::CheckpointError;
use crate::shmem::{Rank, WordExchange, check_agree};
use crate::tensor::{DType, Element, Tensor, split_offsets};
use crate::{Error, Placement, Result};

const OP: &str = "checkpoint::save";

/// One named tensor to save: this rank's part of it and how the parts make the whole.
///
/// # Examples
/// ```
/// use dist_tensor::checkpoint::Entry;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// World::threads(2)?.run(|rank| {
///     let x = DistTensor::from_global(rank, &Tensor::<f32>::random(&[5, 3], 1), Placement::Shard(0))?;
///     let e = Entry::new("x", &x)?;
///     assert_eq!(e.name(), "x");
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    name: String,
    dtype: DType,
    bytes: Cow<'a, [u8]>,
    local_shape: Vec<usize>,
    placement: Placement,
    /// The global shape and (for `Shard`) every rank's size; `None` until `save` exchanges the
    /// local shapes (an entry made from a local part).
    layout: Option<(Vec<usize>, Vec<usize>)>,
}

/// The bytes of `part`'s elements on the host: borrowed where they are there, copied from a
/// device otherwise.
fn host_bytes<T: Element>(part: &Tensor<T>) -> Result<Cow<'_, [u8]>> {
    Ok(match part.host_elements()? {
        Cow::Borrowed(values) => Cow::Borrowed(as_bytes(values)),
        Cow::Owned(values) => Cow::Owned(as_bytes(&values).to_vec()),
    })
}

impl<'a> Entry<'a> {
    /// The distributed tensor `t`, saved as `name`. Its part is borrowed (copied to the host in
    /// a GPU world). A `Partial` tensor is summed first (a `reduce_scatter` to `Shard(0)`, or an
    /// all-reduce for a 0-D one): collective then, so every rank makes its entries in the same
    /// order.
    ///
    /// # Errors
    /// As [`DistTensor::redistribute`] for a `Partial` tensor; as [`Tensor::to_host`] on a GPU.
    pub fn new<T: Element>(name: impl Into<String>, t: &'a DistTensor<'_, T>) -> Result<Self> {
        let name = name.into();
        if t.placement() == Placement::Partial {
            let to =
                if t.global_dims().is_empty() { Placement::Replicate } else { Placement::Shard(0) };
            let summed = t.redistribute(to)?;
            let layout = Some((summed.global_shape(), summed.shard_sizes().to_vec()));
            return Entry::owned(name, summed.local(), to, layout);
        }
        let layout = Some((t.global_shape(), t.shard_sizes().to_vec()));
        Ok(Entry {
            name,
            dtype: T::DTYPE,
            bytes: host_bytes(t.local())?,
            local_shape: t.local().shape().to_vec(),
            placement: t.placement(),
            layout,
        })
    }

    /// This rank's part `part` of a tensor placed as `placement` (a layer's parameter, an
    /// optimizer's moment), saved as `name`. [`save`] learns the other ranks' sizes (one
    /// exchange per such entry). `Partial` is not taken here: sum it first.
    ///
    /// # Errors
    /// [`Error::UnsupportedPlacement`] for `Partial`; as [`Tensor::to_host`] on a GPU.
    pub fn local<T: Element>(
        name: impl Into<String>,
        part: &'a Tensor<T>,
        placement: Placement,
    ) -> Result<Self> {
        if placement == Placement::Partial {
            return Err(Error::UnsupportedPlacement {
                op: "checkpoint::Entry::local",
                placement: placement.to_string(),
                expected: "Shard or Replicate (sum a Partial tensor first)".to_string(),
            });
        }
        Ok(Entry {
            name: name.into(),
            dtype: T::DTYPE,
            bytes: host_bytes(part)?,
            local_shape: part.shape().to_vec(),
            placement,
            layout: None,
        })
    }

    fn owned<T: Element>(
        name: String,
        part: &Tensor<T>,
        placement: Placement,
        layout: Option<(Vec<usize>, Vec<usize>)>,
    ) -> Result<Self> {
        let host = part.to_host()?;
        Ok(Entry {
            name,
            dtype: T::DTYPE,
            bytes: Cow::Owned(as_bytes(host.as_slice()).to_vec()),
            local_shape: host.shape().to_vec(),
            placement,
            layout,
        })
    }

    /// An entry of raw elements `values` (of type `A`), a part of `shape` placed as `placement`:
    /// an optimizer's buffers, which are vectors rather than tensors.
    /// The entry owning its bytes (an entry made from a state that does not outlive the call).
    pub(crate) fn into_owned(self) -> Entry<'static> {
        Entry { bytes: Cow::Owned(self.bytes.into_owned()), ..self }
    }

    pub(crate) fn from_values<A: Element>(
        name: String,
        values: Cow<'a, [A]>,
        shape: &[usize],
        placement: Placement,
    ) -> Self {
        let bytes = match values {
            Cow::Borrowed(v) => Cow::Borrowed(as_bytes(v)),
            Cow::Owned(v) => Cow::Owned(as_bytes(&v).to_vec()),
        };
        Entry { name, dtype: A::DTYPE, bytes, local_shape: shape.to_vec(), placement, layout: None }
    }

    /// The name it is saved under.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// What [`save`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    /// This rank's file.
    pub file: PathBuf,
    /// Bytes of tensor data this rank wrote.
    pub bytes: u64,
}

/// Saves `entries` into the checkpoint directory `dir` (made if missing), every rank its own
/// slices, rank 0 the index last. Collective: every rank passes the same names in the same order
/// (their parts differ), and `dir` must be one directory every rank sees. A replicated tensor is
/// written once, by rank 0, after the ranks checked that their copies are equal. Saving into a directory that holds a checkpoint replaces it only when
/// the new one is complete (see the module docs).
///
/// # Errors
/// On every rank: [`Error::RanksDisagree`] when the ranks' entries differ (names, types,
/// placements, the sizes of unsharded dimensions, the elements of a replicated tensor); [`Error::Checkpoint`] naming the rank, the file
/// and the tensor when writing, syncing or renaming a file fails.
///
/// # Examples
/// ```
/// use dist_tensor::checkpoint::{self, Entry, Target};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let dir = std::env::temp_dir().join(format!("dist-tensor-doc-save-{}", std::process::id()));
/// let w = Tensor::<f32>::random(&[6, 4], 1);
/// World::threads(3)?.run(|rank| {
///     let x = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
///     checkpoint::save(rank, &dir, &[Entry::new("w", &x)?])?;
///     Ok(())
/// })?;
/// // Loaded on 2 ranks, split by columns.
/// let back = World::threads(2)?.run(|rank| {
///     let ck = checkpoint::Checkpoint::open(rank, &dir)?;
///     ck.load::<f32>("w", Target::new(Placement::Shard(1)))?.to_global()
/// })?;
/// assert_eq!(back[0], w);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn save(rank: &Rank<'_>, dir: impl AsRef<Path>, entries: &[Entry<'_>]) -> Result<Saved> {
    let dir = dir.as_ref();
    let (me, n) = (rank.rank(), rank.num_ranks());
    let made = fs::create_dir_all(dir).map_err(|e| {
        Error::from(CheckpointError::io(OP, me, dir, None, "create the directory", &e))
    });
    agree(rank, OP, made)?;

    // Agree on the generation (rank 0's clock) and on what is saved.
    let mut digest = crc32fast::Hasher::new();
    for e in entries {
        digest.update(e.name.as_bytes());
        digest.update(&[0, e.dtype as u8]);
        digest.update(placement_name(e.placement).as_bytes());
    }
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // Only rank 0's copy of a replicated tensor is written: the ranks check that theirs agree,
    // so a replica that drifted is an error rather than silently dropped.
    let replicas: Vec<u32> = entries
        .iter()
        .filter(|e| e.placement == Placement::Replicate)
        .map(|e| crc32fast::hash(&e.bytes))
        .collect();
    let mut replica_digest = crc32fast::Hasher::new();
    for crc in &replicas {
        replica_digest.update(&crc.to_le_bytes());
    }
    let mut ex = WordExchange::new(rank, 4)?;
    let words = [
        clock,
        entries.len() as u64,
        u64::from(digest.finalize()),
        u64::from(replica_digest.finalize()),
    ];
    let all = ex.exchange_checked(rank, OP, &words, None)?;
    check_agree(OP, &all, 1, "number of entries")?;
    check_agree(OP, &all, 2, "digest of the entries' names, types and placements")?;
    if check_agree(OP, &all, 3, "").is_err() {
        return Err(name_differing_replica(rank, entries, &replicas));
    }
    let generation = format!("{:016x}", all[0][0]);
    // The same names on every rank (checked above), so every rank finds the same problem.
    let mut seen = std::collections::BTreeSet::new();
    for e in entries {
        if e.name == "__metadata__" || !seen.insert(e.name.as_str()) {
            return Err(Error::InvalidArgument {
                op: OP,
                rank: me,
                reason: format!(
                    "the entry name {:?} is used twice or reserved by safetensors: every entry \
                     needs a name of its own",
                    e.name
                ),
            });
        }
    }

    // Every entry's layout: global shape and every rank's size along a sharded dimension.
    let mut layouts = Vec::with_capacity(entries.len());
    for e in entries {
        layouts.push(match &e.layout {
            Some(l) => l.clone(),
            None => exchange_layout(rank, e)?,
        });
    }

    // This rank's slices, its file, written to a temporary name, synced, renamed.
    let name = file_name(me, &generation);
    let path = dir.join(&name);
    let written = write_rank_file(me, entries, &layouts, &generation, &path);
    let bytes = agree(rank, OP, written)?;

    // Rank 0: the index, last.
    let indexed =
        if me == 0 { write_index(dir, &generation, n, entries, &layouts) } else { Ok(()) };
    agree(rank, OP, indexed)?;
    Ok(Saved { file: path, bytes })
}

/// Which replicated entry differs between ranks (their digests did): every rank exchanges each
/// replica's checksum in turn, so all name the same first one.
fn name_differing_replica(rank: &Rank<'_>, entries: &[Entry<'_>], replicas: &[u32]) -> Error {
    let names = entries.iter().filter(|e| e.placement == Placement::Replicate).map(|e| &e.name);
    for (name, &crc) in names.zip(replicas) {
        let exchanged = WordExchange::new(rank, 1)
            .and_then(|mut ex| ex.exchange_checked(rank, OP, &[u64::from(crc)], None));
        match exchanged {
            Ok(all) => {
                let what = format!(
                    "checksum (crc32) of the replicated tensor {name:?}, whose copies must be equal"
                );
                if let Err(e) = check_agree(OP, &all, 0, &what) {
                    return e;
                }
            }
            Err(e) => return e,
        }
    }
    unreachable!("the replicas' digests differ, so one replica does")
}

/// The global shape and splits of an entry made from a local part: the ranks exchange shapes.
fn exchange_layout(rank: &Rank<'_>, e: &Entry<'_>) -> Result<(Vec<usize>, Vec<usize>)> {
    const MAX: usize = crate::dist_tensor::MAX_DIMS;
    let shape = &e.local_shape;
    let problem = match e.placement {
        _ if shape.len() > MAX => {
            Some(format!("{:?}: {} dimensions, at most {MAX}", e.name, shape.len()))
        }
        Placement::Shard(d) if d >= shape.len() => {
            Some(format!("{:?}: shard dimension {d} of a {}-D part", e.name, shape.len()))
        }
        _ => None,
    };
    let mut words = vec![shape.len() as u64];
    words.extend(shape.iter().take(MAX).map(|&d| d as u64));
    let mut ex = WordExchange::new(rank, 1 + MAX)?;
    let all = ex.exchange_checked(rank, OP, &words, problem)?;
    check_agree(OP, &all, 0, &format!("number of dimensions of {:?}", e.name))?;
    let sharded = match e.placement {
        Placement::Shard(d) => Some(d),
        _ => None,
    };
    for d in (0..shape.len()).filter(|&d| Some(d) != sharded) {
        check_agree(OP, &all, 1 + d, &format!("size of dimension {d} of {:?}", e.name))?;
    }
    let mut global = shape.clone();
    let splits = match sharded {
        Some(d) => {
            let s: Vec<usize> = all.iter().map(|w| w[1 + d] as usize).collect();
            global[d] = s.iter().sum();
            s
        }
        None => Vec::new(),
    };
    Ok((global, splits))
}

/// An I/O error of this save, as a checkpoint error naming the file.
fn io_err(me: usize, path: &Path, action: &str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::from(CheckpointError::io(OP, me, path, None, action, &e))
}

/// Writes this rank's file: its slices (a replicated tensor on rank 0 only), their chunk
/// checksums in the file's metadata. Returns the data bytes written.
fn write_rank_file(
    me: usize,
    entries: &[Entry<'_>],
    layouts: &[(Vec<usize>, Vec<usize>)],
    generation: &str,
    path: &Path,
) -> Result<u64> {
    let mut slices = BTreeMap::new();
    let mut infos = Vec::new();
    let mut data: Vec<&[u8]> = Vec::new();
    let mut offset = 0usize;
    for (e, (global, splits)) in entries.iter().zip(layouts) {
        let (dim, start, len) = match e.placement {
            Placement::Shard(d) => {
                if splits[me] == 0 {
                    continue;
                }
                (Some(d), split_offsets(splits)[me], splits[me])
            }
            _ if me == 0 => (None, 0, global.first().copied().unwrap_or(1)),
            _ => continue,
        };
        let bytes: &[u8] = &e.bytes;
        debug_assert_eq!(
            bytes.len(),
            e.local_shape.iter().product::<usize>() * dtype_size(e.dtype)
        );
        slices.insert(
            e.name.clone(),
            FileSlice {
                dtype: dtype_name(e.dtype).to_string(),
                shape: global.clone(),
                placement: placement_name(e.placement),
                dim,
                start,
                len,
                crc32: chunk_crcs(bytes, CHUNK_BYTES),
            },
        );
        infos.push((
            e.name.clone(),
            TensorInfo {
                dtype: to_st(e.dtype),
                shape: e.local_shape.clone(),
                data_offsets: (offset, offset + bytes.len()),
            },
        ));
        offset += bytes.len();
        data.push(bytes);
    }
    let meta = FileMeta { generation: generation.to_string(), rank: me, slices };
    let meta = HashMap::from([(
        FILE_META_KEY.to_string(),
        serde_json::to_string(&meta).expect("metadata serialises"),
    )]);
    let header = Metadata::new(Some(meta), infos).map_err(|e| {
        Error::from(CheckpointError::malformed(OP, me, path, None, format!("{e:?}")))
    })?;
    let mut header = serde_json::to_string(&header).expect("a header serialises").into_bytes();
    // safetensors pads the header with spaces to a multiple of 8 bytes (the data then aligned).
    header.resize(header.len().next_multiple_of(8), b' ');

    let tmp = tmp_name(path);
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(io_err(me, &tmp, "create"))?;
    file.write_all(&(header.len() as u64).to_le_bytes()).map_err(io_err(me, &tmp, "write"))?;
    file.write_all(&header).map_err(io_err(me, &tmp, "write"))?;
    for bytes in &data {
        file.write_all(bytes).map_err(io_err(me, &tmp, "write"))?;
    }
    file.sync_all().map_err(io_err(me, &tmp, "sync"))?;
    drop(file);
    fs::rename(&tmp, path).map_err(io_err(me, path, "rename into place"))?;
    Ok(offset as u64)
}

/// `path` with `.tmp` added.
fn tmp_name(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Syncs a directory, so that the renames into it last.
fn sync_dir(me: usize, dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(me, dir, "sync the directory"))
}

/// Rank 0, once every rank's file is in place: reads back every file's header, writes the
/// index, then deletes the files of older generations.
fn write_index(
    dir: &Path,
    generation: &str,
    world: usize,
    entries: &[Entry<'_>],
    layouts: &[(Vec<usize>, Vec<usize>)],
) -> Result<()> {
    sync_dir(0, dir)?;
    let mut files = Vec::with_capacity(world);
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    for r in 0..world {
        let name = file_name(r, generation);
        let path = dir.join(&name);
        let f = MappedFile::open(OP, 0, &path, None)?;
        let bytes = fs::metadata(&path).map_err(io_err(0, &path, "stat"))?.len();
        let bad =
            |reason: String| Error::from(CheckpointError::malformed(OP, 0, &path, None, reason));
        let meta: FileMeta = f
            .meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(FILE_META_KEY))
            .ok_or_else(|| bad("no dist_tensor metadata".into()))
            .and_then(|s| serde_json::from_str(s).map_err(|e| bad(e.to_string())))?;
        if meta.generation != generation || meta.rank != r {
            return Err(bad(format!(
                "it says generation {} rank {}, expected {generation} rank {r}",
                meta.generation, meta.rank
            )));
        }
        for (tensor, s) in meta.slices {
            let entry = tensors.entry(tensor).or_insert_with(|| TensorEntry {
                dtype: s.dtype.clone(),
                shape: s.shape.clone(),
                placement: s.placement.clone(),
                dim: s.dim,
                slices: Vec::new(),
            });
            entry.slices.push(SliceEntry { file: r, start: s.start, len: s.len, crc32: s.crc32 });
        }
        files.push(FileEntry { name, bytes });
    }
    // A tensor no rank holds a slice of (every rank's size 0) is in no file, but in the index.
    for (e, (global, _)) in entries.iter().zip(layouts) {
        tensors.entry(e.name.clone()).or_insert_with(|| TensorEntry {
            dtype: dtype_name(e.dtype).to_string(),
            shape: global.clone(),
            placement: placement_name(e.placement),
            dim: match e.placement {
                Placement::Shard(d) => Some(d),
                _ => None,
            },
            slices: Vec::new(),
        });
    }
    let index = Index {
        format: FORMAT.to_string(),
        version: VERSION,
        generation: generation.to_string(),
        world,
        chunk_bytes: CHUNK_BYTES,
        files,
        tensors,
    };
    let text = serde_json::to_string_pretty(&index).expect("an index serialises");
    let path = dir.join(INDEX_FILE);
    let tmp = tmp_name(&path);
    let mut file = File::create(&tmp).map_err(io_err(0, &tmp, "create"))?;
    file.write_all(text.as_bytes()).map_err(io_err(0, &tmp, "write"))?;
    file.sync_all().map_err(io_err(0, &tmp, "sync"))?;
    drop(file);
    fs::rename(&tmp, &path).map_err(io_err(0, &path, "rename into place"))?;
    sync_dir(0, dir)?;
    // The new checkpoint is complete: the older generations' files (and any a crashed save
    // left) go. A failure here loses nothing.
    if let Ok(read) = fs::read_dir(dir) {
        for e in read.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let base = name.strip_suffix(".tmp").unwrap_or(&name);
            if generation_of(base).is_some_and(|g| g != generation) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}
