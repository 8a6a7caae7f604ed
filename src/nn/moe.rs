//! [`MoeLayer`]: a mixture-of-experts MLP layer, expert-parallel, trainable.
//!
//! Each rank holds whole experts (split over the ranks as `numpy.array_split` splits them),
//! stored as two parameters sharded on their first axis, `gate_up` `[E, hidden, 2 ffn]` and
//! `down` `[E, ffn, hidden]`, so a state dict saved on one world loads on another. The router
//! `[hidden, E]` is replicated. A token's path: router logits, [`route`] (which experts), the
//! gate weights recomputed differentiably from the logits (softmax, the chosen experts'
//! probabilities, renormalised where asked, 0 where dropped), [`Var::moe_dispatch`], each
//! expert's SwiGLU on its rows, [`Var::moe_combine`]. The load-balancing loss and the router
//! z-loss come back as differentiable scalars over this rank's tokens.

use ndarray::Array2;

use super::{Module, Param, join};
use crate::autograd::{DVar, Var};
use crate::shmem::Rank;
use crate::tensor::{DROPPED, Gate, Routed, Router, Tensor, array_split, route, split_offsets};
use crate::{Element, Error, Placement, Result};

/// What a forward pass of a [`MoeLayer`] gives: the output and its routing's losses and counts.
pub struct MoeOutput<'r, T: Element> {
    /// `[tokens, hidden]` sharded as the input.
    pub out: DVar<'r, T>,
    /// The load-balancing loss over this rank's tokens (0-D).
    pub aux_loss: Var<'r, T>,
    /// The router z-loss over this rank's tokens (0-D).
    pub z_loss: Var<'r, T>,
    /// Rows each expert took from this rank's tokens (after dropping).
    pub load: Vec<usize>,
    /// This rank's slots dropped for capacity.
    pub dropped: usize,
}

/// An expert-parallel mixture-of-experts layer (module docs).
///
/// # Examples
/// ```
/// use dist_tensor::autograd::DVar;
/// use dist_tensor::nn::{Adam, Module, MoeLayer};
/// use dist_tensor::tensor::Router;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let x = Tensor::<f32>::random(&[10, 8], 1);
/// World::threads(2)?.run(|rank| {
///     // 4 experts of width 16, top-2, on 2 ranks: 2 experts each.
///     let mut moe = MoeLayer::<f32>::new(rank, 8, 16, 4, Router::softmax_top_k(2), 7)?;
///     let xs = DVar::param(DistTensor::from_global(rank, &x, Placement::Shard(0))?);
///     let y = moe.forward(rank, &xs)?;
///     assert_eq!(y.out.value().global_shape(), vec![10, 8]);
///     (&y.out.local().sum() + &y.aux_loss.scale(0.01)).backward()?;
///     Adam::new(1e-3).step(moe.parameters_mut())?;
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct MoeLayer<T: Element> {
    /// `[hidden, E]`, replicated.
    pub router: Param<T>,
    /// `[E_r, hidden, 2 ffn]`: this rank's experts' gate then up columns.
    pub gate_up: Param<T>,
    /// `[E_r, ffn, hidden]`: this rank's experts' down rows.
    pub down: Param<T>,
    settings: Router,
    experts: usize,
    first: usize,
    fused: bool,
}

