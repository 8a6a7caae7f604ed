//! Local tensors: [`Tensor`] on ndarray, the [`Element`] types, local matrix products, and the
//! local math a model needs between the distributed ops: arithmetic operators, maps,
//! activations, reductions and normalizations, each computed in the accumulator type (f32 for
//! f16 and bf16) and rounded once.

mod activation;
mod activation_grad;
mod arith;
mod attention;
pub(crate) mod backend;
mod batched;
mod bias_activation;
mod convert;
pub(crate) mod decode_attention;
mod dense;
mod device;
mod dispatch;
mod display;
mod element;
#[cfg(test)]
mod fake_backend;
mod few_rows;
mod gemm_kernel;
mod grouped_matmul;
mod join;
mod layout;
mod lhs_transposed;
mod map;
mod matmul;
mod mse;
mod norm;
mod norm_grad;
mod optim_step;
mod pod;
pub(crate) mod pool;
mod reduce;
mod route;
mod scan;
mod select;
mod split;
mod storage;
mod top;

pub(crate) use attention::exp_row;
pub use attention::{
    scaled_dot_product_attention, scaled_dot_product_attention_backward,
    scaled_dot_product_attention_lse,
};
pub(crate) use bias_activation::ActivationFn;
pub use decode_attention::decode_attention_lse;
pub use dense::Tensor;
pub use device::Device;
pub(crate) use element::short_type_name;
pub use element::{Accumulator, DType, Element};
pub(crate) use few_rows::MAX_ROWS as FEW_ROWS;
pub(crate) use gemm_kernel::transpose_into;
pub use grouped_matmul::grouped_matmul;
#[cfg(all(test, feature = "cuda"))]
pub(crate) use map::broadcast_shape;
pub(crate) use map::require_host;
pub use matmul::{matmul, matmul_into};
pub(crate) use optim_step::OptimRule;
pub use pod::Pod;
pub use pool::{DEFAULT_POOL_BYTES, POOL_BYTES_ENV, pooled_bytes, release_pool};
pub use route::{DROPPED, Gate, Routed, Router, expert_capacity, route};
pub use split::{array_split, split_offsets};
pub(crate) use storage::{LENT_ALIGN, LentMemory};
