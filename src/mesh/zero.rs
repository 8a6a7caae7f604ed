//! ZeRO stage 1: the optimizer's state sharded over the data-parallel group. Each rank of the
//! group keeps Adam's moments for its slice of the parameters only (the parameters flattened in
//! order, cut as `numpy.array_split` cuts them), steps that slice with the averaged gradients,
//! and the group all-gathers the slices into every rank's parameters. Adam works element by
//! element, so the result is bit for bit that of every rank stepping every parameter.

use super::Averager;
use crate::nn::{Adam, Param};
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
///     let dp = mesh.averager("dp")?;
///     let mut p = Param::new(Tensor::<f64>::from(vec![1.0, 2.0, 3.0]));
///     let mut zero = Zero1::new(Adam::new(0.1));
///     let grad = Tensor::from(vec![1.0, -1.0, 1.0]); // averaged over dp already
///     zero.step(&dp, vec![&mut p], &[grad])?;
///     Ok((p.value().as_slice().to_vec(), zero.state_len()))
/// })?;
/// assert_eq!(out[0].0, out[1].0); // every rank has every parameter
/// assert_eq!((out[0].1, out[1].1), (2, 1)); // each keeps moments for its slice only
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Zero1<T: Element> {
    adam: Adam<T>,
    /// This rank's slice of the flattened parameters, as Adam's one parameter.
    slice: Option<Param<T>>,
}

impl<T: Element> Zero1<T> {
    /// Sharded `adam` (its settings; its state starts empty).
    pub fn new(adam: Adam<T>) -> Self {
        Zero1 { adam, slice: None }
    }

    /// Elements of the parameters whose state this rank keeps (0 before the first step).
    pub fn state_len(&self) -> usize {
        self.slice.as_ref().map_or(0, |p| p.value().len())
    }

    /// Steps this rank's slice of `params` with `grads` (one per parameter, averaged over `dp`,
    /// as [`data_parallel`](super::data_parallel) gives them), then all-gathers the slices into
    /// `params`. Collective over `dp`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `grads` do not match `params` in number or sizes; as
    /// [`Averager::all_gather`].
    pub fn step(
        &mut self,
        dp: &Averager<'_>,
        params: Vec<&mut Param<T>>,
        grads: &[Tensor<T>],
    ) -> Result<()> {
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
        let (n, r) = (dp.size(), dp.rank());
        let start = r * (total / n) + r.min(total % n);
        let end = start + total / n + usize::from(r < total % n);
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
