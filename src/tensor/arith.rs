//! Arithmetic operators on [`Tensor`]: `+ - * /` between tensors (by reference or by value,
//! broadcast as ndarray broadcasts) and with a scalar on either side, their assigning forms, and
//! negation.
//!
//! Every element type computes in its accumulator type and rounds once: f16 and bf16 in f32, f32
//! and f64 in themselves. An operator whose result has the shape of a tensor taken by value writes
//! into that tensor's buffer instead of allocating.
//!
//! Shapes that do not broadcast panic (an operator cannot return an error); use
//! [`Tensor::zip_map`] for the fallible form. Inside [`World::run`](crate::World::run) such a panic
//! fails the run on every rank, it does not hang them.

use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

use half::{bf16, f16};

use super::backend::{Binary, Unary};
use super::dispatch;
use super::map::{broadcast_error, broadcast_shape};
use super::{Accumulator, Element, Tensor};

/// The device arm of an elementwise op that returns a tensor (not a `Result`): a failure on the
/// device (a kernel the backend lacks included) panics with the error's message, as a host
/// allocation failure does.
#[track_caller]
pub(crate) fn or_panic<T: Element>(result: crate::Result<Tensor<T>>) -> Tensor<T> {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// `op` with scalar `s` on every element of `t`, which lives on a device.
#[track_caller]
fn gpu_scalar<T: Element>(t: &Tensor<T>, op: Unary, s: T) -> Tensor<T> {
    or_panic(dispatch::unary(t, op, s.to_f64()))
}

/// `a op b` for two elements, computed in their accumulator type and rounded once.
#[inline(always)]
fn widened<T: Element>(a: T, b: T, op: impl Fn(T::Acc, T::Acc) -> T::Acc) -> T {
    T::from_acc(op(a.to_acc(), b.to_acc()))
}

/// `a op b` into a new tensor, broadcast.
#[track_caller]
fn binary<T: Element>(
    a: &Tensor<T>,
    b: &Tensor<T>,
    name: &'static str,
    op: impl Fn(T::Acc, T::Acc) -> T::Acc,
    gpu: Binary,
) -> Tensor<T> {
    match (a.is_on_host(), b.is_on_host()) {
        (true, true) => {}
        (false, false) => {
            let shape = broadcast_shape(a.shape(), b.shape())
                .unwrap_or_else(|| panic!("{}", broadcast_error(name, a.shape(), b.shape())));
            return or_panic(dispatch::binary(a, b, gpu, &shape));
        }
        _ => panic!(
            "{name}: operands on {} and {}: move one first (Tensor::to_device)",
            a.device(),
            b.device()
        ),
    }
    match a.zip_map(b, |x, y| widened(x, y, &op)) {
        Ok(t) => t,
        Err(_) => panic!("{}", broadcast_error(name, a.shape(), b.shape())),
    }
}

/// `a op b` into `a`'s buffer when the result has `a`'s shape, else into a new tensor.
#[track_caller]
fn binary_owned<T: Element>(
    mut a: Tensor<T>,
    b: &Tensor<T>,
    name: &'static str,
    op: impl Fn(T::Acc, T::Acc) -> T::Acc,
    gpu: Binary,
) -> Tensor<T> {
    // Device buffers are never written in place: a new tensor.
    if !a.is_on_host() || !b.is_on_host() {
        binary(&a, b, name, op, gpu)
    } else if broadcast_shape(a.shape(), b.shape()).as_deref() == Some(a.shape()) {
        a.zip_assign(b, |x, y| widened(x, y, &op));
        a
    } else {
        binary(&a, b, name, op, gpu)
    }
}

/// `a op= b`, with `b` broadcast to `a`'s shape.
#[track_caller]
fn assign<T: Element>(
    a: &mut Tensor<T>,
    b: &Tensor<T>,
    name: &'static str,
    op: impl Fn(T::Acc, T::Acc) -> T::Acc,
    gpu: Binary,
) {
    if !a.is_on_host() || !b.is_on_host() {
        if broadcast_shape(a.shape(), b.shape()).as_deref() != Some(a.shape()) {
            panic!(
                "{name}: the right-hand side's shape {:?} does not broadcast to {:?}",
                b.shape(),
                a.shape()
            );
        }
        *a = binary(a, b, name, op, gpu);
        return;
    }
    if !a.zip_assign(b, |x, y| widened(x, y, &op)) {
        panic!(
            "{name}: the right-hand side's shape {:?} does not broadcast to {:?}",
            b.shape(),
            a.shape()
        );
    }
}

fn add<A: Accumulator>(a: A, b: A) -> A {
    a + b
}
fn sub<A: Accumulator>(a: A, b: A) -> A {
    a - b
}
fn mul<A: Accumulator>(a: A, b: A) -> A {
    a * b
}
fn div<A: Accumulator>(a: A, b: A) -> A {
    a / b
}

macro_rules! tensor_ops {
    ($Op:ident, $op:ident, $OpAssign:ident, $op_assign:ident, $name:literal, $f:ident, $sym:tt,
     $gpu:ident, $gpu_scalar:ident) => {
        /// Elementwise, broadcast; computed in the accumulator type and rounded once.
        ///
        /// # Panics
        /// When the shapes do not broadcast ([`Tensor::zip_map`] returns an error instead).
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let a = Tensor::<f32>::random(&[2, 3], 1);"]
        #[doc = "let b = Tensor::<f32>::random(&[3], 2); // broadcast over the rows of a"]
        #[doc = concat!("let want = &a.to_array() ", stringify!($sym), " &b.to_array();")]
        #[doc = concat!("assert_eq!((&a ", stringify!($sym), " &b).to_array(), want);")]
        #[doc = "```"]
        impl<T: Element> $Op<&Tensor<T>> for &Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $op(self, rhs: &Tensor<T>) -> Tensor<T> {
                binary(self, rhs, $name, $f::<T::Acc>, Binary::$gpu)
            }
        }

        /// Elementwise, broadcast, written into `self`'s buffer when the result has its shape.
        ///
        /// # Panics
        /// When the shapes do not broadcast.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let a = Tensor::<f32>::random(&[2, 3], 1);"]
        #[doc = "let b = Tensor::<f32>::random(&[3], 2); // broadcast over the rows of a"]
        #[doc = concat!("let want = &a.to_array() ", stringify!($sym), " &b.to_array();")]
        #[doc = concat!("assert_eq!((a ", stringify!($sym), " &b).to_array(), want);")]
        #[doc = "```"]
        impl<T: Element> $Op<&Tensor<T>> for Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $op(self, rhs: &Tensor<T>) -> Tensor<T> {
                binary_owned(self, rhs, $name, $f::<T::Acc>, Binary::$gpu)
            }
        }

        /// Elementwise, broadcast, written into `rhs`'s buffer when the result has its shape.
        ///
        /// # Panics
        /// When the shapes do not broadcast.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let a = Tensor::<f32>::random(&[2, 3], 1);"]
        #[doc = "let b = Tensor::<f32>::random(&[3], 2); // broadcast over the rows of a"]
        #[doc = concat!("let want = &a.to_array() ", stringify!($sym), " &b.to_array();")]
        #[doc = concat!("assert_eq!((&a ", stringify!($sym), " b).to_array(), want);")]
        #[doc = "```"]
        impl<T: Element> $Op<Tensor<T>> for &Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $op(self, rhs: Tensor<T>) -> Tensor<T> {
                if !self.is_on_host() || !rhs.is_on_host() {
                    return binary(self, &rhs, $name, $f::<T::Acc>, Binary::$gpu);
                }
                binary_owned(rhs, self, $name, |y: T::Acc, x: T::Acc| $f(x, y), Binary::$gpu)
            }
        }

        /// Elementwise, broadcast, written into either operand's buffer when the result has its
        /// shape.
        ///
        /// # Panics
        /// When the shapes do not broadcast.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let a = Tensor::<f32>::random(&[2, 3], 1);"]
        #[doc = "let b = Tensor::<f32>::random(&[3], 2); // broadcast over the rows of a"]
        #[doc = concat!("let want = &a.to_array() ", stringify!($sym), " &b.to_array();")]
        #[doc = concat!("assert_eq!((a ", stringify!($sym), " b).to_array(), want);")]
        #[doc = "```"]
        impl<T: Element> $Op<Tensor<T>> for Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $op(self, rhs: Tensor<T>) -> Tensor<T> {
                if broadcast_shape(self.shape(), rhs.shape()).as_deref() == Some(self.shape()) {
                    binary_owned(self, &rhs, $name, $f::<T::Acc>, Binary::$gpu)
                } else {
                    (&self).$op(rhs)
                }
            }
        }

        /// Every element with the scalar.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let a = Tensor::<f64>::random(&[2, 3], 1);"]
        #[doc = concat!("let want = a.to_array().mapv(|x| x ", stringify!($sym), " 0.5);")]
        #[doc = concat!("assert_eq!((&a ", stringify!($sym), " 0.5).to_array(), want);")]
        #[doc = "```"]
        impl<T: Element> $Op<T> for &Tensor<T> {
            type Output = Tensor<T>;
            fn $op(self, rhs: T) -> Tensor<T> {
                if !self.is_on_host() {
                    return gpu_scalar(self, Unary::$gpu_scalar, rhs);
                }
                let s = rhs.to_acc();
                self.map(|x| T::from_acc($f(x.to_acc(), s)))
            }
        }

        /// Every element with the scalar, in place.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let a = Tensor::<f64>::random(&[2, 3], 1);"]
        #[doc = concat!("let want = a.to_array().mapv(|x| x ", stringify!($sym), " 0.5);")]
        #[doc = concat!("assert_eq!((a ", stringify!($sym), " 0.5).to_array(), want);")]
        #[doc = "```"]
        impl<T: Element> $Op<T> for Tensor<T> {
            type Output = Tensor<T>;
            fn $op(mut self, rhs: T) -> Tensor<T> {
                self.$op_assign(rhs);
                self
            }
        }

        /// Elementwise, with `rhs` broadcast to `self`'s shape.
        ///
        /// # Panics
        /// When `rhs` does not broadcast to `self`'s shape.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let mut a = Tensor::<f32>::random(&[2, 3], 1);"]
        #[doc = "let b = Tensor::<f32>::random(&[3], 2);"]
        #[doc = concat!("let want = &a.to_array() ", stringify!($sym), " &b.to_array();")]
        #[doc = concat!("a ", stringify!($sym), "= &b;")]
        #[doc = "assert_eq!(a.to_array(), want);"]
        #[doc = "```"]
        impl<T: Element> $OpAssign<&Tensor<T>> for Tensor<T> {
            #[track_caller]
            fn $op_assign(&mut self, rhs: &Tensor<T>) {
                assign(self, rhs, $name, $f::<T::Acc>, Binary::$gpu)
            }
        }

        /// Elementwise, with `rhs` broadcast to `self`'s shape.
        ///
        /// # Panics
        /// When `rhs` does not broadcast to `self`'s shape.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let mut a = Tensor::<f32>::random(&[2, 3], 1);"]
        #[doc = "let b = Tensor::<f32>::random(&[3], 2);"]
        #[doc = concat!("let want = &a.to_array() ", stringify!($sym), " &b.to_array();")]
        #[doc = concat!("a ", stringify!($sym), "= b;")]
        #[doc = "assert_eq!(a.to_array(), want);"]
        #[doc = "```"]
        impl<T: Element> $OpAssign<Tensor<T>> for Tensor<T> {
            #[track_caller]
            fn $op_assign(&mut self, rhs: Tensor<T>) {
                assign(self, &rhs, $name, $f::<T::Acc>, Binary::$gpu)
            }
        }

        /// Every element with the scalar.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::Tensor;"]
        #[doc = "let mut a = Tensor::<f64>::random(&[2, 3], 1);"]
        #[doc = concat!("let want = a.to_array().mapv(|x| x ", stringify!($sym), " 0.5);")]
        #[doc = concat!("a ", stringify!($sym), "= 0.5;")]
        #[doc = "assert_eq!(a.to_array(), want);"]
        #[doc = "```"]
        impl<T: Element> $OpAssign<T> for Tensor<T> {
            fn $op_assign(&mut self, rhs: T) {
                if !self.is_on_host() {
                    *self = gpu_scalar(self, Unary::$gpu_scalar, rhs);
                    return;
                }
                let s = rhs.to_acc();
                self.map_inplace(|x| T::from_acc($f(x.to_acc(), s)));
            }
        }
    };
}

