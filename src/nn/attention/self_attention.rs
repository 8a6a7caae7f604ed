//! [`UlyssesSelfAttention`]: the attention layer of a transformer with the sequence sharded, its
//! projections and its backward pass.

use super::{UlyssesAttention, check_sequence};
use crate::autograd::{DVar, Var};
use crate::dist_tensor::DistTensor;
use crate::nn::recorded::Recorded;
use crate::nn::{GradHook, Param, linear_init};
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

/// Self-attention with the sequence sharded (DeepSpeed-Ulysses), with its projections:
/// `y = attention(x W_q, x W_k, x W_v) W_o` for `x: [B, s_r, E]` (`Shard(1)`), `H` heads of
/// `D = E / H`. The weights are replicated: every rank projects its own tokens with all of them.
///
/// - **forward**: local products of this rank's tokens with `W_q`, `W_k` and `W_v` (the
///   three side by side in `W_qkv`, `[E, 3E]`) give q, k and v as `[B, s_r, H, D]`;
///   [`UlyssesAttention`] trades each for heads, attends and brings the output back to
///   `[B, s_r, H, D]`; a local product with `W_o` ends it.
/// - **backward**: the same exchanges the other way round; the weight gradients from this
///   rank's tokens, summed over the ranks (the weights are replicated), so that they are
///   complete and equal on every rank.
///
/// `forward` records the pass on autograd ([`UlyssesSelfAttention::forward_var`] on a tracked
/// copy of `x`) and `backward` runs that record backward.
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Module, UlyssesSelfAttention};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
///
/// let x = Tensor::<f64>::random(&[2, 9, 8], 1); // [B, S, E]
/// let run = |world: usize| World::threads(world)?.run(|rank| {
///     let mut attn = UlyssesSelfAttention::<f64>::new(8, 4, true, 3)?; // 4 heads of 2
///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
///     let (y, saved) = attn.forward(&xs)?;
///     let dx = attn.backward(saved, &y)?; // the gradients of sum(y^2) / 2
///     Ok((y.to_global()?, dx.to_global()?, attn.parameters()[0].grad().unwrap().clone()))
/// });
/// let (one, three) = (run(1)?, run(3)?);
/// let close = |a: &Tensor<f64>, b: &Tensor<f64>| (a - b).as_slice().iter().all(|d| d.abs() < 1e-12);
/// assert!(close(&one[0].0, &three[0].0) && close(&one[0].1, &three[0].1));
/// assert!(close(&one[0].2, &three[2].2)); // the weight gradient, the same on every rank
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct UlyssesSelfAttention<T: Element> {
    wqkv: Param<T>,
    wo: Param<T>,
    heads: usize,
    attention: UlyssesAttention,
}

/// What [`UlyssesSelfAttention::forward`] keeps for its backward pass: the pass recorded on
/// autograd (its input, this rank's heads of q, k and v, each row's log-sum-exp, the attention
/// output that is the input of `W_o`, and the input's sequence split). It borrows the rank, as
/// the forward's output does. Consumed by the backward pass; a clone shares the record, which
/// runs backward once.
///
/// # Examples
/// ```
/// use dist_tensor::nn::UlyssesSelfAttention;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let x = Tensor::<f32>::random(&[2, 5, 8], 1);
/// World::threads(2)?.run(|rank| {
///     let mut attn = UlyssesSelfAttention::<f32>::new(8, 2, true, 1)?;
///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
///     let (y, saved) = attn.forward(&xs)?;
///     let dx = attn.backward(saved, &y)?;
///     assert_eq!(dx.shard_sizes(), xs.shard_sizes());
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SelfAttentionSaved<'r, T: Element> {
    recorded: Recorded<'r, T>,
}

