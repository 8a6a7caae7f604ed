//! [`ColumnParallelLinear`]: `y = x @ W + b` with `W` split by columns, input sharded by rows.

use super::recorded::Recorded;
use super::{GradHook, Param};
use crate::autograd::DVar;
use crate::dist_tensor::{DistTensor, MatmulOptions, Split};
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

/// A linear layer `y = x @ W + b` whose weight `W: [in, out]` is split by columns (and `b` with
/// it), in the sequence-parallel arrangement: the input `x: [..., in]` is sharded on a leading
/// dimension (its rows: tokens, or the sequence), and the output `[..., out_r]` has every row and
/// this rank's columns (`Shard` of its last dimension), ready for an elementwise activation and a
/// [`RowParallelLinear`](super::RowParallelLinear).
///
/// - **forward**: one fused `all_gather_matmul`, which also hands back the gathered input
///   ([`DistTensor::all_gather_matmul_keep_input`]): the backward pass needs it for the weight
///   gradient, and gets it without a second gather.
/// - **backward**: the input gradient `dx = reduce_scatter(dy @ W_r^T)` through the dual fused
///   op, `matmul_reduce_scatter`, with `W_r` read transposed and the rows split as `x`'s
///   were; the weight gradient `X^T @ dy` (the gathered input) and the bias gradient (`dy`
///   summed over its rows) locally, with no exchange.
///
/// `forward` records the pass on autograd ([`ColumnParallelLinear::forward_var`] on a tracked
/// copy of `x`) and `backward` runs that record backward: the two forms are one computation.
///
/// # Examples
/// ```
/// use dist_tensor::nn::ColumnParallelLinear;
/// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
///
/// let (x, w) = (Tensor::<f64>::random(&[5, 4], 1), Tensor::<f64>::random(&[4, 6], 2));
/// let dy = Tensor::<f64>::random(&[5, 6], 3); // the gradient of some loss with respect to y
/// let outs = World::threads(2)?.run(|rank| {
///     let mut fc = ColumnParallelLinear::from_global(rank, &w, None, Split::Even)?;
///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
///     let (y, saved) = fc.forward(&xs)?; // [5, 3] per rank: every row, this rank's columns
///     let dys = DistTensor::from_global(rank, &dy, Placement::Shard(1))?;
///     let dx = fc.backward(saved, &dys)?; // [5, 4] split by rows as x
///     let dw = DistTensor::from_local(rank, fc.weight().grad().unwrap().clone(), Placement::Shard(1))?;
///     Ok((y.to_global()?, dx.to_global()?, dw.to_global()?))
/// })?;
/// let (y, dx, dw) = &outs[0];
/// let close = |a: &Tensor<f64>, b: Tensor<f64>| (a - &b).as_slice().iter().all(|d| d.abs() < 1e-12);
/// assert!(close(y, x.matmul(&w)?));
/// assert!(close(dx, dy.matmul(&w.transpose(0, 1)?)?));
/// assert!(close(dw, x.transpose(0, 1)?.matmul(&dy)?));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ColumnParallelLinear<T: Element> {
    weight: Param<T>,
    bias: Option<Param<T>>,
    fused: bool,
}

/// What [`ColumnParallelLinear::forward`] keeps for its backward pass: the pass recorded on
/// autograd (the gathered input, shared, and how the input's rows were split: the input
/// gradient comes back split the same way). It borrows the rank, as the forward's output does.
/// Consumed by the backward pass; a clone shares the record, which runs backward once.
///
/// # Examples
/// ```
/// use dist_tensor::nn::ColumnParallelLinear;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let x = Tensor::<f32>::random(&[2, 7, 4], 1); // [B, S, E], the sequence sharded
/// World::threads(3)?.run(|rank| {
///     let mut fc = ColumnParallelLinear::<f32>::new(rank, 4, 6, true, 1)?;
///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
///     let (y, saved) = fc.forward(&xs)?;
///     let dx = fc.backward(saved, &y)?; // consumed by the backward pass
///     assert_eq!(dx.shard_sizes(), xs.shard_sizes());
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ColumnParallelSaved<'r, T: Element> {
    recorded: Recorded<'r, T>,
}