impl<T: Element> MoeLayer<T> {
    /// A layer of `experts` SwiGLU experts of width `ffn` on `hidden` features, routed by
    /// `router` (softmax gates only), with weights drawn from `seed` (the same global weights
    /// on every world), this rank's experts cut out.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no experts, a `top_k` of 0 or above the experts, or a
    /// sigmoid gate.
    pub fn new(
        rank: &Rank<'_>,
        hidden: usize,
        ffn: usize,
        experts: usize,
        router: Router,
        seed: u64,
    ) -> Result<Self> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "MoeLayer::new",
            rank: rank.rank(),
            reason,
        };
        if experts == 0 || router.top_k == 0 || router.top_k > experts {
            return Err(bad(format!("top_k {} of {experts} experts", router.top_k)));
        }
        if router.gate != Gate::Softmax {
            return Err(bad(
                "the layer's gate weights are differentiated for softmax gates only".into()
            ));
        }
        let at = split_offsets(&array_split(experts, rank.num_ranks()));
        let (first, last) = (at[rank.rank()], at[rank.rank() + 1]);
        let init = |rows: usize, cols: usize, s: u64| {
            Tensor::<f64>::random(&[rows, cols], s) * (1.0 / (rows as f64).sqrt())
        };
        let stack = |parts: Vec<Tensor<f64>>, shape: [usize; 3]| -> Result<Tensor<T>> {
            let data: Vec<T> =
                parts.iter().flat_map(|p| p.as_slice().iter().map(|&v| T::from_f64(v))).collect();
            Tensor::from_shape_vec(&[last - first, shape[1], shape[2]], data)
        };
        let gate_up =
            (first..last).map(|e| init(hidden, 2 * ffn, seed + 100 + 2 * e as u64)).collect();
        let down = (first..last).map(|e| init(ffn, hidden, seed + 101 + 2 * e as u64)).collect();
        Ok(MoeLayer {
            router: Param::new(init(hidden, experts, seed).cast()),
            gate_up: Param::sharded(stack(gate_up, [0, hidden, 2 * ffn])?, 0),
            down: Param::sharded(stack(down, [0, ffn, hidden])?, 0),
            settings: router,
            experts,
            first,
            fused: true,
        })
    }

    /// The same layer running the unfused dispatch and combine (`fused == false`), forward and
    /// backward.
    pub fn fused(mut self, fused: bool) -> Self {
        self.fused = fused;
        self
    }

    /// The experts this rank holds.
    pub fn local_experts(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.gate_up.value().shape()[0]
    }

    /// The layer on `x` (`[tokens, hidden]` sharded on tokens, each rank routing its own).
    /// Collective, forward and backward.
    ///
    /// # Errors
    /// As [`route`], [`Var::moe_dispatch`] and [`Var::moe_combine`].
    pub fn forward<'r>(&self, rank: &'r Rank<'r>, x: &DVar<'r, T>) -> Result<MoeOutput<'r, T>> {
        let xl = x.local();
        let logits = xl.matmul(&self.router.var())?;
        let routed: Routed<T> = route(logits.value(), &self.settings)?;
        let (tokens, k, e) = (xl.shape()[0], self.settings.top_k, self.experts);
        // The gate weights again, differentiably: the chosen experts' probabilities.
        let probs = logits.softmax(1)?;
        let index = Array2::from_shape_fn((tokens, k), |(t, s)| match routed.expert[t * k + s] {
            DROPPED => 0,
            x => x as usize,
        });
        let mut w = probs.gather(1, &index)?;
        if self.settings.normalize {
            let norm = w.sum_axis(1)?.insert_axis(1)?;
            w = &w / &norm;
        }
        let dropped =
            Array2::from_shape_fn((tokens, k), |(t, s)| routed.expert[t * k + s] == DROPPED);
        let w = w.masked_fill(&dropped, T::zero())?;
        let (rows, got) = xl.moe_dispatch(rank, &routed, self.fused)?;
        let (gu, down) = (self.gate_up.var(), self.down.var());
        let (hidden, ffn) = (self.down.value().shape()[2], self.down.value().shape()[1]);
        let mut parts = Vec::new();
        for (i, expert) in got.experts.clone().enumerate() {
            let r = got.rows_of(expert);
            if r.is_empty() {
                continue;
            }
            let x_e = rows.narrow(0, r.start, r.len())?;
            let w_gu = gu.narrow(0, i, 1)?.reshape(&[hidden, 2 * ffn])?;
            let h = x_e.matmul(&w_gu)?;
            let act = &h.narrow(1, 0, ffn)?.silu() * &h.narrow(1, ffn, ffn)?;
            parts.push(act.matmul(&down.narrow(0, i, 1)?.reshape(&[ffn, hidden])?)?);
        }
        let y = match parts.len() {
            0 => rows.narrow(0, 0, 0)?,
            _ => Var::cat(&parts.iter().collect::<Vec<_>>(), 0)?,
        };
        let out = y.moe_combine(rank, &got, &w, self.fused)?;
        // experts * sum_e (assigned_e / tokens) * mean_t probs[t, e], assignments before
        // dropping: the sum over (t, e) of probs[t, e] * experts * assigned_e / tokens^2.
        let scale = e as f64 / (tokens.max(1) as f64).powi(2);
        let f: Vec<T> = routed.assigned.iter().map(|&a| T::from_f64(a as f64 * scale)).collect();
        let f = Var::constant(Tensor::from_shape_vec(&[1, e], f)?);
        let aux_loss = (&probs * &f).sum();
        let lse = logits.logsumexp(1)?;
        let z_loss = (&lse * &lse).mean();
        let out = DVar::from_var(rank, &out, Placement::Shard(0))?;
        Ok(MoeOutput { out, aux_loss, z_loss, load: routed.load, dropped: routed.dropped })
    }
}

impl<T: Element> Module<T> for MoeLayer<T> {
    fn visit<'s>(&'s self, p: &str, f: &mut dyn FnMut(&str, &'s Param<T>)) {
        f(&join(p, "router.weight"), &self.router);
        f(&join(p, "experts.gate_up"), &self.gate_up);
        f(&join(p, "experts.down"), &self.down);
    }

    fn visit_mut<'s>(&'s mut self, p: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>)) {
        f(&join(p, "router.weight"), &mut self.router);
        f(&join(p, "experts.gate_up"), &mut self.gate_up);
        f(&join(p, "experts.down"), &mut self.down);
    }
}
