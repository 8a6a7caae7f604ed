//! Learning-rate schedules behind one trait, [`LrSchedule`]: the rate at each step, which a
//! training loop hands to [`Optimizer::set_lr`](super::Optimizer::set_lr) before the step.
//! A schedule is a pure function of the step, so a resumed run (which knows its step) follows
//! the same rates as an unbroken one without saving anything.

/// A learning rate as a function of the step (from 0).
///
/// # Examples
/// ```
/// use dist_tensor::nn::{Constant, LrSchedule, StepDecay, WarmupCosine, WarmupLinear};
/// let schedules: Vec<Box<dyn LrSchedule>> = vec![
///     Box::new(Constant(1e-3)),
///     Box::new(WarmupCosine { peak: 1e-3, min: 1e-5, warmup: 10, total: 100 }),
///     Box::new(WarmupLinear { peak: 1e-3, min: 0.0, warmup: 10, total: 100 }),
///     Box::new(StepDecay { initial: 1e-3, factor: 0.5, every: 30 }),
/// ];
/// for s in &schedules {
///     assert!(s.lr(50) > 0.0 && s.lr(50) <= 1e-3);
/// }
/// ```
pub trait LrSchedule {
    /// The rate at `step`.
    fn lr(&self, step: usize) -> f64;
}

/// A boxed schedule is one (a schedule picked at run time).
impl<S: LrSchedule + ?Sized> LrSchedule for Box<S> {
    fn lr(&self, step: usize) -> f64 {
        (**self).lr(step)
    }
}

/// The same rate at every step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Constant(pub f64);

impl LrSchedule for Constant {
    fn lr(&self, _step: usize) -> f64 {
        self.0
    }
}

/// A rate that rises linearly from 0 to `peak` over `warmup` steps, then falls along a half
/// cosine to `min` at step `total` (and stays there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine {
    /// The rate at the end of the warm-up.
    pub peak: f64,
    /// The rate at `total` and after.
    pub min: f64,
    /// Steps of warm-up.
    pub warmup: usize,
    /// The step at which the cosine reaches `min`.
    pub total: usize,
}

/// The linear warm-up to `peak` that both warm-up schedules share: the rate at `step < warmup`.
fn warming(peak: f64, warmup: usize, step: usize) -> f64 {
    peak * (step + 1) as f64 / warmup as f64
}

/// How far past the warm-up `step` is, from 0 to 1 at `total`.
fn progress(warmup: usize, total: usize, step: usize) -> f64 {
    let span = total.saturating_sub(warmup).max(1);
    ((step - warmup) as f64 / span as f64).min(1.0)
}

impl LrSchedule for WarmupCosine {
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{LrSchedule, WarmupCosine};
    /// let s = WarmupCosine { peak: 1.0, min: 0.1, warmup: 10, total: 110 };
    /// assert_eq!(s.lr(0), 0.1); // 1/10 of the way up
    /// assert_eq!(s.lr(9), 1.0);
    /// assert!((s.lr(60) - 0.55).abs() < 1e-12); // half way down
    /// assert_eq!(s.lr(500), 0.1);
    /// ```
    fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return warming(self.peak, self.warmup, step);
        }
        let t = progress(self.warmup, self.total, step);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

/// A rate that rises linearly from 0 to `peak` over `warmup` steps, then falls linearly to
/// `min` at step `total` (and stays there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupLinear {
    /// The rate at the end of the warm-up.
    pub peak: f64,
    /// The rate at `total` and after.
    pub min: f64,
    /// Steps of warm-up.
    pub warmup: usize,
    /// The step at which the rate reaches `min`.
    pub total: usize,
}

impl LrSchedule for WarmupLinear {
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{LrSchedule, WarmupLinear};
    /// let s = WarmupLinear { peak: 1.0, min: 0.0, warmup: 0, total: 100 };
    /// assert_eq!(s.lr(0), 1.0);
    /// assert_eq!(s.lr(25), 0.75);
    /// assert_eq!(s.lr(200), 0.0);
    /// ```
    fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return warming(self.peak, self.warmup, step);
        }
        self.peak + (self.min - self.peak) * progress(self.warmup, self.total, step)
    }
}

/// `initial`, multiplied by `factor` every `every` steps (PyTorch's `StepLR`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDecay {
    /// The rate of the first `every` steps.
    pub initial: f64,
    /// What each decay multiplies the rate by.
    pub factor: f64,
    /// Steps between decays (0 is taken as never).
    pub every: usize,
}

impl LrSchedule for StepDecay {
    /// # Examples
    /// ```
    /// use dist_tensor::nn::{LrSchedule, StepDecay};
    /// let s = StepDecay { initial: 1.0, factor: 0.1, every: 10 };
    /// assert_eq!(s.lr(9), 1.0);
    /// assert!((s.lr(10) - 0.1).abs() < 1e-15);
    /// assert!((s.lr(25) - 0.01).abs() < 1e-15);
    /// ```
    fn lr(&self, step: usize) -> f64 {
        match self.every {
            0 => self.initial,
            n => self.initial * self.factor.powi((step / n).min(i32::MAX as usize) as i32),
        }
    }
}
