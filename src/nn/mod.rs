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
//! # On autograd
//!
//! Every layer is also an autograd [`Module`], its parameters named as
//! its checkpoint names ([`NamedState`]), and has `forward_var`, its forward pass on
//! [`DVar`](crate::autograd::DVar)s: the same fused ops, each recording its dual. So one model
//! mixes these layers with those of [`autograd::gpt`](crate::autograd::gpt), differentiates it
//! with one `backward()` and steps it with one [`AdamW::step`](crate::autograd::AdamW::step) (or
//! [`Adam::step_module`], [`Sgd::step_module`]). A [`Param`]'s gradient is an autograd leaf's:
//! a layer's `backward` and a `backward()` through its `forward_var` accumulate into the same
//! place.
//!
//! The `forward` / `backward` pairs are autograd too: `forward` runs `forward_var` on a tracked
//! copy of its input and keeps the record, and `backward` runs the record backward, seeded with
//! the output gradient. No hand-written derivative is left: none was faster than autograd's
//! (`cargo bench --bench nn -- autograd` timed both; docs/results/2026-12-01-autograd-cost-zen4.md has the figures), and one
//! backward pass per layer is one to keep right. One difference remains between the two ways to
//! call them: `backward` returns the gradients of replicated parameters (a row-parallel bias,
//! the Ulysses projections) complete on every rank, summing this pass's parts over the ranks,
//! where a `backward()` through `forward_var` leaves the ranks' parts for
//! [`sync_grads`](crate::autograd::sync_grads), as for every
//! [`Sharing::Replicated`](crate::autograd::Sharing) parameter.
//!
//! # Training
//!
//! Every layer implements [`Parameters`]: its [`Param`]s, each this rank's shard of a weight
//! (or a replicated bias) and its accumulated gradient. [`Sgd`] and [`Adam`] step them;
//! [`mse_loss`] gives a loss and its gradient for row-sharded predictions. A layer's
//! `backward_hooked` is its `backward` telling a [`GradHook`] of each parameter's gradient the
//! moment the pass completes it (a column-parallel weight before the input gradient's exchange
//! and product): data parallelism's buckets
//! ([`GradBuckets`](crate::mesh::data_parallel::GradBuckets)) send it to be averaged while the
//! rest of the pass runs.
//!
//! ```
//! use dist_tensor::nn::{Activation, Adam, ParallelMlp, Parameters, mse_loss};
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
mod grad_hook;
mod loss;
mod mlp;
mod optim;
mod param;
mod recorded;
mod row_parallel;
mod state;

pub use activation::Activation;
pub use attention::{AttentionSaved, SelfAttentionSaved, UlyssesAttention, UlyssesSelfAttention};
pub use column_parallel::{ColumnParallelLinear, ColumnParallelSaved};
pub use grad_hook::GradHook;
pub use loss::{mse_loss, mse_loss_var};
pub use mlp::{MlpSaved, ParallelMlp};
pub use optim::{Adam, Sgd};
pub use param::{Param, Parameters};
pub use row_parallel::{RowParallelLinear, RowParallelSaved};
pub use state::{NamedState, OptimizerState, load_training, save_training};

use crate::autograd::{Module, Sharing, Var};
use crate::dist_tensor::Placement;

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

/// How autograd sees a parameter placed so: a shard is complete on its rank; a replicated one is
/// used by each rank on its own rows, its gradient a partial sum.
fn sharing(placement: Placement) -> Sharing {
    match placement {
        Placement::Replicate | Placement::Partial => Sharing::Replicated,
        Placement::Shard(_) => Sharing::Sharded,
    }
}

/// [`Module::visit`] of a layer: its parameters as tracked [`Var`]s sharing their gradients, under
/// their checkpoint names.
fn visit_layer<'a, T: Element, L: NamedState<T>>(
    layer: &L,
    prefix: &str,
    f: &mut dyn FnMut(&str, &Var<'a, T>, Sharing),
) {
    for (p, (name, placement)) in layer.parameters().into_iter().zip(layer.param_names()) {
        f(&state::join(prefix, &name), &p.var(), sharing(placement));
    }
}

/// [`Module::visit_mut`] of a layer: as [`visit_layer`], keeping the values `f` leaves.
fn visit_layer_mut<'a, T: Element, L: NamedState<T>>(
    layer: &mut L,
    prefix: &str,
    f: &mut dyn FnMut(&str, &mut Var<'a, T>, Sharing),
) {
    let names = layer.param_names();
    for (p, (name, placement)) in layer.parameters_mut().into_iter().zip(names) {
        p.with_var_mut(|v| f(&state::join(prefix, &name), v, sharing(placement)));
    }
}

/// Every layer is a [`Module`] through its [`NamedState`].
macro_rules! layer_module {
    ($($layer:ident),*) => {$(
        impl<'a, T: Element> Module<'a, T> for $layer<T> {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Var<'a, T>, Sharing)) {
                visit_layer(self, prefix, f);
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Var<'a, T>, Sharing),
            ) {
                visit_layer_mut(self, prefix, f);
            }
        }
    )*};
}

layer_module!(ColumnParallelLinear, RowParallelLinear, ParallelMlp, UlyssesSelfAttention);

/// `act` on a [`Var`], differentiated.
fn activation_var<'a, T: Element>(act: Activation, x: &Var<'a, T>) -> Var<'a, T> {
    match act {
        Activation::Gelu => x.gelu(),
        Activation::GeluTanh => x.gelu_tanh(),
        Activation::Silu => x.silu(),
        Activation::Relu => x.relu(),
    }
}
