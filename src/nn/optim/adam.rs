//! Adam, with AdamW's decoupled weight decay.

use super::Slots;
use crate::Result;
use crate::nn::Param;
use crate::tensor::{Element, OptimRule};

/// Adam (Kingma and Ba), with decoupled weight decay as in AdamW (Loshchilov and Hutter):
///
/// ```text
/// p -= lr * weight_decay * p
/// m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g^2
/// p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
/// ```
///
/// PyTorch's `AdamW` (with `weight_decay` 0, its `Adam`). Defaults: betas 0.9 and 0.999, eps
/// 1e-8, no weight decay.
///
/// The update is computed in the accumulator type; f16 and bf16 parameters are stepped through
/// f32 master weights (made from their values at the first step, rounded into the parameters
/// after each step), so that updates below the half type's resolution add up.
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Adam, Param};
/// use dist_tensor::Tensor;
///
/// // Adam's first step moves every parameter by about lr, whatever the gradient's size.
/// let mut p = Param::new(Tensor::<f64>::from(vec![1.0, 1.0]));
/// p.accumulate_grad(Tensor::from(vec![1e-3, -50.0]))?;
/// Adam::<f64>::new(0.1).step(vec![&mut p])?;
/// assert!((p.value().as_slice()[0] - 0.9).abs() < 1e-5);
/// assert!((p.value().as_slice()[1] - 1.1).abs() < 1e-5);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Adam<T: Element> {
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    slots: Slots<T::Acc, 2>,
}

impl<T: Element> Adam<T> {
    /// Adam with learning rate `lr` and the default betas, eps and no weight decay.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Adam;
    /// assert_eq!(Adam::<f32>::new(1e-3).lr(), 1e-3);
    /// ```
    pub fn new(lr: f64) -> Self {
        Adam { lr, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, slots: Slots::new() }
    }

    /// With these decay rates of the first and second moments.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Adam, Param};
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f64>::from(vec![0.0]));
    /// p.accumulate_grad(Tensor::from(vec![2.0]))?;
    /// Adam::<f64>::new(0.1).betas(0.5, 0.5).step(vec![&mut p])?;
    /// assert!((p.value().as_slice()[0] + 0.1).abs() < 1e-6); // bias-corrected: still lr
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.betas = (beta1, beta2);
        self
    }

    /// With this `eps` (added to the root of the second moment).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Adam, Param};
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f64>::from(vec![0.0]));
    /// p.accumulate_grad(Tensor::from(vec![1.0]))?;
    /// Adam::<f64>::new(1.0).eps(1.0).step(vec![&mut p])?;
    /// assert!((p.value().as_slice()[0] + 0.5).abs() < 1e-12); // 1 / (1 + 1)
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// With decoupled weight decay (AdamW): `p -= lr * weight_decay * p` before the Adam update.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Adam, Param};
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f64>::from(vec![2.0]));
    /// p.accumulate_grad(Tensor::from(vec![0.0]))?;
    /// Adam::<f64>::new(0.1).weight_decay(0.5).step(vec![&mut p])?;
    /// assert!((p.value().as_slice()[0] - 1.9).abs() < 1e-12);
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
    /// use dist_tensor::nn::Adam;
    /// assert_eq!(Adam::<f32>::new(0.01).lr(), 0.01);
    /// ```
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Changes the learning rate (a schedule).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::Adam;
    /// let mut adam = Adam::<f32>::new(0.01);
    /// adam.set_lr(0.001);
    /// assert_eq!(adam.lr(), 0.001);
    /// ```
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// Forgets the state (moments, step counts, master weights): the next step starts afresh.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{Adam, Param};
    /// use dist_tensor::Tensor;
    /// let mut p = Param::new(Tensor::<f64>::from(vec![0.0]));
    /// let mut adam = Adam::<f64>::new(0.1);
    /// p.accumulate_grad(Tensor::from(vec![1.0]))?;
    /// adam.step(vec![&mut p])?;
    /// p.value_mut().as_mut_slice()[0] = 5.0; // a checkpoint loaded
    /// adam.reset();
    /// adam.step(vec![&mut p])?;
    /// assert!((p.value().as_slice()[0] - 4.9).abs() < 1e-6);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn reset(&mut self) {
        self.slots = Slots::new();
    }

    /// The state, for checkpoints.
    pub(crate) fn slots(&self) -> &Slots<T::Acc, 2> {
        &self.slots
    }

    /// The state, to load a checkpoint into.
    pub(crate) fn slots_mut(&mut self) -> &mut Slots<T::Acc, 2> {
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
    /// use dist_tensor::nn::{Adam, Param};
    /// use dist_tensor::Tensor;
    /// // Minimise (p - 3)^2.
    /// let mut p = Param::new(Tensor::<f32>::from(vec![0.0]));
    /// let mut adam = Adam::<f32>::new(0.1);
    /// for _ in 0..300 {
    ///     let x = p.value().as_slice()[0];
    ///     p.zero_grad();
    ///     p.accumulate_grad(Tensor::from(vec![2.0 * (x - 3.0)]))?;
    ///     adam.step(vec![&mut p])?;
    /// }
    /// assert!((p.value().as_slice()[0] - 3.0).abs() < 0.05);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn step(&mut self, params: Vec<&mut Param<T>>) -> Result<()> {
        let (beta1, beta2) = self.betas;
        let (lr, decay, eps) = (self.lr, self.weight_decay, self.eps);
        // The bias corrections folded into the step size and the root, in f64.
        let rule = move |t: u64| {
            let t = t.min(i32::MAX as u64) as i32;
            OptimRule::Adam {
                step: lr / (1.0 - beta1.powi(t)),
                beta1,
                beta2,
                eps,
                shrink: 1.0 - lr * decay,
                root: (1.0 - beta2.powi(t)).sqrt(),
            }
        };
        self.slots.step("Adam::step", params, rule)
    }
}
