//! [`Param`]: the one parameter type: a parameter's value (this rank's part of it), its
//! placement over the ranks, and its gradient.

use std::sync::Arc;

use crate::autograd::Var;
use crate::autograd::graph::Leaf;
use crate::tensor::{Element, Tensor};
use crate::{Error, Placement, Result};

/// A trainable parameter as one rank holds it: its value (a shard of a sharded weight, or the
/// whole of a replicated one) and the gradient that backward passes have accumulated into it.
///
/// Backward passes add to the gradient (as PyTorch's `.grad` accumulates over micro-batches);
/// [`Param::zero_grad`] clears it. An optimizer ([`Sgd`](super::Sgd), [`Adam`](super::Adam))
/// reads the gradient and updates the value.
///
/// # Examples
/// ```
/// use dist_tensor::nn::Param;
/// use dist_tensor::Tensor;
///
/// let mut p = Param::new(Tensor::<f32>::from(vec![1.0, 2.0]));
/// assert!(p.grad().is_none());
/// p.accumulate_grad(Tensor::from(vec![0.5, 0.5]))?;
/// p.accumulate_grad(Tensor::from(vec![0.25, 1.0]))?;
/// assert_eq!(p.grad().unwrap().as_slice(), &[0.75, 1.5]);
/// p.zero_grad();
/// assert!(p.grad().is_none());
/// # Ok::<(), dist_tensor::Error>(())
/// ```
///
/// The gradient lives in an autograd leaf: [`Param::var`] is the parameter as a tracked
/// [`Var`], and a backward pass through it accumulates into this same gradient. So a layer's
/// `backward` and a `backward()` through its `forward_var` add up in one place.
///
/// The placement says how the ranks hold it: [`Param::new`] is replicated (every rank holds
/// all of it, and uses it on its own rows: its gradient is a partial sum until
/// [`sync_grads`](super::sync_grads)), [`Param::sharded`] a shard along an axis (its gradient
/// complete on the rank). Checkpoints save it as the global tensor it is a part of.
///
/// A `Param` is `Send`: a model of them can leave [`World::run`](crate::World::run).
pub struct Param<T: Element> {
    value: Tensor<T>,
    leaf: Arc<Leaf<T>>,
    placement: Placement,
}

/// A copy has its own gradient (a copy of this one), not a shared one.
impl<T: Element> Clone for Param<T> {
    fn clone(&self) -> Self {
        let leaf = Leaf::new(self.value.shape());
        leaf.set_grad(self.grad());
        Param { value: self.value.clone(), leaf, placement: self.placement }
    }
}

impl<T: Element> PartialEq for Param<T> {
    fn eq(&self, other: &Self) -> bool {
        self.value == other.value
            && self.placement == other.placement
            && self.grad() == other.grad()
    }
}

impl<T: Element> std::fmt::Debug for Param<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Param")
            .field("value", &self.value)
            .field("placement", &self.placement)
            .field("grad", &self.grad())
            .finish()
    }
}

impl<T: Element> Param<T> {
    /// A replicated parameter with this value and no gradient yet.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Param;
    /// use dist_tensor::Tensor;
    /// let p = Param::new(Tensor::<f64>::zeros(&[3, 2]));
    /// assert_eq!(p.value().shape(), &[3, 2]);
    /// ```
    pub fn new(value: Tensor<T>) -> Self {
        let leaf = Leaf::new(value.shape());
        Param { value, leaf, placement: Placement::Replicate }
    }

    /// A parameter of which `value` is this rank's shard along `axis` (a column block, a slice
    /// of the vocabulary), with no gradient yet.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Param;
    /// use dist_tensor::{Placement, Tensor};
    /// let p = Param::sharded(Tensor::<f32>::zeros(&[4, 3]), 1);
    /// assert_eq!(p.placement(), Placement::Shard(1));
    /// assert!(!p.is_replicated());
    /// ```
    pub fn sharded(value: Tensor<T>, axis: usize) -> Self {
        let leaf = Leaf::new(value.shape());
        Param { value, leaf, placement: Placement::Shard(axis) }
    }

    /// How the ranks hold the parameter: `Replicate` or `Shard(axis)`.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Whether every rank holds all of it (its gradient a partial sum over the ranks' rows).
    pub fn is_replicated(&self) -> bool {
        !matches!(self.placement, Placement::Shard(_))
    }

