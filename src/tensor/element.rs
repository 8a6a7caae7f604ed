//! Element types: f32, f64, f16 and bf16, each with the type it accumulates in.

use std::fmt::{Debug, Display};
use std::ops::{Add, AddAssign, Mul};

use half::{bf16, f16};

use super::gemm_kernel;

/// The element types a tensor can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// IEEE half precision.
    F16,
    /// Brain floating point (8-bit exponent, 7-bit mantissa).
    BF16,
}

impl Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A tensor element: f32, f64, [`f16`](half::f16) or [`bf16`](half::bf16).
///
/// Products accumulate in [`Element::Acc`] (f32 for the half types, f64 for f64) and are rounded
/// to the element type once, at the end.
///
/// # Examples
/// ```
/// use dist_tensor::{DType, Element};
/// use half::bf16;
///
/// assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
/// let x = bf16::from_f64(1.5);
/// let acc: f32 = x.to_acc();
/// assert_eq!(acc, 1.5);
///
/// // Generic code has the arithmetic operators.
/// fn scale<T: Element>(a: T, v: &[T]) -> Vec<T> {
///     v.iter().map(|&x| a * x - x / a).collect()
/// }
/// assert_eq!(scale(2.0f32, &[4.0]), vec![6.0]);
/// assert_eq!(scale(bf16::from_f64(2.0), &[bf16::from_f64(4.0)]), vec![bf16::from_f64(6.0)]);
/// ```
pub trait Element:
    super::Pod
    + Debug
    + Display
    + Default
    + PartialEq
    + PartialOrd
    + sealed::Sealed
    // The arithmetic every element type has, so that generic code can write `a * v`.
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
{
    /// The type products and sums accumulate in.
    type Acc: Accumulator;
    /// This type's tag.
    const DTYPE: DType;
    /// Machine epsilon of the type, as f64 (the distance from 1.0 to the next value).
    const EPSILON: f64;

    /// Widens to the accumulator type.
    fn to_acc(self) -> Self::Acc;
    /// Rounds from the accumulator type (round to nearest even).
    fn from_acc(acc: Self::Acc) -> Self;
    /// Widens to f64, exactly.
    fn to_f64(self) -> f64;
    /// Rounds from f64.
    fn from_f64(v: f64) -> Self;
    /// Zero.
    fn zero() -> Self {
        Self::default()
    }

    /// `acc (m x n) += a (m x k) * b (k x n)` on raw strided operands (strides in elements).
    ///
    /// # Safety
    /// Every pointer must be valid for every element its shape and strides reach, `acc` must not
    /// overlap `a` or `b`, and nothing else may write any of them during the call.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_acc(
        m: usize,
        n: usize,
        k: usize,
        acc: (*mut Self::Acc, isize, isize),
        read_acc: bool,
        a: (*const Self, isize, isize),
        b: (*const Self, isize, isize),
        threads: usize,
    );

    /// Atomically adds `v` to `*dst` (compare-and-swap on the bits; half types add in f32 and
    /// round).
    ///
    /// # Safety
    /// `dst` must be valid, aligned, and only accessed atomically while this runs.
    #[doc(hidden)]
    unsafe fn atomic_add(dst: *mut Self, v: Self);
}

// The atomic types `atomic_add` reinterprets elements as must match them in size and alignment
// (f64 is only 4-byte aligned on some 32-bit targets: refuse to build there).
const _: () = assert!(
    size_of::<std::sync::atomic::AtomicU64>() == size_of::<f64>()
        && align_of::<std::sync::atomic::AtomicU64>() == align_of::<f64>()
        && align_of::<std::sync::atomic::AtomicU32>() == align_of::<f32>()
        && align_of::<std::sync::atomic::AtomicU16>() == align_of::<half::f16>()
);

