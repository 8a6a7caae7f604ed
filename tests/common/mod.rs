//! Helpers the integration tests share (each test binary takes them with `mod common;`), and
//! the f64 references of [`reference`].
//!
//! Nothing here calls the code under test to compute an expected value: splits are cut by
//! [`array_split`] written out here, not by `dist_tensor::tensor::array_split` or `Split::sizes`;
//! the references use ndarray and plain loops, never `Tensor` math or `nn::Activation`. A bug
//! in the library then cannot be copied into what the tests expect.

// Each test binary uses some of these helpers, none uses all of them.
#![allow(dead_code)]

pub mod checks;
pub mod crossed;
pub mod gpu;
pub mod jobs;
pub mod mesh_ops;
pub mod mlp_fused;
pub mod reference;

use std::ops::Range;

use dist_tensor::{Element, Tensor};
use ndarray::{ArrayD, Axis, Slice};

/// The sizes `numpy.array_split` gives `n` pieces of a length `len`: the first `len % n` get one
/// more. Written out here so that the tests do not take the library's own split.
pub fn array_split(len: usize, n: usize) -> Vec<usize> {
    (0..n).map(|r| len / n + usize::from(r < len % n)).collect()
}

/// Where each piece of the given sizes starts, and the total at the end (`sizes.len() + 1`
/// entries).
pub fn offsets(sizes: &[usize]) -> Vec<usize> {
    let mut at = vec![0];
    for s in sizes {
        at.push(at.last().unwrap() + s);
    }
    at
}

/// The ranges of consecutive pieces of the given sizes.
pub fn ranges(sizes: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&s| {
            start += s;
            start - s..start
        })
        .collect()
}

/// The ranges `numpy.array_split` gives `n` ranks of a length `len`.
pub fn pieces(len: usize, n: usize) -> Vec<Range<usize>> {
    ranges(&array_split(len, n))
}

/// `t[.., range, ..]` along `dim`, as a new tensor.
pub fn slice<T: Element>(t: &Tensor<T>, dim: usize, range: Range<usize>) -> Tensor<T> {
    Tensor::from_array(t.view().slice_axis(Axis(dim), Slice::from(range)).to_owned())
}

/// The tensor's values widened to f64.
pub fn f64s<T: Element>(t: &Tensor<T>) -> ArrayD<f64> {
    t.view().mapv(|v| v.to_f64())
}

/// The values of a 2-D tensor widened to an f64 matrix.
pub fn f64s2<T: Element>(t: &Tensor<T>) -> ndarray::Array2<f64> {
    f64s(t).into_dimensionality::<ndarray::Ix2>().expect("a 2-D tensor")
}

/// A tensor of multiples of 1/4 in [-4, 4], never zero, seeded: sums of a few are exact in
/// every element type.
pub fn dyadic<T: Element>(shape: &[usize], seed: u64) -> Tensor<T> {
    Tensor::from_array(Tensor::<f64>::random(shape, seed).view().mapv(|x| {
        let q = (x * 16.0).round() / 4.0;
        T::from_f64(if q == 0.0 { 0.25 } else { q })
    }))
}

/// Whether two tensors have the same shape and the same bits.
pub fn bits_equal<T: Element>(a: &Tensor<T>, b: &Tensor<T>) -> bool {
    a.shape() == b.shape()
        && a.as_slice()
            .iter()
            .zip(b.as_slice())
            .all(|(x, y)| x.to_f64().to_bits() == y.to_f64().to_bits())
}

/// Whether `err <= bound`: false when either is NaN, so that a NaN result never passes.
pub fn within(err: f64, bound: f64) -> bool {
    err <= bound
}

/// Fails with every failure listed when there are any.
#[track_caller]
pub fn assert_none(fails: Vec<String>) {
    assert!(fails.is_empty(), "{} failures:\n{}", fails.len(), fails.join("\n"));
}

