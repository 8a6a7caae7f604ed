//! [`GradHook`]: what a layer's backward pass tells, parameter by parameter, the moment each
//! gradient is complete (the layers' `backward_hooked`), so that data parallelism can send it
//! while the rest of the pass runs, as PyTorch's DDP does from its hooks after a gradient's
//! accumulation.

use crate::Result;
use crate::tensor::{Element, Tensor};

/// Told of each of a layer's parameters as soon as the layer's backward pass has completed its
/// gradient: a layer's `backward_hooked` (for example
/// [`ColumnParallelLinear::backward_hooked`](super::ColumnParallelLinear::backward_hooked))
/// calls it once per parameter, in the order the gradients complete, which is the same on every
/// rank. A weight whose product with the output gradient is all its gradient needs is told
/// before the pass computes the layer's input gradient; a replicated parameter (a row-parallel
/// bias) once its parts are summed over the ranks, at the end of the layer's pass.
/// [`GradBuckets`](crate::mesh::data_parallel::GradBuckets) is one: it puts each gradient in the
/// bucket that goes to be averaged next. A closure `FnMut(usize, &Tensor<T>) -> Result<()>` is
/// one too, told the parameter's index.
///
/// # Examples
/// ```
/// use dist_tensor::nn::ColumnParallelLinear;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let (x, w, b) = (Tensor::<f64>::random(&[5, 4], 1), Tensor::random(&[4, 6], 2), Tensor::random(&[6], 3));
/// World::threads(2)?.run(|rank| {
///     let mut fc = ColumnParallelLinear::from_global(rank, &w, Some(&b), dist_tensor::Split::Even)?;
///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
///     let (y, saved) = fc.forward(&xs)?;
///     let mut told = Vec::new();
///     fc.backward_hooked(saved, &y, &mut |index: usize, grad: &Tensor<f64>| {
///         told.push((index, grad.shape().to_vec()));
///         Ok(())
///     })?;
///     // The bias (parameter 1) first, then the weight: both before the input gradient.
///     assert_eq!(told, vec![(1, vec![3]), (0, vec![4, 3])]);
///     assert_eq!(fc.weight().grad().unwrap().shape(), &[4, 3]);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub trait GradHook<T: Element> {
    /// The gradient of parameter `index` (in the layer's
    /// [`Module::parameters`](super::Module::parameters) order) of a layer of `count`
    /// parameters is complete for this pass: `grad` is what [`Param::grad`](super::Param::grad)
    /// reads now (with what earlier passes accumulated).
    ///
    /// # Errors
    /// The hook's own; the layer's backward pass stops with it.
    fn grad_ready(&mut self, index: usize, count: usize, grad: &Tensor<T>) -> Result<()>;
}

impl<T: Element, F: FnMut(usize, &Tensor<T>) -> Result<()>> GradHook<T> for F {
    fn grad_ready(&mut self, index: usize, _count: usize, grad: &Tensor<T>) -> Result<()> {
        self(index, grad)
    }
}
