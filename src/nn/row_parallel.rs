//! [`RowParallelLinear`]: `y = h @ W + b` with `W` split by rows, output sharded by rows.

use super::column_parallel::check_linear;
use super::recorded::Recorded;
use super::{GradHook, Param};
use crate::Result;
use crate::autograd::DVar;
use crate::dist_tensor::{DistTensor, MatmulOptions, Split};
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};

/// A linear layer `y = h @ W + b` whose weight `W: [in, out]` is split by rows, in the
/// sequence-parallel arrangement: the input `h: [..., in_r]` has every row and this rank's
/// columns (the output of a [`ColumnParallelLinear`](super::ColumnParallelLinear), through an
/// elementwise activation), and the output `[..., out]` is summed over the ranks and sharded on a
/// leading dimension again: by default exactly as the block's input was (see
/// [`DistTensor::matmul_reduce_scatter`]). The bias `b: [out]` is replicated.
///
/// - **forward**: one fused `matmul_reduce_scatter`; it keeps its input `h` (this rank's own, no
///   copy) for the weight gradient.
/// - **backward**: the input gradient `dh = all_gather(dy) @ W_r^T` through the dual fused op,
///   `all_gather_matmul`, with `W_r` read transposed; the fused op also hands back the
///   gathered `dY`, from which the weight gradient `h^T @ dY` follows locally, with no second
///   gather. The bias gradient, `dy` summed over this rank's rows, is summed over the ranks
///   (one small all-reduce): complete, the same on every rank.
///
/// `forward` records the pass on autograd ([`RowParallelLinear::forward_var`] on a tracked copy
/// of `h`) and `backward` runs that record backward: the two forms are one computation.
///
/// # Examples
/// ```
/// use dist_tensor::nn::RowParallelLinear;
/// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
///
/// let (h, w, b) = (Tensor::<f64>::random(&[5, 6], 1), Tensor::<f64>::random(&[6, 4], 2), Tensor::random(&[4], 3));
/// let dy = Tensor::<f64>::random(&[5, 4], 4);
/// let outs = World::threads(3)?.run(|rank| {
///     let mut fc = RowParallelLinear::from_global(rank, &w, Some(&b), Split::Even)?;
///     let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?; // every row, 2 columns each
///     let (y, saved) = fc.forward(&hs)?; // [m_r, 4], summed over the ranks
///     let dh = fc.backward(saved, &DistTensor::from_global(rank, &dy, Placement::Shard(0))?)?;
///     let dw = DistTensor::from_local(rank, fc.weight().grad().unwrap().clone(), Placement::Shard(0))?;
///     Ok((y.to_global()?, dh.to_global()?, dw.to_global()?, fc.bias().unwrap().grad().unwrap().clone()))
/// })?;
/// let (y, dh, dw, db) = &outs[0];
/// let close = |a: &Tensor<f64>, b: Tensor<f64>| (a - &b).as_slice().iter().all(|d| d.abs() < 1e-12);
/// assert!(close(y, &h.matmul(&w)? + &b));
/// assert!(close(dh, dy.matmul(&w.transpose(0, 1)?)?));
/// assert!(close(dw, h.transpose(0, 1)?.matmul(&dy)?));
/// assert!(close(db, dy.sum_axis(0)?));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RowParallelLinear<T: Element> {
    weight: Param<T>,
    bias: Option<Param<T>>,
    fused: bool,
}

/// What [`RowParallelLinear::forward`] keeps for its backward pass: the pass recorded on
/// autograd, with its input (this rank's columns of every row; shared with the caller's tensor,
/// not copied). It borrows the rank, as the forward's output does. Consumed by the backward
/// pass; a clone shares the record, which runs backward once.
///
/// # Examples
/// ```
/// use dist_tensor::nn::RowParallelLinear;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let h = Tensor::<f32>::random(&[5, 6], 1);
/// World::threads(2)?.run(|rank| {
///     let mut fc = RowParallelLinear::<f32>::new(rank, 6, 4, false, 1)?;
///     let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
///     let (y, saved) = fc.forward(&hs)?;
///     let dh = fc.backward(saved, &y)?; // laid out as the input was
///     assert_eq!(dh.local().shape(), hs.local().shape());
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RowParallelSaved<'r, T: Element> {
    recorded: Recorded<'r, T>,
}

impl<T: Element> RowParallelSaved<'_, T> {
    /// The input `[..., in_r]` the forward pass saw (this rank's part).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
    /// let (h, w) = (Tensor::<f32>::random(&[3, 4], 1), Tensor::<f32>::random(&[4, 2], 2));
    /// World::threads(2)?.run(|rank| {
    ///     let fc = RowParallelLinear::from_global(rank, &w, None, Split::Even)?;
    ///     let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
    ///     assert_eq!(fc.forward(&hs)?.1.input(), hs.local());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn input(&self) -> &Tensor<T> {
        self.recorded.input(0).local()
    }
}