tensor_ops!(Add, add, AddAssign, add_assign, "Tensor + Tensor", add, +, Add, AddScalar);
tensor_ops!(Sub, sub, SubAssign, sub_assign, "Tensor - Tensor", sub, -, Sub, SubScalar);
tensor_ops!(Mul, mul, MulAssign, mul_assign, "Tensor * Tensor", mul, *, Mul, MulScalar);
tensor_ops!(Div, div, DivAssign, div_assign, "Tensor / Tensor", div, /, Div, DivScalar);

/// Negation, exact in every element type.
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// let a = Tensor::<f32>::random(&[2, 3], 1);
/// assert_eq!((-&a).to_array(), -a.to_array());
/// ```
impl<T: Element> Neg for &Tensor<T> {
    type Output = Tensor<T>;
    fn neg(self) -> Tensor<T> {
        if !self.is_on_host() {
            return or_panic(dispatch::unary(self, Unary::Neg, 0.0));
        }
        self.map(|x| T::from_acc(-x.to_acc()))
    }
}

/// Negation in place.
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// let a = Tensor::<f64>::random(&[3], 1);
/// let want = -a.to_array();
/// assert_eq!((-a).to_array(), want);
/// ```
impl<T: Element> Neg for Tensor<T> {
    type Output = Tensor<T>;
    fn neg(mut self) -> Tensor<T> {
        if !self.is_on_host() {
            return or_panic(dispatch::unary(&self, Unary::Neg, 0.0));
        }
        self.map_inplace(|x| T::from_acc(-x.to_acc()));
        self
    }
}

