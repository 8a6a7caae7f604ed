#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![doc(test(attr(deny(warnings))))]

//! # Errors and panics
//!
//! Anything one rank can get wrong at run time (a shape, a placement, a peer that failed or never
//! signalled, symmetric memory running out) returns [`Error`], because a panic on one rank would
//! leave the others waiting. Only programmer mistakes that cannot depend on run-time data panic,
//! and those functions say so under `# Panics`.

pub mod collectives;
pub mod device;
pub mod dist;
pub mod error;
pub mod fused;
pub mod shmem;
pub mod tensor;

pub use device::Device;
pub use dist::{DistTensor, Placement};
pub use error::{Error, Result};
pub use shmem::{Rank, World};
pub use tensor::{DType, Element, Tensor};
