//! [`CheckpointError`]: what went wrong with a checkpoint, naming the file and the tensor
//! (`checkpoint`'s errors, defined here so that the crate's error type imports nothing above it;
//! `checkpoint` re-exports them, and carries one rank's error to every rank).

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::Error;

/// A checkpoint (or a safetensors file) that cannot be saved or loaded: the operation, the rank
/// that found the problem, the file, the tensor (where one is concerned) and what is wrong.
///
/// Every rank of a collective save or load returns the same error (that of the lowest rank that
/// found one), inside [`Error::Checkpoint`]: a checksum that only rank 3 checks still fails
/// ranks 0 to 2, naming rank 3, the file and the tensor.
///
/// # Examples
/// ```
/// use dist_tensor::checkpoint::{CheckpointError, CheckpointErrorKind};
/// let e = CheckpointError::new("checkpoint::load", 2, "/ck/rank-00001.safetensors", Some("fc1.weight"),
///     CheckpointErrorKind::ChecksumMismatch { offset: 0, expected: 1, found: 2 });
/// assert!(e.to_string().contains("rank 2"));
/// assert!(e.to_string().contains("fc1.weight"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointError {
    /// The operation (`checkpoint::save`, `checkpoint::load`, `DistTensor::from_safetensors`).
    #[serde(skip, default)]
    pub op: &'static str,
    /// The rank that found the problem.
    pub rank: usize,
    /// The file concerned (the index, a rank's file, a published safetensors file).
    pub file: String,
    /// The tensor concerned, if one is.
    pub tensor: Option<String>,
    /// What is wrong.
    pub kind: CheckpointErrorKind,
}

/// What is wrong with a checkpoint; see [`CheckpointError`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum CheckpointErrorKind {
    /// The directory has no index: it is not a checkpoint, or a save into it did not finish.
    NoIndex,
    /// A file the index names is not there.
    MissingFile,
    /// Reading or writing failed at the operating system.
    Io {
        /// What was being done.
        action: String,
        /// The system's message.
        message: String,
    },
    /// The file is shorter (or longer) than the index or its own header says.
    Truncated {
        /// Bytes expected.
        expected: u64,
        /// Bytes found.
        found: u64,
    },
    /// The index or a file's header cannot be read, or disagrees with the index.
    Malformed {
        /// What is wrong with it.
        reason: String,
    },
    /// The bytes of a slice do not have the checksum the index recorded: the file was corrupted.
    ChecksumMismatch {
        /// The byte offset in the file of the chunk that differs.
        offset: u64,
        /// The CRC-32 the index recorded.
        expected: u32,
        /// The CRC-32 of the bytes found.
        found: u32,
    },
    /// The index (or the safetensors file) has no tensor of this name.
    TensorNotFound,
    /// The tensor's global shape is not the one asked for.
    ShapeMismatch {
        /// The shape asked for.
        expected: Vec<usize>,
        /// The shape in the checkpoint.
        found: Vec<usize>,
    },
    /// The tensor's element type is not the one asked for (and conversion was not asked for),
    /// or is not one this crate has.
    DtypeMismatch {
        /// The type asked for.
        expected: String,
        /// The type in the checkpoint.
        found: String,
    },
}

impl CheckpointError {
    /// An error of `op` found on `rank` in `file` (about `tensor`, if given).
    pub fn new(
        op: &'static str,
        rank: usize,
        file: impl AsRef<Path>,
        tensor: Option<&str>,
        kind: CheckpointErrorKind,
    ) -> Self {
        CheckpointError {
            op,
            rank,
            file: file.as_ref().display().to_string(),
            tensor: tensor.map(str::to_string),
            kind,
        }
    }

    /// An I/O error while doing `action`.
    pub(crate) fn io(
        op: &'static str,
        rank: usize,
        file: impl AsRef<Path>,
        tensor: Option<&str>,
        action: &str,
        err: &std::io::Error,
    ) -> Self {
        let kind = if err.kind() == std::io::ErrorKind::NotFound && action.starts_with("open") {
            CheckpointErrorKind::MissingFile
        } else {
            CheckpointErrorKind::Io { action: action.to_string(), message: err.to_string() }
        };
        Self::new(op, rank, file, tensor, kind)
    }

    /// A malformed index or header.
    pub(crate) fn malformed(
        op: &'static str,
        rank: usize,
        file: impl AsRef<Path>,
        tensor: Option<&str>,
        reason: impl Into<String>,
    ) -> Self {
        Self::new(op, rank, file, tensor, CheckpointErrorKind::Malformed { reason: reason.into() })
    }
}

impl fmt::Display for CheckpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: rank {} found in {}", self.op, self.rank, self.file)?;
        if let Some(t) = &self.tensor {
            write!(f, ", tensor {t:?}")?;
        }
        write!(f, ": {}", self.kind)
    }
}

impl fmt::Display for CheckpointErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use CheckpointErrorKind::*;
        match self {
            NoIndex => f.write_str(
                "no index: not a checkpoint, or a save into it did not finish (the index is \
                 written last)",
            ),
            MissingFile => f.write_str("the file is missing"),
            Io { action, message } => write!(f, "{action}: {message}"),
            Truncated { expected, found } => {
                write!(f, "the file has {found} bytes, {expected} expected: truncated or replaced")
            }
            Malformed { reason } => write!(f, "malformed: {reason}"),
            ChecksumMismatch { offset, expected, found } => write!(
                f,
                "checksum mismatch in the chunk at byte {offset}: CRC-32 {found:#010x}, the index \
                 recorded {expected:#010x} (the file is corrupted)"
            ),
            TensorNotFound => f.write_str("no such tensor"),
            ShapeMismatch { expected, found } => {
                write!(f, "the tensor has shape {found:?}, {expected:?} was asked for")
            }
            DtypeMismatch { expected, found } => write!(
                f,
                "the tensor is {found}, {expected} was asked for (ask for a conversion with \
                 Target::convert_dtype)"
            ),
        }
    }
}

impl std::error::Error for CheckpointError {}

impl From<CheckpointError> for Error {
    fn from(e: CheckpointError) -> Self {
        Error::Checkpoint(Box::new(e))
    }
}
