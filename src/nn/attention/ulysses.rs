//! [`UlyssesAttention`]: attention with the sequence sharded, heads traded for sequence and back.

use super::check_sequence;
use crate::Result;
use crate::autograd::{DVar, Var};
use crate::dist_tensor::DistTensor;
use crate::nn::recorded::Recorded;
use crate::tensor::Element;

/// Softmax attention over a sequence sharded on the ranks (DeepSpeed-Ulysses): `q`, `k`, `v` of
/// `[B, s_r, H, D]` (`Shard(1)`) each go through one `all_to_all(2, 1)` to `[B, S, h_r, D]` (all
/// of the sequence, this rank's whole heads), each rank attends its heads, and one
/// `all_to_all(1, 2)` brings the output back to `[B, s_r, H, D]`, split as `q` was.
///
/// Each rank attends with the fused
/// [`scaled_dot_product_attention`](crate::autograd::Var::scaled_dot_product_attention) (no
/// `S x S` scores). The backward pass is the same exchanges the other way round: the output
/// gradient goes to heads with `all_to_all(2, 1)`, the local attention's backward pass gives
/// the gradients of this rank's heads of `q`, `k` and `v`, and three `all_to_all(1, 2)` bring
/// them back to sequence shards. The forward pass keeps the heads it attended and each row's
/// log-sum-exp; the backward pass recomputes the probabilities from them. `forward` records the
/// pass on autograd ([`UlyssesAttention::forward_var`] on tracked copies of `q`, `k`, `v`) and
/// `backward` runs that record backward.
///
/// `S` and `H` need not divide by the world size (with more ranks than heads, some attend
/// none).
///
/// # Examples
/// ```
/// use dist_tensor::nn::UlyssesAttention;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
///
/// let [q, k, v] = [1, 2, 3].map(|seed| Tensor::<f64>::random(&[2, 7, 4, 3], seed)); // [B, S, H, D]
/// let attention = UlyssesAttention::new(true); // causal
/// let run = |world: usize| World::threads(world)?.run(|rank| {
///     let [qs, ks, vs] = [&q, &k, &v].map(|t| DistTensor::from_global(rank, t, Placement::Shard(1)));
///     let (out, saved) = attention.forward(&qs?, &ks?, &vs?)?;
///     let (dq, _, _) = attention.backward(saved, &out)?; // d(sum(out^2) / 2) / dq
///     Ok((out.to_global()?, dq.to_global()?))
/// });
/// let (one, three) = (run(1)?, run(3)?);
/// for (a, b) in [(&one[0].0, &three[0].0), (&one[0].1, &three[0].1)] {
///     assert!((a - b).as_slice().iter().all(|d| d.abs() < 1e-12));
/// }
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UlyssesAttention {
    causal: bool,
    scale: Option<f64>,
}

/// What [`UlyssesAttention::forward`] keeps for its backward pass: the pass recorded on
/// autograd (this rank's heads of `q`, `k` and `v` over the whole sequence, each row's
/// log-sum-exp, and the input's sequence split). It borrows the rank, as the forward's output
/// does. Consumed by the backward pass; a clone shares the record, which runs backward once.
///
/// # Examples
/// ```
/// use dist_tensor::nn::UlyssesAttention;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let q = Tensor::<f32>::random(&[1, 6, 4, 2], 1);
/// World::threads(2)?.run(|rank| {
///     let qs = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
///     let attention = UlyssesAttention::new(true);
///     let (out, saved) = attention.forward(&qs, &qs, &qs)?;
///     let (dq, _, _) = attention.backward(saved, &out)?;
///     assert_eq!(dq.shard_sizes(), qs.shard_sizes());
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct AttentionSaved<'r, T: Element> {
    recorded: Recorded<'r, T>,
}

impl UlyssesAttention {
    /// Attention scaled by `1 / sqrt(D)`, causal (token `i` attends to `0..=i`) or not.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesAttention;
    /// assert!(UlyssesAttention::new(true).is_causal());
    /// ```
    pub fn new(causal: bool) -> Self {
        UlyssesAttention { causal, scale: None }
    }

    /// With this scale of the scores instead of `1 / sqrt(D)`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesAttention;
    /// assert_ne!(UlyssesAttention::new(false).scale(0.5), UlyssesAttention::new(false));
    /// ```
    pub fn scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Whether the attention is causal.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesAttention;
    /// assert!(!UlyssesAttention::new(false).is_causal());
    /// ```
    pub fn is_causal(&self) -> bool {
        self.causal
    }

