//! Mixture-of-experts routing: which experts each token goes to, and with what weight
//! ([`route`]), from the router's logits `[tokens, experts]`.
//!
//! The gate turns a token's logits into scores: a softmax over the experts (Mixtral, Qwen-MoE)
//! or a sigmoid per expert (DeepSeek-V3). The `top_k` largest scores pick the experts, ties to
//! the lower expert index; the chosen scores are the weights, renormalised to sum to 1 when
//! asked. An optional capacity factor bounds the rows an expert takes,
//! `ceil(capacity_factor * tokens * top_k / experts)`: past it, the assignments with the lowest
//! gate scores (before renormalising) are dropped, ties to the later token, as Megatron-LM's
//! default drop policy; without
//! one routing is dropless. Scores are computed in the accumulator type; the weights are rounded
//! once to `T` (as `transformers` casts them to the model's type).
//!
//! Two losses come with the routing, in f64 from the accumulator-type values, over this call's
//! tokens: the load-balancing loss as `transformers` computes it for Mixtral,
//! `experts * sum_e (assigned_e / tokens) * mean_t(probs_te)` (assignments before dropping; the
//! probabilities a softmax over all experts, for a sigmoid gate the scores normalised per
//! token; Megatron-LM's is this over `top_k`), and the router z-loss of ST-MoE,
//! `mean_t(logsumexp_e(logits_te)^2)`.

use num_traits::Float;

use super::{Element, Tensor};
use crate::{Error, Result};

const OP: &str = "route";

/// The expert of a slot that routing dropped (over its expert's capacity).
pub const DROPPED: u32 = u32::MAX;

/// How a token's logits become scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// A softmax over the experts (Mixtral, Qwen2-MoE).
    Softmax,
    /// A sigmoid of each logit (DeepSeek-V3).
    Sigmoid,
}

/// A router's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Router {
    /// Experts per token (at most the number of experts).
    pub top_k: usize,
    /// Softmax or sigmoid scores.
    pub gate: Gate,
    /// Whether the chosen scores are renormalised to sum to 1 per token.
    pub normalize: bool,
    /// Rows per expert at most `ceil(factor * tokens * top_k / experts)`, the rest dropped; `None`:
    /// dropless.
    pub capacity_factor: Option<f64>,
}

impl Router {
    /// Softmax scores, `top_k` experts, renormalised, dropless: Mixtral's router.
    pub fn softmax_top_k(top_k: usize) -> Router {
        Router { top_k, gate: Gate::Softmax, normalize: true, capacity_factor: None }
    }
}

/// Where a call's tokens go: `top_k` slots per token, each an expert (or [`DROPPED`]) and its
/// weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed<T: Element> {
    /// The number of experts.
    pub experts: usize,
    /// Slots per token.
    pub top_k: usize,
    /// `[tokens * top_k]`: the expert of each slot, in decreasing score (ties to the lower
    /// expert), or [`DROPPED`].
    pub expert: Vec<u32>,
    /// `[tokens, top_k]`: each slot's weight (0 where dropped).
    pub weight: Tensor<T>,
    /// Rows each expert takes (after dropping).
    pub load: Vec<usize>,
    /// Slots routed to each expert before dropping (what the load-balancing loss counts).
    pub assigned: Vec<usize>,
    /// Slots dropped for capacity.
    pub dropped: usize,
    /// The load-balancing loss (module docs).
    pub aux_loss: f64,
    /// The router z-loss (module docs).
    pub z_loss: f64,
}

impl<T: Element> Routed<T> {
    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.expert.len() / self.top_k.max(1)
    }

    /// Routing given outright: `expert` `[tokens * top_k]` (experts, or [`DROPPED`]) and their
    /// `weight` `[tokens, top_k]`; no losses (0).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an expert out of range, or shapes that do not match.
    pub fn from_parts(experts: usize, expert: Vec<u32>, weight: Tensor<T>) -> Result<Self> {
        let top_k = weight.shape().get(1).copied().unwrap_or(0);
        let bad = |reason: String| Error::InvalidArgument { op: OP, rank: 0, reason };
        if weight.ndim() != 2 || weight.shape()[0] * top_k != expert.len() {
            return Err(bad(format!(
                "weights {:?} do not give one per slot of {} slots",
                weight.shape(),
                expert.len()
            )));
        }
        let mut load = vec![0; experts];
        let mut dropped = 0;
        for &e in &expert {
            match load.get_mut(e as usize) {
                Some(l) => *l += 1,
                None if e == DROPPED => dropped += 1,
                None => return Err(bad(format!("expert {e} of {experts}"))),
            }
        }
        let assigned = load.clone();
        Ok(Routed {
            experts,
            top_k,
            expert,
            weight,
            load,
            assigned,
            dropped,
            aux_loss: 0.0,
            z_loss: 0.0,
        })
    }
}

