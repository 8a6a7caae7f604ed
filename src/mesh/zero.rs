//! ZeRO stage 1: the optimizer's state sharded over the data-parallel group. Each rank of the
//! group keeps Adam's moments for its slice of the parameters only (the parameters flattened in
//! order, cut as `numpy.array_split` cuts them), steps that slice with the averaged gradients,
//! and the group all-gathers the slices into every rank's parameters. Adam works element by
//! element, so the result is bit for bit that of every rank stepping every parameter.
//!
//! [`Zero1`] is an [`Optimizer`]: its state dict is plain [`Adam`]'s (the group gathers the
//! slices into whole moments, laid out as the parameters), so a checkpoint saved with ZeRO
//! loads into Adam on any world, and one saved by Adam loads into ZeRO over any group.

use super::Averager;
use crate::checkpoint::{Checkpoint, Entry};
use crate::nn::{Adam, FlatSlot, Module, Optimizer, Param, Slots, layout_of, targets_of};
use crate::{Element, Error, Result, Tensor};

/// Adam with its state sharded over a data-parallel group (see the module docs).
///
/// # Examples
/// ```
/// use dist_tensor::mesh::{zero::Zero1, DeviceMesh};
/// use dist_tensor::nn::{Adam, Param};
/// use dist_tensor::{Tensor, World};
///
/// let out = World::threads(2)?.run(|rank| {
///     let mesh = DeviceMesh::new(rank, &[("dp", 2)])?;
///     let mut p = Param::new(Tensor::<f64>::from(vec![1.0, 2.0, 3.0]));
///     let mut zero = Zero1::new(Adam::new(0.1), mesh.averager("dp")?);
///     let grad = Tensor::from(vec![1.0, -1.0, 1.0]); // averaged over dp already
///     zero.step_with_grads(vec![&mut p], &[grad])?;
///     Ok((p.value().as_slice().to_vec(), zero.state_len()))
/// })?;
/// assert_eq!(out[0].0, out[1].0); // every rank has every parameter
/// assert_eq!((out[0].1, out[1].1), (2, 1)); // each keeps moments for its slice only
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Zero1<'m, T: Element> {
    adam: Adam<T>,
    dp: Averager<'m>,
    /// This rank's slice of the flattened parameters, as Adam's one parameter.
    slice: Option<Param<T>>,
}

/// Elements `start..end` of `total` that rank `r` of `n` keeps (as `numpy.array_split`).
fn slice_of(total: usize, n: usize, r: usize) -> (usize, usize) {
    let start = r * (total / n) + r.min(total % n);
    (start, start + total / n + usize::from(r < total % n))
}

impl<'m, T: Element> Zero1<'m, T> {
    /// `adam` (its settings; its state starts empty) with its state sharded over `dp`.
    pub fn new(adam: Adam<T>, dp: Averager<'m>) -> Self {
        Zero1 { adam, dp, slice: None }
    }

    /// Elements of the parameters whose state this rank keeps (0 before the first step).
    pub fn state_len(&self) -> usize {
        self.slice.as_ref().map_or(0, |p| p.value().len())
    }

    /// Steps this rank's slice of `params` with `grads` (one per parameter, averaged over the
    /// group, as [`data_parallel`](super::data_parallel) gives them), then all-gathers the
    /// slices into `params`. Collective over the group.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `grads` do not match `params` in number or sizes; as
    /// [`Averager::all_gather`].
    pub fn step_with_grads(
        &mut self,
        params: Vec<&mut Param<T>>,
        grads: &[Tensor<T>],
    ) -> Result<()> {
        let dp = &self.dp;
        let sizes: Vec<usize> = params.iter().map(|p| p.value().len()).collect();
        if grads.len() != params.len() || grads.iter().zip(&sizes).any(|(g, &n)| g.len() != n) {
            return Err(Error::InvalidArgument {
                op: "Zero1::step",
                rank: dp.rank(),
                reason: format!(
                    "{} gradients of sizes {:?} for {} parameters of sizes {sizes:?}",
                    grads.len(),
                    grads.iter().map(Tensor::len).collect::<Vec<_>>(),
                    params.len()
                ),
            });
        }
        let total: usize = sizes.iter().sum();
        let (start, end) = slice_of(total, dp.size(), dp.rank());
        let flat = |i: usize| -> (usize, usize) {
            // Which parameter holds flat element `i`, and where.
            let mut at = i;
            for (k, &s) in sizes.iter().enumerate() {
                if at < s {
                    return (k, at);
                }
                at -= s;
            }
            unreachable!("{i} is below the total")
        };
        let mine = |of: &dyn Fn(usize, usize) -> T| -> Vec<T> {
            (start..end).map(&flat).map(|(k, j)| of(k, j)).collect()
        };
        let values = mine(&|k, j| params[k].value().as_slice()[j]);
        let slice_grads = mine(&|k, j| grads[k].as_slice()[j]);
        let slice = self.slice.get_or_insert_with(|| Param::new(Tensor::from(values.clone())));
        *slice.value_mut() = Tensor::from(values);
        slice.zero_grad();
        slice.accumulate_grad(Tensor::from(slice_grads))?;
        self.adam.step(vec![slice])?;
        let all = dp.all_gather(slice.value().as_slice())?;
        let mut at = 0;
        for p in params {
            let len = p.value().len();
            p.value_mut().as_mut_slice().copy_from_slice(&all[at..at + len]);
            at += len;
        }
        Ok(())
    }
}

