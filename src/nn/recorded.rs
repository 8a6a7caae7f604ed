//! [`Recorded`]: a layer's forward pass recorded on autograd, which its `backward` method runs
//! backward. The layers' `forward` / `backward` pairs are this and nothing more: no hand-written
//! derivative is left (none was measurably faster than autograd's, `cargo bench --bench nn --
//! autograd`), so there is one backward pass per layer to keep right.

use super::GradHook;
use crate::autograd::graph::LeafHook;
use crate::autograd::{DVar, Var};
use crate::dist_tensor::{DistTensor, Placement};
use crate::nn::Module;
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

/// The tracked leaves a forward pass made of its inputs, and its output: what a layer's saved
/// value holds between `forward` and `backward`. The graph behind the output keeps what each op
/// needs for its backward pass (shared with the forward pass's values, not copied).
#[derive(Clone)]
pub(crate) struct Recorded<'r, T: Element> {
    inputs: Vec<DVar<'r, T>>,
    output: DVar<'r, T>,
}

impl<T: Element> std::fmt::Debug for Recorded<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shapes: Vec<_> = self.inputs.iter().map(|x| x.value().global_dims().to_vec()).collect();
        f.debug_struct("Recorded")
            .field("inputs", &shapes)
            .field("output", &self.output.value().global_dims())
            .finish()
    }
}