    pub(super) fn scale_for(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (head_dim.max(1) as f64).sqrt())
    }

    /// Attention of `q`, `k`, `v` (each `[B, s_r, H, D]`, `Shard(1)`, laid out alike): the output
    /// `[B, s_r, H, D]`, split as `q`, and what the backward pass needs. Collective.
    ///
    /// # Errors
    /// [`Error::UnsupportedPlacement`](crate::Error::UnsupportedPlacement) unless each is 4-D and
    /// `Shard(1)`; [`Error::InvalidShape`](crate::Error::InvalidShape) when their shapes differ;
    /// and as [`DistTensor::all_to_all`].
    ///
    /// # Examples
    /// See [`UlyssesAttention`].
    #[allow(clippy::type_complexity)]
    pub fn forward<'r, T: Element>(
        &self,
        q: &DistTensor<'r, T>,
        k: &DistTensor<'r, T>,
        v: &DistTensor<'r, T>,
    ) -> Result<(DistTensor<'r, T>, AttentionSaved<'r, T>)> {
        let (out, recorded) = Recorded::forward([q, k, v], |[q, k, v]| self.forward_var(q, k, v))?;
        Ok((out, AttentionSaved { recorded }))
    }

    /// The forward pass on autograd: as [`UlyssesAttention::forward`], each exchange recording
    /// the reverse one and the local attention its backward pass. Collective.
    ///
    /// # Errors
    /// As [`UlyssesAttention::forward`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::DVar;
    /// use dist_tensor::nn::UlyssesAttention;
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let q = Tensor::<f64>::random(&[1, 5, 2, 3], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let q = DVar::param(DistTensor::from_global(rank, &q, Placement::Shard(1))?);
    ///     let out = UlyssesAttention::new(true).forward_var(&q, &q, &q)?;
    ///     out.local().sum().backward()?; // collective
    ///     assert_eq!(q.grad().unwrap().shape(), q.value().local().shape());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn forward_var<'r, T: Element>(
        &self,
        q: &DVar<'r, T>,
        k: &DVar<'r, T>,
        v: &DVar<'r, T>,
    ) -> Result<DVar<'r, T>> {
        const OP: &str = "UlyssesAttention::forward";
        let dims = q.value().global_dims().to_vec();
        for (what, t) in [("q", q), ("k", k), ("v", v)] {
            check_sequence(OP, what, t.value(), 4)?;
            if t.value().global_dims() != dims {
                return Err(crate::Error::InvalidShape {
                    op: OP,
                    reason: format!("q is {dims:?}, {what} {:?}", t.value().global_dims()),
                });
            }
        }
        let [qh, kh, vh] = [q, k, v].map(|t| t.all_to_all(2, 1));
        let (qh, kh, vh) = (qh?, kh?, vh?);
        let (causal, scale) = (self.causal, self.scale_for(dims[3]));
        let out = qh.map(|q| {
            heads_first(q)?
                .scaled_dot_product_attention_scaled(
                    &heads_first(kh.local())?,
                    &heads_first(vh.local())?,
                    causal,
                    scale,
                )?
                .permute(&[0, 2, 1, 3])
        })?;
        out.all_to_all(1, 2)?.resplit(1, q.value().shard_sizes())
    }

    /// The backward pass: given `dout`, the gradient with respect to the output (`[B, s_r, H,
    /// D]`, `Shard(1)`), the gradients with respect to `q`, `k` and `v`, each split as `q` was.
    /// Collective.
    ///
    /// # Errors
    /// [`Error::UnsupportedPlacement`](crate::Error::UnsupportedPlacement) unless `dout` is 4-D
    /// and `Shard(1)`; [`Error::InvalidShape`](crate::Error::InvalidShape) when it is not laid
    /// out as the output was; and as [`DistTensor::all_to_all`].
    ///
    /// # Examples
    /// See [`UlyssesAttention`].
    #[allow(clippy::type_complexity)]
    pub fn backward<'r, T: Element>(
        &self,
        saved: AttentionSaved<'r, T>,
        dout: &DistTensor<'r, T>,
    ) -> Result<(DistTensor<'r, T>, DistTensor<'r, T>, DistTensor<'r, T>)> {
        const OP: &str = "UlyssesAttention::backward";
        check_sequence(OP, "the output gradient", dout, 4)?;
        let mut grads = saved.recorded.backward(OP, self, dout)?.into_iter();
        let mut next = || grads.next().expect("one gradient per input");
        Ok((next(), next(), next()))
    }
}

/// `[B, S, h, D]` as `[B, h, S, D]`: heads as a batch dimension, as the fused attention takes
/// them.
fn heads_first<'r, T: Element>(t: &Var<'r, T>) -> Result<Var<'r, T>> {
    t.permute(&[0, 2, 1, 3])
}

/// No parameters: a [`Module`](crate::nn::Module) so that its backward pass runs as the layers' do.
/// No parameters: attention alone.
impl<T: Element> crate::nn::Module<T> for UlyssesAttention {
    fn visit<'s>(&'s self, _prefix: &str, _f: &mut dyn FnMut(&str, &'s crate::nn::Param<T>)) {}

    fn visit_mut<'s>(
        &'s mut self,
        _prefix: &str,
        _f: &mut dyn FnMut(&str, &'s mut crate::nn::Param<T>),
    ) {
    }
}
