//! [`UlyssesAttention`]: attention with the sequence sharded, heads traded for sequence and back.

use ndarray::Array3;

use super::{check_sequence, device, local, resplit, view4, view4_mut};
use crate::Result;
use crate::dist::DistTensor;
use crate::tensor::{Element, Tensor};

/// Softmax attention over a sequence sharded on the ranks (DeepSpeed-Ulysses): `q`, `k`, `v` of
/// `[B, s_r, H, D]` (`Shard(1)`) each go through one `all_to_all(2, 1)` to `[B, S, h_r, D]` (all
/// of the sequence, this rank's whole heads), each rank attends its heads, and one
/// `all_to_all(1, 2)` brings the output back to `[B, s_r, H, D]`, split as `q` was.
///
/// The backward pass is the same exchanges the other way round: the output gradient goes to
/// heads with `all_to_all(2, 1)`, the local attention's backward pass gives the gradients of
/// this rank's heads of `q`, `k` and `v`, and three `all_to_all(1, 2)` bring them back to
/// sequence shards. The forward pass keeps the heads it attended and each row's log-sum-exp;
/// the backward pass recomputes the probabilities from them.
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

/// What [`UlyssesAttention::forward`] keeps for its backward pass: this rank's heads of `q`,
/// `k` and `v` over the whole sequence, each row's log-sum-exp, and the input's sequence split.
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
///     assert_eq!(saved.query_heads().shape(), &[1, 6, 2, 2]); // all 6 tokens, 2 of the 4 heads
///     let (dq, _, _) = attention.backward(saved, &out)?;
///     assert_eq!(dq.shard_sizes(), qs.shard_sizes());
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct AttentionSaved<T: Element> {
    q: Tensor<T>,
    k: Tensor<T>,
    v: Tensor<T>,
    lse: Array3<T::Acc>,
    sizes: Vec<usize>,
    /// For heads on a GPU: what its backward pass reads (`lse` is then empty).
    on_device: Option<device::DeviceSaved<T::Acc>>,
}

impl<T: Element> AttentionSaved<T> {
    /// This rank's heads of `q`, `[B, S, h_r, D]`, as attention saw them.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::UlyssesAttention;
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let q = Tensor::<f32>::random(&[1, 5, 3, 2], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let qs = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
    ///     let (_, saved) = UlyssesAttention::new(false).forward(&qs, &qs, &qs)?;
    ///     assert_eq!(saved.query_heads().shape(), &[1, 5, 2 - rank.rank(), 2]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn query_heads(&self) -> &Tensor<T> {
        &self.q
    }
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
    pub fn forward<'r, T: Element>(
        &self,
        q: &DistTensor<'r, T>,
        k: &DistTensor<'r, T>,
        v: &DistTensor<'r, T>,
    ) -> Result<(DistTensor<'r, T>, AttentionSaved<T>)> {
        const OP: &str = "UlyssesAttention::forward";
        for (what, t) in [("q", q), ("k", k), ("v", v)] {
            check_sequence(OP, what, t, 4)?;
            if t.global_dims() != q.global_dims() {
                return Err(crate::Error::InvalidShape {
                    op: OP,
                    reason: format!("q is {:?}, {what} {:?}", q.global_dims(), t.global_dims()),
                });
            }
        }
        let [qh, kh, vh] = [q, k, v].map(|t| t.all_to_all(2, 1));
        let (qh, kh, vh) = (qh?, kh?, vh?);
        let scale = self.scale_for(q.global_dims()[3]);
        let (out, lse, on_device) = if qh.local().device_storage().is_some() {
            let (out, saved) =
                device::forward(qh.local(), kh.local(), vh.local(), self.causal, scale)?;
            (out, Array3::from_elem((0, 0, 0), <T::Acc as crate::Element>::zero()), Some(saved))
        } else {
            let mut out = Tensor::<T>::try_zeros(qh.local().shape())?;
            let (qv, kv, vv) = (view4(qh.local()), view4(kh.local()), view4(vh.local()));
            let lse = local::forward(qv, kv, vv, self.causal, scale, view4_mut(&mut out))?;
            (out, lse, None)
        };
        let out = resplit(qh.map_local(|_| out)?.all_to_all(1, 2)?, q.shard_sizes())?;
        let sizes = q.shard_sizes().to_vec();
        let saved = AttentionSaved {
            q: qh.into_local(),
            k: kh.into_local(),
            v: vh.into_local(),
            lse,
            sizes,
            on_device,
        };
        Ok((out, saved))
    }

    /// The backward pass: given `dout`, the gradient with respect to the output (`[B, s_r, H,
    /// D]`, `Shard(1)`), the gradients with respect to `q`, `k` and `v`, each split as `q` was.
    /// Collective.
    ///
    /// # Errors
    /// [`Error::UnsupportedPlacement`](crate::Error::UnsupportedPlacement) unless `dout` is 4-D
    /// and `Shard(1)`; [`Error::InvalidShape`](crate::Error::InvalidShape) when its heads are not
    /// those the forward pass attended; and as [`DistTensor::all_to_all`].
    ///
    /// # Examples
    /// See [`UlyssesAttention`].
    #[allow(clippy::type_complexity)]
    pub fn backward<'r, T: Element>(
        &self,
        saved: AttentionSaved<T>,
        dout: &DistTensor<'r, T>,
    ) -> Result<(DistTensor<'r, T>, DistTensor<'r, T>, DistTensor<'r, T>)> {
        const OP: &str = "UlyssesAttention::backward";
        check_sequence(OP, "the output gradient", dout, 4)?;
        let dh = dout.all_to_all(2, 1)?;
        if dh.local().shape() != saved.q.shape() {
            return Err(crate::Error::InvalidShape {
                op: OP,
                reason: format!(
                    "the output gradient's heads are {:?}, the forward pass attended {:?}",
                    dh.local().shape(),
                    saved.q.shape()
                ),
            });
        }
        let scale = self.scale_for(dout.global_dims()[3]);
        let (dq, dk, dv) = match &saved.on_device {
            Some(on_device) => {
                let [dq, dk, dv] = device::backward(on_device, dh.local(), scale)?;
                (dq, dk, dv)
            }
            None => {
                let shape = saved.q.shape().to_vec();
                let (mut dq, mut dk, mut dv) = (
                    Tensor::try_zeros(&shape)?,
                    Tensor::try_zeros(&shape)?,
                    Tensor::try_zeros(&shape)?,
                );
                let grads = (view4_mut(&mut dq), view4_mut(&mut dk), view4_mut(&mut dv));
                let (q, k, v) = (view4(&saved.q), view4(&saved.k), view4(&saved.v));
                local::backward(q, k, v, &saved.lse, view4(dh.local()), self.causal, scale, grads)?;
                (dq, dk, dv)
            }
        };
        let back = |g: Tensor<T>| resplit(dh.map_local(|_| g)?.all_to_all(1, 2)?, &saved.sizes);
        Ok((back(dq)?, back(dk)?, back(dv)?))
    }
}
