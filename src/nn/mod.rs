//! Tensor- and sequence-parallel layers that train: each has a forward pass that keeps what its
//! backward pass needs, and a backward pass that returns the input gradient and accumulates the
//! gradients of its parameters. A model calls its layers' `backward` in reverse order, passing
//! each the `Saved` value its `forward` returned; or it runs every layer's `forward_var` and
//! differentiates the whole model with autograd (see *On autograd* below).
//!
//! # The sequence-parallel arrangement (Megatron-LM with sequence parallelism)
//!
//! Activations between blocks are sharded by rows (tokens, or the sequence of `[B, S, E]`). A
//! block's first layer, [`ColumnParallelLinear`], gathers the rows and multiplies by its columns
//! of the weight in one fused `all_gather_matmul`; the second, [`RowParallelLinear`], multiplies
//! by its rows of the weight and reduce-scatters the sum back to row shards in one fused
//! `matmul_reduce_scatter`. The fused ops are each other's duals, so each layer's backward pass
//! runs the other op:
//!
//! | layer | forward | input gradient | weight gradient |
//! | --- | --- | --- | --- |
//! | column | `h = all_gather(x) @ W_r` | `dx = reduce_scatter(dh @ W_r^T)` | `X^T @ dh`, `X` the gathered input the forward kept |
//! | row | `y = reduce_scatter(a @ W_r)` | `da = all_gather(dy) @ W_r^T` | `a^T @ dY`, `dY` the gathered `dy` of that same op |
//!
//! Nothing is gathered twice (the fused `all_gather_matmul` hands back the rows it gathered), and
//! the layers make no transposed copies: the local GEMM reads `X^T` and `a^T` in place, through
//! strides, and the fused kernels read `W^T` so too, except in products of more rows than one
//! tile, where they copy it once into row-major order (the GEMM packs a column-major block of the
//! weight for every block of rows, much slower). [`ParallelMlp`] is the block built from the two,
//! with an [`Activation`] between them.
//!
//! Sequence-parallel attention ([`UlyssesAttention`], DeepSpeed-Ulysses) trades the sequence for
//! heads with one `all_to_all` before attention and back with another after; its backward pass is
//! the same two exchanges the other way round. [`UlyssesSelfAttention`] adds the projections
//! around it.
//!
//! # Where they run
//!
//! On the host worlds (threads, and processes of one host), and on GPUs: in a GPU world the
//! layers' parameters, gradients and saved activations live on the ranks' GPUs, and the fused
//! ops, the products, the sums, the activations and their derivatives, [`mse_loss`],
//! attention (autograd's scaled_dot_product_attention: on a GPU not yet a fused kernel, it
//! keeps the probabilities, quadratic in the sequence) and the
//! optimizers' updates ([`Sgd`], [`Adam`], f32 master weights for the half types) run there as
//! GPU kernels. An Ascend world has no fused op that keeps the gathered input: the layers' calls
//! return [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) there, on every rank.
//!
//! # One training stack
//!
//! Everything trainable is a [`Module`]: a tree of named [`Param`]s (the one parameter type:
//! this rank's part of a weight, its placement, its gradient). The layers here, the
//! [`gpt`] model and a user's own struct ([`impl_module!`](crate::impl_module) names its
//! parameters from its fields) are all modules, and every piece of training works for any of
//! them: one optimizer family ([`Sgd`], [`Adam`] with AdamW's decoupled decay, behind
//! [`Optimizer`], f32 master weights for the half types), learning-rate schedules behind
//! [`LrSchedule`], [`sync_grads`] (the replicated parameters' partial gradients summed over
//! the ranks), [`clip_grad_norm`] (the global norm in one all-reduce), state dicts
//! ([`Module::state_dict`]) and whole training states ([`save_training`], [`load_training`])
//! that reshard to any world size, data parallelism's buckets and ZeRO-1
//! ([`mesh`](crate::mesh)).
//!
//! Each layer has `forward_var`, its forward pass on [`DVar`](crate::autograd::DVar)s: the
//! fused ops, each recording its dual; one `backward()` differentiates a whole model. The
//! `forward` / `backward` pairs are autograd too: `forward` runs `forward_var` on a tracked
//! copy of its input and keeps the record, and `backward` runs the record backward, seeded with
//! the output gradient. No hand-written derivative is left: none was faster than autograd's
//! (`cargo bench --bench nn -- autograd` timed both; docs/results/2026-12-01-autograd-cost-zen4.md
//! has the figures). One difference remains between the two ways to call them: `backward`
//! returns the gradients of replicated parameters (a row-parallel bias, the Ulysses
//! projections) complete on every rank, summing this pass's parts over the ranks, where a
//! `backward()` through `forward_var` leaves the ranks' parts for [`sync_grads`].
//!
//! A layer's `backward_hooked` is its `backward` telling a [`GradHook`] of each parameter's
//! gradient the moment the pass completes it (a column-parallel weight before the input
//! gradient's exchange and product): data parallelism's buckets
//! ([`GradBuckets`](crate::mesh::data_parallel::GradBuckets)) send it to be averaged while the
//! rest of the pass runs.
//!
//! ```
//! use dist_tensor::nn::{Activation, Adam, Module, ParallelMlp, mse_loss};
//! use dist_tensor::{DistTensor, Placement, Tensor, World};
//!
//! let x = Tensor::<f32>::random(&[24, 8], 1);
//! let target = x.map(|v| v.sin()); // learn sin, elementwise
//! let losses = World::threads(2)?.run(|rank| {
//!     let mut mlp = ParallelMlp::<f32>::new(rank, 8, 32, Activation::Gelu, 7)?;
//!     let mut adam = Adam::new(1e-2);
//!     let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
//!     let ts = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
//!     let mut losses = Vec::new();
//!     for _ in 0..30 {
//!         let (y, saved) = mlp.forward(&xs)?;
//!         let (loss, dy) = mse_loss(&y, &ts)?;
//!         mlp.zero_grad();
//!         mlp.backward(saved, &dy)?;
//!         adam.step(mlp.parameters_mut())?;
//!         losses.push(loss);
//!     }
//!     Ok(losses)
//! })?;
//! assert_eq!(losses[0], losses[1]); // every rank sees the same loss
//! assert!(losses[0][29] < losses[0][0] / 4.0, "{:?}", losses[0]);
//! # Ok::<(), dist_tensor::Error>(())
//! ```

