//! The execution model: topologies, launch modes, kernel launches and tile operations.

mod topology;

pub use topology::{LaunchMode, Topology};