    /// The parameter as a tracked autograd leaf (of any graph's lifetime): a backward pass
    /// through it accumulates into this parameter's gradient. The value is shared, not copied.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Param;
    /// use dist_tensor::autograd::Var;
    /// use dist_tensor::Tensor;
    /// let p = Param::new(Tensor::<f64>::from(vec![1.0, 2.0]));
    /// let x = Var::constant(Tensor::from(vec![3.0, 4.0]));
    /// (&p.var() * &x).sum().backward()?;
    /// assert_eq!(p.grad().unwrap().as_slice(), &[3.0, 4.0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn var<'a>(&self) -> Var<'a, T> {
        Var::from_leaf(self.value.clone(), self.leaf.clone())
    }

    /// The value (this rank's part of it).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Param;
    /// use dist_tensor::Tensor;
    /// let p = Param::new(Tensor::<f32>::from(vec![4.0]));
    /// assert_eq!(p.value().as_slice(), &[4.0]);
    /// ```
    pub fn value(&self) -> &Tensor<T> {
        &self.value
    }

    /// The value, to change in place (load a checkpoint, initialise differently). An optimizer
    /// that keeps f32 master weights for a half type
    /// ([`Sgd`](super::Sgd), [`Adam`](super::Adam)) must be [reset](super::Adam::reset) after
    /// such a change, or it keeps stepping from its own copy.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Param;
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f32>::from(vec![4.0]));
    /// p.value_mut().as_mut_slice()[0] = 5.0;
    /// assert_eq!(p.value().as_slice(), &[5.0]);
    /// ```
    pub fn value_mut(&mut self) -> &mut Tensor<T> {
        &mut self.value
    }

    /// Replaces the value by one of the same shape (a loaded checkpoint's part).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `value`'s shape is not the parameter's.
    pub fn set_value(&mut self, value: Tensor<T>) -> Result<()> {
        if value.shape() != self.value.shape() {
            return Err(Error::InvalidShape {
                op: "Param::set_value",
                reason: format!(
                    "a value of shape {:?} for a parameter of shape {:?}",
                    value.shape(),
                    self.value.shape()
                ),
            });
        }
        self.value = value;
        Ok(())
    }

    /// The gradient accumulated since the last [`Param::zero_grad`], if any backward pass reached
    /// this parameter.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Param;
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f32>::from(vec![4.0]));
    /// p.accumulate_grad(Tensor::from(vec![1.0]))?;
    /// assert_eq!(p.grad().map(|g| g.as_slice()[0]), Some(1.0));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    ///
    /// A copy of the gradient that shares its elements (copy-on-write): the gradient lives in
    /// an autograd leaf that a backward pass through [`Param::var`] may add to.
    pub fn grad(&self) -> Option<Tensor<T>> {
        self.leaf.grad()
    }

    /// Adds `grad` to the gradient (sets it when there is none), in the accumulator type,
    /// rounded once.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `grad`'s shape is not the value's.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Param;
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f32>::zeros(&[2]));
    /// assert!(p.accumulate_grad(Tensor::zeros(&[3])).is_err());
    /// ```
    pub fn accumulate_grad(&mut self, grad: Tensor<T>) -> Result<()> {
        if grad.shape() != self.value.shape() {
            return Err(Error::InvalidShape {
                op: "Param::accumulate_grad",
                reason: format!(
                    "a gradient of shape {:?} for a parameter of shape {:?}",
                    grad.shape(),
                    self.value.shape()
                ),
            });
        }
        self.leaf.accumulate(grad)
    }

    /// Forgets the gradient.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Param;
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f32>::zeros(&[1]));
    /// p.accumulate_grad(Tensor::from(vec![1.0]))?;
    /// p.zero_grad();
    /// assert!(p.grad().is_none());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn zero_grad(&mut self) {
        self.leaf.set_grad(None);
    }

    /// The number of the autograd leaf holding the gradient (what a backward pass's hook names).
    pub(crate) fn leaf_id(&self) -> u64 {
        self.leaf.id()
    }

    /// Replaces the gradient (the gradient lives in a shared leaf, so a shared reference does:
    /// what [`sync_grads`](super::sync_grads) and clipping need).
    pub(crate) fn set_grad(&self, grad: Option<Tensor<T>>) {
        self.leaf.set_grad(grad);
    }

    /// The value and the gradient at once, the value mutable (what an optimizer step needs).
    pub(crate) fn value_and_grad(&mut self) -> (&mut Tensor<T>, Option<Tensor<T>>) {
        (&mut self.value, self.leaf.grad())
    }
}
