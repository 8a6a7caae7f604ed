//! Symmetric memory: the [`World`] of ranks, the symmetric heap, signals, and the pointer types
//! that make the seed's rules hold.
//!
//! | seed (`dl.*`) | here |
//! | --- | --- |
//! | `symm_at(ptr, rank)` | [`symm_at`]`(&buf, rank)` |
//! | `wait(sig, v, scope, "acquire")` | [`Rank::wait`] / [`Program::wait`](crate::device::Program::wait), returning a [`Token`] |
//! | `consume_token(ptr, token)` | [`consume_token`] |
//! | `notify(sig, rank, signal, sig_op, scope)` | [`Rank::notify`] / [`Program::notify`](crate::device::Program::notify) |
//! | `barrier_all()` | [`Rank::barrier_all`] |

mod buffer;
mod control;
mod crossed;
mod device_process;
mod device_runtime;
mod exchange;
mod group;
mod heap;
pub mod job_env;
pub(crate) mod latency;
mod lent;
mod mapping;
#[cfg(feature = "mpi")]
mod mpi;
mod mpi_collectives;
mod process;
mod put;
mod rank;
mod signal;
mod spawn;
mod sync;
pub(crate) mod topology;
mod transport;
mod world;

pub use crate::tensor::Pod;
pub use buffer::{
    GlobalPtr, GlobalPtrMut, Readable, SymmBuf, SymmPtr, Writable, consume_token, symm_at,
    try_symm_at,
};
pub(crate) use device_process::ProcessJob;
pub(crate) use device_runtime::{DeviceRuntime, OpenProcessDevice};
pub(crate) use exchange::{Call, Exchanged, digest};
pub use exchange::{MAX_WORDS, WordExchange, check_agree};
pub use group::Group;
#[cfg(test)]
pub(crate) use lent::MAX_OUTPUT_BLOCKS;
pub(crate) use lent::OutputBlock;
pub(crate) use put::{PutSignal, Shape};
pub use rank::Rank;
pub(crate) use signal::Awaited;
pub use signal::{NotifySem, Scope, SignalBuf, SignalOp, Token, WaitCmp, WaitSem};
pub use spawn::{LocalJob, RankExit};
pub(crate) use world::DeviceSetup;
pub use world::{
    DEFAULT_HEAP_BYTES, DEFAULT_WAIT_TIMEOUT, HEAP_BYTES_ENV, WAIT_TIMEOUT_ENV, Workspace, World,
    WorldBuilder,
};

#[cfg_attr(not(feature = "cuda"), allow(unused_imports))] // the GPU rendezvous uses them
pub(crate) use mapping::Mapping;
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use process::{peer_pid, recv_fd, send_fd};
pub(crate) use world::panic_message;
