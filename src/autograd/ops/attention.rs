//! Fused attention on [`Var`]: [`scaled_dot_product_attention`], whose backward pass
//! recomputes the probabilities from the log-sum-exp its forward pass keeps (linear in the
//! sequence length, as the forward pass).

use super::attention_device;
use crate::autograd::Var;
use crate::autograd::var::record;
use crate::tensor::{scaled_dot_product_attention_backward, scaled_dot_product_attention_lse};
use crate::{Element, Result};

impl<'a, T: Element> Var<'a, T> {
    /// [`scaled_dot_product_attention`](crate::tensor::scaled_dot_product_attention) with `self`
    /// as the queries: `softmax(q k^T / sqrt(D)) v` over the last two axes, causal or not.
    ///
    /// # Errors
    /// As [`scaled_dot_product_attention`](crate::tensor::scaled_dot_product_attention).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::{GradcheckOptions, gradcheck};
    /// use dist_tensor::Tensor;
    /// let x: Vec<Tensor<f64>> = (0..3).map(|i| Tensor::random(&[2, 5, 4], i)).collect();
    /// gradcheck(|x| x[0].scaled_dot_product_attention(&x[1], &x[2], true), &x, GradcheckOptions::default())?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn scaled_dot_product_attention(
        &self,
        k: &Var<'a, T>,
        v: &Var<'a, T>,
        causal: bool,
    ) -> Result<Var<'a, T>> {
        let d = self.shape().last().copied().unwrap_or(1).max(1);
        self.scaled_dot_product_attention_scaled(k, v, causal, 1.0 / (d as f64).sqrt())
    }

    /// [`Var::scaled_dot_product_attention`] with the scores scaled by `scale` instead of
    /// `1 / sqrt(D)` ([`UlyssesAttention::scale`](crate::nn::UlyssesAttention::scale)).
    pub(crate) fn scaled_dot_product_attention_scaled(
        &self,
        k: &Var<'a, T>,
        v: &Var<'a, T>,
        causal: bool,
        scale: f64,
    ) -> Result<Var<'a, T>> {
        if !self.value.is_on_host() {
            let (o, saved) =
                attention_device::forward(&self.value, &k.value, &v.value, causal, scale)?;
            return Ok(record(o, &[self, k, v], move |g, _| {
                let [dq, dk, dv] = attention_device::backward(&saved, g, scale)?;
                Ok(vec![Some(dq), Some(dk), Some(dv)])
            }));
        }
        let (o, lse) =
            scaled_dot_product_attention_lse(&self.value, &k.value, &v.value, causal, scale)?;
        let (qv, kv, vv, ov) = (self.value.clone(), k.value.clone(), v.value.clone(), o.clone());
        Ok(record(o, &[self, k, v], move |g, _| {
            let (dq, dk, dv) =
                scaled_dot_product_attention_backward(&qv, &kv, &vv, &ov, &lse, g, causal, scale)?;
            Ok(vec![Some(dq), Some(dk), Some(dv)])
        }))
    }
}
