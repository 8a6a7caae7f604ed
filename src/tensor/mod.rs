//! Local tensors: [`Tensor`] on ndarray, the [`Element`] types, and local matrix products.

mod dense;
mod element;
mod gemm_kernel;
mod matmul;
mod pod;
pub(crate) mod pool;
mod split;
mod storage;

pub use dense::Tensor;
pub use element::{Accumulator, DType, Element};
pub use matmul::{matmul, matmul_into};
pub use pod::Pod;
pub use pool::{DEFAULT_POOL_BYTES, POOL_BYTES_ENV, pooled_bytes, release_pool};
pub use split::{array_split, split_offsets};