/// The relative tolerance for a sum of `terms` products in `T` (the bound of
/// `tests/fused_ops.rs`'s module docs): `u_T` for the final rounding of a half type, plus
/// `(terms + 1) EPSILON_acc` for the sum in the accumulator type.
pub fn tolerance<T: Element>(terms: usize) -> f64 {
    tolerance_rounded::<T>(terms, 1.0)
}

/// [`tolerance`] with `roundings` final roundings to a half type (an op that rounds a partial
/// result to the element type before adding it rounds twice).
pub fn tolerance_rounded<T: Element>(terms: usize, roundings: f64) -> f64 {
    let acc_eps = <T::Acc as Element>::EPSILON;
    let last =
        if T::DTYPE == <T::Acc as Element>::DTYPE { 0.0 } else { roundings * T::EPSILON / 2.0 };
    last + (terms as f64 + 1.0) * acc_eps
}

/// A digest of a result's bits (FNV-1a of each value widened to f64), with its length.
pub fn digest<T: Element>(values: &[T]) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in values {
        for b in v.to_f64().to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}/{}", values.len())
}

/// `len` values of `rank`'s input for a case `salt`: multiples of 1/7 in [-48/7, 48/7], exact
/// in f64 and the same on every rank that regenerates them (a reference for the whole job is
/// computed from every rank's inputs this way).
pub fn seeded<T: Element>(rank: usize, len: usize, salt: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f64((((rank * 131 + i * 17 + salt) % 97) as f64 - 48.0) / 7.0))
        .collect()
}

/// The weights of an MLP `hidden -> ffn -> hidden` for the training tests, `[W1, b1, W2, b2]`:
/// W1 `[hidden, ffn]`, b1 `[ffn]`, W2 `[ffn, hidden]` and b2 `[hidden]`, random of seeds 3 to 6,
/// each scaled by 1 / sqrt(the fan-in of its layer).
pub fn mlp_weights(hidden: usize, ffn: usize) -> [Tensor<f64>; 4] {
    let scaled = |shape: &[usize], seed, fan_in: usize| {
        Tensor::<f64>::random(shape, seed) * (1.0 / (fan_in as f64).sqrt())
    };
    [
        scaled(&[hidden, ffn], 3, hidden),
        scaled(&[ffn], 4, hidden),
        scaled(&[ffn, hidden], 5, ffn),
        scaled(&[hidden], 6, ffn),
    ]
}

/// `$f::<T>(args)` for every element type, f32, f64, f16 and bf16 in turn, the four results as
/// an array: `()`s for a check that asserts, or the failures of each for one that lists them
/// (`.concat()` them).
#[allow(unused_macros)]
macro_rules! in_every_dtype {
    ($f:ident($($arg:expr),* $(,)?)) => {
        [
            $f::<f32>($($arg),*),
            $f::<f64>($($arg),*),
            $f::<::half::f16>($($arg),*),
            $f::<::half::bf16>($($arg),*),
        ]
    };
}
#[allow(unused_imports)]
pub(crate) use in_every_dtype;

/// One test per element type of the generic `$check` (as candle's `test_device!` makes one per
/// device), each named by the caller: `test_dtypes!(check, name_f32, name_f64, name_f16,
/// name_bf16)`; with `check -> Type`, the tests return what `check` returns.
#[allow(unused_macros)]
macro_rules! test_dtypes {
    ($check:ident $(-> $ret:ty)?, $f32:ident, $f64:ident, $f16:ident, $bf16:ident $(,)?) => {
        #[test]
        fn $f32() $(-> $ret)? {
            $check::<f32>()
        }

        #[test]
        fn $f64() $(-> $ret)? {
            $check::<f64>()
        }

        #[test]
        fn $f16() $(-> $ret)? {
            $check::<::half::f16>()
        }

        #[test]
        fn $bf16() $(-> $ret)? {
            $check::<::half::bf16>()
        }
    };
}
#[allow(unused_imports)]
pub(crate) use test_dtypes;
