//! [`Recorded`]: a layer's forward pass recorded on autograd, which its `backward` method runs
//! backward. The layers' `forward` / `backward` pairs are this and nothing more: no hand-written
//! derivative is left (none was measurably faster than autograd's, `cargo bench --bench nn --
//! autograd`), so there is one backward pass per layer to keep right.

use crate::autograd::{DVar, Module, Sharing, Var};
use crate::dist::{DistTensor, Placement};
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

    /// The `i`-th input, as the forward pass saw it.
    pub(crate) fn input(&self, i: usize) -> &DistTensor<'r, T> {
        self.inputs[i].value()
    }

    /// The backward pass of `layer`'s recorded forward pass, seeded with `dy` (laid out as the
    /// output): the inputs' gradients, each laid out as its input. The gradients of the layer's
    /// parameters are added to theirs, complete on every rank: a replicated parameter's part
    /// from this rank's rows is summed over the ranks here (autograd alone leaves the parts, for
    /// [`sync_grads`](crate::autograd::sync_grads)), and only this pass's part, so gradients
    /// accumulated before stay as they were. Collective.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] (naming `op`) when `dy` is not laid out as the output; an op's
    /// backward error.
    pub(crate) fn backward<L: for<'a> Module<'a, T> + ?Sized>(
        self,
        op: &'static str,
        layer: &L,
        dy: &DistTensor<'r, T>,
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
        let mut replicated: Vec<Var<'r, T>> = Vec::new();
        layer.visit("", &mut |_, v, sharing| {
            if sharing == Sharing::Replicated {
                replicated.push(v.clone());
            }
        });
        // This pass's parts alone: what earlier passes accumulated is complete already.
        let before: Vec<Option<Tensor<T>>> = replicated.iter().map(Var::take_grad).collect();
        if let Err(e) = self.output.local().backward_with(dy.local().clone()) {
            for (v, prev) in replicated.iter().zip(before) {
                v.set_grad(prev);
            }
            return Err(e);
        }
        for (v, prev) in replicated.iter().zip(before) {
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
        self.inputs
            .iter()
            .map(|x| {
                let g = x.grad().unwrap_or_else(|| Tensor::zeros(x.value().local().shape()));
                x.value().map_local(|_| g)
            })
            .collect()
    }
}
