//! Distributed tensors: [`DistTensor`] and its [`Placement`], the user-facing layer. Methods here
//! validate, choose a kernel and return new distributed tensors; they never touch raw memory.

mod dist_tensor;
mod layout;
mod local;
mod matmul_ops;
mod placement;
mod redistribute;
mod sequence;
mod split;

pub use dist_tensor::{DistTensor, MAX_DIMS};
pub use matmul_ops::MatmulOptions;
pub use placement::Placement;
pub use split::Split;
