//! Activations: GELU (exact and tanh), SiLU, ReLU, and softmax over an axis.
//!
//! Each element is widened to its accumulator type (f32 for f16 and bf16), computed there and
//! rounded once; the exact GELU computes in f64, as `erf` has no f32 form in `num-traits`.

use ndarray::{Axis, Zip};
use num_traits::Float;

use super::arith::or_panic;
use super::backend::Unary;
use super::dispatch;
use super::{Accumulator, Element, Tensor};
use crate::{Error, Result};

/// `sqrt(2 / pi)`, for the tanh form of GELU.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

fn acc<A: Accumulator>(v: f64) -> A {
    A::from_f64(v)
}

/// `x` computed in the accumulator type by `f`, rounded once.
fn unary<T: Element>(t: &Tensor<T>, f: impl Fn(T::Acc) -> T::Acc) -> Tensor<T> {
    t.map(|x| T::from_acc(f(x.to_acc())))
}

/// The softmax of one lane `x` into `out`, through `exps` (the lane in the accumulator type).
fn softmax_lane<'a, T: Element>(
    exps: &mut Vec<T::Acc>,
    x: impl Iterator<Item = T>,
    out: impl Iterator<Item = &'a mut T>,
) {
    exps.clear();
    exps.extend(x.map(|v| v.to_acc()));
    let max = exps.iter().copied().fold(<T::Acc as Float>::neg_infinity(), Float::max);
    for e in exps.iter_mut() {
        *e = (*e - max).exp();
    }
    let sum = super::reduce::pairwise_sum(exps);
    for (o, &e) in out.zip(exps.iter()) {
        *o = T::from_acc(e / sum);
    }
}

impl<T: Element> Tensor<T> {
    /// GELU, `x * Phi(x)` with the standard normal CDF `Phi(x) = (1 + erf(x / sqrt 2)) / 2`:
    /// PyTorch's `gelu` (the exact form, as BERT uses it). Computed in f64, rounded once.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f64>::from_shape_vec(&[3], vec![-1.0, 0.0, 2.0])?;
    /// let g = t.gelu();
    /// assert!((g.as_slice()[0] - -0.158_655_253_931_457_05).abs() < 1e-15);
    /// assert_eq!(g.as_slice()[1], 0.0);
    /// assert!((g.as_slice()[2] - 1.954_499_736_103_642).abs() < 1e-15);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn gelu(&self) -> Tensor<T> {
        if !self.is_on_host() {
            return or_panic(dispatch::unary(self, Unary::Gelu, 0.0));
        }
        self.map(|x| {
            let v = x.to_f64();
            T::from_f64(0.5 * v * (1.0 + libm::erf(v * std::f64::consts::FRAC_1_SQRT_2)))
        })
    }

    /// GELU's tanh approximation, `x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`: PyTorch's
    /// `gelu(approximate="tanh")`, as GPT-2 and most decoder MLPs use it. Within 1e-3 of
    /// [`Tensor::gelu`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::random(&[100], 1);
    /// let (approx, exact) = (t.gelu_tanh(), t.gelu());
    /// assert!(approx.as_slice().iter().zip(exact.as_slice()).all(|(a, e)| (a - e).abs() < 1e-3));
    /// ```
    pub fn gelu_tanh(&self) -> Tensor<T> {
        if !self.is_on_host() {
            return or_panic(dispatch::unary(self, Unary::GeluTanh, 0.0));
        }
        let [half, one, c, k]: [T::Acc; 4] = [0.5, 1.0, SQRT_2_OVER_PI, 0.044715].map(acc);
        unary(self, |x| half * x * (one + (c * (x + k * x * x * x)).tanh()))
    }

    /// SiLU (swish), `x * sigmoid(x) = x / (1 + exp(-x))`, as SwiGLU MLPs use it.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f64>::from_shape_vec(&[2], vec![0.0, 1.0])?;
    /// let s = t.silu();
    /// assert_eq!(s.as_slice()[0], 0.0);
    /// assert!((s.as_slice()[1] - 1.0 / (1.0 + (-1.0f64).exp())).abs() < 1e-15);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn silu(&self) -> Tensor<T> {
        if !self.is_on_host() {
            return or_panic(dispatch::unary(self, Unary::Silu, 0.0));
        }
        let one: T::Acc = acc(1.0);
        unary(self, |x| x / (one + (-x).exp()))
    }

    /// ReLU, `max(x, 0)`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[3], vec![-1.0, 0.5, 2.0])?;
    /// assert_eq!(t.relu().as_slice(), &[0.0, 0.5, 2.0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn relu(&self) -> Tensor<T> {
        if !self.is_on_host() {
            return or_panic(dispatch::unary(self, Unary::Relu, 0.0));
        }
        self.map(|x| if x > T::zero() { x } else { T::zero() })
    }

    /// Softmax along `axis`: `exp(x_i - max) / sum_j exp(x_j - max)` over each lane of that
    /// axis, in the accumulator type, rounded once. `-inf` entries (masked out) get 0; a lane
    /// that is all `-inf` gets NaN, as in PyTorch.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] when `axis` is not a dimension of the tensor;
    /// [`Error::OutOfMemory`] when the output cannot be allocated.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 2., 3., 0., 0., f32::NEG_INFINITY])?;
    /// let p = t.softmax(1)?;
    /// let row0: f32 = p.as_slice()[..3].iter().sum();
    /// assert!((row0 - 1.0).abs() < 1e-6);
    /// assert_eq!(&p.as_slice()[3..], &[0.5, 0.5, 0.0]);
    /// assert!(t.softmax(2).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn softmax(&self, axis: usize) -> Result<Tensor<T>> {
        if axis >= self.ndim() {
            return Err(Error::DimOutOfRange {
                op: "Tensor::softmax",
                dim: axis,
                ndim: self.ndim(),
            });
        }
        if !self.is_on_host() {
            return dispatch::softmax(self, axis);
        }
        let mut out = Tensor::<T>::scratch("Tensor::softmax", self.shape())?;
        let n = self.shape()[axis];
        let mut exps: Vec<T::Acc> = Vec::with_capacity(n);
        if axis + 1 == self.ndim() && n > 0 {
            // The last axis: each lane is a contiguous run.
            let rows = self.as_slice().chunks_exact(n).zip(out.as_mut_slice().chunks_exact_mut(n));
            for (x, o) in rows {
                softmax_lane(&mut exps, x.iter().copied(), o.iter_mut());
            }
        } else {
            let input = self.view();
            Zip::from(out.view_mut().lanes_mut(Axis(axis)))
                .and(input.lanes(Axis(axis)))
                .for_each(|mut o, x| softmax_lane(&mut exps, x.iter().copied(), o.iter_mut()));
        }
        Ok(out)
    }
}
