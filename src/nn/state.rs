//! Modules' and optimizers' state by name, for checkpoints ([`Module::state_dict`],
//! [`Optimizer::state_dict`]), and [`save_training`] / [`load_training`], a whole training
//! state in one call each.
//!
//! The names are stable and a user can rely on them (PyTorch's where PyTorch has one):
//!
//! | what | names |
//! | --- | --- |
//! | [`ColumnParallelLinear`](super::ColumnParallelLinear) | `weight` (`[in, out]`, `Shard(1)`), `bias` (`[out]`, `Shard(0)`) |
//! | [`RowParallelLinear`](super::RowParallelLinear) | `weight` (`[in, out]`, `Shard(0)`), `bias` (`[out]`, `Replicate`) |
//! | [`ParallelMlp`](super::ParallelMlp) | `fc1.weight`, `fc1.bias`, `fc2.weight`, `fc2.bias` |
//! | [`UlyssesSelfAttention`](super::UlyssesSelfAttention) | `wqkv` (`[E, 3 * E]`), `wo` (`[E, E]`), both `Replicate` |
//! | [`gpt::Gpt`](super::gpt::Gpt) | `embed.weight` (`Shard(0)`), `pos`, `layers.<i>.{norm1,norm2}.weight`, `layers.<i>.attn.{q,k,v}.weight` (`Shard(1)`), `layers.<i>.attn.out.weight` (`Shard(0)`), `layers.<i>.mlp.fc1.weight` (`Shard(1)`), `layers.<i>.mlp.fc2.weight` (`Shard(0)`), `norm.weight`, `head.weight` (`Shard(1)`) |
//! | a user's module | its fields' names, joined by dots ([`impl_module!`](crate::impl_module)) |
//! | [`Adam`](super::Adam), per parameter `p` | `p.exp_avg`, `p.exp_avg_sq`, `p.step`, and `p.master` (f32 master weights of f16 and bf16 parameters) |
//! | [`Sgd`](super::Sgd), per parameter `p` | `p.momentum_buffer`, `p.step`, `p.master` |
//!
//! each under the prefix given (`model.` and `optim.` in [`save_training`]). A layer's weights
//! are saved as global tensors, so a checkpoint saved by 4 ranks loads on 2, 3 or 1, each rank
//! reading its own part.

use std::path::Path;

use super::module::part_target;
use super::{Adam, Module, Optimizer, Param, Sgd};
use crate::checkpoint::{self, Checkpoint, Entry, Saved, Target};
use crate::shmem::Rank;
use crate::tensor::Element;
use crate::{Placement, Result};

/// Every parameter of `model`: its name, placement, local shape and load target.
pub(crate) fn layout_of<T: Element, M: Module<T> + ?Sized>(
    model: &M,
) -> Vec<(String, Placement, Vec<usize>)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.placement(), p.value().shape().to_vec()))
        .collect()
}

/// The load targets of `model`'s parameters (one exchange each).
pub(crate) fn targets_of<'a, T: Element, M: Module<T> + ?Sized>(
    rank: &'a Rank<'a>,
    model: &M,
) -> Result<Vec<Target>> {
    model.parameters().into_iter().map(|p| part_target(rank, p.value(), p.placement())).collect()
}

impl<T: Element> Optimizer<T> for Adam<T> {
    fn step(&mut self, params: Vec<&mut Param<T>>) -> Result<()> {
        Adam::step(self, params)
    }

    fn lr(&self) -> f64 {
        Adam::lr(self)
    }

    fn set_lr(&mut self, lr: f64) {
        Adam::set_lr(self, lr);
    }

    fn reset(&mut self) {
        Adam::reset(self);
    }

    fn state_dict<'a>(&'a self, model: &dyn Module<T>, prefix: &str) -> Result<Vec<Entry<'a>>> {
        self.slots().entries(&layout_of(model), prefix, ["exp_avg", "exp_avg_sq"])
    }

    fn load_state_dict(
        &mut self,
        ck: &Checkpoint<'_>,
        model: &dyn Module<T>,
        prefix: &str,
    ) -> Result<()> {
        let layout = layout_of(model);
        let targets = targets_of(ck.rank(), model)?;
        self.slots_mut().load(ck, &layout, &targets, prefix, ["exp_avg", "exp_avg_sq"])
    }
}

