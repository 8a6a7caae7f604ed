//! Local tensors: [`Tensor`] on ndarray, the [`Element`] types, and local matrix products.

mod element;
mod gemm_kernel;
mod matmul;
mod dense;

pub use element::{Accumulator, DType, Element};
pub use matmul::{matmul, matmul_into};
pub use dense::Tensor;
