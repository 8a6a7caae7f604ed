//! The index of a checkpoint (`index.json`): which files it covers, and for every tensor its
//! global shape, element type, placement and which slice of it each file holds, with checksums.
//!
//! ```text
//! {
//!   "format": "dist-tensor checkpoint", "version": 1, "generation": "0x18c2...", "world": 4,
//!   "chunk_bytes": 1048576,
//!   "files": [{"name": "rank-00000.18c2....safetensors", "bytes": 4096}, ...],
//!   "tensors": {
//!     "fc1.weight": {"dtype": "f32", "shape": [32, 128], "placement": "Shard(1)",
//!                    "dim": 1, "slices": [{"file": 0, "start": 0, "len": 32, "crc32": [...]}, ...]},
//!     "fc2.bias":   {"dtype": "f32", "shape": [32], "placement": "Replicate", "dim": null,
//!                    "slices": [{"file": 0, "start": 0, "len": 32, "crc32": [...]}]}
//!   }
//! }
//! ```
//!
//! A slice is a slab of the global tensor: indices `start..start + len` along `dim` and all of
//! every other dimension (the whole tensor when `dim` is null), stored in its file under the
//! tensor's own name as a row-major safetensors tensor. Its bytes are checksummed in chunks of
//! `chunk_bytes` (CRC-32, one per chunk, the last shorter), so a rank that reads part of a slice
//! checks only the chunks it reads.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Placement;
use crate::tensor::DType;

/// The index's file name inside a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";
/// What `format` says.
pub(crate) const FORMAT: &str = "dist-tensor checkpoint";
/// The version this crate writes and reads.
pub(crate) const VERSION: u32 = 1;
/// Bytes per checksum chunk.
pub(crate) const CHUNK_BYTES: usize = 1 << 20;
/// The key of a rank file's safetensors metadata that holds its slices (as JSON).
pub(crate) const FILE_META_KEY: &str = "dist_tensor";

/// The whole index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Index {
    pub format: String,
    pub version: u32,
    /// Names this save's files (a hex number); rank files carry it too.
    pub generation: String,
    /// The world that saved it.
    pub world: usize,
    pub chunk_bytes: usize,
    pub files: Vec<FileEntry>,
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// One rank's file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FileEntry {
    /// Its name inside the directory.
    pub name: String,
    /// Its length in bytes.
    pub bytes: u64,
}

/// One tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct TensorEntry {
    /// `f32`, `f64`, `f16` or `bf16`.
    pub dtype: String,
    /// The global shape.
    pub shape: Vec<usize>,
    /// The placement it had when saved (for the record: loading takes any placement).
    pub placement: String,
    /// The dimension the slices cut; `None` for one slice of the whole tensor.
    pub dim: Option<usize>,
    pub slices: Vec<SliceEntry>,
}

/// One slice: which file holds it, where it lies along `dim`, and its chunks' checksums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SliceEntry {
    /// The index of its file in [`Index::files`].
    pub file: usize,
    pub start: usize,
    pub len: usize,
    pub crc32: Vec<u32>,
}

/// What a rank writes about its own slices into its file's metadata, for rank 0 to gather into
/// the index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FileMeta {
    pub generation: String,
    pub rank: usize,
    pub slices: BTreeMap<String, FileSlice>,
}

/// One slice as its own file describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FileSlice {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub placement: String,
    pub dim: Option<usize>,
    pub start: usize,
    pub len: usize,
    pub crc32: Vec<u32>,
}

/// The name of `rank`'s file of save `generation`.
pub(crate) fn file_name(rank: usize, generation: &str) -> String {
    format!("rank-{rank:05}.{generation}.safetensors")
}

/// The generation of a rank file's name, if it is one of ours.
pub(crate) fn generation_of(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("rank-")?.strip_suffix(".safetensors")?;
    let (rank, generation) = rest.split_once('.')?;
    (rank.len() == 5 && rank.bytes().all(|b| b.is_ascii_digit())).then_some(generation)
}

/// A dtype as the index writes it.
pub(crate) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// A dtype as the index writes it, read back.
pub(crate) fn dtype_from_name(s: &str) -> Option<DType> {
    match s {
        "f32" => Some(DType::F32),
        "f64" => Some(DType::F64),
        "f16" => Some(DType::F16),
        "bf16" => Some(DType::BF16),
        _ => None,
    }
}

/// The safetensors dtype of ours, and back.
pub(crate) fn to_st(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
    }
}

/// Ours for a safetensors dtype, if we have it.
pub(crate) fn from_st(d: safetensors::Dtype) -> Option<DType> {
    match d {
        safetensors::Dtype::F32 => Some(DType::F32),
        safetensors::Dtype::F64 => Some(DType::F64),
        safetensors::Dtype::F16 => Some(DType::F16),
        safetensors::Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// Bytes per element.
pub(crate) fn dtype_size(d: DType) -> usize {
    match d {
        DType::F32 => 4,
        DType::F64 => 8,
        DType::F16 | DType::BF16 => 2,
    }
}

/// The placement's text in the index.
pub(crate) fn placement_name(p: Placement) -> String {
    p.to_string()
}

/// CRC-32 of `bytes` in chunks of `chunk` bytes.
pub(crate) fn chunk_crcs(bytes: &[u8], chunk: usize) -> Vec<u32> {
    bytes.chunks(chunk).map(crc32fast::hash).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_carry_the_generation() {
        let name = file_name(3, "0x1f");
        assert_eq!(name, "rank-00003.0x1f.safetensors");
        assert_eq!(generation_of(&name), Some("0x1f"));
        assert_eq!(generation_of("rank-3.0x1f.safetensors"), None);
        assert_eq!(generation_of("index.json"), None);
    }

    #[test]
    fn checksums_cover_every_chunk() {
        let bytes: Vec<u8> = (0..10u8).collect();
        let crcs = chunk_crcs(&bytes, 4);
        assert_eq!(crcs.len(), 3);
        assert_eq!(crcs[2], crc32fast::hash(&[8, 9]));
        assert!(chunk_crcs(&[], 4).is_empty());
    }
}