impl<T: Element> RowParallelLinear<T> {
    /// This rank's rows of the whole weight `[in, out]` (cut as `split` says) and the whole bias
    /// `[out]`. Local: every rank passes the same tensors and split, and keeps its own piece.
    ///
    /// # Errors
    /// [`Error::InvalidShape`](crate::Error::InvalidShape) when the weight is not 2-D or the
    /// bias not `[out]`; [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the
    /// split does not fit `in`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::{Tensor, World};
    /// let w = Tensor::<f32>::random(&[10, 3], 1);
    /// let rows = World::threads(2)?.run(|rank| {
    ///     let fc = RowParallelLinear::from_global(rank, &w, None, vec![7, 3])?;
    ///     Ok(fc.weight().value().shape()[0])
    /// })?;
    /// assert_eq!(rows, vec![7, 3]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_global(
        rank: &Rank<'_>,
        weight: &Tensor<T>,
        bias: Option<&Tensor<T>>,
        split: impl Into<Split>,
    ) -> Result<Self> {
        check_linear("RowParallelLinear::from_global", weight, bias)?;
        let rows = DistTensor::from_global_split(rank, weight, 0, split)?.into_local();
        // The bias whole on every rank, where the world computes (its GPU in a GPU world).
        let bias = match bias {
            Some(b) => Some(DistTensor::from_global(rank, b, crate::Placement::Replicate)?),
            None => None,
        };
        Self::from_local(rows, bias.map(DistTensor::into_local))
    }

    /// A layer of `in_features` inputs (split evenly) and `out_features` outputs initialised as
    /// PyTorch's `nn.Linear` is, uniform in `+-1/sqrt(in_features)`, from `seed`: the same whole
    /// weight on every rank, each keeping its rows.
    ///
    /// # Errors
    /// As [`RowParallelLinear::from_global`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let fc = RowParallelLinear::<f32>::new(rank, 9, 4, true, 7)?;
    ///     assert_eq!(fc.weight().value().shape(), &[[5, 4][rank.rank()], 4]);
    ///     assert_eq!(fc.bias().unwrap().value().shape(), &[4]); // whole on every rank
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

    /// A layer from this rank's own rows of the weight, `[in_r, out]`, and the whole bias
    /// `[out]` (the same on every rank).
    ///
    /// # Errors
    /// [`Error::InvalidShape`](crate::Error::InvalidShape) when the weight is not 2-D or the
    /// bias not `[out]`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::Tensor;
    /// let fc = RowParallelLinear::from_local(Tensor::<f32>::zeros(&[3, 5]), Some(Tensor::zeros(&[5])))?;
    /// assert_eq!(fc.out_features(), 5);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_local(weight: Tensor<T>, bias: Option<Tensor<T>>) -> Result<Self> {
        check_linear("RowParallelLinear::from_local", &weight, bias.as_ref())?;
        Ok(RowParallelLinear {
            weight: Param::sharded(weight, 0),
            bias: bias.map(Param::new),
            fused: true,
        })
    }

    /// With `false`, the unfused baselines run instead of the fused kernels: the same results,
    /// for comparison.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::Tensor;
    /// let fc = RowParallelLinear::from_local(Tensor::<f32>::zeros(&[3, 5]), None)?.fused(false);
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
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::Tensor;
    /// assert!(RowParallelLinear::from_local(Tensor::<f32>::zeros(&[3, 5]), None)?.is_fused());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn is_fused(&self) -> bool {
        self.fused
    }

    /// The weight: this rank's rows `[in_r, out]`, and their gradient.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::Tensor;
    /// let fc = RowParallelLinear::from_local(Tensor::<f32>::zeros(&[3, 5]), None)?;
    /// assert_eq!(fc.weight().value().shape(), &[3, 5]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn weight(&self) -> &Param<T> {
        &self.weight
    }

    /// The bias, if any: the whole `[out]`, replicated, and its gradient (equal on every rank).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::Tensor;
    /// let fc = RowParallelLinear::from_local(Tensor::<f32>::zeros(&[3, 5]), Some(Tensor::zeros(&[5])))?;
    /// assert_eq!(fc.bias().unwrap().value().shape(), &[5]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn bias(&self) -> Option<&Param<T>> {
        self.bias.as_ref()
    }

    /// Outputs per row (`out`).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::Tensor;
    /// assert_eq!(RowParallelLinear::from_local(Tensor::<f32>::zeros(&[3, 5]), None)?.out_features(), 5);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn out_features(&self) -> usize {
        self.weight.value().shape()[1]
    }

    /// `sum over ranks of h_r @ W_r, + b` for `h: [..., in_r]` sharded on its last dimension:
    /// `[..., out]`, sharded on a leading dimension as [`DistTensor::matmul_reduce_scatter`]
    /// chooses (the rows the block's input had, when `h` comes from an `all_gather_matmul`
    /// through local updates). Returns what the backward pass needs too. Collective.
    ///
    /// # Errors
    /// As [`DistTensor::matmul_reduce_scatter`].
    ///
    /// # Examples
    /// See [`RowParallelLinear`].
    pub fn forward<'r>(
        &self,
        h: &DistTensor<'r, T>,
    ) -> Result<(DistTensor<'r, T>, RowParallelSaved<'r, T>)> {
        let (y, recorded) = Recorded::forward([h], |[h]| self.forward_var(h))?;
        Ok((y, RowParallelSaved { recorded }))
    }

    /// The forward pass without keeping anything for a backward pass (inference). Collective.
    ///
    /// # Errors
    /// As [`RowParallelLinear::forward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
    /// let (h, w) = (Tensor::<f32>::random(&[3, 4], 1), Tensor::<f32>::random(&[4, 2], 2));
    /// World::threads(2)?.run(|rank| {
    ///     let fc = RowParallelLinear::from_global(rank, &w, None, Split::Even)?;
    ///     let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
    ///     assert_eq!(fc.infer(&hs)?.local(), fc.forward(&hs)?.0.local());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn infer<'r>(&self, h: &DistTensor<'r, T>) -> Result<DistTensor<'r, T>> {
        let opts = MatmulOptions::new().unfused(!self.fused);
        let y = h.matmul_reduce_scatter_with(self.weight.value(), &opts)?;
        match &self.bias {
            Some(b) => y.map_local(|t| t + b.value()),
            None => Ok(y),
        }
    }

    /// The backward pass: given `dy`, the gradient of the loss with respect to this layer's
    /// output (`[..., out]`, sharded as the output was), returns the gradient with respect to
    /// the input (`[..., in_r]`, every row, `Shard` on its last dimension) and adds the weight's
    /// and bias's gradients to theirs. Collective.
    ///
    /// # Errors
    /// [`Error::InvalidShape`](crate::Error::InvalidShape) when `dy` is not laid out as the
    /// output was; as [`DistTensor::all_gather_matmul_keep_input`].
    ///
    /// # Examples
    /// See [`RowParallelLinear`].
    pub fn backward<'r>(
        &mut self,
        saved: RowParallelSaved<'r, T>,
        dy: &DistTensor<'r, T>,
    ) -> Result<DistTensor<'r, T>> {
        let mut dh = saved.recorded.backward("RowParallelLinear::backward", &*self, dy)?;
        Ok(dh.remove(0))
    }

    /// [`RowParallelLinear::backward`], telling `hook` of each parameter's gradient as soon as it is
    /// complete ([`GradHook`]: data parallelism's buckets send it while the rest of the pass
    /// runs). The same gradients, bit for bit. Collective.
    ///
    /// # Errors
    /// As [`RowParallelLinear::backward`]; the hook's error.
    ///
    /// # Examples
    /// See [`GradHook`].
    pub fn backward_hooked<'r>(
        &mut self,
        saved: RowParallelSaved<'r, T>,
        dy: &DistTensor<'r, T>,
        hook: &mut impl GradHook<T>,
    ) -> Result<DistTensor<'r, T>> {
        let mut dh = saved.recorded.backward_hooked(
            "RowParallelLinear::backward",
            &*self,
            dy,
            Some(hook),
        )?;
        Ok(dh.remove(0))
    }

    /// The forward pass on autograd: `reduce_scatter(h @ W_r) + b` as
    /// [`RowParallelLinear::forward`] computes it (one fused `matmul_reduce_scatter`, or the
    /// unfused baselines after [`fused(false)`](RowParallelLinear::fused)), recording its dual.
    /// The bias's gradient is this rank's rows' part: sum it over the
    /// ranks with [`sync_grads`](crate::nn::sync_grads). Collective.
    ///
    /// # Errors
    /// As [`DVar::matmul_reduce_scatter`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::DVar;
    /// use dist_tensor::nn::RowParallelLinear;
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let h = Tensor::<f64>::random(&[5, 6], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let fc = RowParallelLinear::<f64>::new(rank, 6, 4, true, 3)?;
    ///     let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
    ///     let y = fc.forward_var(&DVar::constant(hs.clone()))?;
    ///     assert_eq!(y.value().local(), fc.forward(&hs)?.0.local());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn forward_var<'r>(&self, h: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let y = h.matmul_reduce_scatter_fused(&self.weight.var(), self.fused)?;
        match &self.bias {
            Some(b) => {
                let b = b.var();
                y.map(|y| Ok(y + &b))
            }
            None => Ok(y),
        }
    }
}

crate::impl_module!(RowParallelLinear<T> { weight, bias });
