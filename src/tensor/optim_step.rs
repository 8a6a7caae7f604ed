//! One fused optimizer step of a parameter tensor: the element update of SGD (momentum, weight
//! decay) or AdamW, with the optimizer's state beside it. One dispatch: a host parameter runs
//! the loop below; a GPU parameter runs one kernel (`kernels/train.cu`) computing the same update
//! in the same accumulator type. The optimizers of `nn::optim` own the state and the rule's
//! constants; this is their arithmetic.

use std::any::TypeId;

use super::{Accumulator, Element, Tensor};
use crate::{Error, Result};

/// An optimizer's update rule with this step's constants (f64; each arm rounds them to the
/// parameter's accumulator type once).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum OptimRule {
    /// `d = g + weight_decay * p`; with momentum `v = momentum * v + d`, `d = v`; `p -= lr * d`.
    Sgd { lr: f64, momentum: f64, weight_decay: f64 },
    /// AdamW: `m`, `v` the moments; `p = p * shrink - step * m / (sqrt(v) / root + eps)` with
    /// `step = lr / (1 - beta1^t)`, `root = sqrt(1 - beta2^t)`, `shrink = 1 - lr * decay`.
    Adam { step: f64, beta1: f64, beta2: f64, eps: f64, shrink: f64, root: f64 },
}

impl OptimRule {
    /// How many state buffers the rule reads and writes: SGD's velocity (with momentum only),
    /// Adam's two moments.
    pub(crate) fn buffers(self) -> usize {
        match self {
            OptimRule::Sgd { momentum, .. } => usize::from(momentum != 0.0),
            OptimRule::Adam { .. } => 2,
        }
    }
}

const OP: &str = "optimizer step";

impl<T: Element> Tensor<T> {
    /// One step of this parameter with gradient `grad` under `rule`, in place: the update is
    /// computed in the accumulator type `T::Acc`, through `master` (the f32 copy of an f16 or
    /// bf16 parameter, required for those and `None` for f32 and f64, updated in place and
    /// rounded into the parameter), with `state` (`rule.buffers()` tensors of the parameter's
    /// length, updated in place). Every tensor lives where the parameter does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a tensor lives elsewhere than the parameter, a half-type
    /// parameter has no master weights, or `state` is not the rule's number of buffers;
    /// [`Error::InvalidShape`] when the lengths differ; a GPU's launch error.
    pub(crate) fn optim_step_(
        &mut self,
        master: Option<&mut Tensor<T::Acc>>,
        grad: &Tensor<T>,
        state: &mut [Tensor<T::Acc>],
        rule: OptimRule,
    ) -> Result<()> {
        let own_master = TypeId::of::<T>() == TypeId::of::<T::Acc>();
        if master.is_some() == own_master || state.len() != rule.buffers() {
            return Err(Error::InvalidArgument {
                op: OP,
                rank: 0,
                reason: format!(
                    "a {} parameter steps with {} master weights and {} state buffers, given {} \
                     and {}",
                    T::DTYPE,
                    if own_master { "no" } else { "f32" },
                    rule.buffers(),
                    if master.is_some() { "master weights" } else { "none" },
                    state.len()
                ),
            });
        }
        let n = self.len();
        let lens = master.iter().map(|m| m.len()).chain(state.iter().map(Tensor::len));
        if grad.len() != n || lens.clone().any(|l| l != n) {
            return Err(Error::InvalidShape {
                op: OP,
                reason: format!(
                    "a parameter of {n} elements with a gradient of {} and state of {:?}",
                    grad.len(),
                    lens.collect::<Vec<_>>()
                ),
            });
        }
        let devices = master.iter().map(|m| m.device()).chain(state.iter().map(Tensor::device));
        if let Some(elsewhere) =
            std::iter::once(grad.device()).chain(devices).find(|&d| d != self.device())
        {
            return Err(Error::InvalidArgument {
                op: OP,
                rank: 0,
                reason: format!(
                    "the parameter lives on {}, its gradient or state on {elsewhere}: all on one \
                     device",
                    self.device()
                ),
            });
        }
        if !self.is_on_host() && !grad.is_on_host() {
            *self = super::dispatch::optimizer_step(self, master.as_deref(), grad, state, rule)?;
            return Ok(());
        }
        let mut buffers: Vec<&mut [T::Acc]> = state.iter_mut().map(|b| b.as_mut_slice()).collect();
        match master {
            Some(master) => {
                host_update(master.as_mut_slice(), grad.as_slice(), &mut buffers, rule);
                for (v, &m) in self.as_mut_slice().iter_mut().zip(master.as_slice()) {
                    *v = T::from_acc(m);
                }
            }
            None => {
                let values = self.as_mut_slice();
                // SAFETY: `T` is `T::Acc` (checked above), so the slice is reinterpreted as
                // itself.
                let values = unsafe {
                    std::slice::from_raw_parts_mut(
                        values.as_mut_ptr().cast::<T::Acc>(),
                        values.len(),
                    )
                };
                host_update(values, grad.as_slice(), &mut buffers, rule);
            }
        }
        Ok(())
    }
}