impl<T: Element> Optimizer<T> for Sgd<T> {
    fn step(&mut self, params: Vec<&mut Param<T>>) -> Result<()> {
        Sgd::step(self, params)
    }

    fn lr(&self) -> f64 {
        Sgd::lr(self)
    }

    fn set_lr(&mut self, lr: f64) {
        Sgd::set_lr(self, lr);
    }

    fn reset(&mut self) {
        Sgd::reset(self);
    }

    fn state_dict<'a>(&'a self, model: &dyn Module<T>, prefix: &str) -> Result<Vec<Entry<'a>>> {
        self.slots().entries(&layout_of(model), prefix, ["momentum_buffer"])
    }

    fn load_state_dict(
        &mut self,
        ck: &Checkpoint<'_>,
        model: &dyn Module<T>,
        prefix: &str,
    ) -> Result<()> {
        let layout = layout_of(model);
        let targets = targets_of(ck.rank(), model)?;
        self.slots_mut().load(ck, &layout, &targets, prefix, ["momentum_buffer"])
    }
}

/// Saves a whole training state into checkpoint directory `dir`: `model`'s parameters under
/// `model.` and `optimizer`'s state under `optim.`. Collective.
///
/// # Errors
/// As [`checkpoint::save`].
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Activation, Adam, Module, ParallelMlp, load_training, mse_loss, save_training};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let dir = std::env::temp_dir().join(format!("dist-tensor-doc-train-{}", std::process::id()));
/// let x = Tensor::<f32>::random(&[12, 4], 1);
/// World::threads(2)?.run(|rank| {
///     let mut mlp = ParallelMlp::<f32>::new(rank, 4, 8, Activation::Gelu, 1)?;
///     let mut adam = Adam::new(1e-2);
///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
///     let (y, saved) = mlp.forward(&xs)?;
///     let (_, dy) = mse_loss(&y, &xs)?;
///     mlp.backward(saved, &dy)?;
///     adam.step(mlp.parameters_mut())?;
///     save_training(rank, &dir, &mlp, &adam)?;
///     Ok(())
/// })?;
/// World::threads(1)?.run(|rank| {
///     let mut mlp = ParallelMlp::<f32>::new(rank, 4, 8, Activation::Gelu, 5)?;
///     let mut adam = Adam::new(1e-2);
///     load_training(rank, &dir, &mut mlp, &mut adam)?;
///     Ok(())
/// })?;
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn save_training<T, M, O>(
    rank: &Rank<'_>,
    dir: impl AsRef<Path>,
    model: &M,
    optimizer: &O,
) -> Result<Saved>
where
    T: Element,
    M: Module<T>,
    O: Optimizer<T> + ?Sized,
{
    save_training_with(rank, dir, model, optimizer, Vec::new())
}

/// [`save_training`] with `extra` entries beside the model's and the optimizer's (a step
/// count, a [`LossScaler`](super::LossScaler)'s state), read back from the checkpoint that
/// [`load_training`] returns. Collective.
///
/// # Errors
/// As [`checkpoint::save`].
pub fn save_training_with<'a, T, M, O>(
    rank: &Rank<'_>,
    dir: impl AsRef<Path>,
    model: &'a M,
    optimizer: &'a O,
    extra: Vec<Entry<'a>>,
) -> Result<Saved>
where
    T: Element,
    M: Module<T>,
    O: Optimizer<T> + ?Sized,
{
    let mut entries = model.state_dict("model")?;
    entries.extend(optimizer.state_dict(model, "optim")?);
    entries.extend(extra);
    checkpoint::save(rank, dir, &entries)
}

/// Loads a whole training state saved by [`save_training`] (in a world of any size) into
/// `model` and `optimizer`; returns the checkpoint, for what else was saved with it
/// ([`save_training_with`]). Collective.
///
/// # Errors
/// As [`Checkpoint::open`] and [`Checkpoint::load`].
pub fn load_training<'r, T, M, O>(
    rank: &'r Rank<'r>,
    dir: impl AsRef<Path>,
    model: &mut M,
    optimizer: &mut O,
) -> Result<Checkpoint<'r>>
where
    T: Element,
    M: Module<T>,
    O: Optimizer<T> + ?Sized,
{
    let ck = Checkpoint::open(rank, dir)?;
    model.load_state_dict(&ck, "model")?;
    optimizer.load_state_dict(&ck, model, "optim")?;
    Ok(ck)
}