/// Routes each row of `logits` `[tokens, experts]` (module docs). Host tensors.
///
/// # Errors
/// [`Error::InvalidArgument`] for logits that are not 2-D, no experts, `top_k` 0 or above the
/// experts, a capacity factor that is not positive; [`Error::DeviceUnavailable`] for logits on
/// a device.
///
/// # Examples
/// ```
/// use dist_tensor::tensor::{route, Router, Tensor};
/// let logits = Tensor::from_shape_vec(&[2, 3], vec![0.0f64, 2.0, 1.0, 3.0, 3.0, 0.0])?;
/// let r = route(&logits, &Router::softmax_top_k(2))?;
/// assert_eq!(r.expert, vec![1, 2, 0, 1]); // token 1's tie goes to expert 0
/// assert_eq!(r.load, vec![1, 2, 1]);
/// let w = r.weight.as_slice();
/// assert!((w[0] + w[1] - 1.0).abs() < 1e-15 && (w[2] - 0.5).abs() < 1e-15);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn route<T: Element>(logits: &Tensor<T>, router: &Router) -> Result<Routed<T>> {
    let bad = |reason: String| Err(Error::InvalidArgument { op: OP, rank: 0, reason });
    if logits.ndim() != 2 {
        return bad(format!("logits {:?} are not [tokens, experts]", logits.shape()));
    }
    let (tokens, experts) = (logits.shape()[0], logits.shape()[1]);
    let k = router.top_k;
    if experts == 0 || k == 0 || k > experts || experts >= DROPPED as usize {
        return bad(format!("top_k {k} of {experts} experts"));
    }
    if router.capacity_factor.is_some_and(|f| !(f > 0.0 && f.is_finite())) {
        return bad(format!("capacity factor {:?} is not positive", router.capacity_factor));
    }
    super::map::require_host(OP, logits)?;
    let x = logits.as_slice();
    let acc = |v: f64| <T::Acc as Element>::from_f64(v);
    let mut expert = vec![DROPPED; tokens * k];
    let mut score = vec![<T::Acc as Element>::zero(); tokens * k];
    // The gate's scores of the chosen experts, before renormalising: what dropping ranks by.
    let mut raw = vec![<T::Acc as Element>::zero(); tokens * k];
    let (mut assigned, mut prob_sum) = (vec![0usize; experts], vec![0f64; experts]);
    let mut z_loss = 0f64;
    let mut s = vec![<T::Acc as Element>::zero(); experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for t in 0..tokens {
        let row = &x[t * experts..(t + 1) * experts];
        let max = row
            .iter()
            .map(|v| v.to_acc())
            .fold(acc(f64::NEG_INFINITY), |m, v| if v > m { v } else { m });
        let sum_exp = row.iter().fold(acc(0.0), |a, v| a + (v.to_acc() - max).exp());
        let lse = (max + sum_exp.ln()).to_f64();
        z_loss += lse * lse;
        for (e, v) in row.iter().enumerate() {
            s[e] = match router.gate {
                Gate::Softmax => (v.to_acc() - max).exp() / sum_exp,
                Gate::Sigmoid => acc(1.0) / (acc(1.0) + (-v.to_acc()).exp()),
            };
        }
        // The probabilities of the load-balancing loss: the softmax, or the scores normalised.
        let total = s.iter().fold(0.0, |a, v| a + v.to_f64());
        for e in 0..experts {
            prob_sum[e] += match router.gate {
                Gate::Softmax => s[e].to_f64(),
                Gate::Sigmoid => s[e].to_f64() / total,
            };
        }
        order.clear();
        order.extend(0..experts);
        // Larger first, NaN first (never silently skipped), ties to the lower expert.
        order.sort_by(|&a, &b| {
            let (x, y) = (s[a], s[b]);
            (y.is_nan().cmp(&x.is_nan()))
                .then(y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal))
                .then(a.cmp(&b))
        });
        let chosen = &order[..k];
        let norm = chosen.iter().fold(acc(0.0), |a, &e| a + s[e]);
        for (slot, &e) in chosen.iter().enumerate() {
            expert[t * k + slot] = e as u32;
            score[t * k + slot] = if router.normalize { s[e] / norm } else { s[e] };
            raw[t * k + slot] = s[e];
            assigned[e] += 1;
        }
    }
    let dropped = match router.capacity_factor {
        Some(f) => drop_over_capacity(&mut expert, &raw, experts, k, f),
        None => 0,
    };
    let mut load = vec![0usize; experts];
    for &e in expert.iter().filter(|&&e| e != DROPPED) {
        load[e as usize] += 1;
    }
    let weight: Vec<T> = (expert.iter().zip(&score))
        .map(|(&e, &w)| if e == DROPPED { T::zero() } else { T::from_acc(w) })
        .collect();
    let per_token = |v: f64| if tokens == 0 { 0.0 } else { v / tokens as f64 };
    let aux_loss = experts as f64
        * (0..experts).map(|e| per_token(assigned[e] as f64) * per_token(prob_sum[e])).sum::<f64>();
    Ok(Routed {
        experts,
        top_k: k,
        expert,
        weight: Tensor::from_shape_vec(&[tokens, k], weight)?,
        load,
        assigned,
        dropped,
        aux_loss,
        z_loss: per_token(z_loss),
    })
}

/// The capacity of each expert for `tokens * k` slots.
pub fn expert_capacity(tokens: usize, k: usize, experts: usize, factor: f64) -> usize {
    (factor * (tokens * k) as f64 / experts as f64).ceil() as usize
}

/// Drops, per expert, the assignments past its capacity with the lowest scores (ties to the
/// later token); returns how many.
fn drop_over_capacity<A: Element>(
    expert: &mut [u32],
    score: &[A],
    experts: usize,
    k: usize,
    factor: f64,
) -> usize {
    let capacity = expert_capacity(expert.len() / k, k, experts, factor);
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts];
    for (slot, &e) in expert.iter().enumerate() {
        by_expert[e as usize].push(slot);
    }
    let mut dropped = 0;
    for slots in &mut by_expert {
        if slots.len() <= capacity {
            continue;
        }
        // Stable: equal scores keep token order, so the later token is dropped first.
        slots
            .sort_by(|&a, &b| score[b].partial_cmp(&score[a]).unwrap_or(std::cmp::Ordering::Equal));
        for &slot in &slots[capacity..] {
            expert[slot] = DROPPED;
            dropped += 1;
        }
    }
    dropped
}
