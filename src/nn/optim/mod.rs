//! Optimizers: [`Sgd`] (with momentum and weight decay) and [`Adam`] (AdamW's decoupled weight
//! decay). Each rank steps its own parameters: its shards of sharded weights, and its copy of
//! replicated ones, whose gradients the layers' backward passes make equal on every rank, so the
//! copies stay equal without an exchange.
//!
//! The update is computed in the accumulator type (f32 for f16 and bf16). For f16 and bf16
//! parameters the optimizer keeps f32 *master weights* (made from the values at the first step)
//! and rounds them into the parameter after each step, so that small updates are not lost to
//! the half type's rounding; f32 and f64 parameters are updated in place.

mod adam;
mod sgd;
mod state;

pub use adam::Adam;
pub use sgd::Sgd;

use std::any::TypeId;

use super::Param;
use crate::autograd::Module;
use crate::tensor::{Accumulator, Element};
use crate::{Error, Result};

/// One parameter's optimizer state: its master weights (half types only), `N` buffers of its
/// size (momentum; Adam's two moments), and the steps taken.
pub(crate) struct Slot<A, const N: usize> {
    master: Option<Vec<A>>,
    buffers: [Vec<A>; N],
    steps: u64,
}

/// The state of every parameter, matched to them by position.
pub(crate) struct Slots<A, const N: usize> {
    slots: Vec<Slot<A, N>>,
}

impl<A: Accumulator, const N: usize> Slots<A, N> {
    fn new() -> Self {
        Slots { slots: Vec::new() }
    }

    /// Runs `update(value, grad, buffers, step)` on every parameter that has a gradient, with its
    /// value in the accumulator type (the parameter itself for f32 and f64, its master weights
    /// for half types, rounded back into it afterwards). Creates the state at the first call.
    fn step<T: Element<Acc = A>>(
        &mut self,
        op: &'static str,
        params: Vec<&mut Param<T>>,
        mut update: impl FnMut(&mut [A], &[T], &mut [Vec<A>; N], u64),
    ) -> Result<()> {
        if self.slots.is_empty() {
            self.slots = params
                .iter()
                .map(|p| Slot {
                    master: None,
                    buffers: std::array::from_fn(|_| vec![<A as Element>::zero(); p.value().len()]),
                    steps: 0,
                })
                .collect();
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
            if value.len() != slot.buffers.first().map_or(value.len(), Vec::len) {
                return Err(Error::InvalidArgument {
                    op,
                    rank: 0,
                    reason: format!(
                        "parameter {i} has {} elements, its state {}: the same parameters, in \
                         the same order (or reset the optimizer)",
                        value.len(),
                        slot.buffers[0].len()
                    ),
                });
            }
            let Some(grad) = grad else { continue };
            // The updates are host loops over the elements; a GPU kernel for them is not
            // written yet.
            if value.device() != crate::Device::Host {
                return Err(Error::DeviceUnavailable {
                    op,
                    device: value.device().to_string(),
                    reason: "the optimizers update parameters on the host: a world of GPUs has \
                             no optimizer kernel yet (move the parameters with to_host())"
                        .into(),
                });
            }
            slot.steps += 1;
            if TypeId::of::<T>() == TypeId::of::<A>() {
                let values = value.as_mut_slice();
                // SAFETY: `T` is `A` (checked), so the slice is reinterpreted as itself.
                let values = unsafe {
                    std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<A>(), values.len())
                };
                update(values, grad.as_slice(), &mut slot.buffers, slot.steps);
            } else {
                let master = slot
                    .master
                    .get_or_insert_with(|| value.as_slice().iter().map(|v| v.to_acc()).collect());
                update(master, grad.as_slice(), &mut slot.buffers, slot.steps);
                for (v, &m) in value.as_mut_slice().iter_mut().zip(master.iter()) {
                    *v = T::from_acc(m);
                }
            }
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
