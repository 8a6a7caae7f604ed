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

use crate::checkpoint::{Checkpoint, Entry};

/// What every optimizer does, for any [`Module`](super::Module): step its parameters, say and
/// set its learning rate (what a [schedule](super::LrSchedule) drives), and save and load its
/// state as checkpoint entries laid out as the parameters (so it reshards with the model).
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Adam, Module, Optimizer, Param, Sgd};
/// use dist_tensor::Tensor;
/// fn train_step(opt: &mut dyn Optimizer<f32>, model: &mut Param<f32>) -> dist_tensor::Result<()> {
///     model.accumulate_grad(Tensor::from(vec![1.0]))?;
///     opt.step(model.parameters_mut())?;
///     model.zero_grad();
///     Ok(())
/// }
/// let mut p = Param::new(Tensor::<f32>::from(vec![0.0]));
/// train_step(&mut Sgd::new(0.5), &mut p)?;
/// train_step(&mut Adam::new(0.5), &mut p)?;
/// assert!(p.value().as_slice()[0] < -0.9); // -0.5, then Adam's first step of -lr
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub trait Optimizer<T: Element> {
    /// One step of every parameter that has a gradient, in the order given (the same every
    /// time: the state is matched by position). Local: no exchange.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the parameters are not those of the first step.
    fn step(&mut self, params: Vec<&mut Param<T>>) -> Result<()>;

    /// The learning rate.
    fn lr(&self) -> f64;

    /// Sets the learning rate (for the next step).
    fn set_lr(&mut self, lr: f64);

    /// Forgets the state (moments, master weights, step counts).
    fn reset(&mut self);

    /// The state as checkpoint entries named `prefix.<parameter>.<buffer>` for the parameters
    /// of `model` (laid out as they are); none before the first step.
    ///
    /// # Errors
    /// As [`Entry::local`].
    fn state_dict<'a>(
        &'a self,
        model: &dyn super::Module<T>,
        prefix: &str,
    ) -> Result<Vec<Entry<'a>>>;

    /// Replaces the state by the checkpoint's, cut as `model`'s parameters are; a checkpoint
    /// with no state for them (saved before the first step) leaves the optimizer fresh.
    /// Collective.
    ///
    /// # Errors
    /// As [`Checkpoint::load`].
    fn load_state_dict(
        &mut self,
        ck: &Checkpoint<'_>,
        model: &dyn super::Module<T>,
        prefix: &str,
    ) -> Result<()>;
}

use std::any::TypeId;

use super::Param;
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

/// One parameter's state as host vectors: what ZeRO gathers over its group and cuts into
/// slices.
pub(crate) struct FlatSlot<A: Element, const N: usize> {
    pub(crate) buffers: [Vec<A>; N],
    pub(crate) master: Option<Vec<A>>,
    pub(crate) steps: u64,
}

impl<A: Accumulator, const N: usize> Slots<A, N> {
    pub(crate) fn new() -> Self {
        Slots { slots: Vec::new() }
    }

    /// Every parameter's state on the host, in order (none before the first step).
    pub(crate) fn to_flat(&self) -> Result<Vec<FlatSlot<A, N>>> {
        self.slots
            .iter()
            .map(|slot| {
                let mut buffers = Vec::with_capacity(N);
                for b in &slot.buffers {
                    buffers.push(b.host_elements()?.into_owned());
                }
                let buffers = buffers.try_into().unwrap_or_else(|_| unreachable!("N buffers"));
                let master = match &slot.master {
                    Some(m) => Some(m.host_elements()?.into_owned()),
                    None => None,
                };
                Ok(FlatSlot { buffers, master, steps: slot.steps })
            })
            .collect()
    }

    /// The state of parameters from host vectors (the next step moves them where each
    /// parameter lives).
    pub(crate) fn from_flat(flat: Vec<FlatSlot<A, N>>) -> Self {
        let slots = flat
            .into_iter()
            .map(|f| Slot {
                buffers: f.buffers.map(Tensor::from),
                master: f.master.map(Tensor::from),
                steps: f.steps,
            })
            .collect();
        Slots { slots }
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

/// A boxed optimizer is one (a training loop that picks Adam or ZeRO at run time).
impl<T: Element, O: Optimizer<T> + ?Sized> Optimizer<T> for Box<O> {
    fn step(&mut self, params: Vec<&mut Param<T>>) -> Result<()> {
        (**self).step(params)
    }

    fn lr(&self) -> f64 {
        (**self).lr()
    }

    fn set_lr(&mut self, lr: f64) {
        (**self).set_lr(lr);
    }

    fn reset(&mut self) {
        (**self).reset();
    }

    fn state_dict<'a>(
        &'a self,
        model: &dyn super::Module<T>,
        prefix: &str,
    ) -> Result<Vec<Entry<'a>>> {
        (**self).state_dict(model, prefix)
    }

    fn load_state_dict(
        &mut self,
        ck: &Checkpoint<'_>,
        model: &dyn super::Module<T>,
        prefix: &str,
    ) -> Result<()> {
        (**self).load_state_dict(ck, model, prefix)
    }
}