impl<T: Element> ColumnParallelLinear<T> {
    /// This rank's columns of the whole weight `[in, out]` (and bias `[out]`), cut as `split`
    /// says ([`Split::Units`] keeps attention heads whole). Local: every rank passes the same
    /// tensors and split, and keeps its own piece.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the weight is not 2-D or the bias not `[out]`;
    /// [`Error::InvalidArgument`] when the split does not fit `out`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::{Split, Tensor, World};
    /// let (w, b) = (Tensor::<f32>::random(&[8, 24], 1), Tensor::<f32>::random(&[24], 2));
    /// let widths = World::threads(3)?.run(|rank| {
    ///     let fc = ColumnParallelLinear::from_global(rank, &w, Some(&b), Split::Units(8))?;
    ///     Ok(fc.weight().value().shape()[1])
    /// })?;
    /// assert_eq!(widths, vec![8, 8, 8]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_global(
        rank: &Rank<'_>,
        weight: &Tensor<T>,
        bias: Option<&Tensor<T>>,
        split: impl Into<Split>,
    ) -> Result<Self> {
        const OP: &str = "ColumnParallelLinear::from_global";
        check_linear(OP, weight, bias)?;
        let split = split.into();
        let cols = DistTensor::from_global_split(rank, weight, 1, split.clone())?.into_local();
        let bias = match bias {
            Some(b) => Some(DistTensor::from_global_split(rank, b, 0, split)?.into_local()),
            None => None,
        };
        Self::from_local(cols, bias)
    }

    /// A layer of `in_features` inputs and `out_features` outputs (split evenly) initialised as
    /// PyTorch's `nn.Linear` is, uniform in `+-1/sqrt(in_features)`, from `seed`: the same whole
    /// weight on every rank, each keeping its columns.
    ///
    /// # Errors
    /// As [`ColumnParallelLinear::from_global`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let fc = ColumnParallelLinear::<f32>::new(rank, 16, 9, true, 7)?;
    ///     assert_eq!(fc.weight().value().shape(), &[16, [5, 4][rank.rank()]]);
    ///     assert!(fc.weight().value().as_slice().iter().all(|w| w.abs() <= 0.25));
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn new(
        rank: &Rank<'_>,
        in_features: usize,
        out_features: usize,
        bias: bool,
        seed: u64,
    ) -> Result<Self> {
        let (w, b) = super::linear_init(in_features, out_features, bias, seed)?;
        Self::from_global(rank, &w, b.as_ref(), Split::Even)
    }

    /// A layer from this rank's own shards: `weight: [in, out_r]`, `bias: [out_r]`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the weight is not 2-D or the bias not `[out_r]`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::Tensor;
    /// let fc = ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[4, 2]), Some(Tensor::zeros(&[2])))?;
    /// assert_eq!(fc.in_features(), 4);
    /// assert!(ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[4, 2]), Some(Tensor::zeros(&[3]))).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_local(weight: Tensor<T>, bias: Option<Tensor<T>>) -> Result<Self> {
        check_linear("ColumnParallelLinear::from_local", &weight, bias.as_ref())?;
        Ok(ColumnParallelLinear {
            weight: Param::sharded(weight, 1),
            bias: bias.map(|b| Param::sharded(b, 0)),
            fused: true,
        })
    }

    /// With `false`, the unfused baselines run instead of the fused kernels (all_gather, then a
    /// local product; a local product, then reduce_scatter): the same results, for comparison.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::Tensor;
    /// let fc = ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[4, 2]), None)?.fused(false);
    /// assert!(!fc.is_fused());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn fused(mut self, fused: bool) -> Self {
        self.fused = fused;
        self
    }

    /// Whether the fused kernels run (the default).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::Tensor;
    /// assert!(ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[4, 2]), None)?.is_fused());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn is_fused(&self) -> bool {
        self.fused
    }

    /// The weight: this rank's columns `[in, out_r]`, and their gradient.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::Tensor;
    /// let fc = ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[4, 2]), None)?;
    /// assert_eq!(fc.weight().value().shape(), &[4, 2]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn weight(&self) -> &Param<T> {
        &self.weight
    }

    /// The bias, if any: this rank's part `[out_r]`, and its gradient.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::Tensor;
    /// let fc = ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[4, 2]), None)?;
    /// assert!(fc.bias().is_none());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn bias(&self) -> Option<&Param<T>> {
        self.bias.as_ref()
    }

    /// Inputs per row (`in`).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::Tensor;
    /// assert_eq!(ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[4, 2]), None)?.in_features(), 4);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn in_features(&self) -> usize {
        self.weight.value().shape()[0]
    }

    /// `x @ W_r + b_r` for `x: [..., in]` sharded on a leading dimension: `[..., out_r]`, every
    /// row, `Shard` on its last dimension. Returns what the backward pass needs too. Collective.
    ///
    /// # Errors
    /// As [`DistTensor::all_gather_matmul_keep_input`]: on every rank, when `x` is not sharded
    /// on a leading dimension or its last dimension is not `in`.
    ///
    /// # Examples
    /// See [`ColumnParallelLinear`].
    pub fn forward<'r>(
        &self,
        x: &DistTensor<'r, T>,
    ) -> Result<(DistTensor<'r, T>, ColumnParallelSaved<'r, T>)> {
        let (y, recorded) = Recorded::forward([x], |[x]| self.forward_var(x))?;
        Ok((y, ColumnParallelSaved { recorded }))
    }

    /// The forward pass without keeping anything for a backward pass (inference): the plain
    /// fused `all_gather_matmul`. Collective.
    ///
    /// # Errors
    /// As [`ColumnParallelLinear::forward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
    /// let (x, w) = (Tensor::<f32>::random(&[3, 2], 1), Tensor::<f32>::random(&[2, 4], 2));
    /// World::threads(2)?.run(|rank| {
    ///     let fc = ColumnParallelLinear::from_global(rank, &w, None, Split::Even)?;
    ///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
    ///     assert_eq!(fc.infer(&xs)?.local(), fc.forward(&xs)?.0.local());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn infer<'r>(&self, x: &DistTensor<'r, T>) -> Result<DistTensor<'r, T>> {
        self.add_bias(self.infer_product(x)?)
    }

    /// [`ColumnParallelLinear::infer`] without the bias: `x @ W_r`.
    pub(crate) fn infer_product<'r>(&self, x: &DistTensor<'r, T>) -> Result<DistTensor<'r, T>> {
        let opts = MatmulOptions::new().unfused(!self.fused);
        Ok(x.all_gather_matmul_with(&[self.weight.value()], &opts)?.remove(0))
    }

    /// The forward pass on autograd: `x @ W_r + b_r` as [`ColumnParallelLinear::forward`]
    /// computes it (one fused `all_gather_matmul`, or the unfused baselines after
    /// [`fused(false)`](ColumnParallelLinear::fused)), recording its dual, so that a `backward()`
    /// through the result reaches `x` and adds to this layer's gradients. Collective.
    ///
    /// # Errors
    /// As [`DVar::all_gather_matmul`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::DVar;
    /// use dist_tensor::nn::ColumnParallelLinear;
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f64>::random(&[5, 4], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let fc = ColumnParallelLinear::<f64>::new(rank, 4, 6, true, 3)?;
    ///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
    ///     let y = fc.forward_var(&DVar::constant(xs.clone()))?;
    ///     assert_eq!(y.value().local(), fc.forward(&xs)?.0.local());
    ///     y.local().sum().backward()?; // collective
    ///     assert!(fc.weight().grad().is_some() && fc.bias().unwrap().grad().is_some());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn forward_var<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let h = self.product_var(x)?;
        match &self.bias {
            Some(b) => {
                let b = b.var();
                h.map(|h| Ok(h + &b))
            }
            None => Ok(h),
        }
    }

    /// [`ColumnParallelLinear::forward_var`] without the bias: `x @ W_r` (for a caller that
    /// adds the bias with what follows, as [`ParallelMlp`](super::ParallelMlp) adds it with the
    /// activation).
    pub(crate) fn product_var<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        x.all_gather_matmul_fused(&self.weight.var(), self.fused)
    }

    fn add_bias<'r>(&self, y: DistTensor<'r, T>) -> Result<DistTensor<'r, T>> {
        match &self.bias {
            Some(b) => y.map_local(|t| t + b.value()),
            None => Ok(y),
        }
    }

    /// The backward pass: given `dy`, the gradient of the loss with respect to this layer's
    /// output (`[..., out_r]`, every row, `Shard` on its last dimension, as the output was),
    /// returns the gradient with respect to the input (`[..., in]`, its rows split as the
    /// input's were) and adds the weight's and bias's gradients to theirs. Collective.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `dy` is not laid out as the output was; as
    /// [`DistTensor::matmul_reduce_scatter_with`].
    ///
    /// # Examples
    /// See [`ColumnParallelLinear`].
    pub fn backward<'r>(
        &mut self,
        saved: ColumnParallelSaved<'r, T>,
        dy: &DistTensor<'r, T>,
    ) -> Result<DistTensor<'r, T>> {
        let mut dx = saved.recorded.backward("ColumnParallelLinear::backward", &*self, dy)?;
        Ok(dx.remove(0))
    }

    /// [`ColumnParallelLinear::backward`], telling `hook` of each parameter's gradient as soon as it is
    /// complete ([`GradHook`]: data parallelism's buckets send it while the rest of the pass
    /// runs). The same gradients, bit for bit. Collective.
    ///
    /// # Errors
    /// As [`ColumnParallelLinear::backward`]; the hook's error.
    ///
    /// # Examples
    /// See [`GradHook`].
    pub fn backward_hooked<'r>(
        &mut self,
        saved: ColumnParallelSaved<'r, T>,
        dy: &DistTensor<'r, T>,
        hook: &mut impl GradHook<T>,
    ) -> Result<DistTensor<'r, T>> {
        let mut dx = saved.recorded.backward_hooked(
            "ColumnParallelLinear::backward",
            &*self,
            dy,
            Some(hook),
        )?;
        Ok(dx.remove(0))
    }
}

