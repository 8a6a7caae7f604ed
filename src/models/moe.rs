//! The sparse MoE block of Mixtral and Qwen2-MoE (with its shared expert), tensor-parallel:
//! every expert's `gate` / `up` columns and `down` rows are split over the ranks as a dense
//! MLP's are, the router (and Qwen2-MoE's shared-expert gate) replicated. The whole block is
//! one fused `all_gather_matmul` (router logits and every expert's columns of this rank) and
//! one fused `matmul_reduce_scatter` (every expert's rows, each token's activations scaled by
//! its routing weight, zero for the experts it did not pick).
//!
//! So each rank computes every expert for every token (the top-k of `E` experts do the useful
//! part): simple and exact, and the right first version for small expert counts; expert
//! parallelism (each rank holding whole experts, tokens dispatched to them) is the goal.

use super::blocks::{cat_cols, column, from_f32, row, rt, t2, to_f32};
use super::weights::Weights;
use crate::dist_tensor::DistTensor;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Placement, Result, Split};

/// The HF tensor names of one layer's MoE block.
pub(crate) struct MoeNames {
    /// The router, `[E, hidden]`.
    pub router: String,
    /// Expert `e`'s gate, up, down weights.
    pub expert: Box<dyn Fn(usize) -> [String; 3]>,
    /// The shared expert's gate, up, down weights, and its gate `[1, hidden]`.
    pub shared: Option<([String; 3], String)>,
}

/// One layer's MoE block on this rank.
pub(crate) struct Moe<T: Element> {
    experts: usize,
    top_k: usize,
    normalize: bool,
    /// This rank's columns of each expert, and of the shared expert.
    ffn: usize,
    shared_ffn: usize,
    /// `[hidden, E (+1) + 2 E ffn + 2 shared_ffn]`: router, shared gate, each expert's gate then
    /// up columns, the shared expert's gate then up columns.
    w_in: Tensor<T>,
    /// `[E ffn + shared_ffn, hidden]`.
    w_down: Tensor<T>,
}

impl<T: Element> Moe<T> {
    /// Loads a block of `experts` experts of width `ffn` (and a shared expert of `shared_ffn`).
    /// Collective.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        w: &Weights<'_>,
        names: &MoeNames,
        hidden: usize,
        experts: usize,
        top_k: usize,
        normalize: bool,
        ffn: usize,
        shared_ffn: usize,
    ) -> Result<Self> {
        let col = |name: &str, out: usize| -> Result<Tensor<T>> {
            t2(&w.part::<T>(name, &[out, hidden], Placement::Shard(0), Split::Even)?)
        };
        let down = |name: &str, inner: usize| -> Result<Tensor<T>> {
            t2(&w.part::<T>(name, &[hidden, inner], Placement::Shard(1), Split::Even)?)
        };
        let mut ins = vec![t2(&w.whole::<T>(&names.router, &[experts, hidden])?)?];
        if let Some((_, gate)) = &names.shared {
            ins.push(t2(&w.whole::<T>(gate, &[1, hidden])?)?);
        }
        let mut downs = Vec::new();
        for e in 0..experts {
            let [g, u, d] = (names.expert)(e);
            ins.push(col(&g, ffn)?);
            ins.push(col(&u, ffn)?);
            downs.push(down(&d, ffn)?);
        }
        if let Some(([g, u, d], _)) = &names.shared {
            ins.push(col(g, shared_ffn)?);
            ins.push(col(u, shared_ffn)?);
            downs.push(down(d, shared_ffn)?);
        }
        let ffn_r = downs[0].shape()[0];
        let shared_r = if names.shared.is_some() { downs[experts].shape()[0] } else { 0 };
        let w_in = cat_cols(&ins.iter().collect::<Vec<_>>())?;
        let w_down = t2(&cat_cols(
            &downs.iter().map(t2).collect::<Result<Vec<_>>>()?.iter().collect::<Vec<_>>(),
        )?)?;
        Ok(Moe { experts, top_k, normalize, ffn: ffn_r, shared_ffn: shared_r, w_in, w_down })
    }

    /// The block's output for sequence-sharded `h`, sharded as `like`. Collective.
    pub fn forward<'r>(
        &self,
        rank: &'r Rank<'r>,
        h: &DistTensor<'r, T>,
        like: &DistTensor<'r, T>,
    ) -> Result<DistTensor<'r, T>> {
        let g = column(h, &self.w_in)?;
        let (len, width) = (g.shape()[0], g.shape()[1]);
        let v = to_f32(&g)?;
        let e = self.experts;
        let shared_gate = usize::from(self.shared_ffn > 0);
        let (f, sf) = (self.ffn, self.shared_ffn);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        let mut act = vec![0.0f32; len * (e * f + sf)];
        for t in 0..len {
            let r = &v[t * width..(t + 1) * width];
            // Routing as transformers does it: softmax in f32, top-k, optionally renormalised,
            // then cast to the model's type.
            let logits = &r[..e];
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let exps: Vec<f32> = logits.iter().map(|x| (x - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            let probs: Vec<f32> = exps.iter().map(|x| x / sum).collect();
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            let chosen = &order[..self.top_k.min(e)];
            let total: f32 = chosen.iter().map(|&i| probs[i]).sum();
            let out = &mut act[t * (e * f + sf)..(t + 1) * (e * f + sf)];
            let cols = &r[e + shared_gate..];
            for &x in chosen {
                let weight = rt::<T>(if self.normalize { probs[x] / total } else { probs[x] });
                let gu = &cols[x * 2 * f..(x + 1) * 2 * f];
                for i in 0..f {
                    out[x * f + i] = rt::<T>(weight * rt::<T>(rt::<T>(silu(gu[i])) * gu[f + i]));
                }
            }
            if sf > 0 {
                let gate = rt::<T>(1.0 / (1.0 + (-r[e]).exp()));
                let gu = &cols[e * 2 * f..e * 2 * f + 2 * sf];
                for i in 0..sf {
                    out[e * f + i] = rt::<T>(gate * rt::<T>(rt::<T>(silu(gu[i])) * gu[sf + i]));
                }
            }
        }
        let act = from_f32::<T>(&[len, e * f + sf], &act)?;
        row(rank, act, &self.w_down, like)
    }
}
