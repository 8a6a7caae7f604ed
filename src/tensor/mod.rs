//! Local tensors: [`Tensor`] on ndarray, the [`Element`] types, and local matrix products.

mod dense;
mod element;
mod gemm_kernel;
mod matmul;
mod pod;
mod split;

pub use dense::Tensor;
pub use element::{Accumulator, DType, Element};
pub use matmul::{matmul, matmul_into};
pub use pod::Pod;
pub use split::{array_split, split_offsets};