/// `scalar op tensor` for each concrete element type (a generic `impl<T> Add<Tensor<T>> for T`
/// is not allowed by the orphan rule).
macro_rules! scalar_lhs {
    ($($t:ty => $path:literal),*) => {$(
        scalar_lhs!(@op $t, $path, Add, add, +, AddScalar);
        scalar_lhs!(@op $t, $path, Sub, sub, -, ScalarSub);
        scalar_lhs!(@op $t, $path, Mul, mul, *, MulScalar);
        scalar_lhs!(@op $t, $path, Div, div, /, ScalarDiv);
    )*};
    (@op $t:ty, $path:literal, $Op:ident, $op:ident, $sym:tt, $gpu:ident) => {
        /// The scalar with every element.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::{Element, Tensor};"]
        #[doc = concat!("let a = Tensor::<", $path, ">::from(vec![1.0, 2.0, 4.0].into_iter().map(<", $path, " as Element>::from_f64).collect::<Vec<_>>());")]
        #[doc = concat!("let s = <", $path, " as Element>::from_f64(0.5);")]
        #[doc = concat!("let got: Vec<f64> = (s ", stringify!($sym), " &a).as_slice().iter().map(|v| v.to_f64()).collect();")]
        #[doc = concat!("assert_eq!(got, [1.0, 2.0, 4.0].map(|x| 0.5 ", stringify!($sym), " x));")]
        #[doc = "```"]
        impl $Op<&Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            fn $op(self, rhs: &Tensor<$t>) -> Tensor<$t> {
                if !rhs.is_on_host() {
                    return gpu_scalar(rhs, Unary::$gpu, self);
                }
                let s = self.to_acc();
                rhs.map(|x| <$t>::from_acc($op(s, x.to_acc())))
            }
        }

        /// The scalar with every element, in place.
        ///
        /// # Examples
        #[doc = "```"]
        #[doc = "use dist_tensor::{Element, Tensor};"]
        #[doc = concat!("let a = Tensor::<", $path, ">::from(vec![1.0, 2.0, 4.0].into_iter().map(<", $path, " as Element>::from_f64).collect::<Vec<_>>());")]
        #[doc = concat!("let s = <", $path, " as Element>::from_f64(0.5);")]
        #[doc = concat!("let got: Vec<f64> = (s ", stringify!($sym), " a).as_slice().iter().map(|v| v.to_f64()).collect();")]
        #[doc = concat!("assert_eq!(got, [1.0, 2.0, 4.0].map(|x| 0.5 ", stringify!($sym), " x));")]
        #[doc = "```"]
        impl $Op<Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            fn $op(self, mut rhs: Tensor<$t>) -> Tensor<$t> {
                if !rhs.is_on_host() {
                    return gpu_scalar(&rhs, Unary::$gpu, self);
                }
                let s = self.to_acc();
                rhs.map_inplace(|x| <$t>::from_acc($op(s, x.to_acc())));
                rhs
            }
        }
    };
}

scalar_lhs!(
    f32 => "f32",
    f64 => "f64",
    f16 => "dist_tensor::half::f16",
    bf16 => "dist_tensor::half::bf16"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_operands_reuse_their_buffer_when_the_result_fits() {
        let a = Tensor::<f32>::random(&[4, 3], 1);
        let b = Tensor::<f32>::random(&[3], 2);
        let ptr = a.as_slice().as_ptr();
        let c = a + &b;
        assert_eq!(c.as_slice().as_ptr(), ptr);
        // The right operand's buffer, when only it has the result's shape.
        let d = Tensor::<f32>::random(&[4, 3], 3);
        let ptr = d.as_slice().as_ptr();
        let e = b.clone() - d;
        assert_eq!(e.as_slice().as_ptr(), ptr);
    }

    #[test]
    fn a_shared_operand_is_copied_not_written() {
        let a = Tensor::<f64>::random(&[5], 1);
        let keep = a.clone();
        let sum = a + 1.0;
        assert_ne!(sum.as_slice().as_ptr(), keep.as_slice().as_ptr());
        assert!(sum.as_slice().iter().zip(keep.as_slice()).all(|(s, k)| *s == k + 1.0));
    }
}
