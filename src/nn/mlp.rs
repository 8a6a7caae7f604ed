//! [`ParallelMlp`]: the tensor-parallel MLP block, column-parallel, activation, row-parallel.

use super::recorded::Recorded;
use super::{Activation, ColumnParallelLinear, GradHook, RowParallelLinear};
use crate::Result;
use crate::autograd::DVar;
use crate::dist_tensor::DistTensor;
use crate::shmem::Rank;
use crate::tensor::Element;

/// The MLP block of a transformer, tensor-parallel with the sequence sharded:
/// `y = act(x @ W1 + b1) @ W2 + b2`, with `W1: [E, F]` split by columns
/// ([`ColumnParallelLinear`]) and `W2: [F, E]` by rows ([`RowParallelLinear`]). `x: [..., E]`
/// sharded on a leading dimension gives `y: [..., E]` sharded the same way; the only
/// communication is fused into the two products, forward and backward.
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Activation, ParallelMlp};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
///
/// let x = Tensor::<f64>::random(&[2, 7, 8], 1); // [B, S, E]
/// let outs = World::threads(3)?.run(|rank| {
///     let mlp = ParallelMlp::<f64>::new(rank, 8, 20, Activation::Gelu, 5)?;
///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?; // the sequence sharded
///     let (y, _saved) = mlp.forward(&xs)?;
///     assert_eq!(y.shard_sizes(), xs.shard_sizes()); // rows line up with x's: a local residual
///     y.to_global()
/// })?;
/// // The same block on one rank.
/// let one = World::threads(1)?.run(|rank| {
///     let mlp = ParallelMlp::<f64>::new(rank, 8, 20, Activation::Gelu, 5)?;
///     mlp.forward(&DistTensor::from_global(rank, &x, Placement::Shard(1))?)?.0.to_global()
/// })?;
/// assert!((&outs[0] - &one[0]).as_slice().iter().all(|d| d.abs() < 1e-12));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ParallelMlp<T: Element> {
    fc1: ColumnParallelLinear<T>,
    act: Activation,
    fc2: RowParallelLinear<T>,
}

/// What [`ParallelMlp::forward`] keeps for its backward pass: the pass recorded on autograd
/// (what the two layers' fused ops keep, and the activation's input). It borrows the rank, as
/// the forward's output does. Consumed by the backward pass; a clone shares the record, which
/// runs backward once.
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Activation, ParallelMlp};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let x = Tensor::<f32>::random(&[6, 4], 1);
/// World::threads(2)?.run(|rank| {
///     let mut mlp = ParallelMlp::<f32>::new(rank, 4, 8, Activation::Relu, 1)?;
///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
///     // Two forward passes, then their backward passes in any order (gradients add up).
///     let (y1, saved1) = mlp.forward(&xs)?;
///     let (y2, saved2) = mlp.forward(&xs)?;
///     mlp.backward(saved2, &y2)?;
///     mlp.backward(saved1, &y1)?;
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MlpSaved<'r, T: Element> {
    recorded: Recorded<'r, T>,
}

