//! Arithmetic on [`Var`]: `+ - * /` between variables (broadcast as [`Tensor`] broadcasts; the
//! gradient of a broadcast operand is summed over the dimensions it was stretched along), with a
//! scalar, and negation.

use std::ops::{Add, Div, Mul, Neg, Sub};

use crate::autograd::Var;
use crate::autograd::var::{Grads, record};
use crate::{Element, Result, Tensor};

/// `g`, of a broadcast result's shape, summed down to `shape`: over the leading dimensions
/// `shape` lacks, and over those where `shape` has 1 and `g` more.
pub(crate) fn sum_to_shape<T: Element>(g: &Tensor<T>, shape: &[usize]) -> Result<Tensor<T>> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let mut out = g.clone();
    while out.ndim() > shape.len() {
        out = out.sum_axis(0)?;
    }
    for (axis, &len) in shape.iter().enumerate() {
        if len == 1 && out.shape()[axis] != 1 {
            out = out.sum_axis(axis)?.insert_axis(axis)?;
        }
    }
    Ok(out)
}

fn binary<'a, T: Element>(
    a: &Var<'a, T>,
    b: &Var<'a, T>,
    value: Tensor<T>,
    grads: impl FnOnce(&Tensor<T>, &Tensor<T>, &Tensor<T>, &[bool]) -> Result<[Option<Tensor<T>>; 2]>
    + 'a,
) -> Var<'a, T> {
    let (av, bv) = (a.value.clone(), b.value.clone());
    record(value, &[a, b], move |g, need| {
        let [ga, gb] = grads(g, &av, &bv, need)?;
        let ga = ga.map(|ga| sum_to_shape(&ga, av.shape())).transpose()?;
        let gb = gb.map(|gb| sum_to_shape(&gb, bv.shape())).transpose()?;
        Ok::<Grads<T>, crate::Error>(vec![ga, gb])
    })
}

/// `d(a / b) / db = -a / b^2`, times the output's gradient.
fn quotient_rhs_grad<T: Element>(g: &Tensor<T>, a: &Tensor<T>, b: &Tensor<T>) -> Tensor<T> {
    -(g * a) / &(b * b)
}

fn when<T>(need: bool, f: impl FnOnce() -> T) -> Option<T> {
    need.then(f)
}

impl<'a, T: Element> Var<'a, T> {
    /// `self * s` for a scalar `s`.
    pub fn scale(&self, s: f64) -> Var<'a, T> {
        let k = T::from_f64(s);
        record(&self.value * k, &[self], move |g, _| Ok(vec![Some(g * k)]))
    }

    /// `self + s` for a scalar `s`.
    pub fn add_scalar(&self, s: f64) -> Var<'a, T> {
        record(&self.value + T::from_f64(s), &[self], |g, _| Ok(vec![Some(g.clone())]))
    }
}

macro_rules! var_op {
    ($Op:ident, $op:ident, $sym:tt, |$g:ident, $a:ident, $b:ident| $ga:expr, $gb:expr) => {
        /// Elementwise, broadcast as [`Tensor`] broadcasts, recorded when either side is tracked.
        ///
        /// # Panics
        /// When the shapes do not broadcast (as the [`Tensor`] operator).
        impl<'a, T: Element> $Op<&Var<'a, T>> for &Var<'a, T> {
            type Output = Var<'a, T>;
            #[track_caller]
            fn $op(self, rhs: &Var<'a, T>) -> Var<'a, T> {
                let value = &self.value $sym &rhs.value;
                binary(self, rhs, value, |$g, $a, $b, need| {
                    Ok([when(need[0], || $ga), when(need[1], || $gb)])
                })
            }
        }

        /// Elementwise with a scalar on the right.
        impl<'a, T: Element> $Op<T> for &Var<'a, T> {
            type Output = Var<'a, T>;
            fn $op(self, rhs: T) -> Var<'a, T> {
                let scalar = Var::constant(Tensor::from_shape_vec(&[], vec![rhs]).expect("0-D"));
                self $sym &scalar
            }
        }
    };
}

var_op!(Add, add, +, |g, _a, _b| g.clone(), g.clone());
var_op!(Sub, sub, -, |g, _a, _b| g.clone(), -g);
var_op!(Mul, mul, *, |g, a, b| g * b, g * a);
var_op!(Div, div, /, |g, a, b| g / b, quotient_rhs_grad(g, a, b));

/// Negation.
impl<'a, T: Element> Neg for &Var<'a, T> {
    type Output = Var<'a, T>;
    fn neg(self) -> Var<'a, T> {
        record(-&self.value, &[self], |g, _| Ok(vec![Some(-g)]))
    }
}