/// The host arm: `rule` on every element of `values` (the parameter, or its master weights) in
/// the accumulator type `A`, the constants rounded to `A` once.
fn host_update<A: Accumulator, T: Element<Acc = A>>(
    values: &mut [A],
    grads: &[T],
    state: &mut [&mut [A]],
    rule: OptimRule,
) {
    let acc = <A as Element>::from_f64;
    match (rule, state) {
        (OptimRule::Sgd { lr, momentum, weight_decay }, state) => {
            let (lr, mom, decay) = (acc(lr), acc(momentum), acc(weight_decay));
            match state {
                [velocity] => {
                    for ((p, &g), v) in values.iter_mut().zip(grads).zip(velocity.iter_mut()) {
                        *v = mom * *v + (g.to_acc() + decay * *p);
                        *p = *p - lr * *v;
                    }
                }
                _ => {
                    for (p, &g) in values.iter_mut().zip(grads) {
                        *p = *p - lr * (g.to_acc() + decay * *p);
                    }
                }
            }
        }
        (OptimRule::Adam { step, beta1, beta2, eps, shrink, root }, [m, v]) => {
            let (step, b1, b2, eps) = (acc(step), acc(beta1), acc(beta2), acc(eps));
            let (shrink, root, one) = (acc(shrink), acc(root), acc(1.0));
            for (((p, &g), m), v) in
                values.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut())
            {
                let g = g.to_acc();
                *m = b1 * *m + (one - b1) * g;
                *v = b2 * *v + (one - b2) * g * g;
                *p = *p * shrink - step * *m / (v.sqrt() / root + eps);
            }
        }
        (OptimRule::Adam { .. }, _) => unreachable!("checked: Adam has two state buffers"),
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::OptimRule;
    use crate::{Error, Tensor};

    const SGD: OptimRule = OptimRule::Sgd { lr: 0.5, momentum: 0.9, weight_decay: 0.1 };

    #[test]
    fn sgd_and_adam_match_the_formulas_in_f64() {
        let (p0, g) = ([1.0, -2.0, 0.25], [0.5, 0.125, -4.0]);
        let mut p = Tensor::<f64>::from(p0.to_vec());
        let mut v = [Tensor::<f64>::from(vec![0.5; 3])];
        p.optim_step_(None, &Tensor::from(g.to_vec()), &mut v, SGD).unwrap();
        for i in 0..3 {
            let vel = 0.9 * 0.5 + (g[i] + 0.1 * p0[i]);
            assert!((v[0].as_slice()[i] - vel).abs() < 1e-15);
            assert!((p.as_slice()[i] - (p0[i] - 0.5 * vel)).abs() < 1e-15);
        }
        let adam = OptimRule::Adam {
            step: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-3,
            shrink: 0.98,
            root: 0.5,
        };
        let mut p = Tensor::<f64>::from(p0.to_vec());
        let mut mv = [Tensor::<f64>::from(vec![0.25; 3]), Tensor::from(vec![0.5; 3])];
        p.optim_step_(None, &Tensor::from(g.to_vec()), &mut mv, adam).unwrap();
        for i in 0..3 {
            let m = 0.9 * 0.25 + 0.1 * g[i];
            let v = 0.99 * 0.5 + 0.01 * g[i] * g[i];
            let want = p0[i] * 0.98 - 0.1 * m / (v.sqrt() / 0.5 + 1e-3);
            assert!((p.as_slice()[i] - want).abs() < 1e-15, "{i}");
        }
    }

    #[test]
    fn half_parameters_step_through_their_master_weights() {
        let mut p = Tensor::<bf16>::from(vec![bf16::ONE; 2]);
        let mut master = Tensor::<f32>::from(vec![1.0; 2]);
        let g = Tensor::from(vec![bf16::ONE; 2]);
        let plain = OptimRule::Sgd { lr: 1e-3, momentum: 0.0, weight_decay: 0.0 };
        for _ in 0..10 {
            p.optim_step_(Some(&mut master), &g, &mut [], plain).unwrap();
        }
        // 1 - 10 * 1e-3 in f32, rounded into bf16 (whose step near 1 is 2^-8 below).
        assert!((master.as_slice()[0] - 0.99).abs() < 1e-6);
        assert_eq!(p.as_slice()[0], bf16::from_f32(master.as_slice()[0]));
    }

    #[test]
    fn wrong_state_is_a_typed_error() {
        let g = Tensor::<bf16>::from(vec![bf16::ONE; 2]);
        let mut p = g.clone();
        let none = OptimRule::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 };
        // A half type without master weights, f32 with them, the wrong number of buffers.
        let err = p.optim_step_(None, &g, &mut [], none).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let mut q = Tensor::<f32>::from(vec![1.0; 2]);
        let err = q
            .optim_step_(Some(&mut q.clone()), &Tensor::from(vec![1.0; 2]), &mut [], none)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let err = q.optim_step_(None, &Tensor::from(vec![1.0; 2]), &mut [], SGD).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        // A gradient of another length; the parameter is left as it was.
        let err = q.optim_step_(None, &Tensor::from(vec![1.0; 3]), &mut [], none).unwrap_err();
        assert!(matches!(err, Error::InvalidShape { .. }), "{err}");
        assert_eq!(q.as_slice(), &[1.0, 1.0]);
    }
}
