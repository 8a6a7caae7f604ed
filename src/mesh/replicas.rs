//! [`DataParallel`]: data parallelism for any [`Module`] trained with autograd. Its backward
//! pass averages each parameter's gradient over the data-parallel group in buckets sent while
//! the pass goes on (the moment autograd completes a parameter's gradient, it joins a bucket:
//! [`data_parallel::overlapped`]), and its step checks every few steps that the replicas still
//! hold the same parameters, so that a forgotten average is an error, not a silent drift.
//!
//! Gradient accumulation: run the inner micro-batches' `loss.backward()` plainly (the
//! gradients add up in the parameters, nothing is sent), and the last one's through
//! [`DataParallel::backward`], which averages the accumulated sums once.

use std::collections::HashMap;

use super::Averager;
use super::data_parallel::{self, DEFAULT_BUCKET_BYTES};
use crate::autograd::DVar;
use crate::nn::{Module, Optimizer, Param};
use crate::{Element, Error, Result, Tensor};

/// How often [`DataParallel::step`] compares the replicas, unless told otherwise.
pub const DEFAULT_CHECK_EVERY: usize = 10;

/// Data parallelism over one group of a mesh (see the module docs).
///
/// # Examples
/// Two replicas of a 2-rank tensor-parallel MLP, each on its half of the batch:
/// ```
/// use dist_tensor::mesh::{DataParallel, DeviceMesh};
/// use dist_tensor::nn::{Activation, Adam, Module, ParallelMlp, mse_loss_var, sync_grads};
/// use dist_tensor::autograd::DVar;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let x = Tensor::<f64>::random(&[8, 4], 1);
/// let params = World::threads(4)?.run(|rank| {
///     let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
///     let tp = mesh.rank_of("tp")?;
///     let mut ddp = DataParallel::new(mesh.averager("dp")?);
///     let mut mlp = ParallelMlp::<f64>::new(&tp, 4, 8, Activation::Gelu, 3)?;
///     let mut adam = Adam::new(1e-2);
///     let at = 16 * mesh.coord("dp")?; // this replica's 4 rows
///     let half = Tensor::from_shape_vec(&[4, 4], x.as_slice()[at..at + 16].to_vec())?;
///     let xs = DVar::constant(DistTensor::from_global(&tp, &half, Placement::Shard(0))?);
///     for _ in 0..3 {
///         mlp.zero_grad();
///         let loss = mse_loss_var(&mlp.forward_var(&xs)?, xs.value())?;
///         ddp.backward(&loss, &mlp)?; // averaged over dp while the pass goes on
///         sync_grads(&mlp, &tp)?; // the replicated bias's parts, over tp
///         ddp.step(&mut adam, &mut mlp)?;
///     }
///     Ok(mlp.parameters()[0].value().clone())
/// })?;
/// assert_eq!(params[0], params[2]); // the replicas agree (ranks 0 and 2 hold tp shard 0)
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug)]
pub struct DataParallel<'m> {
    dp: Averager<'m>,
    bucket_bytes: usize,
    check_every: usize,
    steps: u64,
}

impl<'m> DataParallel<'m> {
    /// Over `dp`, in buckets of [`DEFAULT_BUCKET_BYTES`], checking the replicas every
    /// [`DEFAULT_CHECK_EVERY`] steps.
    pub fn new(dp: Averager<'m>) -> Self {
        DataParallel {
            dp,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            check_every: DEFAULT_CHECK_EVERY,
            steps: 0,
        }
    }

    /// Buckets of `bytes` (at least one element each).
    pub fn bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// Compares the replicas every `steps` steps (0: never).
    pub fn check_every(mut self, steps: usize) -> Self {
        self.check_every = steps;
        self
    }

