//! [`UlyssesSelfAttention`]: the attention layer of a transformer with the sequence sharded, its
//! projections and its backward pass.

use ndarray::{Array3, ArrayView4, ArrayViewMut4, Axis, Ix5};

use super::{UlyssesAttention, check_sequence, local, resplit, view4, view4_mut};
use crate::autograd::{DVar, Var};
use crate::collectives;
use crate::dist::{DistTensor, Placement};
use crate::nn::{Param, Parameters, linear_init, rows_matmul, weight_grad};
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

/// Self-attention with the sequence sharded (DeepSpeed-Ulysses), with its projections:
/// `y = attention(x W_q, x W_k, x W_v) W_o` for `x: [B, s_r, E]` (`Shard(1)`), `H` heads of
/// `D = E / H`. The weights are replicated: every rank projects its own tokens with all of them.
///
/// - **forward**: one local product `x @ W_qkv` (`W_qkv = [W_q | W_k | W_v]`, `[E, 3E]`) gives
///   q, k and v packed as `[B, s_r, 3, H, D]`; *one* `all_to_all` trades the sequence for heads
///   for all three (`[B, S, 3, h_r, D]`); each rank attends its heads over the whole sequence
///   (q, k, v read in place from the packed tensor); one `all_to_all` brings the output back to
///   `[B, s_r, H, D]`, and a local product with `W_o` ends it.
/// - **backward**: the same exchanges the other way round (the output gradient to heads; the
///   packed gradients of q, k and v back to sequence shards in one `all_to_all`); the input
///   gradient `dqkv @ W_qkv^T` with the weight read transposed in place; the weight gradients
///   from this rank's tokens, summed over the ranks in one `all_reduce` (rank order: equal on
///   every rank, bit for bit).
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Parameters, UlyssesSelfAttention};
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

/// What [`UlyssesSelfAttention::forward`] keeps for its backward pass: its input, the packed q,
/// k and v of this rank's heads, each row's log-sum-exp, the attention output (the input of
/// `W_o`), and the input's sequence split.
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
///     assert_eq!(saved.packed_heads().shape(), &[2, 5, 3, 1, 4]); // one head of q, k, v each
///     let dx = attn.backward(saved, &y)?;
///     assert_eq!(dx.shard_sizes(), xs.shard_sizes());
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SelfAttentionSaved<T: Element> {
    x: Tensor<T>,
    heads: Tensor<T>,
    head_splits: Vec<usize>,
    lse: Array3<T::Acc>,
    ctx: Tensor<T>,
    sizes: Vec<usize>,
}

impl<T: Element> SelfAttentionSaved<T> {
    /// This rank's heads of q, k and v over the whole sequence, packed: `[B, S, 3, h_r, D]`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesSelfAttention;
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f32>::random(&[1, 5, 6], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let attn = UlyssesSelfAttention::<f32>::new(6, 3, false, 1)?;
    ///     let (_, saved) = attn.forward(&DistTensor::from_global(rank, &x, Placement::Shard(1))?)?;
    ///     assert_eq!(saved.packed_heads().shape(), &[1, 5, 3, 2 - rank.rank(), 2]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn packed_heads(&self) -> &Tensor<T> {
        &self.heads
    }
}