crate::impl_module!(ColumnParallelLinear<T> { weight, bias });

/// Checks that a weight is 2-D and a bias, if any, `[columns]`.
pub(super) fn check_linear<T: Element>(
    op: &'static str,
    weight: &Tensor<T>,
    bias: Option<&Tensor<T>>,
) -> Result<()> {
    if weight.ndim() != 2 {
        return Err(Error::InvalidShape {
            op,
            reason: format!(
                "the weight is {:?}; a linear layer's weight is [in, out]",
                weight.shape()
            ),
        });
    }
    match bias {
        Some(b) if b.shape() != [weight.shape()[1]] => Err(Error::InvalidShape {
            op,
            reason: format!(
                "the bias is {:?}; a weight of {:?} takes a bias of [{}]",
                b.shape(),
                weight.shape(),
                weight.shape()[1]
            ),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Placement, World};

    /// The weight's gradient (and the bias's) is complete, and the hook told, before the pass
    /// computes the input gradient (its exchange and product), which data parallelism's
    /// all-reduce of the weight then runs beside.
    #[test]
    fn the_weight_is_told_before_the_input_gradient_is_computed() {
        let (x, w) = (Tensor::<f64>::random(&[7, 5], 1), Tensor::<f64>::random(&[5, 9], 2));
        let b = Tensor::<f64>::random(&[9], 3);
        let seen = World::threads(3)
            .unwrap()
            .run(|rank| {
                let mut fc = ColumnParallelLinear::from_global(rank, &w, Some(&b), Split::Even)?;
                let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
                let (y, saved) = fc.forward(&xs)?;
                let probe = saved.recorded.clone(); // shares the record
                let mut seen = Vec::new();
                fc.backward_hooked(saved, &y, &mut |index: usize, _: &Tensor<f64>| {
                    seen.push((index, probe.input_grad(0).is_some()));
                    Ok(())
                })?;
                seen.push((usize::MAX, probe.input_grad(0).is_some()));
                Ok(seen)
            })
            .unwrap();
        for (r, seen) in seen.into_iter().enumerate() {
            // (parameter, whether the input gradient existed when it was told); then after.
            assert_eq!(seen, vec![(1, false), (0, false), (usize::MAX, true)], "rank {r}");
        }
    }
}