impl<T: Element> ParallelMlp<T> {
    /// A block of `hidden` inputs and outputs and `ffn` inner features (split evenly), both
    /// layers with biases, initialised as PyTorch's `nn.Linear` from `seed` (the second layer
    /// from `seed + 2`): the same whole weights on every rank, each keeping its shards.
    ///
    /// # Errors
    /// As [`ColumnParallelLinear::from_global`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, Module, ParallelMlp};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let mlp = ParallelMlp::<f32>::new(rank, 8, 32, Activation::Silu, 1)?;
    ///     let shapes: Vec<_> = mlp.parameters().iter().map(|p| p.value().shape().to_vec()).collect();
    ///     assert_eq!(shapes, vec![vec![8, 16], vec![16], vec![16, 8], vec![8]]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn new(
        rank: &Rank<'_>,
        hidden: usize,
        ffn: usize,
        act: Activation,
        seed: u64,
    ) -> Result<Self> {
        let fc1 = ColumnParallelLinear::new(rank, hidden, ffn, true, seed)?;
        let fc2 = RowParallelLinear::new(rank, ffn, hidden, true, seed.wrapping_add(2))?;
        Ok(ParallelMlp::from_layers(fc1, act, fc2))
    }

    /// The block of these two layers (`fc1`'s outputs are `fc2`'s inputs) and activation.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, ColumnParallelLinear, ParallelMlp, RowParallelLinear};
    /// use dist_tensor::{Split, Tensor, World};
    /// let (w1, w2) = (Tensor::<f32>::random(&[4, 6], 1), Tensor::<f32>::random(&[6, 4], 2));
    /// World::threads(2)?.run(|rank| {
    ///     let fc1 = ColumnParallelLinear::from_global(rank, &w1, None, Split::Even)?;
    ///     let fc2 = RowParallelLinear::from_global(rank, &w2, None, Split::Even)?;
    ///     let mlp = ParallelMlp::from_layers(fc1, Activation::Relu, fc2);
    ///     assert_eq!(mlp.activation(), Activation::Relu);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_layers(
        fc1: ColumnParallelLinear<T>,
        act: Activation,
        fc2: RowParallelLinear<T>,
    ) -> Self {
        ParallelMlp { fc1, act, fc2 }
    }

    /// With `false`, both layers run the unfused baselines (see
    /// [`ColumnParallelLinear::fused`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, ParallelMlp};
    /// use dist_tensor::World;
    /// World::threads(1)?.run(|rank| {
    ///     let mlp = ParallelMlp::<f32>::new(rank, 4, 8, Activation::Gelu, 1)?.fused(false);
    ///     assert!(!mlp.fc1().is_fused() && !mlp.fc2().is_fused());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn fused(self, fused: bool) -> Self {
        ParallelMlp { fc1: self.fc1.fused(fused), act: self.act, fc2: self.fc2.fused(fused) }
    }

    /// The first layer (column-parallel).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, ParallelMlp};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let mlp = ParallelMlp::<f32>::new(rank, 4, 8, Activation::Gelu, 1)?;
    ///     assert_eq!(mlp.fc1().weight().value().shape(), &[4, 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn fc1(&self) -> &ColumnParallelLinear<T> {
        &self.fc1
    }

    /// The second layer (row-parallel).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, ParallelMlp};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let mlp = ParallelMlp::<f32>::new(rank, 4, 8, Activation::Gelu, 1)?;
    ///     assert_eq!(mlp.fc2().weight().value().shape(), &[4, 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn fc2(&self) -> &RowParallelLinear<T> {
        &self.fc2
    }

    /// The activation between the layers.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, ParallelMlp};
    /// use dist_tensor::World;
    /// World::threads(1)?.run(|rank| {
    ///     assert_eq!(ParallelMlp::<f32>::new(rank, 4, 8, Activation::Silu, 1)?.activation(), Activation::Silu);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn activation(&self) -> Activation {
        self.act
    }

    /// `act(x @ W1 + b1) @ W2 + b2` for `x: [..., E]` sharded on a leading dimension: `[..., E]`,
    /// sharded as `x`. Returns what the backward pass needs too: the pass recorded on autograd
    /// ([`ParallelMlp::forward_var`] on a tracked copy of `x`). Collective.
    ///
    /// # Errors
    /// As [`ColumnParallelLinear::forward`] and [`RowParallelLinear::forward`].
    ///
    /// # Examples
    /// See [`ParallelMlp`].
    pub fn forward<'r>(
        &self,
        x: &DistTensor<'r, T>,
    ) -> Result<(DistTensor<'r, T>, MlpSaved<'r, T>)> {
        let (y, recorded) = Recorded::forward([x], |[x]| self.forward_var(x))?;
        Ok((y, MlpSaved { recorded }))
    }

    /// The forward pass without keeping anything for a backward pass (inference). Collective.
    ///
    /// # Errors
    /// As [`ParallelMlp::forward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, ParallelMlp};
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f32>::random(&[5, 4], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let mlp = ParallelMlp::<f32>::new(rank, 4, 6, Activation::Gelu, 1)?;
    ///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
    ///     assert_eq!(mlp.infer(&xs)?.local(), mlp.forward(&xs)?.0.local());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn infer<'r>(&self, x: &DistTensor<'r, T>) -> Result<DistTensor<'r, T>> {
        let h = self.fc1.infer_product(x)?;
        let a = match self.fc1.bias() {
            Some(b) => h.try_map_local(|t| t.bias_activation(b.value(), self.act.function()))?,
            None => h.map_local(|t| self.act.forward(t))?,
        };
        self.fc2.infer(&a)
    }

    /// The forward pass on autograd: `fc2(act(fc1(x)))` with each layer's
    /// [`forward_var`](ColumnParallelLinear::forward_var), recording the duals. Collective.
    ///
    /// # Errors
    /// As the layers' `forward_var`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::DVar;
    /// use dist_tensor::nn::{Activation, Adam, Module, ParallelMlp};
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f32>::random(&[6, 4], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let mut mlp = ParallelMlp::<f32>::new(rank, 4, 8, Activation::Gelu, 3)?;
    ///     let xs = DVar::constant(DistTensor::from_global(rank, &x, Placement::Shard(0))?);
    ///     let y = mlp.forward_var(&xs)?;
    ///     y.local().sum().backward()?;
    ///     let names: Vec<String> = mlp.named_parameters().into_iter().map(|(n, _)| n).collect();
    ///     assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
    ///     Adam::new(1e-3).step(mlp.parameters_mut())?; // every parameter, one call
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn forward_var<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        // fc1's bias and the activation as one op (one pass each way on a GPU, the sum before
        // the activation not stored): the same values and gradients as fc1's forward_var and
        // then the activation.
        let h = self.fc1.product_var(x)?;
        let a = match self.fc1.bias() {
            Some(b) => {
                let b = b.var();
                h.map(|h| h.bias_activation(&b, self.act.function()))?
            }
            None => h.map(|h| Ok(super::activation_var(self.act, h)))?,
        };
        self.fc2.forward_var(&a)
    }

    /// The backward pass: given `dy` (sharded as the output), returns the gradient with respect
    /// to `x` (sharded as `x`) and accumulates every parameter's gradient, complete on every
    /// rank (the replicated second bias's summed over the ranks). The recorded pass run
    /// backward: through `fc2`'s dual, the activation's derivative and `fc1`'s dual. Collective.
    ///
    /// # Errors
    /// As [`RowParallelLinear::backward`] and [`ColumnParallelLinear::backward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, Module, ParallelMlp};
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let (x, dy) = (Tensor::<f64>::random(&[5, 4], 1), Tensor::<f64>::random(&[5, 4], 2));
    /// // The input gradient is the same at every world size.
    /// let grads = [1, 2, 4].map(|n| {
    ///     World::threads(n).and_then(|w| w.run(|rank| {
    ///         let mut mlp = ParallelMlp::<f64>::new(rank, 4, 6, Activation::GeluTanh, 1)?;
    ///         let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
    ///         let (_, saved) = mlp.forward(&xs)?;
    ///         let dx = mlp.backward(saved, &DistTensor::from_global(rank, &dy, Placement::Shard(0))?)?;
    ///         assert!(mlp.parameters().iter().all(|p| p.grad().is_some()));
    ///         dx.to_global()
    ///     }))
    /// });
    /// let one = grads[0].as_ref().unwrap()[0].clone();
    /// for g in &grads {
    ///     assert!((&g.as_ref().unwrap()[0] - &one).as_slice().iter().all(|d| d.abs() < 1e-12));
    /// }
    /// ```
    pub fn backward<'r>(
        &mut self,
        saved: MlpSaved<'r, T>,
        dy: &DistTensor<'r, T>,
    ) -> Result<DistTensor<'r, T>> {
        let mut dx = saved.recorded.backward("ParallelMlp::backward", &*self, dy)?;
        Ok(dx.remove(0))
    }

    /// [`ParallelMlp::backward`], telling `hook` of each parameter's gradient as soon as it is
    /// complete ([`GradHook`]: data parallelism's buckets send it while the rest of the pass
    /// runs). The same gradients, bit for bit. Collective.
    ///
    /// # Errors
    /// As [`ParallelMlp::backward`]; the hook's error.
    ///
    /// # Examples
    /// See [`GradHook`].
    pub fn backward_hooked<'r>(
        &mut self,
        saved: MlpSaved<'r, T>,
        dy: &DistTensor<'r, T>,
        hook: &mut impl GradHook<T>,
    ) -> Result<DistTensor<'r, T>> {
        let mut dx =
            saved.recorded.backward_hooked("ParallelMlp::backward", &*self, dy, Some(hook))?;
        Ok(dx.remove(0))
    }
}

crate::impl_module!(ParallelMlp<T> { fc1, fc2 });
