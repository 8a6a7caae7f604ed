//! Distributed tensors: [`DistTensor`] and its [`Placement`], the user-facing layer. Methods here
//! validate, choose a kernel and return new distributed tensors; they never touch raw memory.

mod layout;
mod local;
mod matmul_ops;
mod placement;
mod redistribute;
mod sequence;
mod split;
mod tensor;

pub use matmul_ops::MatmulOptions;
pub use placement::Placement;
pub use split::Split;
pub use tensor::{DistTensor, MAX_DIMS};
