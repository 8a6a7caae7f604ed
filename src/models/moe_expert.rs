//! The sparse MoE block of Mixtral and Qwen2-MoE, expert-parallel: each rank holds whole experts
//! (split over the ranks as `numpy.array_split` splits them) and reads only theirs from the
//! file; the router is replicated. A block is: this rank's tokens' router logits (a local
//! product: the activations between blocks are sharded by tokens), their routing
//! ([`route`]: softmax in the accumulator type, top-k, renormalised where the model says), and
//! one [`moe_experts`] kernel: the rows dispatched to the experts' ranks, each expert's SwiGLU
//! on them as they arrive, and the outputs combined back, weighted. Qwen2-MoE's shared expert is
//! dense: tensor-parallel as a dense MLP, its sigmoid gate folded into its column product.
//!
//! Against the tensor-parallel block (`moe.rs`), each token's rows are computed by its top-k
//! experts only, and an expert's weights are read by one rank.

use super::blocks::{cat_cols, column, from_f32, row, rt, t2, to_f32};
use super::moe::MoeNames;
use super::weights::Weights;
use crate::dist_tensor::DistTensor;
use crate::fused::moe_experts;
use crate::shmem::Rank;
use crate::tensor::{Element, Gate, Router, Tensor, array_split, route, split_offsets};
use crate::{Placement, Result, Split};

/// The shared expert, tensor-parallel: `[hidden, 1 + 2 f_r]` (its gate logit, then this rank's
/// gate and up columns) and `[f_r, hidden]` (its down rows).
struct Shared<T: Element> {
    w_in: Tensor<T>,
    w_down: Tensor<T>,
    ffn: usize,
}

/// One layer's expert-parallel MoE block on this rank.
pub(crate) struct ExpertMoe<T: Element> {
    /// `[hidden, experts]`.
    router: Tensor<T>,
    router_settings: Router,
    /// `[local experts, hidden, 2 ffn]` (each expert's gate then up columns) and
    /// `[local experts, ffn, hidden]`.
    gate_up: Tensor<T>,
    down: Tensor<T>,
    shared: Option<Shared<T>>,
}

impl<T: Element> ExpertMoe<T> {
    /// Loads a block of `experts` experts of width `ffn` (and a shared expert of `shared_ffn`),
    /// this rank's experts whole. Collective.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        rank: &Rank<'_>,
        w: &Weights<'_>,
        names: &MoeNames,
        hidden: usize,
        experts: usize,
        top_k: usize,
        normalize: bool,
        ffn: usize,
        shared_ffn: usize,
    ) -> Result<Self> {
        let (me, n) = (rank.rank(), rank.num_ranks());
        let at = split_offsets(&array_split(experts, n));
        let local = at[me]..at[me + 1];
        let whole_t = |name: &str, shape: [usize; 2]| t2(&w.whole::<T>(name, &shape)?);
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in local.clone() {
            let [g, u, d] = (names.expert)(e);
            let (g, u) = (whole_t(&g, [ffn, hidden])?, whole_t(&u, [ffn, hidden])?);
            gate_up.extend_from_slice(cat_cols(&[&g, &u])?.as_slice());
            down.extend_from_slice(whole_t(&d, [hidden, ffn])?.as_slice());
        }
        let gate_up = Tensor::from_shape_vec(&[local.len(), hidden, 2 * ffn], gate_up)?;
        let down = Tensor::from_shape_vec(&[local.len(), ffn, hidden], down)?;
        let shared = match &names.shared {
            None => None,
            Some(([g, u, d], gate)) => {
                let col = |name: &str| -> Result<Tensor<T>> {
                    let part =
                        w.part::<T>(name, &[shared_ffn, hidden], Placement::Shard(0), Split::Even)?;
                    t2(&part)
                };
                let gate = whole_t(gate, [1, hidden])?;
                let w_in = cat_cols(&[&gate, &col(g)?, &col(u)?])?;
                let part =
                    w.part::<T>(d, &[hidden, shared_ffn], Placement::Shard(1), Split::Even)?;
                let w_down = t2(&part)?;
                let ffn = w_down.shape()[0];
                Some(Shared { w_in, w_down, ffn })
            }
        };
        Ok(ExpertMoe {
            router: whole_t(&names.router, [experts, hidden])?,
            router_settings: Router {
                top_k,
                gate: Gate::Softmax,
                normalize,
                capacity_factor: None,
            },
            gate_up,
            down,
            shared,
        })
    }

    /// The block's output for sequence-sharded `h`, sharded as `like`. Collective.
    pub fn forward<'r>(
        &self,
        rank: &'r Rank<'r>,
        h: &DistTensor<'r, T>,
        like: &DistTensor<'r, T>,
    ) -> Result<DistTensor<'r, T>> {
        let x = h.local().to_host()?;
        let routed = route(&x.matmul(&self.router)?, &self.router_settings)?;
        let out = moe_experts(rank, &x, &routed, &self.gate_up, &self.down)?;
        let out = DistTensor::from_local(rank, out, Placement::Shard(0))?;
        debug_assert_eq!(out.shard_sizes(), like.shard_sizes());
        let Some(s) = &self.shared else { return Ok(out) };
        let g = to_f32(&column(h, &s.w_in)?)?;
        let (len, width, sf) = (h.global_shape()[0], 1 + 2 * s.ffn, s.ffn);
        let mut act = vec![0.0f32; len * sf];
        for t in 0..len {
            let r = &g[t * width..(t + 1) * width];
            let gate = rt::<T>(1.0 / (1.0 + (-r[0]).exp()));
            for i in 0..sf {
                act[t * sf + i] = rt::<T>(gate * rt::<T>(rt::<T>(silu(r[1 + i])) * r[1 + sf + i]));
            }
        }
        let shared = row(rank, from_f32::<T>(&[len, sf], &act)?, &s.w_down, like)?;
        out.zip_local(&shared, |a, b| a + b)
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