    /// The data-parallel group.
    pub fn averager(&self) -> &Averager<'m> {
        &self.dp
    }

    /// Steps taken through [`DataParallel::step`] (or counted by a loaded training state).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Sets the step count (a resumed run's), so the checks fall on the same steps.
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Runs the backward pass of `loss` and averages the gradient of every parameter of
    /// `model` over the group, each sent in its bucket as soon as the pass completes it; the
    /// parameters hold the averages after. A gradient accumulated by earlier passes is part of
    /// what is averaged. Collective over the group.
    ///
    /// # Errors
    /// As [`DVar::backward`] and [`data_parallel::overlapped`].
    pub fn backward<T: Element, M: Module<T> + ?Sized>(
        &self,
        loss: &DVar<'_, T>,
        model: &M,
    ) -> Result<()> {
        let params = model.parameters();
        let index: HashMap<u64, usize> =
            params.iter().enumerate().map(|(i, p)| (p.leaf_id(), i)).collect();
        let (order, mean) = data_parallel::overlapped(&self.dp, self.bucket_bytes, |buckets| {
            let mut order = Vec::with_capacity(params.len());
            let mut handed = vec![false; params.len()];
            let mut hand_in = |i: usize, order: &mut Vec<usize>| -> Result<()> {
                if !std::mem::replace(&mut handed[i], true) {
                    order.push(i);
                    buckets.ready(&host_grad(params[i])?);
                }
                Ok(())
            };
            let mut on_leaf = |id: u64| match index.get(&id) {
                Some(&i) => hand_in(i, &mut order),
                None => Ok(()), // an input, not a parameter of the model
            };
            loss.backward_hooked(Some(&mut on_leaf))?;
            // Parameters the pass did not reach (a rank that holds no head), in order.
            for i in 0..params.len() {
                hand_in(i, &mut order)?;
            }
            Ok(order)
        })?;
        set_grads(&params, &order, mean)
    }

    /// One step of `optimizer` over `model`'s parameters; then, every `check_every` steps,
    /// [`DataParallel::check_replicas`]. Collective over the group on those steps.
    ///
    /// # Errors
    /// As the optimizer's step and [`DataParallel::check_replicas`].
    pub fn step<T: Element, M: Module<T> + ?Sized, O: Optimizer<T> + ?Sized>(
        &mut self,
        optimizer: &mut O,
        model: &mut M,
    ) -> Result<()> {
        optimizer.step(model.parameters_mut())?;
        self.record_step(model)
    }

    /// Counts a step taken some other way (a loss scaler's, which may skip it) and, every
    /// `check_every` steps, [`DataParallel::check_replicas`]. Collective over the group on
    /// those steps.
    ///
    /// # Errors
    /// As [`DataParallel::check_replicas`].
    pub fn record_step<T: Element, M: Module<T> + ?Sized>(&mut self, model: &M) -> Result<()> {
        self.steps += 1;
        if self.check_every > 0 && self.steps.is_multiple_of(self.check_every as u64) {
            self.check_replicas(model)?;
        }
        Ok(())
    }

    /// Checks that every replica holds the same parameters: a checksum per parameter (a
    /// weighted sum of its elements in f64), gathered over the group and compared bit for bit.
    /// Replicas that averaged their gradients and stepped alike agree exactly. Collective over
    /// the group.
    ///
    /// # Errors
    /// [`Error::RanksDisagree`] on every rank of the group, naming the first parameter that
    /// differs, the replicas and their checksums; as [`Averager::all_gather`].
    pub fn check_replicas<T: Element, M: Module<T> + ?Sized>(&self, model: &M) -> Result<()> {
        let named = model.named_parameters();
        let mine = named.iter().map(|(_, p)| checksum(p)).collect::<Result<Vec<f64>>>()?;
        let all = self.dp.all_gather(&mine)?;
        let n = mine.len();
        if n == 0 {
            return Ok(());
        }
        for (replica, sums) in all.chunks(n).enumerate().skip(1) {
            let first = &all[..n];
            if let Some(k) = (0..n).find(|&k| sums[k].to_bits() != first[k].to_bits()) {
                return Err(Error::RanksDisagree {
                    op: "DataParallel::check_replicas",
                    rank_a: 0,
                    value_a: format!("{} with checksum {:e}", named[k].0, first[k]),
                    rank_b: replica,
                    value_b: format!(
                        "{:e} after step {}: the replicas drifted apart (were the gradients \
                         averaged over the data-parallel group, with DataParallel::backward?)",
                        sums[k], self.steps
                    ),
                });
            }
        }
        Ok(())
    }
}

/// A parameter's gradient on the host, zeros where the pass gave it none.
fn host_grad<T: Element>(p: &Param<T>) -> Result<Tensor<T>> {
    match p.grad() {
        Some(g) => g.into_host(),
        None => Tensor::try_zeros(p.value().shape()),
    }
}

/// Gives the parameters (in `order`, the order they were handed in) their averaged gradients,
/// where each one's value lives.
fn set_grads<T: Element>(
    params: &[&Param<T>],
    order: &[usize],
    mean: Vec<Tensor<T>>,
) -> Result<()> {
    for (&i, g) in order.iter().zip(mean) {
        params[i].set_grad(Some(g.into_place_of(params[i].value())?));
    }
    Ok(())
}

/// A weighted sum of `p`'s elements in f64 (weights 1 to 13 by position, so that two elements
/// trading places show).
fn checksum<T: Element>(p: &Param<T>) -> Result<f64> {
    let values = p.value().host_elements()?;
    Ok(values.iter().enumerate().map(|(i, x)| x.to_f64() * (1 + i % 13) as f64).sum())
}
