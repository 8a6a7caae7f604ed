//! [`LossScaler`]: dynamic loss scaling for f16 training (PyTorch's `GradScaler`). The loss is
//! multiplied by a large scale before the backward pass, so that small gradients do not flush
//! to zero in f16; the gradients are divided by it before the step. A step whose gradients hold
//! an inf or a NaN on *any* rank is skipped on *every* rank (one all-reduce of a flag), and the
//! scale halves; after `growth_interval` good steps in a row it doubles.

use std::borrow::Cow;

use super::{Module, Optimizer};
use crate::autograd::DVar;
use crate::checkpoint::{Checkpoint, Entry};
use crate::collectives::all_reduce;
use crate::shmem::Rank;
use crate::tensor::Element;
use crate::{Error, Placement, Result};

/// Dynamic loss scaling (see the module docs).
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Adam, LossScaler, Param};
/// use dist_tensor::{Tensor, World};
/// let out = World::threads(2)?.run(|rank| {
///     let mut p = Param::new(Tensor::<f32>::from(vec![1.0]));
///     let mut adam = Adam::new(0.1);
///     let mut scaler = LossScaler::new(1024.0);
///     // Rank 1's gradient overflowed: both ranks skip the step.
///     let g = if rank.rank() == 1 { f32::INFINITY } else { 1024.0 };
///     p.accumulate_grad(Tensor::from(vec![g]))?;
///     let stepped = scaler.step(&mut adam, &mut p, rank)?;
///     Ok((stepped, p.value().as_slice()[0], scaler.scale(), scaler.skipped()))
/// })?;
/// assert_eq!(out[0], (false, 1.0, 512.0, 1));
/// assert_eq!(out[0], out[1]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
    good_steps: u64,
    skipped: u64,
    /// Whether the gradients of the step under way are divided by the scale already.
    unscaled: Option<bool>,
}

impl LossScaler {
    /// A scaler starting at `initial_scale` (PyTorch starts at 65536), doubling after 2000 good
    /// steps in a row, halving at every overflow.
    pub fn new(initial_scale: f64) -> Self {
        LossScaler {
            scale: initial_scale,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            good_steps: 0,
            skipped: 0,
            unscaled: None,
        }
    }

    /// Good steps in a row after which the scale grows.
    pub fn growth_interval(mut self, steps: u64) -> Self {
        self.growth_interval = steps.max(1);
        self
    }

    /// The scale the next loss is multiplied by.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped for an inf or a NaN so far.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// `loss` times the scale: run the backward pass on this.
    ///
    /// # Errors
    /// As [`DVar::map`].
    pub fn scale_loss<'r, T: Element>(&self, loss: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let s = self.scale;
        loss.map(|l| Ok(l.scale(s)))
    }

    /// Divides every gradient of `model` by the scale and says whether they are all finite on
    /// every rank of `rank` (one all-reduce). Call it before clipping; [`LossScaler::step`]
    /// then does not divide again. Collective.
    ///
    /// # Errors
    /// As [`all_reduce`].
    pub fn unscale<T: Element, M: Module<T> + ?Sized>(
        &mut self,
        model: &M,
        rank: &Rank<'_>,
    ) -> Result<bool> {
        if let Some(finite) = self.unscaled {
            return Ok(finite);
        }
        let inv = T::from_f64(1.0 / self.scale);
        let mut bad = 0.0f64;
        let mut failed = None;
        model.visit("", &mut |_, p| {
            let Some(g) = p.grad() else { return };
            let g = g * inv;
            match g.host_elements() {
                Ok(v) if v.iter().any(|x| !x.to_f64().is_finite()) => bad = 1.0,
                Ok(_) => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
            p.set_grad(Some(g));
        });
        if let Some(e) = failed {
            return Err(e);
        }
        let finite = all_reduce(rank, &[bad])?[0] == 0.0;
        self.unscaled = Some(finite);
        Ok(finite)
    }

    /// Unscales (unless [`LossScaler::unscale`] did), steps `optimizer` over `model` when every
    /// gradient on every rank is finite (else skips, counting it), and updates the scale;
    /// whether it stepped. The gradients are left as they are (zero them before the next
    /// backward pass). Collective.
    ///
    /// # Errors
    /// As [`LossScaler::unscale`] and the optimizer's step.
    pub fn step<T: Element, M: Module<T> + ?Sized, O: Optimizer<T> + ?Sized>(
        &mut self,
        optimizer: &mut O,
        model: &mut M,
        rank: &Rank<'_>,
    ) -> Result<bool> {
        let finite = self.unscale(model, rank)?;
        self.unscaled = None;
        if finite {
            optimizer.step(model.parameters_mut())?;
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.good_steps = 0;
            }
        } else {
            self.skipped += 1;
            self.good_steps = 0;
            self.scale *= self.backoff_factor;
        }
        Ok(finite)
    }

    /// The scaler's state as checkpoint entries `prefix.scale`, `prefix.good_steps`,
    /// `prefix.skipped` (replicated: the same on every rank).
    pub fn state_dict(&self, prefix: &str) -> Vec<Entry<'static>> {
        [
            ("scale", self.scale),
            ("good_steps", self.good_steps as f64),
            ("skipped", self.skipped as f64),
        ]
        .into_iter()
        .map(|(name, v)| {
            Entry::from_values(
                super::join(prefix, name),
                Cow::Owned(vec![v]),
                &[1],
                Placement::Replicate,
            )
        })
        .collect()
    }

    /// The state saved by [`LossScaler::state_dict`]. Collective.
    ///
    /// # Errors
    /// As [`Checkpoint::load`]; [`Error::InvalidArgument`] for a scale that is not positive.
    pub fn load_state_dict(&mut self, ck: &Checkpoint<'_>, prefix: &str) -> Result<()> {
        let read = |name: &str| -> Result<f64> {
            let t = ck.load::<f64>(&super::join(prefix, name), Placement::Replicate)?;
            Ok(t.local().as_slice().first().copied().unwrap_or(f64::NAN))
        };
        let scale = read("scale")?;
        if scale.is_nan() || scale <= 0.0 {
            return Err(Error::InvalidArgument {
                op: "LossScaler::load_state_dict",
                rank: ck.rank().rank(),
                reason: format!("the checkpoint's scale is {scale}: it must be positive"),
            });
        }
        self.scale = scale;
        self.good_steps = read("good_steps")? as u64;
        self.skipped = read("skipped")? as u64;
        self.unscaled = None;
        Ok(())
    }
}
