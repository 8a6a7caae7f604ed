//! Layers' and optimizers' state by name, for checkpoints: [`NamedState`] (layers),
//! [`OptimizerState`] (optimizers), and [`save_training`] / [`load_training`], a whole training
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
//! | [`Adam`](super::Adam), per parameter `p` | `p.exp_avg`, `p.exp_avg_sq`, `p.step`, and `p.master` (f32 master weights of f16 and bf16 parameters) |
//! | [`Sgd`](super::Sgd), per parameter `p` | `p.momentum_buffer`, `p.step`, `p.master` |
//!
//! each under the prefix given (`model.` and `optim.` in [`save_training`]). A layer's weights
//! are saved as global tensors, so a checkpoint saved by 4 ranks loads on 2, 3 or 1, each rank
//! reading its own part.

use std::path::Path;

use super::UlyssesSelfAttention;
use super::{Adam, ColumnParallelLinear, ParallelMlp, Parameters, RowParallelLinear, Sgd};
use crate::checkpoint::{self, Checkpoint, Entry, Saved, Target};
use crate::dist_tensor::DistTensor;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Placement, Result, Split};

/// `prefix.name`, or `name` alone for an empty prefix.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() { name.to_string() } else { format!("{prefix}.{name}") }
}

/// A layer's parameters by name: their names and placements (in the order of
/// [`Parameters::parameters`]), and from those, its state to save and its load.
///
/// # Examples
/// ```
/// use dist_tensor::checkpoint::{self, Checkpoint};
/// use dist_tensor::nn::{Activation, NamedState, ParallelMlp, Parameters};
/// use dist_tensor::World;
/// let dir = std::env::temp_dir().join(format!("dist-tensor-doc-named-{}", std::process::id()));
/// World::threads(4)?.run(|rank| {
///     let mlp = ParallelMlp::<f32>::new(rank, 8, 12, Activation::Gelu, 7)?;
///     let names: Vec<String> = mlp.param_names().into_iter().map(|(n, _)| n).collect();
///     assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
///     checkpoint::save(rank, &dir, &mlp.named_state("model")?)?;
///     Ok(())
/// })?;
/// // Loaded into a model of other weights, on 3 ranks: the same function again.
/// World::threads(3)?.run(|rank| {
///     let mut mlp = ParallelMlp::<f32>::new(rank, 8, 12, Activation::Gelu, 99)?;
///     mlp.load_named_state(&Checkpoint::open(rank, &dir)?, "model")?;
///     let fresh = ParallelMlp::<f32>::new(rank, 8, 12, Activation::Gelu, 7)?;
///     assert_eq!(mlp.parameters()[0].value(), fresh.parameters()[0].value());
///     Ok(())
/// })?;
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub trait NamedState<T: Element>: Parameters<T> {
    /// Every parameter's name and placement, in the order of [`Parameters::parameters`].
    fn param_names(&self) -> Vec<(String, Placement)>;

    /// The parameters as checkpoint entries named `prefix.name`, borrowing their values.
    ///
    /// # Errors
    /// As [`Entry::local`].
    fn named_state(&self, prefix: &str) -> Result<Vec<Entry<'_>>> {
        self.parameters()
            .into_iter()
            .zip(self.param_names())
            .map(|(p, (name, placement))| Entry::local(join(prefix, &name), p.value(), placement))
            .collect()
    }

    /// Replaces every parameter's value by the checkpoint's `prefix.name`, cut as the layer's
    /// own parts are (whatever world saved it). Gradients are kept; an optimizer's state is
    /// loaded by [`OptimizerState::load_optimizer_state`]. Collective.
    ///
    /// # Errors
    /// As [`Checkpoint::load`]: on every rank, a parameter missing from the checkpoint, or of
    /// another global shape or element type.
    fn load_named_state(&mut self, ck: &Checkpoint<'_>, prefix: &str) -> Result<()> {
        let names = self.param_names();
        let rank = ck.rank();
        for (p, (name, placement)) in self.parameters_mut().into_iter().zip(names) {
            let target = part_target(rank, p.value(), placement)?;
            let loaded = ck.load::<T>(&join(prefix, &name), target)?;
            *p.value_mut() = loaded.into_local();
        }
        Ok(())
    }
}

/// The target that gives this rank a part laid out as `part` is: its placement, every rank's
/// size along a sharded dimension, the global shape. One exchange of shapes.
fn part_target<'a, T: Element>(
    rank: &'a Rank<'a>,
    part: &Tensor<T>,
    placement: Placement,
) -> Result<Target> {
    // A clone shares the elements (copy-on-write): no copy.
    let d = DistTensor::from_local(rank, part.clone(), placement)?;
    let (global, splits) = (d.global_shape(), d.shard_sizes().to_vec());
    let target = Target::new(placement).shape(&global);
    Ok(match placement {
        Placement::Shard(_) => target.split(Split::Sizes(splits)),
        _ => target,
    })
}

impl<T: Element> NamedState<T> for ColumnParallelLinear<T> {
    fn param_names(&self) -> Vec<(String, Placement)> {
        let mut names = vec![("weight".to_string(), Placement::Shard(1))];
        if self.bias().is_some() {
            names.push(("bias".to_string(), Placement::Shard(0)));
        }
        names
    }
}

