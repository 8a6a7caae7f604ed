//! Optimizers: [`Sgd`] (with momentum and weight decay) and [`Adam`] (AdamW's decoupled weight
//! decay). Each rank steps its own parameters: its shards of sharded weights, and its copy of
//! replicated ones, whose gradients the layers' backward passes make equal on every rank, so the
//! copies stay equal without an exchange.
//!
//! The update is computed in the accumulator type (f32 for f16 and bf16). For f16 and bf16
//! parameters the optimizer keeps f32 *master weights* (made from the values at the first step)
//! and rounds them into the parameter after each step, so that small updates are not lost to
//! the half type's rounding; f32 and f64 parameters are updated in place. Parameters on a GPU
//! are stepped there (one fused kernel per parameter computing the same update in the same
//! accumulator type, through the tensors' optimizer step), their state kept on that GPU.

mod adam;
mod sgd;
mod state;

pub use adam::Adam;
pub use sgd::Sgd;

use std::any::TypeId;

use super::Param;
use crate::autograd::Module;
use crate::tensor::{Accumulator, Element, OptimRule, Tensor};
use crate::{Error, Result};

/// One parameter's optimizer state: its master weights (half types only), `N` buffers of its
/// size (momentum; Adam's two moments), and the steps taken. The tensors live where the
/// parameter does: on the host, or on its GPU (a state loaded from a checkpoint moves there at
/// the next step).
pub(crate) struct Slot<A: Element, const N: usize> {
    master: Option<Tensor<A>>,
    buffers: [Tensor<A>; N],
    steps: u64,
}

/// The state of every parameter, matched to them by position.
pub(crate) struct Slots<A: Element, const N: usize> {
    slots: Vec<Slot<A, N>>,
}

/// A state buffer of `value`'s length, zeros, where `value` lives.
fn zeros_like<T: Element, A: Element>(value: &Tensor<T>) -> Result<Tensor<A>> {
    value.zeros_beside::<A>(&[value.len()])
}

/// `t` where `value` lives (a state loaded on the host, for a parameter on a GPU).
fn beside<T: Element, A: Element>(t: Tensor<A>, value: &Tensor<T>) -> Result<Tensor<A>> {
    t.into_place_of(value)
}

/// Moves every buffer where `value` lives, where it is not there yet.
fn move_beside<T: Element, A: Element>(buffers: &mut [Tensor<A>], value: &Tensor<T>) -> Result<()> {
    for b in buffers {
        if b.device() != value.device() {
            *b = beside(b.clone(), value)?;
        }
    }
    Ok(())
}

impl<A: Accumulator, const N: usize> Slots<A, N> {
    fn new() -> Self {
        Slots { slots: Vec::new() }
    }

    /// Steps every parameter that has a gradient by `rule(step)` (the tensors' fused optimizer
    /// step, on the host or the GPU where the parameter lives), with its value in the
    /// accumulator type (the parameter itself for f32 and f64, its master weights for half
    /// types, rounded back into it). Creates the state at the first call.
    fn step<T: Element<Acc = A>>(
        &mut self,
        op: &'static str,
        params: Vec<&mut Param<T>>,
        mut rule: impl FnMut(u64) -> OptimRule,
    ) -> Result<()> {
        if self.slots.is_empty() {
            let mut slots = Vec::with_capacity(params.len());
            for p in &params {
                let mut buffers = Vec::with_capacity(N);
                for _ in 0..N {
                    buffers.push(zeros_like::<T, A>(p.value())?);
                }
                let buffers = buffers.try_into().unwrap_or_else(|_| unreachable!("N buffers"));
                slots.push(Slot { master: None, buffers, steps: 0 });
            }
            self.slots = slots;
        }
        if params.len() != self.slots.len() {
            return Err(Error::InvalidArgument {
                op,
                rank: 0,
                reason: format!(
                    "{} parameters given, the optimizer's state is for {}: step the same \
                     parameters every time, in the same order (or reset it)",
                    params.len(),
                    self.slots.len()
                ),
            });
        }
        for (i, (param, slot)) in params.into_iter().zip(&mut self.slots).enumerate() {
            let (value, grad) = param.value_and_grad();
            let state_len = slot.buffers.first().map_or(value.len(), Tensor::len);
            if value.len() != state_len {
                return Err(Error::InvalidArgument {
                    op,
                    rank: 0,
                    reason: format!(
                        "parameter {i} has {} elements, its state {state_len}: the same \
                         parameters, in the same order (or reset the optimizer)",
                        value.len(),
                    ),
                });
            }
            let Some(grad) = grad else { continue };
            if value.device() != grad.device() {
                return Err(Error::InvalidArgument {
                    op,
                    rank: 0,
                    reason: format!(
                        "parameter {i} lives on {}, its gradient on {}: both on one device",
                        value.device(),
                        grad.device()
                    ),
                });
            }
            slot.steps += 1;
            move_beside(&mut slot.buffers, value)?;
            let mut master = match slot.master.take() {
                _ if TypeId::of::<T>() == TypeId::of::<A>() => None,
                Some(m) => Some(beside(m, value)?),
                None => Some(value.cast::<A>()),
            };
            let rule = rule(slot.steps);
            let stepped = value.optim_step_(
                master.as_mut(),
                &grad,
                &mut slot.buffers[..rule.buffers()],
                rule,
            );
            slot.master = master;
            stepped?;
        }
        Ok(())
    }
}

/// Steps every parameter of `model` with `step` (an optimizer's step over [`Param`]s, in the
/// module's fixed order), then writes the new values back into the model.
pub(crate) fn step_module<'a, T: Element>(
    op: &'static str,
    model: &mut dyn Module<'a, T>,
    step: impl FnOnce(Vec<&mut Param<T>>) -> Result<()>,
) -> Result<()> {
    let mut params = Vec::new();
    let mut not_leaf = None;
    model.visit("", &mut |name, v, _| match Param::from_var(v) {
        Some(p) => params.push(p),
        None => not_leaf = not_leaf.take().or_else(|| Some(name.to_string())),
    });
    if let Some(name) = not_leaf {
        return Err(Error::InvalidArgument {
            op,
            rank: 0,
            reason: format!("the module's {name} is not a parameter (a tracked leaf)"),
        });
    }
    step(params.iter_mut().collect())?;
    let mut stepped = params.into_iter();
    let mut result = Ok(());
    model.visit_mut("", &mut |_, v, _| {
        if let Some(p) = stepped.next()
            && let Err(e) = v.set_value(p.value().clone())
        {
            result = Err(e);
        }
    });
    result
}
