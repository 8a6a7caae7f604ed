//! [`Param`]: a parameter's value (this rank's shard of it) and its gradient, and
//! [`Parameters`], what every layer implements so that an optimizer can step it.

use std::sync::Arc;

use crate::autograd::Var;
use crate::autograd::graph::Leaf;
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

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
/// `backward` and a `backward()` through its `forward_var` add up in one place, and a layer is an autograd
/// [`Module`](crate::autograd::Module) whose parameters [`AdamW`](crate::autograd::AdamW) steps.
pub struct Param<T: Element> {
    value: Tensor<T>,
    leaf: Arc<Leaf<T>>,
}

/// A copy has its own gradient (a copy of this one), not a shared one.
impl<T: Element> Clone for Param<T> {
    fn clone(&self) -> Self {
        let leaf = Leaf::new(self.value.shape());
        leaf.set_grad(self.grad());
        Param { value: self.value.clone(), leaf }
    }
}

impl<T: Element> PartialEq for Param<T> {
    fn eq(&self, other: &Self) -> bool {
        self.value == other.value && self.grad() == other.grad()
    }
}

impl<T: Element> std::fmt::Debug for Param<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Param").field("value", &self.value).field("grad", &self.grad()).finish()
    }
}

impl<T: Element> Param<T> {
    /// A parameter with this value and no gradient yet.
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
        Param { value, leaf }
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

    /// A parameter over a tracked leaf `v` (its value shared, its gradient the same); `None`
    /// for a value computed by an op or an untracked one.
    pub(crate) fn from_var(v: &Var<'_, T>) -> Option<Self> {
        Some(Param { value: v.value().clone(), leaf: v.leaf()? })
    }

    /// Calls `f` with the parameter as a [`Var`] (an optimizer's step on a
    /// [`Module`](crate::autograd::Module)), then keeps the value `f` left in it.
    pub(crate) fn with_var_mut<'a>(&mut self, f: impl FnOnce(&mut Var<'a, T>)) {
        let mut v = self.var();
        f(&mut v);
        // `Var::set_value` keeps the shape, so the value still fits the parameter.
        self.value = v.into_value();
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

    /// The value and the gradient at once, the value mutable (what an optimizer step needs).
    pub(crate) fn value_and_grad(&mut self) -> (&mut Tensor<T>, Option<Tensor<T>>) {
        (&mut self.value, self.leaf.grad())
    }
}

/// What a layer exposes to an optimizer: its parameters, in a fixed order (the same on every
/// rank, and from call to call, as an optimizer's state is matched to them by position).
///
/// # Examples
/// ```
/// use dist_tensor::nn::{ColumnParallelLinear, Parameters};
/// use dist_tensor::{Tensor, World};
/// World::threads(2)?.run(|rank| {
///     let w = Tensor::<f32>::random(&[4, 6], 1);
///     let mut fc = ColumnParallelLinear::from_global(rank, &w, Some(&Tensor::zeros(&[6])), dist_tensor::Split::Even)?;
///     assert_eq!(fc.parameters().len(), 2); // weight, bias
///     assert_eq!(fc.parameters()[0].value().shape(), &[4, 3]); // this rank's columns
///     fc.zero_grad();
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub trait Parameters<T: Element> {
    /// Every parameter, in a fixed order.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Activation, ParallelMlp, Parameters};
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let mlp = ParallelMlp::<f32>::new(rank, 4, 6, Activation::Gelu, 1)?;
    ///     // W1's columns, b1's part, W2's rows, b2 whole.
    ///     let sizes: Vec<usize> = mlp.parameters().iter().map(|p| p.value().len()).collect();
    ///     assert_eq!(sizes, vec![12, 3, 12, 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    fn parameters(&self) -> Vec<&Param<T>>;

    /// Every parameter, mutably, in the same order.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{ColumnParallelLinear, Parameters};
    /// use dist_tensor::Tensor;
    /// let mut fc = ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[2, 2]), None)?;
    /// fc.parameters_mut()[0].value_mut().as_mut_slice()[0] = 1.0;
    /// assert_eq!(fc.weight().value().as_slice()[0], 1.0);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    fn parameters_mut(&mut self) -> Vec<&mut Param<T>>;

    /// Forgets every parameter's gradient.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{ColumnParallelLinear, Parameters};
    /// use dist_tensor::Tensor;
    /// let mut fc = ColumnParallelLinear::from_local(Tensor::<f32>::zeros(&[2, 2]), None)?;
    /// fc.parameters_mut()[0].accumulate_grad(Tensor::zeros(&[2, 2]))?;
    /// fc.zero_grad();
    /// assert!(fc.weight().grad().is_none());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    fn zero_grad(&mut self) {
        for p in self.parameters_mut() {
            p.zero_grad();
        }
    }
}
