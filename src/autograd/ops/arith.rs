//! Arithmetic on [`Var`]: `+ - * /` between variables (broadcast as [`Tensor`] broadcasts; the
//! gradient of a broadcast operand is summed over the dimensions it was stretched along), with a
//! scalar of the element type on either side (`&v * 2.0`, `2.0f32 - &v`, by reference or by
//! value), and negation.

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

/// `d(s / x) / dx = -s / x^2`, times the output's gradient (dividing by `x` twice: `x * x`
/// overflows sooner in f16).
fn scalar_quotient_grad<T: Element>(g: &Tensor<T>, s: T, x: &Tensor<T>) -> Tensor<T> {
    -(&(g * s) / x) / x
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
    };
}

var_op!(Add, add, +, |g, _a, _b| g.clone(), g.clone());
var_op!(Sub, sub, -, |g, _a, _b| g.clone(), -g);
var_op!(Mul, mul, *, |g, a, b| g * b, g * a);
var_op!(Div, div, /, |g, a, b| g / b, quotient_rhs_grad(g, a, b));

/// `Var op scalar` (the scalar of the element type `T`), by reference and by value: the
/// [`Tensor`] scalar operator where the value lives (on a GPU too), recorded when the variable
/// is tracked, with the gradient `$grad` of the output's gradient `g` and the scalar `s`. No
/// tensor is saved for the backward pass.
macro_rules! var_scalar_rhs {
    ($Op:ident, $op:ident, $sym:tt, |$g:ident, $s:ident| $grad:expr, $dx:literal) => {
        /// Every element with a scalar of the element type, recorded when `self` is tracked.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::autograd::Var;"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let x = Var::param(Tensor::<f64>::from_shape_vec(&[2], vec![1.0, 4.0])?);"]
        #[doc = concat!("let y = &x ", stringify!($sym), " 2.0;")]
        #[doc = concat!("assert_eq!(y.value().as_slice(), &[1.0 ", stringify!($sym), " 2.0, 4.0 ", stringify!($sym), " 2.0]);")]
        #[doc = "y.sum().backward()?;"]
        #[doc = concat!("assert_eq!(x.grad().unwrap().as_slice(), &", $dx, ");")]
        #[doc = "# Ok::<(), dist_tensor::Error>(())"]
        #[doc = "```"]
        impl<'a, T: Element> $Op<T> for &Var<'a, T> {
            type Output = Var<'a, T>;
            fn $op(self, $s: T) -> Var<'a, T> {
                record(&self.value $sym $s, &[self], move |$g, _| Ok(vec![Some($grad)]))
            }
        }

        /// Every element with a scalar of the element type, recorded when `self` is tracked.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::autograd::Var;"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let x = Var::param(Tensor::<f32>::from_shape_vec(&[2], vec![1.0, 4.0])?);"]
        #[doc = concat!("let y = x.clone() ", stringify!($sym), " 2.0;")]
        #[doc = concat!("assert_eq!(y.value().as_slice(), &[1.0 ", stringify!($sym), " 2.0, 4.0 ", stringify!($sym), " 2.0]);")]
        #[doc = "# Ok::<(), dist_tensor::Error>(())"]
        #[doc = "```"]
        impl<'a, T: Element> $Op<T> for Var<'a, T> {
            type Output = Var<'a, T>;
            fn $op(self, s: T) -> Var<'a, T> {
                (&self).$op(s)
            }
        }
    };
}

var_scalar_rhs!(Add, add, +, |g, s| g.clone(), "[1.0, 1.0]");
var_scalar_rhs!(Sub, sub, -, |g, s| g.clone(), "[1.0, 1.0]");
var_scalar_rhs!(Mul, mul, *, |g, s| g * s, "[2.0, 2.0]");
var_scalar_rhs!(Div, div, /, |g, s| g / s, "[0.5, 0.5]");

/// `scalar op Var` for each concrete element type (a generic `impl<T> Add<&Var<T>> for T` is not
/// allowed by the orphan rule, as for [`Tensor`]): the [`Tensor`] operator where the value lives
/// (on a GPU too), recorded when the variable is tracked. `$backward` makes the backward
/// function from the variable `$x` and the scalar `$s`; only `scalar / Var` saves a tensor (the
/// variable's value: `d(s / x)/dx = -s / x^2`).
macro_rules! var_scalar_lhs {
    ($($t:ty => $path:literal),*) => {$(
        var_scalar_lhs!(@op $t, $path, Add, add, +, "[1.0, 1.0]",
            |_x, _s| |g: &Tensor<$t>| g.clone());
        var_scalar_lhs!(@op $t, $path, Sub, sub, -, "[-1.0, -1.0]",
            |_x, _s| |g: &Tensor<$t>| -g);
        var_scalar_lhs!(@op $t, $path, Mul, mul, *, "[2.0, 2.0]",
            |_x, s| move |g: &Tensor<$t>| g * s);
        var_scalar_lhs!(@op $t, $path, Div, div, /, "[-2.0, -0.125]", |x, s| {
            let x = x.value.clone();
            move |g: &Tensor<$t>| scalar_quotient_grad(g, s, &x)
        });
    )*};
    (@op $t:ty, $path:literal, $Op:ident, $op:ident, $sym:tt, $dx:literal,
     |$x:ident, $s:ident| $backward:expr) => {
        /// The scalar with every element, recorded when the variable is tracked.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::autograd::Var;"]
        #[doc = "use dist_tensor::{Element, Tensor};"]
        #[doc = concat!("let t = |v: &[f64]| v.iter().map(|&x| <", $path, " as Element>::from_f64(x)).collect::<Vec<_>>();")]
        #[doc = concat!("let x = Var::param(Tensor::<", $path, ">::from(t(&[1.0, 4.0])));")]
        #[doc = concat!("let s = <", $path, " as Element>::from_f64(2.0);")]
        #[doc = concat!("let y = s ", stringify!($sym), " &x;")]
        #[doc = concat!("assert_eq!(y.value().as_slice(), t(&[2.0 ", stringify!($sym), " 1.0, 2.0 ", stringify!($sym), " 4.0]));")]
        #[doc = concat!("let z = s ", stringify!($sym), " x.clone(); // by value too")]
        #[doc = "y.sum().backward()?;"]
        #[doc = concat!("assert_eq!(x.grad().unwrap().as_slice(), t(&", $dx, "));")]
        #[doc = "assert!(z.is_tracked());"]
        #[doc = "# Ok::<(), dist_tensor::Error>(())"]
        #[doc = "```"]
        impl<'a> $Op<&Var<'a, $t>> for $t {
            type Output = Var<'a, $t>;
            fn $op(self, rhs: &Var<'a, $t>) -> Var<'a, $t> {
                let ($x, $s) = (rhs, self);
                let backward = $backward;
                record(self $sym &rhs.value, &[rhs], move |g, _| Ok(vec![Some(backward(g))]))
            }
        }

        /// The scalar with every element, recorded when the variable is tracked (see the
        /// by-reference form).
        impl<'a> $Op<Var<'a, $t>> for $t {
            type Output = Var<'a, $t>;
            fn $op(self, rhs: Var<'a, $t>) -> Var<'a, $t> {
                self $sym &rhs
            }
        }
    };
}

var_scalar_lhs!(f32 => "f32", f64 => "f64", half::f16 => "half::f16", half::bf16 => "half::bf16");

/// Negation.
impl<'a, T: Element> Neg for &Var<'a, T> {
    type Output = Var<'a, T>;
    fn neg(self) -> Var<'a, T> {
        record(-&self.value, &[self], |g, _| Ok(vec![Some(-g)]))
    }
}