/// Zero1 steps the parameters with the gradients they hold (averaged over the group already:
/// [`DataParallel::backward`](super::DataParallel::backward)); its state dict is Adam's.
impl<T: Element> Optimizer<T> for Zero1<'_, T> {
    fn step(&mut self, params: Vec<&mut Param<T>>) -> Result<()> {
        let grads = params
            .iter()
            .map(|p| match p.grad() {
                Some(g) => g.into_host(),
                None => Tensor::try_zeros(p.value().shape()),
            })
            .collect::<Result<Vec<_>>>()?;
        self.step_with_grads(params, &grads)
    }

    fn lr(&self) -> f64 {
        self.adam.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.adam.set_lr(lr);
    }

    fn reset(&mut self) {
        self.adam.reset();
    }

    /// Adam's entries for `model`: the group gathers each buffer's slices into whole ones
    /// (collective over the group, as saving is over the model's ranks).
    fn state_dict<'a>(&'a self, model: &dyn Module<T>, prefix: &str) -> Result<Vec<Entry<'a>>> {
        let layout = layout_of(model);
        let sizes: Vec<usize> = layout.iter().map(|(_, _, s)| s.iter().product()).collect();
        // Every rank of the group takes part, with an empty slice before the first step.
        let mine = self.adam.slots().to_flat()?.pop();
        let stepped = self.dp.all_gather(&[u64::from(mine.is_some()) as f64])?;
        if stepped.iter().all(|&s| s == 0.0) {
            return Ok(Vec::new());
        }
        let empty = || FlatSlot { buffers: [Vec::new(), Vec::new()], master: None, steps: 0 };
        let mine = mine.unwrap_or_else(empty);
        let mut whole = Vec::with_capacity(2);
        for b in &mine.buffers {
            whole.push(self.dp.all_gather(b)?);
        }
        let has_master = self.dp.all_gather(&[u64::from(mine.master.is_some()) as f64])?;
        let master = if has_master.iter().all(|&m| m == 1.0) {
            Some(self.dp.all_gather(mine.master.as_deref().unwrap_or(&[]))?)
        } else {
            None
        };
        let steps = self.dp.all_gather(&[mine.steps as f64])?;
        let steps = steps.into_iter().fold(0.0f64, f64::max) as u64;
        let mut per = Vec::with_capacity(sizes.len());
        let mut at = 0;
        for &n in &sizes {
            let cut = |v: &Vec<T::Acc>| v[at..at + n].to_vec();
            per.push(FlatSlot {
                buffers: [cut(&whole[0]), cut(&whole[1])],
                master: master.as_ref().map(cut),
                steps,
            });
            at += n;
        }
        let slots = Slots::<T::Acc, 2>::from_flat(per);
        let entries = slots.entries(&layout, prefix, ["exp_avg", "exp_avg_sq"])?;
        Ok(entries.into_iter().map(Entry::into_owned).collect())
    }

    /// Adam's state for `model`, loaded whole and cut into this rank's slice.
    fn load_state_dict(
        &mut self,
        ck: &Checkpoint<'_>,
        model: &dyn Module<T>,
        prefix: &str,
    ) -> Result<()> {
        let layout = layout_of(model);
        let targets = targets_of(ck.rank(), model)?;
        let mut whole = Slots::<T::Acc, 2>::new();
        whole.load(ck, &layout, &targets, prefix, ["exp_avg", "exp_avg_sq"])?;
        let per = whole.to_flat()?;
        if per.is_empty() {
            self.adam.reset();
            return Ok(());
        }
        let total: usize = per.iter().map(|f| f.buffers[0].len()).sum();
        let (start, end) = slice_of(total, self.dp.size(), self.dp.rank());
        // This rank's elements of the parameters' buffers laid end to end.
        let mine = |parts: Vec<&[T::Acc]>| -> Vec<T::Acc> {
            parts.into_iter().flatten().copied().skip(start).take(end - start).collect()
        };
        let master = per.iter().map(|f| f.master.as_deref()).collect::<Option<Vec<_>>>().map(&mine);
        let slice = FlatSlot {
            buffers: [0, 1].map(|b| mine(per.iter().map(|f| &f.buffers[b][..]).collect())),
            master,
            steps: per[0].steps,
        };
        *self.adam.slots_mut() = Slots::from_flat(vec![slice]);
        self.slice = None;
        Ok(())
    }
}
