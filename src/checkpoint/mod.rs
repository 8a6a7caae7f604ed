//! Checkpoints: distributed tensors, layers' parameters and optimizers' state saved as
//! safetensors files, one per rank, with an index; loaded into a world of any size, any
//! placement and any split, each rank reading only the slices it needs. Also: a plain
//! safetensors file (a published model's weights) loaded straight into a sharded layout.
//!
//! # Layout on disk
//!
//! A checkpoint is a directory: `rank-RRRRR.<generation>.safetensors`, one per rank of the
//! world that saved it, each holding the slices that rank owned as ordinary safetensors tensors
//! (a replicated tensor only in rank 0's), and `index.json` (see [`index`](self#the-index)),
//! written last, which names the files and says, for every tensor, its global shape, element
//! type, placement, which slice of it each file holds and the CRC-32 of each 1 MiB chunk of
//! every slice.
//!
//! # Saving and loading
//!
//! [`save`] is collective: every rank passes the same names ([`Entry`]: a [`DistTensor`], or a
//! part and its placement); a `Partial` tensor is summed first. [`Checkpoint::open`] reads the
//! index on every rank; [`Checkpoint::load`] gives a tensor in the [`Target`] layout (placement,
//! split, optional shape check and type conversion): each rank maps the files whose slices meet
//! its part and copies only the overlap, checking the checksums of the chunks it reads. Loads
//! work in every world (threads, processes, MPI, over a filesystem every rank sees) and in GPU
//! worlds (read to the host, then moved to the rank's device).
//!
//! # Crash safety
//!
//! Files go to a temporary name, are synced and renamed; the index is written last the same way,
//! after every rank's file is complete, and names the files it covers; files of an earlier
//! save in the same directory are deleted only after the new index is in place. A crash at any
//! point leaves the previous checkpoint loadable (see [`save`]).
//!
//! # Errors
//!
//! A missing, truncated or corrupted file, a checksum mismatch, a tensor missing from the index,
//! a shape or element type that does not match the target: each is an
//! [`Error::Checkpoint`](crate::Error::Checkpoint) ([`CheckpointError`]) on every rank, naming the
//! rank that found it, the file and the tensor.
//!
//! # The index
//!
//! `index.json` is JSON: `format`, `version`, `generation` (the save's, also in every file's
//! name and metadata), `world`, `chunk_bytes`, `files` (`name`, `bytes`) and `tensors`: per name
//! `dtype`, `shape`, `placement` (as saved), `dim` (the dimension the slices cut; null for one
//! slice of the whole tensor) and `slices` (`file`, `start`, `len` along `dim`, `crc32` per
//! chunk).
//!
//! [`DistTensor`]: crate::DistTensor

mod agree;
mod file;
mod index;
mod load;
mod published;
mod save;

pub use crate::error::{CheckpointError, CheckpointErrorKind};
pub use index::INDEX_FILE;
pub use load::{Checkpoint, Target};
pub use published::{SafetensorsFile, write_safetensors};
pub use save::{Entry, Saved, save};
