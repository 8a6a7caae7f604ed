//! [`Module`]: the one trait of everything trainable. A module is a tree of named
//! [`Param`]s; the tree's two visits are all a type implements (or [`impl_module!`](crate::impl_module)
//! writes them from the field names), and everything else follows for any module: its
//! parameters for an optimizer, its gradients cleared, its state dict saved and loaded
//! (resharded to any world size), gradients summed over the ranks ([`sync_grads`]) and clipped
//! by their global norm ([`clip_grad_norm`]).
//!
//! Each [`Param`] carries its [`Placement`]: a sharded one (`Shard(axis)`: a column block, a
//! vocabulary slice) has its gradient complete on its rank; a replicated one is used by each
//! rank on its own rows, so each rank's gradient is a partial sum until [`sync_grads`] sums it.

use super::Param;
use crate::checkpoint::{Checkpoint, Entry, SafetensorsFile, Target, write_safetensors};
use crate::collectives::all_reduce;
use crate::dist_tensor::DistTensor;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Placement, Result, Split};

/// `prefix.name`, or `name` at the top.
///
/// # Examples
/// ```
/// use dist_tensor::nn::join;
/// assert_eq!(join("layers.0", "attn"), "layers.0.attn");
/// assert_eq!(join("", "head"), "head");
/// ```
pub fn join(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (true, _) => name.to_string(),
        (_, true) => prefix.to_string(),
        _ => format!("{prefix}.{name}"),
    }
}