mod activation;
mod attention;
mod column_parallel;
pub mod gpt;
mod grad_hook;
mod loss;
mod mlp;
mod module;
mod moe;
mod optim;
mod param;
mod recorded;
mod row_parallel;
mod scaler;
mod schedule;
mod state;

pub use activation::Activation;
pub use attention::{AttentionSaved, SelfAttentionSaved, UlyssesAttention, UlyssesSelfAttention};
pub use column_parallel::{ColumnParallelLinear, ColumnParallelSaved};
pub use grad_hook::GradHook;
pub use loss::{mse_loss, mse_loss_var};
pub use mlp::{MlpSaved, ParallelMlp};
pub use module::{Module, clip_grad_norm, grad_norm, join, sync_grads};
pub use moe::{MoeLayer, MoeOutput};
pub use optim::{Adam, Optimizer, Sgd};
pub(crate) use optim::{FlatSlot, Slots};
pub use param::Param;
pub use row_parallel::{RowParallelLinear, RowParallelSaved};
pub use scaler::LossScaler;
pub use schedule::{Constant, LrSchedule, StepDecay, WarmupCosine, WarmupLinear};
pub(crate) use state::{layout_of, targets_of};
pub use state::{load_training, save_training, save_training_with};

use crate::autograd::Var;

use crate::Result;
use crate::tensor::{Element, Tensor};

/// A whole weight `[in, out]` and bias `[out]` initialised as PyTorch's `nn.Linear` is: uniform
/// in `+-1/sqrt(in)`, from `seed` (the bias from the next seed).
fn linear_init<T: Element>(
    in_features: usize,
    out_features: usize,
    bias: bool,
    seed: u64,
) -> Result<(Tensor<T>, Option<Tensor<T>>)> {
    let bound = T::from_f64(1.0 / (in_features.max(1) as f64).sqrt());
    let w = Tensor::try_random(&[in_features, out_features], seed)? * bound;
    let b = if bias {
        Some(Tensor::try_random(&[out_features], seed.wrapping_add(1))? * bound)
    } else {
        None
    };
    Ok((w, b))
}

/// `act` on a [`Var`], differentiated.
fn activation_var<'a, T: Element>(act: Activation, x: &Var<'a, T>) -> Var<'a, T> {
    match act {
        Activation::Gelu => x.gelu(),
        Activation::GeluTanh => x.gelu_tanh(),
        Activation::Silu => x.silu(),
        Activation::Relu => x.relu(),
    }
}
