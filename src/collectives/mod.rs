//! Collectives as tile kernels on symmetric memory: [`all_gather`], [`reduce_scatter`],
//! [`all_reduce`], [`all_to_all`] (and the uneven [`all_to_all_v`], [`all_to_all_v_tensor`]),
//! [`broadcast`].
//!
//! Each returns a new vector; the `_into` forms write into the caller's slice instead, for
//! callers that reuse their buffers. Each is collective: every rank of the world calls it, in the same order. Lengths may differ
//! between ranks and may be zero. Reductions run in a fixed rank order, so their results are
//! bitwise the same on every run; f16 and bf16 accumulate in f32 and round once. Buffers and
//! signals are kept per rank between calls (see [`Rank::workspace_bytes`](crate::Rank::workspace_bytes)),
//! and signals count calls instead of being reset, so a call needs no barrier.
//!
//! The kernels follow the seed: vector-only launches over the topology's vector cores, a
//! grid-stride loop over tasks flattened across (peer, chunk), peers visited in an order rotated
//! by the rank, masks at ragged ends.

mod all_gather;
mod all_reduce;
mod all_to_all;
mod broadcast;
mod input;
mod reduce_scatter;
mod tensor;
mod workspace;

pub use all_gather::{all_gather, all_gather_cols, all_gather_cols_into, all_gather_into};
pub use all_reduce::{
    ONE_SHOT_MAX_READ_BYTES, all_reduce, all_reduce_into, all_reduce_one_shot, all_reduce_two_shot,
};
pub use all_to_all::{all_to_all, all_to_all_into, all_to_all_v, all_to_all_v_tensor};
pub use broadcast::{broadcast, broadcast_into};
pub use input::Input;
pub use reduce_scatter::{
    ReduceOp, reduce_scatter, reduce_scatter_cols, reduce_scatter_cols_into, reduce_scatter_into,
};
pub use tensor::all_reduce_tensor;
pub(crate) use tensor::{all_gather_along, reduce_scatter_along, slice_along};