impl<T: Element> NamedState<T> for RowParallelLinear<T> {
    fn param_names(&self) -> Vec<(String, Placement)> {
        let mut names = vec![("weight".to_string(), Placement::Shard(0))];
        if self.bias().is_some() {
            names.push(("bias".to_string(), Placement::Replicate));
        }
        names
    }
}

impl<T: Element> NamedState<T> for ParallelMlp<T> {
    fn param_names(&self) -> Vec<(String, Placement)> {
        let fc1 = self.fc1().param_names().into_iter().map(|(n, p)| (join("fc1", &n), p));
        let fc2 = self.fc2().param_names().into_iter().map(|(n, p)| (join("fc2", &n), p));
        fc1.chain(fc2).collect()
    }
}

impl<T: Element> NamedState<T> for UlyssesSelfAttention<T> {
    fn param_names(&self) -> Vec<(String, Placement)> {
        vec![("wqkv".to_string(), Placement::Replicate), ("wo".to_string(), Placement::Replicate)]
    }
}

/// An optimizer's state by name, for the parameters of `model` (see the module docs for the
/// names): saved and loaded with the model's layout, so it reshards with the model.
pub trait OptimizerState<T: Element> {
    /// The state as checkpoint entries named `prefix.<parameter>.<buffer>`; none before the
    /// first step.
    ///
    /// # Errors
    /// As [`Entry::local`].
    fn optimizer_state<'a, M: NamedState<T> + ?Sized>(
        &'a self,
        model: &M,
        prefix: &str,
    ) -> Result<Vec<Entry<'a>>>;

    /// Replaces the state by the checkpoint's, cut as `model`'s parameters are; a checkpoint
    /// with no state for them (saved before the first step) leaves the optimizer fresh.
    /// Collective.
    ///
    /// # Errors
    /// As [`Checkpoint::load`].
    fn load_optimizer_state<M: NamedState<T> + ?Sized>(
        &mut self,
        ck: &Checkpoint<'_>,
        model: &M,
        prefix: &str,
    ) -> Result<()>;
}

/// Every parameter of `model`: its name, placement, local shape and load target.
pub(crate) fn layout_of<T: Element, M: NamedState<T> + ?Sized>(
    model: &M,
) -> Vec<(String, Placement, Vec<usize>)> {
    model
        .parameters()
        .into_iter()
        .zip(model.param_names())
        .map(|(p, (n, pl))| (n, pl, p.value().shape().to_vec()))
        .collect()
}

/// The load targets of `model`'s parameters (one exchange each).
pub(crate) fn targets_of<'a, T: Element, M: NamedState<T> + ?Sized>(
    rank: &'a Rank<'a>,
    model: &M,
) -> Result<Vec<Target>> {
    model
        .parameters()
        .into_iter()
        .zip(model.param_names())
        .map(|(p, (_, pl))| part_target(rank, p.value(), pl))
        .collect()
}

impl<T: Element> OptimizerState<T> for Adam<T> {
    fn optimizer_state<'a, M: NamedState<T> + ?Sized>(
        &'a self,
        model: &M,
        prefix: &str,
    ) -> Result<Vec<Entry<'a>>> {
        self.slots().entries(&layout_of(model), prefix, ["exp_avg", "exp_avg_sq"])
    }

    fn load_optimizer_state<M: NamedState<T> + ?Sized>(
        &mut self,
        ck: &Checkpoint<'_>,
        model: &M,
        prefix: &str,
    ) -> Result<()> {
        let layout = layout_of(model);
        let targets = targets_of(ck.rank(), model)?;
        self.slots_mut().load(ck, &layout, &targets, prefix, ["exp_avg", "exp_avg_sq"])
    }
}

impl<T: Element> OptimizerState<T> for Sgd<T> {
    fn optimizer_state<'a, M: NamedState<T> + ?Sized>(
        &'a self,
        model: &M,
        prefix: &str,
    ) -> Result<Vec<Entry<'a>>> {
        self.slots().entries(&layout_of(model), prefix, ["momentum_buffer"])
    }

    fn load_optimizer_state<M: NamedState<T> + ?Sized>(
        &mut self,
        ck: &Checkpoint<'_>,
        model: &M,
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
/// use dist_tensor::nn::{Activation, Adam, ParallelMlp, Parameters, load_training, mse_loss, save_training};
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
    M: NamedState<T> + ?Sized,
    O: OptimizerState<T>,
{
    let mut entries = model.named_state("model")?;
    entries.extend(optimizer.optimizer_state(model, "optim")?);
    checkpoint::save(rank, dir, &entries)
}

/// Loads a whole training state saved by [`save_training`] (in a world of any size) into
/// `model` and `optimizer`. Collective.
///
/// # Errors
/// As [`Checkpoint::open`] and [`Checkpoint::load`].
pub fn load_training<'r, T, M, O>(
    rank: &'r Rank<'r>,
    dir: impl AsRef<Path>,
    model: &mut M,
    optimizer: &mut O,
) -> Result<()>
where
    T: Element,
    M: NamedState<T> + ?Sized,
    O: OptimizerState<T>,
{
    let ck = Checkpoint::open(rank, dir)?;
    model.load_named_state(&ck, "model")?;
    optimizer.load_optimizer_state(&ck, model, "optim")
}
