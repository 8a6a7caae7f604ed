//! [`Trainer`]: the training step every script writes, once, for any [`Module`]: the backward
//! pass of each micro-batch's loss, gradient accumulation, data parallelism's averaging, the
//! sum of replicated parameters' gradients over the tensor-parallel ranks, loss scaling, the
//! learning-rate schedule, clipping by the global norm, the optimizer's step; and the whole
//! training state saved and resumed (on any world size and mesh) in one call each.
//!
//! ```
//! use dist_tensor::autograd::vocab_parallel_cross_entropy;
//! use dist_tensor::nn::gpt::{AttentionForm, Gpt, GptConfig};
//! use dist_tensor::nn::{Adam, WarmupCosine};
//! use dist_tensor::train::Trainer;
//! use dist_tensor::World;
//! let config = GptConfig { vocab: 7, embed: 8, heads: 2, hidden: 16, layers: 1, seq_len: 4 };
//! let dir = std::env::temp_dir().join(format!("dist-tensor-doc-trainer-{}", std::process::id()));
//! let ids = [1, 2, 3, 4, 5, 6, 0, 1];
//! let targets: Vec<Option<usize>> = ids.iter().map(|&i| Some((i + 1) % 7)).collect();
//! // Two steps on 2 ranks, saved...
//! World::threads(2)?.run(|rank| {
//!     let mut gpt = Gpt::<f32>::new(rank, config, AttentionForm::TensorParallel, 1)?;
//!     let mut trainer = Trainer::new(Adam::new(1e-2))
//!         .schedule(WarmupCosine { peak: 1e-2, min: 1e-3, warmup: 2, total: 10 })
//!         .clip_grad_norm(1.0);
//!     for _ in 0..2 {
//!         let loss = vocab_parallel_cross_entropy(&gpt.forward(rank, &ids)?, &targets)?;
//!         trainer.step(&loss, &mut gpt, rank)?;
//!     }
//!     trainer.save(rank, &dir, &gpt)
//! })?;
//! // ...and resumed on 1.
//! World::threads(1)?.run(|rank| {
//!     let mut gpt = Gpt::<f32>::new(rank, config, AttentionForm::TensorParallel, 99)?;
//!     let mut trainer = Trainer::new(Adam::new(1e-2));
//!     trainer.resume(rank, &dir, &mut gpt)?;
//!     assert_eq!(trainer.steps(), 2);
//!     Ok(())
//! })?;
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), dist_tensor::Error>(())
//! ```

use std::path::Path;

use crate::autograd::DVar;
use crate::checkpoint::{self, Checkpoint, Entry};
use crate::mesh::DataParallel;
use crate::nn::{
    Constant, LossScaler, LrSchedule, Module, Optimizer, clip_grad_norm, load_training, sync_grads,
};
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Placement, Result};

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// The step's number (from 0).
    pub step: usize,
    /// The loss, averaged over the step's micro-batches and the data-parallel replicas.
    pub loss: f64,
    /// The learning rate of the step.
    pub lr: f64,
    /// The gradients' global norm before clipping (when clipping).
    pub grad_norm: Option<f64>,
    /// Whether the step was skipped (an inf or a NaN in a gradient, with loss scaling).
    pub skipped: bool,
}

/// The training step of any module (see the module docs). Every call is collective over the
/// model's ranks (and, with data parallelism, its replicas).
pub struct Trainer<'m, T: Element> {
    optimizer: Box<dyn Optimizer<T> + 'm>,
    schedule: Box<dyn LrSchedule + 'm>,
    clip: Option<f64>,
    accumulate: usize,
    scaler: Option<LossScaler>,
    dp: Option<DataParallel<'m>>,
    steps: usize,
    micro: usize,
    loss_sum: f64,
}

impl<'m, T: Element> Trainer<'m, T> {
    /// Steps with `optimizer` at its own learning rate, every micro-batch a step, no clipping,
    /// no loss scaling, no data parallelism.
    pub fn new(optimizer: impl Optimizer<T> + 'm) -> Self {
        let lr = optimizer.lr();
        Trainer {
            optimizer: Box::new(optimizer),
            schedule: Box::new(Constant(lr)),
            clip: None,
            accumulate: 1,
            scaler: None,
            dp: None,
            steps: 0,
            micro: 0,
            loss_sum: 0.0,
        }
    }

    /// The learning rate of each step from `schedule`.
    pub fn schedule(mut self, schedule: impl LrSchedule + 'm) -> Self {
        self.schedule = Box::new(schedule);
        self
    }

