//! Expert-parallel dispatch and combine on [`Var`], differentiated through the same fused
//! kernels as the forward pass:
//!
//! | forward | backward |
//! | --- | --- |
//! | `rows = moe_dispatch(x)` | `dx = moe_combine(d_rows)` with every weight 1: each token's slots summed back |
//! | `out = moe_combine(y, w)` | `dy`: each slot's `w * d_out[token]` dispatched as the forward's rows went; `dw[t, s] = <d_out[t], y[row of (t, s)]>` with `y`'s rows brought back, unsummed |
//!
//! Both backward moves reuse the forward's plan (the agreed counts): no routing and no count
//! exchange again, one agreement of the width and the plan each.

use crate::autograd::Var;
use crate::autograd::var::record;
use crate::fused::Dispatched;
use crate::fused::moe_combine::combine_with;
use crate::fused::moe_dispatch::dispatch_again;
use crate::shmem::Rank;
use crate::tensor::Routed;
use crate::{Element, Result, Tensor};

impl<'a, T: Element> Var<'a, T> {
    /// [`fused::moe_dispatch`](crate::fused::moe_dispatch) of this rank's tokens `self`
    /// (`[tokens, hidden]`), differentiated: the rows this rank's experts receive, as a `Var`, and
    /// the dispatch (its layout, for [`Var::moe_combine`]). `fused == false` runs the unfused
    /// baselines forward and backward. Collective, forward and backward.
    ///
    /// # Errors
    /// As [`fused::moe_dispatch`](crate::fused::moe_dispatch).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::tensor::{Routed, Tensor};
    /// use dist_tensor::World;
    /// let grads = World::threads(2)?.run(|rank| {
    ///     // One token a rank, to both experts (one a rank), weights 0.5 and 0.5.
    ///     let x = Var::param(Tensor::<f64>::from_shape_vec(&[1, 2], vec![1.0, 2.0])?);
    ///     let routed = Routed::from_parts(2, vec![0, 1], Tensor::from_shape_vec(&[1, 2], vec![0.5, 0.5])?)?;
    ///     let (rows, got) = x.moe_dispatch(rank, &routed, true)?;
    ///     // Expert e scales by e + 1; the combine's gradient reaches x through both experts.
    ///     let y = rows.scale(rank.rank() as f64 + 1.0);
    ///     let w = Var::constant(routed.weight.clone());
    ///     y.moe_combine(rank, &got, &w, true)?.sum().backward()?;
    ///     Ok(x.grad().unwrap().as_slice().to_vec())
    /// })?;
    /// assert_eq!(grads[0], vec![1.5, 1.5]); // 0.5 * 1 + 0.5 * 2
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn moe_dispatch(
        &self,
        rank: &'a Rank<'a>,
        routed: &Routed<T>,
        fused: bool,
    ) -> Result<(Var<'a, T>, Dispatched<T>)> {
        let run =
            if fused { crate::fused::moe_dispatch } else { crate::fused::moe_dispatch_unfused };
        let got = run(rank, self.value(), routed)?;
        let plan = got.plan.clone();
        let rows = record(got.rows.clone(), &[self], move |g, _| {
            let ones = Tensor::from_shape_vec(
                &[plan.tokens[plan.me], plan.top_k],
                vec![T::from_f64(1.0); plan.tokens[plan.me] * plan.top_k],
            )?;
            Ok(vec![Some(combine_with(rank, g, &plan, &ones, fused)?)])
        });
        Ok((rows, got))
    }

    /// [`fused::moe_combine`](crate::fused::moe_combine) of the experts' outputs `self`
    /// (`[received, width]`) with the gate weights `weight` (`[tokens, top_k]`), both
    /// differentiated (module docs). Collective, forward and backward.
    ///
    /// # Errors
    /// As [`fused::moe_combine`](crate::fused::moe_combine).
    pub fn moe_combine(
        &self,
        rank: &'a Rank<'a>,
        dispatch: &Dispatched<T>,
        weight: &Var<'a, T>,
        fused: bool,
    ) -> Result<Var<'a, T>> {
        let run = if fused { crate::fused::moe_combine } else { crate::fused::moe_combine_unfused };
        let out = run(rank, self.value(), dispatch, weight.value())?;
        let plan = dispatch.plan.clone();
        let (y, w) = (self.value().clone(), weight.value().clone());
        Ok(record(out, &[self, weight], move |g, need| {
            // Both moves run whenever either gradient is wanted, so that every rank makes the
            // same collective calls.
            let flat = plan.flat();
            let (tokens, k, width) = (plan.tokens[plan.me], plan.top_k, y.shape()[1]);
            let ones =
                Tensor::from_shape_vec(&[tokens * k, 1], vec![T::from_f64(1.0); tokens * k])?;
            let back = combine_with(rank, &y, &flat, &ones, fused)?;
            let (g, back_rows, w) = (g.as_slice(), back.as_slice(), w.as_slice());
            let zero = <T::Acc as Element>::zero();
            let mut dw = Vec::with_capacity(tokens * k);
            let mut per_slot = Vec::with_capacity(tokens * k * width);
            for slot in 0..tokens * k {
                let d_out = &g[(slot / k) * width..][..width];
                let row = &back_rows[slot * width..][..width];
                let dot = d_out.iter().zip(row).fold(zero, |a, (x, y)| a + x.to_acc() * y.to_acc());
                dw.push(T::from_acc(dot));
                let ws = w[slot].to_acc();
                per_slot.extend(d_out.iter().map(|x| T::from_acc(ws * x.to_acc())));
            }
            let per_slot = Tensor::from_shape_vec(&[tokens * k, width], per_slot)?;
            let dy = dispatch_again(rank, &flat, &per_slot, fused)?;
            let dw = Tensor::from_shape_vec(&[tokens, k], dw)?;
            Ok(vec![need[0].then_some(dy), need[1].then_some(dw)])
        }))
    }
}