impl<T: Element> UlyssesSelfAttention<T> {
    /// A layer of width `embed` with `heads` heads (`embed / heads` wide), causal or not, its
    /// weights initialised as PyTorch's `nn.Linear` (uniform in `+-1/sqrt(embed)`) from `seed`
    /// (`W_o` from `seed + 2`): the same on every rank.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `heads` divides `embed`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesSelfAttention;
    /// assert_eq!(UlyssesSelfAttention::<f32>::new(16, 4, true, 1)?.heads(), 4);
    /// assert!(UlyssesSelfAttention::<f32>::new(16, 5, true, 1).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn new(embed: usize, heads: usize, causal: bool, seed: u64) -> Result<Self> {
        let (wqkv, _) = linear_init(embed, 3 * embed, false, seed)?;
        let (wo, _) = linear_init(embed, embed, false, seed.wrapping_add(2))?;
        Self::from_weights(wqkv, wo, heads, causal)
    }

    /// A layer of these weights: `wqkv: [E, 3E]` (the q, k and v projections side by side, each
    /// `H` heads of `D` columns) and `wo: [E, E]`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the shapes are not those; [`Error::InvalidArgument`] unless
    /// `heads` divides `E`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesSelfAttention;
    /// use dist_tensor::Tensor;
    /// let (wqkv, wo) = (Tensor::<f32>::random(&[8, 24], 1), Tensor::<f32>::random(&[8, 8], 2));
    /// assert!(UlyssesSelfAttention::from_weights(wqkv.clone(), wo.clone(), 2, false).is_ok());
    /// assert!(UlyssesSelfAttention::from_weights(wo, wqkv, 2, false).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_weights(
        wqkv: Tensor<T>,
        wo: Tensor<T>,
        heads: usize,
        causal: bool,
    ) -> Result<Self> {
        const OP: &str = "UlyssesSelfAttention::from_weights";
        let embed = wo.shape().first().copied().unwrap_or(0);
        if wqkv.shape() != [embed, 3 * embed] || wo.shape() != [embed, embed] {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!(
                    "wqkv is {:?} and wo {:?}; they must be [E, 3E] and [E, E]",
                    wqkv.shape(),
                    wo.shape()
                ),
            });
        }
        if heads == 0 || embed % heads != 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                rank: 0,
                reason: format!("{heads} heads do not divide the width {embed}"),
            });
        }
        let attention = UlyssesAttention::new(causal);
        Ok(UlyssesSelfAttention { wqkv: Param::new(wqkv), wo: Param::new(wo), heads, attention })
    }

    /// The number of heads.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesSelfAttention;
    /// assert_eq!(UlyssesSelfAttention::<f64>::new(6, 3, false, 1)?.heads(), 3);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// The packed projection `W_qkv: [E, 3E]` and its gradient.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesSelfAttention;
    /// assert_eq!(UlyssesSelfAttention::<f64>::new(6, 3, false, 1)?.wqkv().value().shape(), &[6, 18]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn wqkv(&self) -> &Param<T> {
        &self.wqkv
    }

    /// The output projection `W_o: [E, E]` and its gradient.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesSelfAttention;
    /// assert_eq!(UlyssesSelfAttention::<f64>::new(6, 3, false, 1)?.wo().value().shape(), &[6, 6]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn wo(&self) -> &Param<T> {
        &self.wo
    }

    /// The shape `[B, S, E]` of `x` and the width per head, checked against the weights.
    fn dims(&self, op: &'static str, x: &DistTensor<'_, T>) -> Result<([usize; 3], usize)> {
        check_sequence(op, "x", x, 3)?;
        let g = x.global_dims();
        let embed = self.wo.value().shape()[0];
        if g[2] != embed {
            return Err(Error::InnerDimMismatch {
                op,
                rank: x.rank().rank(),
                left: g.to_vec(),
                right: self.wqkv.value().shape().to_vec(),
                left_global: None,
            });
        }
        Ok(([g[0], g[1], g[2]], embed / self.heads))
    }

    /// Self-attention of `x: [B, s_r, E]` (`Shard(1)`): `[B, s_r, E]`, split as `x`, and what
    /// the backward pass needs. Collective.
    ///
    /// # Errors
    /// [`Error::UnsupportedPlacement`] unless `x` is 3-D and `Shard(1)`;
    /// [`Error::InnerDimMismatch`] when its width is not the weights'; and as
    /// [`DistTensor::all_to_all`].
    ///
    /// # Examples
    /// See [`UlyssesSelfAttention`].
    pub fn forward<'r>(
        &self,
        x: &DistTensor<'r, T>,
    ) -> Result<(DistTensor<'r, T>, SelfAttentionSaved<'r, T>)> {
        self.dims("UlyssesSelfAttention::forward", x)?;
        let (y, recorded) = Recorded::forward([x], |[x]| self.forward_var(x))?;
        Ok((y, SelfAttentionSaved { recorded }))
    }

    /// The backward pass: given `dy` (`[B, s_r, E]`, split as the output), the gradient with
    /// respect to `x`; adds the weights' gradients (summed over the ranks) to theirs.
    /// Collective.
    ///
    /// # Errors
    /// As [`UlyssesSelfAttention::forward`]; [`Error::InvalidShape`] when `dy` is not laid out
    /// as the output was.
    ///
    /// # Examples
    /// See [`UlyssesSelfAttention`].
    pub fn backward<'r>(
        &mut self,
        saved: SelfAttentionSaved<'r, T>,
        dy: &DistTensor<'r, T>,
    ) -> Result<DistTensor<'r, T>> {
        const OP: &str = "UlyssesSelfAttention::backward";
        self.dims(OP, dy)?;
        let mut dx = saved.recorded.backward(OP, &*self, dy)?;
        Ok(dx.remove(0))
    }

    /// [`UlyssesSelfAttention::backward`], telling `hook` of each weight's gradient once it is
    /// complete ([`GradHook`]): the projections are replicated, so each is told once its parts
    /// are summed over the ranks, at the end of the pass. The same gradients, bit for bit.
    /// Collective.
    ///
    /// # Errors
    /// As [`UlyssesSelfAttention::backward`]; the hook's error.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Module, UlyssesSelfAttention};
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f64>::random(&[1, 6, 8], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let mut attn = UlyssesSelfAttention::<f64>::new(8, 2, false, 5)?;
    ///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
    ///     let (y, saved) = attn.forward(&xs)?;
    ///     let mut told = Vec::new();
    ///     attn.backward_hooked(saved, &y, &mut |i: usize, _: &Tensor<f64>| {
    ///         told.push(i);
    ///         Ok(())
    ///     })?;
    ///     assert_eq!(told, (0..attn.parameters().len()).collect::<Vec<_>>());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn backward_hooked<'r>(
        &mut self,
        saved: SelfAttentionSaved<'r, T>,
        dy: &DistTensor<'r, T>,
        hook: &mut impl GradHook<T>,
    ) -> Result<DistTensor<'r, T>> {
        const OP: &str = "UlyssesSelfAttention::backward";
        self.dims(OP, dy)?;
        let mut dx = saved.recorded.backward_hooked(OP, &*self, dy, Some(hook))?;
        Ok(dx.remove(0))
    }

    /// The forward pass on autograd: the projections as local products of this rank's tokens,
    /// q, k and v each traded for heads by an `all_to_all`, the fused
    /// [`scaled_dot_product_attention`](Var::scaled_dot_product_attention), the exchange back and
    /// the output projection (as [`UlyssesAttention::forward_var`] between them), each recording
    /// its backward. The weights' gradients are this rank's tokens' parts: sum them with
    /// [`sync_grads`](crate::nn::sync_grads) ([`UlyssesSelfAttention::backward`] does).
    /// Collective.
    ///
    /// # Errors
    /// As [`UlyssesSelfAttention::forward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::DVar;
    /// use dist_tensor::nn::UlyssesSelfAttention;
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f64>::random(&[1, 6, 8], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let attn = UlyssesSelfAttention::<f64>::new(8, 2, true, 5)?;
    ///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
    ///     let y = attn.forward_var(&DVar::constant(xs.clone()))?;
    ///     assert_eq!(y.value().local(), attn.forward(&xs)?.0.local());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn forward_var<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let ([b, s, e], d) = self.dims("UlyssesSelfAttention::forward_var", x.value())?;
        let heads = self.heads;
        let s_r = x.local().shape()[1];
        let wqkv = self.wqkv.var();
        // This rank's tokens times `w`, `[B, s_r, E]`, as heads `[B, s_r, H, D]`.
        let project = |w: &Var<'r, T>| -> Result<DVar<'r, T>> {
            x.map(|x| x.reshape(&[b * s_r, e])?.matmul(w)?.reshape(&[b, s_r, e]))?
                .reshape(&[b, s, heads, d])
        };
        let [q, k, v] = [0, 1, 2].map(|i| wqkv.narrow(1, i * e, e).and_then(|w| project(&w)));
        let o = self.attention.forward_var(&q?, &k?, &v?)?.reshape(&[b, s, e])?;
        let wo = self.wo.var();
        o.map(|o| o.reshape(&[b * s_r, e])?.matmul(&wo)?.reshape(&[b, s_r, e]))
    }
}

crate::impl_module!(UlyssesSelfAttention<T> { wqkv, wo });