/// A model or a part of one: its parameters, each with a dotted name (`layers.0.attn.q.weight`).
/// A type implements the two visits (in a fixed order, the same on every rank); the rest
/// follows. [`impl_module!`](crate::impl_module) writes them for a struct whose fields are
/// parameters or modules.
///
/// # Examples
/// A user's model of two layers, its parameters named from its fields:
/// ```
/// use dist_tensor::nn::{Activation, Module, ParallelMlp, Param};
/// use dist_tensor::{Element, Tensor, World};
///
/// struct Head<T: Element> {
///     mlp: ParallelMlp<T>,
///     scale: Param<T>,
/// }
/// dist_tensor::impl_module!(Head<T> { mlp, scale });
///
/// World::threads(2)?.run(|rank| {
///     let mut head = Head {
///         mlp: ParallelMlp::<f32>::new(rank, 4, 6, Activation::Gelu, 1)?,
///         scale: Param::new(Tensor::from(vec![1.0])),
///     };
///     let names: Vec<String> = head.named_parameters().into_iter().map(|(n, _)| n).collect();
///     assert_eq!(names, ["mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias", "scale"]);
///     assert_eq!(head.parameters_mut().len(), 5);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub trait Module<T: Element> {
    /// Calls `f` with every parameter's full name (under `prefix`) and the parameter, in a
    /// fixed order.
    fn visit<'s>(&'s self, prefix: &str, f: &mut dyn FnMut(&str, &'s Param<T>));

    /// As [`Module::visit`], with the parameters mutable.
    fn visit_mut<'s>(&'s mut self, prefix: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>));

    /// Every parameter with its dotted name.
    fn named_parameters(&self) -> Vec<(String, &Param<T>)> {
        let mut out = Vec::new();
        self.visit("", &mut |name, p| out.push((name.to_string(), p)));
        out
    }

    /// Every parameter, in the fixed order (what an optimizer steps).
    fn parameters(&self) -> Vec<&Param<T>> {
        let mut out = Vec::new();
        self.visit("", &mut |_, p| out.push(p));
        out
    }

    /// Every parameter, mutably, in the same order.
    fn parameters_mut(&mut self) -> Vec<&mut Param<T>> {
        let mut out = Vec::new();
        self.visit_mut("", &mut |_, p| out.push(p));
        out
    }

    /// Elements of this rank's parameters.
    fn num_elements(&self) -> usize {
        self.parameters().iter().map(|p| p.value().len()).sum()
    }

    /// Forgets every parameter's gradient.
    fn zero_grad(&mut self) {
        self.visit_mut("", &mut |_, p| p.zero_grad());
    }

    /// The parameters as checkpoint entries named `prefix.name`, each a global tensor laid out
    /// by its placement (so a state saved by 4 ranks loads on any other number), borrowing
    /// their values.
    ///
    /// # Errors
    /// As [`Entry::local`].
    fn state_dict(&self, prefix: &str) -> Result<Vec<Entry<'_>>> {
        self.named_parameters()
            .into_iter()
            .map(|(name, p)| Entry::local(join(prefix, &name), p.value(), p.placement()))
            .collect()
    }

    /// Replaces every parameter's value by the checkpoint's `prefix.name`, cut as this rank's
    /// part is (whatever world saved it). Gradients are kept; an optimizer's state is loaded by
    /// [`Optimizer::load_state_dict`](super::Optimizer::load_state_dict). Collective.
    ///
    /// # Errors
    /// As [`Checkpoint::load`]: on every rank, a parameter missing from the checkpoint, or of
    /// another global shape or element type.
    fn load_state_dict(&mut self, ck: &Checkpoint<'_>, prefix: &str) -> Result<()> {
        load_parts(self, ck.rank(), |name, target| {
            Ok(ck.load::<T>(&join(prefix, name), target)?.into_local())
        })
    }

    /// Replaces every parameter's value by tensor `prefix.name` of a plain safetensors file (a
    /// model as published, or as [`Module::save_safetensors`] wrote it), each rank reading only
    /// its part. Collective.
    ///
    /// # Errors
    /// As [`SafetensorsFile::load`]: on every rank, a tensor missing, or of another shape.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::checkpoint::SafetensorsFile;
    /// use dist_tensor::nn::{Activation, Module, ParallelMlp};
    /// use dist_tensor::World;
    /// let path = std::env::temp_dir().join(format!("dist-tensor-doc-mst-{}.safetensors", std::process::id()));
    /// World::threads(4)?.run(|rank| {
    ///     let mlp = ParallelMlp::<f32>::new(rank, 8, 12, Activation::Gelu, 7)?;
    ///     mlp.save_safetensors(rank, &path, "mlp") // whole tensors: mlp.fc1.weight [8, 12], ...
    /// })?;
    /// World::threads(3)?.run(|rank| {
    ///     let mut mlp = ParallelMlp::<f32>::new(rank, 8, 12, Activation::Gelu, 99)?;
    ///     mlp.load_safetensors(&SafetensorsFile::open(rank, &path)?, "mlp")?;
    ///     let fresh = ParallelMlp::<f32>::new(rank, 8, 12, Activation::Gelu, 7)?;
    ///     assert_eq!(mlp.parameters()[0].value(), fresh.parameters()[0].value());
    ///     Ok(())
    /// })?;
    /// # std::fs::remove_file(&path).ok();
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    fn load_safetensors(&mut self, file: &SafetensorsFile<'_>, prefix: &str) -> Result<()> {
        load_parts(self, file.rank(), |name, target| {
            Ok(file.load::<T>(&join(prefix, name), target)?.into_local())
        })
    }

    /// Writes every parameter, whole (the shards gathered), into one plain safetensors file at
    /// `path`, named `prefix.name` (rank 0 writes; every rank returns its outcome). Collective.
    ///
    /// # Errors
    /// As the gathers and [`write_safetensors`], on every rank.
    fn save_safetensors(
        &self,
        rank: &Rank<'_>,
        path: &std::path::Path,
        prefix: &str,
    ) -> Result<()> {
        let mut whole = Vec::new();
        for (name, p) in self.named_parameters() {
            let t = match p.placement() {
                Placement::Shard(_) => {
                    DistTensor::from_local(rank, p.value().clone(), p.placement())?.to_global()?
                }
                _ => p.value().clone(),
            };
            whole.push((join(prefix, &name), t));
        }
        let written = if rank.rank() == 0 {
            let refs: Vec<(&str, &Tensor<T>)> =
                whole.iter().map(|(n, t)| (n.as_str(), t)).collect();
            write_safetensors(path, &refs)
        } else {
            Ok(())
        };
        let failed = all_reduce(rank, &[if written.is_ok() { 0.0f64 } else { 1.0 }])?[0];
        match written {
            Err(e) => Err(e),
            Ok(()) if failed == 0.0 => Ok(()),
            Ok(()) => Err(Error::InvalidArgument {
                op: "Module::save_safetensors",
                rank: rank.rank(),
                reason: format!("rank 0 could not write {}", path.display()),
            }),
        }
    }

    /// Moves every parameter (and its gradient) to `rank`'s device: a GPU world's GPU, or the
    /// host. A model built on the host, or loaded there, then trains where its world computes.
    ///
    /// # Errors
    /// As the copies (no memory on the device).
    fn to_device(&mut self, rank: &Rank<'_>) -> Result<()> {
        let mut failed = None;
        self.visit_mut("", &mut |_, p| {
            if failed.is_some() {
                return;
            }
            let moved = crate::device::to_world_device(rank, p.value().clone())
                .and_then(|v| p.set_value(v))
                .and_then(|()| {
                    if let Some(g) = p.grad() {
                        p.set_grad(Some(g.into_place_of(p.value())?));
                    }
                    Ok(())
                });
            if let Err(e) = moved {
                failed = Some(e);
            }
        });
        failed.map_or(Ok(()), Err)
    }
}