/// The q, k and v parts of a packed `[B, S, 3, h, D]` view.
fn unpack<'a, T>(packed: ndarray::ArrayView5<'a, T>) -> [ArrayView4<'a, T>; 3] {
    [0, 1, 2].map(|i| packed.index_axis_move(Axis(2), i))
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
    ) -> Result<(DistTensor<'r, T>, SelfAttentionSaved<T>)> {
        let ([b, s, e], d) = self.dims("UlyssesSelfAttention::forward", x)?;
        let (heads, threads) = (self.heads, x.rank().topology().aicore_num());
        let wqkv = self.wqkv.value().view2("wqkv")?;
        let qkv = x.try_map_local(|t| rows_matmul(t, wqkv, threads))?;
        // One exchange for q, k and v: [B, s_r, 3, H, D] -> [B, S, 3, h_r, D].
        let packed = qkv.reshape(&[b, s, 3, heads, d])?.all_to_all(3, 1)?;
        let view = packed.local().view().into_dimensionality::<Ix5>().expect("5-D");
        let [q, k, v] = unpack(view);
        let mut ctx = Tensor::<T>::try_zeros(q.shape())?;
        let scale = self.attention.scale_for(d);
        let lse = local::forward(q, k, v, self.attention.is_causal(), scale, view4_mut(&mut ctx))?;
        let head_splits = packed.shard_sizes().to_vec();
        let ctx = DistTensor::new(
            x.rank(),
            ctx,
            Placement::Shard(2),
            vec![b, s, heads, d],
            head_splits.clone(),
        );
        let ctx = resplit(ctx.all_to_all(1, 2)?, x.shard_sizes())?.reshape(&[b, s, e])?;
        let wo = self.wo.value().view2("wo")?;
        let y = ctx.try_map_local(|t| rows_matmul(t, wo, threads))?;
        let saved = SelfAttentionSaved {
            x: x.local().clone(),
            heads: packed.into_local(),
            head_splits,
            lse,
            ctx: ctx.into_local(),
            sizes: x.shard_sizes().to_vec(),
        };
        Ok((y, saved))
    }

    /// The backward pass: given `dy` (`[B, s_r, E]`, split as the output), the gradient with
    /// respect to `x`; adds the weights' gradients (summed over the ranks) to theirs.
    /// Collective.
    ///
    /// # Errors
    /// As [`UlyssesSelfAttention::forward`]; [`Error::InvalidShape`] when `dy`'s part is not the
    /// shape of the saved input's.
    ///
    /// # Examples
    /// See [`UlyssesSelfAttention`].
    pub fn backward<'r>(
        &mut self,
        saved: SelfAttentionSaved<T>,
        dy: &DistTensor<'r, T>,
    ) -> Result<DistTensor<'r, T>> {
        const OP: &str = "UlyssesSelfAttention::backward";
        let ([b, s, e], d) = self.dims(OP, dy)?;
        if dy.local().shape() != saved.x.shape() {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!(
                    "the output gradient's part is {:?}, the input's was {:?}",
                    dy.local().shape(),
                    saved.x.shape()
                ),
            });
        }
        let (heads, threads, rank) = (self.heads, dy.rank().topology().aicore_num(), dy.rank());
        let dwo = weight_grad(&saved.ctx, dy.local(), threads)?;
        let wo_t = self.wo.value().view2("wo")?.reversed_axes();
        let dctx =
            dy.try_map_local(|t| rows_matmul(t, wo_t, threads))?.reshape(&[b, s, heads, d])?;
        let dctx = dctx.all_to_all(2, 1)?; // [B, S, h_r, D]
        let mut dpacked = Tensor::<T>::try_zeros(saved.heads.shape())?;
        {
            let packed = saved.heads.view().into_dimensionality::<Ix5>().expect("5-D");
            let [q, k, v] = unpack(packed);
            let grads = dpacked.view_mut().into_dimensionality::<Ix5>().expect("5-D");
            let (dq, rest) = grads.split_at(Axis(2), 1);
            let (dk, dv) = rest.split_at(Axis(2), 1);
            let grads: (ArrayViewMut4<'_, T>, _, _) = (
                dq.index_axis_move(Axis(2), 0),
                dk.index_axis_move(Axis(2), 0),
                dv.index_axis_move(Axis(2), 0),
            );
            let scale = self.attention.scale_for(d);
            let causal = self.attention.is_causal();
            local::backward(q, k, v, &saved.lse, view4(dctx.local()), causal, scale, grads)?;
        }
        let dpacked = DistTensor::new(
            rank,
            dpacked,
            Placement::Shard(3),
            vec![b, s, 3, heads, d],
            saved.head_splits,
        );
        let dqkv = resplit(dpacked.all_to_all(1, 3)?, &saved.sizes)?.reshape(&[b, s, 3 * e])?;
        let dwqkv = weight_grad(&saved.x, dqkv.local(), threads)?;
        let wqkv_t = self.wqkv.value().view2("wqkv")?.reversed_axes();
        let dx = dqkv.try_map_local(|t| rows_matmul(t, wqkv_t, threads))?;
        // The weights are replicated: their gradients add up over the ranks' tokens.
        let mut both = dwqkv.as_slice().to_vec();
        both.extend_from_slice(dwo.as_slice());
        let summed = collectives::all_reduce(rank, &both)?;
        let (sum_qkv, sum_o) = summed.split_at(dwqkv.len());
        self.wqkv.accumulate_grad(Tensor::from_shape_vec(dwqkv.shape(), sum_qkv.to_vec())?)?;
        self.wo.accumulate_grad(Tensor::from_shape_vec(dwo.shape(), sum_o.to_vec())?)?;
        Ok(dx)
    }

    /// The forward pass on autograd: the projections as local products of this rank's tokens,
    /// q, k and v each traded for heads by an `all_to_all` (three exchanges where
    /// [`UlyssesSelfAttention::forward`] packs them in one), the fused
    /// [`scaled_dot_product_attention`](Var::scaled_dot_product_attention), the exchange back and
    /// the output projection, each recording its backward. The weights' gradients are this
    /// rank's tokens' parts: sum them with [`sync_grads`](crate::autograd::sync_grads).
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
    ///     let want = attn.forward(&xs)?.0;
    ///     let err = (y.value().local() - want.local()).as_slice().iter().fold(0.0f64, |m, d| m.max(d.abs()));
    ///     assert!(err < 1e-12, "{err}");
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn forward_var<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let ([b, s, e], d) = self.dims("UlyssesSelfAttention::forward_var", x.value())?;
        let heads = self.heads;
        let s_r = x.local().shape()[1];
        let wqkv = self.wqkv.var();
        // This rank's tokens times `w`, `[B, s_r, E]`, as heads `[B, S, h_r, D]`.
        let project = |w: &Var<'r, T>| -> Result<DVar<'r, T>> {
            x.map(|x| x.reshape(&[b * s_r, e])?.matmul(w)?.reshape(&[b, s_r, e]))?
                .reshape(&[b, s, heads, d])?
                .all_to_all(2, 1)
        };
        let [q, k, v] = [0, 1, 2].map(|i| wqkv.narrow(1, i * e, e).and_then(|w| project(&w)));
        let (q, k, v) = (q?, k?, v?);
        let causal = self.attention.is_causal();
        let heads_first = |t: &Var<'r, T>| t.permute(&[0, 2, 1, 3]);
        let o = q.map(|q| {
            heads_first(q)?
                .scaled_dot_product_attention(
                    &heads_first(k.local())?,
                    &heads_first(v.local())?,
                    causal,
                )?
                .permute(&[0, 2, 1, 3])
        })?;
        let o = o.all_to_all(1, 2)?.reshape(&[b, s, e])?;
        let wo = self.wo.var();
        let rows = o.local().shape()[1];
        o.map(|o| o.reshape(&[b * rows, e])?.matmul(&wo)?.reshape(&[b, rows, e]))
    }
}

impl<T: Element> Parameters<T> for UlyssesSelfAttention<T> {
    fn parameters(&self) -> Vec<&Param<T>> {
        vec![&self.wqkv, &self.wo]
    }

    fn parameters_mut(&mut self) -> Vec<&mut Param<T>> {
        vec![&mut self.wqkv, &mut self.wo]
    }
}
