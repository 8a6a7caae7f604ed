//! The execution model: topologies, launch modes, kernel launches and tile operations.
//!
//! A kernel is a closure run by every program of a launch grid ([`launch`]); each program is told
//! who it is through [`Program`] and works on tiles with the operations in [`tile`].

pub mod ascend;
pub mod capability;
pub mod cuda;
pub mod host;
mod kind;
mod moves;
pub(crate) mod path;
mod placement;
mod world;

pub use crate::shmem::topology::{LaunchMode, Topology};
pub use host::launch::launch;
pub use host::program::Program;
pub use host::tile;
pub use kind::Device;
pub(crate) use moves::{device_data, to_world_device};
pub use world::DEVICE_ENV;
pub(crate) use world::DeviceWorld;