/// A parameter is a module of one parameter, named by its place in the tree.
impl<T: Element> Module<T> for Param<T> {
    fn visit<'s>(&'s self, prefix: &str, f: &mut dyn FnMut(&str, &'s Param<T>)) {
        f(prefix, self);
    }

    fn visit_mut<'s>(&'s mut self, prefix: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>)) {
        f(prefix, self);
    }
}

/// A list of modules (the layers of a model): named by index, `0.`, `1.`, ...
impl<T: Element, M: Module<T>> Module<T> for Vec<M> {
    fn visit<'s>(&'s self, prefix: &str, f: &mut dyn FnMut(&str, &'s Param<T>)) {
        for (i, m) in self.iter().enumerate() {
            m.visit(&join(prefix, &i.to_string()), f);
        }
    }

    fn visit_mut<'s>(&'s mut self, prefix: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>)) {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_mut(&join(prefix, &i.to_string()), f);
        }
    }
}

/// A module that may be absent (a layer's bias): nothing when it is.
impl<T: Element, M: Module<T>> Module<T> for Option<M> {
    fn visit<'s>(&'s self, prefix: &str, f: &mut dyn FnMut(&str, &'s Param<T>)) {
        if let Some(m) = self {
            m.visit(prefix, f);
        }
    }

    fn visit_mut<'s>(&'s mut self, prefix: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>)) {
        if let Some(m) = self {
            m.visit_mut(prefix, f);
        }
    }
}

impl<T: Element, M: Module<T> + ?Sized> Module<T> for Box<M> {
    fn visit<'s>(&'s self, prefix: &str, f: &mut dyn FnMut(&str, &'s Param<T>)) {
        (**self).visit(prefix, f);
    }

    fn visit_mut<'s>(&'s mut self, prefix: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>)) {
        (**self).visit_mut(prefix, f);
    }
}

/// Writes [`Module`] for a struct whose fields (those listed) are parameters or modules, each
/// named by its field: `impl_module!(Block<T> { norm, attn, mlp })` for a struct generic over
/// its element type, `impl_module!(Block: f32 { norm, attn, mlp })` for one of a fixed type.
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Module, Param};
/// use dist_tensor::Tensor;
/// struct Affine {
///     scale: Param<f64>,
///     shift: Option<Param<f64>>,
/// }
/// dist_tensor::impl_module!(Affine: f64 { scale, shift });
/// let a = Affine { scale: Param::new(Tensor::from(vec![2.0])), shift: None };
/// assert_eq!(a.named_parameters()[0].0, "scale");
/// ```
#[macro_export]
macro_rules! impl_module {
    ($ty:ident < $t:ident > { $($field:ident),* $(,)? }) => {
        impl<$t: $crate::Element> $crate::nn::Module<$t> for $ty<$t> {
            $crate::impl_module!(@visits $t; $($field),*);
        }
    };
    ($ty:ty : $t:ty { $($field:ident),* $(,)? }) => {
        impl $crate::nn::Module<$t> for $ty {
            $crate::impl_module!(@visits $t; $($field),*);
        }
    };
    (@visits $t:ty; $($field:ident),*) => {
        fn visit<'s>(
            &'s self,
            prefix: &str,
            f: &mut dyn FnMut(&str, &'s $crate::nn::Param<$t>),
        ) {
            $($crate::nn::Module::<$t>::visit(
                &self.$field,
                &$crate::nn::join(prefix, stringify!($field)),
                f,
            );)*
        }

        fn visit_mut<'s>(
            &'s mut self,
            prefix: &str,
            f: &mut dyn FnMut(&str, &'s mut $crate::nn::Param<$t>),
        ) {
            $($crate::nn::Module::<$t>::visit_mut(
                &mut self.$field,
                &$crate::nn::join(prefix, stringify!($field)),
                f,
            );)*
        }
    };
}

/// Replaces every parameter's value by `read(its name, the target that cuts this rank's part as
/// the parameter's is)`. Collective, as `read`.
fn load_parts<T: Element, M: Module<T> + ?Sized>(
    model: &mut M,
    rank: &Rank<'_>,
    mut read: impl FnMut(&str, Target) -> Result<Tensor<T>>,
) -> Result<()> {
    let mut params = Vec::new();
    model.visit_mut("", &mut |name, p| params.push((name.to_string(), p)));
    for (name, p) in params {
        let target = part_target(rank, p.value(), p.placement())?;
        p.set_value(read(&name, target)?)?;
    }
    Ok(())
}

/// The target that gives this rank a part laid out as `part` is: its placement, every rank's
/// size along a sharded dimension, the global shape. One exchange of shapes.
pub(crate) fn part_target<'a, T: Element>(
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