impl<'r, T: Element> Recorded<'r, T> {
    /// Runs `forward` on tracked copies of `inputs` (the values shared, not copied): the output's
    /// value, and the record for [`Recorded::backward`].
    pub(crate) fn forward<const N: usize>(
        inputs: [&DistTensor<'r, T>; N],
        forward: impl FnOnce([&DVar<'r, T>; N]) -> Result<DVar<'r, T>>,
    ) -> Result<(DistTensor<'r, T>, Self)> {
        let leaves = inputs.map(|x| DVar::param(x.clone()));
        let output = forward(leaves.each_ref())?;
        Ok((output.value().clone(), Recorded { inputs: leaves.into(), output }))
    }

    /// The gradient a backward pass has computed for the `i`-th input so far.
    #[cfg(test)]
    pub(crate) fn input_grad(&self, i: usize) -> Option<Tensor<T>> {
        self.inputs[i].grad()
    }

    /// The `i`-th input, as the forward pass saw it.
    pub(crate) fn input(&self, i: usize) -> &DistTensor<'r, T> {
        self.inputs[i].value()
    }

    /// The backward pass of `layer`'s recorded forward pass, seeded with `dy` (laid out as the
    /// output): the inputs' gradients, each laid out as its input. The gradients of the layer's
    /// parameters are added to theirs, complete on every rank: a replicated parameter's part
    /// from this rank's rows is summed over the ranks here (autograd alone leaves the parts, for
    /// [`sync_grads`](crate::nn::sync_grads)), and only this pass's part, so gradients
    /// accumulated before stay as they were. Collective.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] (naming `op`) when `dy` is not laid out as the output; an op's
    /// backward error.
    pub(crate) fn backward<L: Module<T> + ?Sized>(
        self,
        op: &'static str,
        layer: &L,
        dy: &DistTensor<'r, T>,
    ) -> Result<Vec<DistTensor<'r, T>>> {
        self.backward_hooked(op, layer, dy, None)
    }

    /// [`Recorded::backward`], telling `hook` of each of the layer's parameters (its index in
    /// [`Module::visit`]'s order, which is the layer's
    /// [`Module::parameters`] order) as soon as its gradient
    /// is complete: a sharded one right after the last op that uses it has run backward (before
    /// the ops that come after it in the pass: a weight before the input gradient of its
    /// product), a replicated one once its parts are summed over the ranks, after the pass; a
    /// parameter the pass did not reach at the end, with what it had (zeros if nothing), so that
    /// every parameter is told once. Collective.
    ///
    /// # Errors
    /// As [`Recorded::backward`]; the hook's error (the pass stops there; replicated parameters
    /// keep the gradients they had before it).
    pub(crate) fn backward_hooked<L: Module<T> + ?Sized>(
        self,
        op: &'static str,
        layer: &L,
        dy: &DistTensor<'r, T>,
        mut hook: Option<&mut dyn GradHook<T>>,
    ) -> Result<Vec<DistTensor<'r, T>>> {
        let out = self.output.value();
        if dy.global_dims() != out.global_dims()
            || dy.placement() != out.placement()
            || dy.local().shape() != out.local().shape()
        {
            return Err(Error::InvalidShape {
                op,
                reason: format!(
                    "the output gradient is {:?} placed {} (this rank's part {:?}); the output \
                     was {:?} placed {} (part {:?}): the gradient must be laid out as the output",
                    dy.global_dims(),
                    dy.placement(),
                    dy.local().shape(),
                    out.global_dims(),
                    out.placement(),
                    out.local().shape()
                ),
            });
        }
        let mut params: Vec<(Var<'r, T>, bool)> = Vec::new();
        layer.visit("", &mut |_, p| params.push((p.var(), p.is_replicated())));
        let count = params.len();
        let replicated: Vec<usize> = (0..count).filter(|&i| params[i].1).collect();
        // This pass's parts alone: what earlier passes accumulated is complete already.
        let before: Vec<Option<Tensor<T>>> =
            replicated.iter().map(|&i| params[i].0.take_grad()).collect();
        let mut told = vec![false; count];
        let hooked = hook.is_some();
        let pass = {
            let ids: Vec<Option<u64>> =
                params.iter().map(|(v, _)| v.leaf().map(|l| l.id())).collect();
            let mut on_leaf = |id: u64| -> Result<()> {
                let Some(i) = ids.iter().position(|&p| p == Some(id)) else {
                    return Ok(()); // an input of the layer, not a parameter
                };
                let (v, is_replicated) = &params[i];
                match hook.as_mut() {
                    Some(hook) if !*is_replicated => {
                        told[i] = true;
                        let g = v.grad().unwrap_or_else(|| Tensor::zeros(v.shape()));
                        hook.grad_ready(i, count, &g)
                    }
                    _ => Ok(()),
                }
            };
            let leaf_hook: Option<LeafHook<'_>> = if hooked { Some(&mut on_leaf) } else { None };
            self.output.local().backward_hooked(dy.local().clone(), leaf_hook)
        };
        if let Err(e) = pass {
            for (&i, prev) in replicated.iter().zip(before) {
                params[i].0.set_grad(prev);
            }
            return Err(e);
        }
        for (&i, prev) in replicated.iter().zip(before) {
            let v = &params[i].0;
            let part = v.take_grad().unwrap_or_else(|| Tensor::zeros(v.shape()));
            let whole = DistTensor::from_local(dy.rank(), part, Placement::Partial)
                .and_then(|p| p.redistribute(Placement::Replicate));
            match whole {
                Ok(w) => v.set_grad(Some(match prev {
                    Some(p) => p + w.local(),
                    None => w.into_local(),
                })),
                Err(e) => {
                    v.set_grad(prev);
                    return Err(e);
                }
            }
        }
        if let Some(hook) = hook {
            // The replicated ones, now whole; then any the pass did not reach.
            for i in replicated.into_iter().chain(0..count) {
                if !std::mem::replace(&mut told[i], true) {
                    let v = &params[i].0;
                    hook.grad_ready(
                        i,
                        count,
                        &v.grad().unwrap_or_else(|| Tensor::zeros(v.shape())),
                    )?;
                }
            }
        }
        self.inputs
            .iter()
            .map(|x| {
                let g = x.grad().unwrap_or_else(|| Tensor::zeros(x.value().local().shape()));
                x.value().map_local(|_| g)
            })
            .collect()
    }
}
