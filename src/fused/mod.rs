//! Fused communication + compute ops, one per file, each a tile kernel with its host wrapper and
//! its unfused baseline (the collective, then the local compute), which gives the same results and
//! serves tests, benchmarks, and as a fallback.

pub(crate) mod all_gather_matmul;
pub(crate) mod all_to_all;
pub(crate) mod flash_decode;
pub(crate) mod matmul_reduce_scatter;
pub(crate) mod moe_combine;
pub(crate) mod moe_dispatch;
pub(crate) mod moe_experts;
pub(crate) mod operand;

pub use crate::device::host::schedule::{
    AgShape, HostMachine, PathTaken, Schedule, TILE_COST, all_gather_matmul_path, last_schedule,
    matmul_reduce_scatter_path,
};
pub use crate::device::path::{AgPath, RsPath};
pub use all_gather_matmul::{
    AgMatmulOutput, MAX_WEIGHTS, all_gather_matmul, all_gather_matmul_keep_input,
    all_gather_matmul_unfused, all_gather_matmul_unfused_mpi,
};
pub use all_to_all::{
    AllToAllOutput, MAX_DIMS, all_to_all, all_to_all_unfused, all_to_all_unfused_mpi,
};
pub use flash_decode::{FlashDecodeOutput, flash_decode, flash_decode_unfused};
pub use matmul_reduce_scatter::{
    matmul_reduce_scatter, matmul_reduce_scatter_unfused, matmul_reduce_scatter_unfused_mpi,
};
pub use moe_combine::{moe_combine, moe_combine_unfused};
pub use moe_dispatch::{Dispatched, moe_dispatch, moe_dispatch_unfused};
pub use moe_experts::{moe_experts, moe_experts_unfused};
pub use operand::Operand;