/// `*dst += v` as a compare-and-swap loop on the bits of the value.
macro_rules! cas_add {
    ($atomic:ty, $dst:expr, $v:expr, $t:ty, $add:expr) => {{
        use std::sync::atomic::Ordering;
        // SAFETY: the caller guarantees `dst` is valid, aligned and accessed only atomically;
        // the atomic type has the size and alignment of the element.
        let cell = unsafe { <$atomic>::from_ptr($dst as *mut _) };
        let mut old = cell.load(Ordering::Relaxed);
        loop {
            let new = ($add)(<$t>::from_bits(old), $v).to_bits();
            match cell.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(seen) => old = seen,
            }
        }
    }};
}

/// An accumulator type (f32 or f64): an element that accumulates in itself.
pub trait Accumulator:
    Element<Acc = Self> + num_traits::Float + AddAssign + Add<Output = Self> + Mul<Output = Self>
{
}

impl Accumulator for f32 {}
impl Accumulator for f64 {}

macro_rules! native_element {
    ($t:ty, $atomic:ty, $dtype:expr) => {
        impl Element for $t {
            type Acc = $t;
            const DTYPE: DType = $dtype;
            const EPSILON: f64 = <$t>::EPSILON as f64;

            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(acc: $t) -> $t {
                acc
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> $t {
                v as $t
            }

            unsafe fn gemm_acc(
                m: usize,
                n: usize,
                k: usize,
                acc: (*mut $t, isize, isize),
                read_acc: bool,
                a: (*const $t, isize, isize),
                b: (*const $t, isize, isize),
                threads: usize,
            ) {
                // SAFETY: forwarded from this function's contract.
                unsafe { gemm_kernel::native(m, n, k, acc, read_acc, a, b, threads) }
            }

            unsafe fn atomic_add(dst: *mut $t, v: $t) {
                cas_add!($atomic, dst, v, $t, |a: $t, b: $t| a + b)
            }
        }
    };
}

native_element!(f32, std::sync::atomic::AtomicU32, DType::F32);
native_element!(f64, std::sync::atomic::AtomicU64, DType::F64);

/// Rounds `v` to f32 towards zero and sets the last bit when that was inexact ("round to odd").
/// A value rounded to odd in a format with at least two more bits than the target then rounds
/// correctly to the target: f64 to f16 or bf16 in two steps without double rounding.
fn f64_to_f32_round_to_odd(v: f64) -> f32 {
    let nearest = v as f32;
    if !v.is_finite() || nearest as f64 == v {
        return nearest;
    }
    let mut bits = nearest.to_bits();
    if (nearest as f64).abs() > v.abs() {
        bits -= 1; // one step towards zero: the truncated value (sign and magnitude bits)
    }
    f32::from_bits(bits | 1)
}

macro_rules! half_element {
    ($t:ty, $dtype:expr) => {
        impl Element for $t {
            type Acc = f32;
            const DTYPE: DType = $dtype;
            const EPSILON: f64 = <$t>::EPSILON.to_f64_const();

            #[inline(always)]
            fn to_acc(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn from_acc(acc: f32) -> $t {
                <$t>::from_f32(acc)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> $t {
                // Through f32 rounded to odd, then to nearest even: one correct rounding, unlike
                // `half`'s own `from_f64`, which truncates or rounds twice.
                <$t>::from_f32(f64_to_f32_round_to_odd(v))
            }

            unsafe fn gemm_acc(
                m: usize,
                n: usize,
                k: usize,
                acc: (*mut f32, isize, isize),
                read_acc: bool,
                a: (*const $t, isize, isize),
                b: (*const $t, isize, isize),
                threads: usize,
            ) {
                // SAFETY: forwarded from this function's contract.
                unsafe { gemm_kernel::widened(m, n, k, acc, read_acc, a, b, threads) }
            }

            unsafe fn atomic_add(dst: *mut $t, v: $t) {
                cas_add!(std::sync::atomic::AtomicU16, dst, v, $t, |a: $t, b: $t| {
                    <$t>::from_f32(a.to_f32() + b.to_f32())
                })
            }
        }
    };
}

half_element!(f16, DType::F16);
half_element!(bf16, DType::BF16);

/// The last path segment of a type's name: `half::binary16::f16` is `f16`.
pub(crate) fn short_type_name<T>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}
