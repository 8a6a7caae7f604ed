//! Stochastic gradient descent, with momentum and weight decay.

use super::Slots;
use crate::Result;
use crate::nn::Param;
use crate::tensor::{Element, OptimRule};

/// SGD: `v = momentum * v + (g + weight_decay * p)`, `p -= lr * v` (PyTorch's `SGD` without
/// dampening; with momentum 0, `p -= lr * (g + weight_decay * p)`).
///
/// The update is computed in the accumulator type; f16 and bf16 parameters are stepped through
/// f32 master weights (made from their values at the first step, rounded into the parameters
/// after each step), so that updates below the half type's resolution add up.
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Param, Sgd};
/// use dist_tensor::Tensor;
///
/// let mut p = Param::new(Tensor::<f64>::from(vec![1.0, -2.0]));
/// let mut sgd = Sgd::<f64>::new(0.5);
/// p.accumulate_grad(Tensor::from(vec![0.2, 0.4]))?;
/// sgd.step(vec![&mut p])?;
/// let want = [0.9, -2.2];
/// assert!(p.value().as_slice().iter().zip(want).all(|(v, w)| (v - w).abs() < 1e-15));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Sgd<T: Element> {
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    slots: Slots<T::Acc, 1>,
}

impl<T: Element> Sgd<T> {
    /// Plain SGD with learning rate `lr`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Sgd;
    /// assert_eq!(Sgd::<f32>::new(0.1).lr(), 0.1);
    /// ```
    pub fn new(lr: f64) -> Self {
        Sgd { lr, momentum: 0.0, weight_decay: 0.0, slots: Slots::new() }
    }

    /// With momentum (0 is none).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Param, Sgd};
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f64>::from(vec![0.0]));
    /// let mut sgd = Sgd::<f64>::new(1.0).momentum(0.5);
    /// for _ in 0..2 {
    ///     p.zero_grad();
    ///     p.accumulate_grad(Tensor::from(vec![1.0]))?;
    ///     sgd.step(vec![&mut p])?;
    /// }
    /// assert_eq!(p.value().as_slice(), &[-2.5]); // -1, then -(0.5 + 1)
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// With L2 weight decay (added to the gradient).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Param, Sgd};
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f64>::from(vec![2.0]));
    /// p.accumulate_grad(Tensor::from(vec![0.0]))?;
    /// Sgd::<f64>::new(0.5).weight_decay(0.1).step(vec![&mut p])?;
    /// assert!((p.value().as_slice()[0] - 1.9).abs() < 1e-15); // 2 - 0.5 * (0 + 0.1 * 2)
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// The learning rate.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Sgd;
    /// let mut sgd = Sgd::<f32>::new(0.1);
    /// sgd.set_lr(0.01);
    /// assert_eq!(sgd.lr(), 0.01);
    /// ```
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Changes the learning rate (a schedule).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Sgd;
    /// let mut sgd = Sgd::<f32>::new(0.1);
    /// sgd.set_lr(0.05);
    /// assert_eq!(sgd.lr(), 0.05);
    /// ```
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// Forgets the state (momentum, master weights): the next step starts afresh.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Param, Sgd};
    /// use dist_tensor::Tensor;
    /// let (mut a, mut b) = (Param::new(Tensor::<f32>::zeros(&[1])), Param::new(Tensor::<f32>::zeros(&[2])));
    /// let mut sgd = Sgd::<f32>::new(0.1);
    /// sgd.step(vec![&mut a])?;
    /// assert!(sgd.step(vec![&mut a, &mut b]).is_err()); // not the parameters it has state for
    /// sgd.reset();
    /// sgd.step(vec![&mut a, &mut b])?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn reset(&mut self) {
        self.slots = Slots::new();
    }

    /// The state, for checkpoints.
    pub(crate) fn slots(&self) -> &Slots<T::Acc, 1> {
        &self.slots
    }

    /// The state, to load a checkpoint into.
    pub(crate) fn slots_mut(&mut self) -> &mut Slots<T::Acc, 1> {
        &mut self.slots
    }

    /// One step of every parameter that has a gradient, in the order given (the same every
    /// time: the state is matched by position). Local: no exchange.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the parameters are not
    /// those of the first step (their number or sizes differ).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Param, Sgd};
    /// use dist_tensor::Tensor;
    /// use half::bf16;
    /// // bf16: steps far below bf16's resolution at 1.0 (0.0078) add up in the f32 master weights.
    /// let mut p = Param::new(Tensor::<bf16>::from(vec![bf16::ONE]));
    /// let mut sgd = Sgd::<bf16>::new(1e-3);
    /// for _ in 0..100 {
    ///     p.zero_grad();
    ///     p.accumulate_grad(Tensor::from(vec![bf16::ONE]))?;
    ///     sgd.step(vec![&mut p])?;
    /// }
    /// assert_eq!(p.value().as_slice()[0].to_f32(), 0.8984375); // 0.9, rounded to bf16
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn step(&mut self, params: Vec<&mut Param<T>>) -> Result<()> {
        let rule = OptimRule::Sgd {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
        };
        self.slots.step("Sgd::step", params, |_| rule)
    }
}