    /// Clips the gradients to a global norm of `max_norm` before each step.
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.clip = Some(max_norm);
        self
    }

    /// One optimizer step every `micro_batches` calls of [`Trainer::step`], on the mean of
    /// their gradients; the inner ones send nothing over the data-parallel group.
    pub fn accumulate(mut self, micro_batches: usize) -> Self {
        self.accumulate = micro_batches.max(1);
        self
    }

    /// Scales the loss (for f16), skipping the steps whose gradients overflow.
    pub fn loss_scaling(mut self, scaler: LossScaler) -> Self {
        self.scaler = Some(scaler);
        self
    }

    /// Averages the gradients over `dp`'s group while the backward pass goes on, and checks
    /// the replicas every few steps.
    pub fn data_parallel(mut self, dp: DataParallel<'m>) -> Self {
        self.dp = Some(dp);
        self
    }

    /// Optimizer steps taken (skipped ones included): the next step's number.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The loss scaler, if any.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &dyn Optimizer<T> {
        &*self.optimizer
    }

    /// The backward pass of one micro-batch's `loss` (a mean over its tokens, as the losses
    /// give it) on `model`, whose ranks are `rank`'s; on the last micro-batch of a step, the
    /// step: the gradients averaged over the replicas (during that pass), the replicated
    /// parameters' summed over `rank`, unscaled and checked, clipped, stepped at the
    /// schedule's rate, then cleared. Returns the step's report on the calls that step.
    /// Collective.
    ///
    /// # Errors
    /// As the backward pass, the collectives and the optimizer; with data parallelism,
    /// [`Error::RanksDisagree`] when the replicas drifted apart.
    pub fn step<M: Module<T> + ?Sized>(
        &mut self,
        loss: &DVar<'_, T>,
        model: &mut M,
        rank: &Rank<'_>,
    ) -> Result<Option<StepReport>> {
        if self.micro == 0 {
            model.zero_grad();
            self.loss_sum = 0.0;
        }
        let value = loss.local().value().host_elements()?;
        self.loss_sum += value.first().map_or(f64::NAN, |v| v.to_f64());
        let k = self.accumulate;
        let last = self.micro + 1 == k;
        let factor = self.scaler.as_ref().map_or(1.0, LossScaler::scale) / k as f64;
        let scaled = if factor == 1.0 { loss.clone() } else { loss.map(|l| Ok(l.scale(factor)))? };
        match (&self.dp, last) {
            (Some(dp), true) => dp.backward(&scaled, model)?,
            _ => scaled.backward()?,
        }
        self.micro += 1;
        if !last {
            return Ok(None);
        }
        self.micro = 0;
        let mut loss = self.loss_sum / k as f64;
        if let Some(dp) = &self.dp {
            loss = dp.averager().mean(&[loss])?[0];
        }
        sync_grads(model, rank)?;
        let lr = self.schedule.lr(self.steps);
        self.optimizer.set_lr(lr);
        let finite = match &mut self.scaler {
            Some(s) => s.unscale(model, rank)?,
            None => true,
        };
        let grad_norm = match self.clip {
            Some(max) if finite => Some(clip_grad_norm(model, max, rank)?),
            _ => None,
        };
        let stepped = match &mut self.scaler {
            Some(s) => s.step(&mut *self.optimizer, model, rank)?,
            None => {
                self.optimizer.step(model.parameters_mut())?;
                true
            }
        };
        if let Some(dp) = &mut self.dp {
            dp.record_step(model)?;
        }
        model.zero_grad();
        let report = StepReport { step: self.steps, loss, lr, grad_norm, skipped: !stepped };
        self.steps += 1;
        Ok(Some(report))
    }

    /// Saves the training state into checkpoint directory `dir`: `model`'s parameters, the
    /// optimizer's state, the step count and the loss scaler's state. With data parallelism
    /// the first replica writes (every replica takes part in gathering a sharded optimizer's
    /// state) and the others wait for it. Collective.
    ///
    /// # Errors
    /// As [`checkpoint::save`], on every rank: a replica that could not write makes the others
    /// fail too.
    pub fn save<M: Module<T>>(
        &self,
        rank: &Rank<'_>,
        dir: impl AsRef<Path>,
        model: &M,
    ) -> Result<()> {
        if self.micro != 0 {
            return Err(Error::InvalidArgument {
                op: "Trainer::save",
                rank: rank.rank(),
                reason: format!(
                    "{} of {} micro-batches of a step are accumulated: save between steps",
                    self.micro, self.accumulate
                ),
            });
        }
        let step = Tensor::from(vec![self.steps as f64]);
        let mut entries = model.state_dict("model")?;
        entries.extend(self.optimizer.state_dict(model, "optim")?);
        entries.push(Entry::local("train.step", &step, Placement::Replicate)?);
        if let Some(s) = &self.scaler {
            entries.extend(s.state_dict("train.scaler"));
        }
        let writer = self.dp.as_ref().is_none_or(|dp| dp.averager().rank() == 0);
        let written = if writer { checkpoint::save(rank, dir, &entries).map(drop) } else { Ok(()) };
        let Some(dp) = &self.dp else { return written };
        // Every replica waits for the writer, and fails with it.
        let ok = dp.averager().all_gather(&[if written.is_ok() { 1.0f64 } else { 0.0 }])?;
        match written {
            Err(e) => Err(e),
            Ok(()) if ok.iter().all(|&o| o == 1.0) => Ok(()),
            Ok(()) => Err(Error::InvalidArgument {
                op: "Trainer::save",
                rank: rank.rank(),
                reason: "the first data-parallel replica could not write the checkpoint".into(),
            }),
        }
    }

    /// Loads a training state saved by [`Trainer::save`] (by a world of any size and mesh)
    /// into `model` and this trainer: the next step is the one after the saved ones, at the
    /// schedule's rate for it. Collective.
    ///
    /// # Errors
    /// As [`load_training`]; a checkpoint without a step count (not saved by a trainer).
    pub fn resume<'r, M: Module<T>>(
        &mut self,
        rank: &'r Rank<'r>,
        dir: impl AsRef<Path>,
        model: &mut M,
    ) -> Result<()> {
        let ck: Checkpoint<'r> = load_training(rank, dir, model, &mut *self.optimizer)?;
        let step = ck.load::<f64>("train.step", Placement::Replicate)?;
        self.steps = step.local().as_slice().first().copied().unwrap_or(0.0) as usize;
        if let Some(s) = &mut self.scaler
            && ck.contains("train.scaler.scale")
        {
            s.load_state_dict(&ck, "train.scaler")?;
        }
        if let Some(dp) = &mut self.dp {
            dp.set_steps(self.steps as u64);
        }
        self.micro = 0;
        Ok(())
    }
}