/// A gradient's elements on the host, zeros where there is none.
fn grad_elements<T: Element>(p: &Param<T>) -> Result<Vec<T>> {
    match p.grad() {
        Some(g) => Ok(g.host_elements()?.into_owned()),
        None => Ok(vec![T::zero(); p.value().len()]),
    }
}

/// Sums the gradients of the replicated parameters over the ranks of `rank` (one all-reduce for
/// all of them): after it, each is the gradient of the whole batch, the same on every rank.
/// Parameters with no gradient take part as zeros. Collective.
///
/// # Errors
/// As [`all_reduce`].
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Param, sync_grads};
/// use dist_tensor::{Tensor, World};
/// let grads = World::threads(3)?.run(|rank| {
///     let mut p = Param::new(Tensor::<f64>::from(vec![0.0]));
///     p.accumulate_grad(Tensor::from(vec![rank.rank() as f64]))?;
///     sync_grads(&p, rank)?;
///     Ok(p.grad().unwrap().as_slice()[0])
/// })?;
/// assert_eq!(grads, [3.0, 3.0, 3.0]); // 0 + 1 + 2 on every rank
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn sync_grads<T: Element, M: Module<T> + ?Sized>(model: &M, rank: &Rank<'_>) -> Result<()> {
    let mut replicated = Vec::new();
    model.visit("", &mut |_, p| {
        if p.is_replicated() {
            replicated.push(p);
        }
    });
    let mut flat = Vec::new();
    for p in &replicated {
        flat.extend(grad_elements(p)?);
    }
    let summed = all_reduce(rank, &flat)?;
    let mut at = 0;
    for p in replicated {
        let n = p.value().len();
        let g = Tensor::from_shape_vec(p.value().shape(), summed[at..at + n].to_vec())?;
        p.set_grad(Some(g.into_place_of(p.value())?));
        at += n;
    }
    Ok(())
}

/// Scales every gradient so that their global norm (over every parameter of every rank: each
/// sharded part once, each replicated parameter once) is at most `max_norm`; returns the norm
/// before. The norm is one all-reduce of one number. Call after [`sync_grads`]. Collective.
///
/// # Errors
/// [`Error::InvalidArgument`] for a `max_norm` that is not positive; as [`all_reduce`].
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Param, clip_grad_norm};
/// use dist_tensor::{Tensor, World};
/// let out = World::threads(2)?.run(|rank| {
///     // Each rank's shard holds a gradient of norm 3: the global norm is sqrt(18).
///     let mut p = Param::sharded(Tensor::<f64>::from(vec![0.0]), 0);
///     p.accumulate_grad(Tensor::from(vec![3.0]))?;
///     let norm = clip_grad_norm(&p, 1.0, rank)?;
///     Ok((norm, p.grad().unwrap().as_slice()[0]))
/// })?;
/// assert!((out[0].0 - 18f64.sqrt()).abs() < 1e-12);
/// // Scaled by max_norm / (norm + 1e-6), PyTorch's guard against a zero norm.
/// assert!((out[0].1 - 3.0 / 18f64.sqrt()).abs() < 1e-6);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn clip_grad_norm<T: Element, M: Module<T> + ?Sized>(
    model: &M,
    max_norm: f64,
    rank: &Rank<'_>,
) -> Result<f64> {
    if max_norm.is_nan() || max_norm <= 0.0 {
        return Err(Error::InvalidArgument {
            op: "clip_grad_norm",
            rank: rank.rank(),
            reason: format!("max_norm is {max_norm}: it must be positive"),
        });
    }
    let norm = grad_norm(model, rank)?;
    if norm > max_norm {
        let k = T::from_f64(max_norm / (norm + 1e-6));
        model.visit("", &mut |_, p| {
            if let Some(g) = p.grad() {
                p.set_grad(Some(g * k));
            }
        });
    }
    Ok(norm)
}

/// The global norm of every gradient (each sharded part once, each replicated parameter once),
/// in f64: one all-reduce. Collective.
///
/// # Errors
/// As [`all_reduce`].
pub fn grad_norm<T: Element, M: Module<T> + ?Sized>(model: &M, rank: &Rank<'_>) -> Result<f64> {
    let (mut sharded, mut replicated) = (0.0f64, 0.0f64);
    let mut failed = None;
    model.visit("", &mut |_, p| {
        let Some(g) = p.grad() else { return };
        let sq: f64 = match g.host_elements() {
            Ok(v) => v.iter().map(|x| x.to_f64().powi(2)).sum(),
            Err(e) => {
                failed.get_or_insert(e);
                return;
            }
        };
        if p.is_replicated() {
            replicated += sq;
        } else {
            sharded += sq;
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    Ok((all_reduce(rank, &[sharded])?[0] + replicated).sqrt())
}
