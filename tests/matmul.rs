//! Local matrix products against a plain triple loop in f64.
//!
//! # Tolerance
//! Every input is exactly representable in f64, so the reference is the exact product up to f64
//! rounding (negligible here). For an entry `c_ij = c0_ij + sum_p a_ip b_pj` summed in the
//! accumulator type (unit roundoff `u_acc = EPSILON_acc / 2`) the standard bound (Higham, *Accuracy
//! and Stability of Numerical Algorithms*, 3.1) is
//!
//! ```text
//! |got - want| <= gamma_k * scale,  gamma_k = k u_acc / (1 - k u_acc),  scale = |c0_ij| + sum_p |a_ip| |b_pj|
//! ```
//!
//! whatever order the kernel sums in; a half type then rounds once more, adding at most
//! `u_T |c_ij| <= u_T * scale`. The test allows `(u_T + (k + 1) EPSILON_acc) * scale` (the `u_T` term
//! only for f16 and bf16, the `+ 1` for the accumulate case): about twice the worst case, far below
//! what a dropped term, a dropped k-block or a lost accumulator costs (a whole `|a_ip b_pj|` or
//! `|c0_ij|`, on the order of `scale / k`). When `scale` is 0 (k = 0) the result must be exact.

use dist_tensor::tensor::{matmul, matmul_into};
use dist_tensor::{DType, Element, Error, Tensor};
use half::{bf16, f16};
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Ix2, s};

mod common;

use common::tolerance;

/// The shapes `(m, k, n)` every test runs: odd and prime sizes, plus k = 0, m = 0 and n = 0.
const SHAPES: [(usize, usize, usize); 7] =
    [(1, 1, 1), (7, 13, 5), (64, 64, 64), (257, 129, 65), (6, 0, 4), (0, 7, 4), (5, 3, 0)];

fn random2<T: Element>(rows: usize, cols: usize, seed: u64) -> Array2<T> {
    Tensor::<T>::random(&[rows, cols], seed).into_array().into_dimensionality::<Ix2>().unwrap()
}

/// How an operand is laid out in memory; every one of them is read in place by `matmul`.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Row-major, contiguous.
    Contiguous,
    /// `.t()` of a stored `[cols, rows]` array: column-major.
    Transposed,
    /// Every 2nd row and 3rd column of a stored `[2 rows, 3 cols]` array.
    Stepped,
    /// Rows in reverse order: a negative row stride.
    Reversed,
}

const LAYOUTS: [Layout; 4] =
    [Layout::Contiguous, Layout::Transposed, Layout::Stepped, Layout::Reversed];

/// A `rows x cols` operand stored so that [`Operand::view`] has the given layout.
struct Operand<T> {
    storage: Array2<T>,
    layout: Layout,
}

impl<T: Element> Operand<T> {
    fn new(rows: usize, cols: usize, layout: Layout, seed: u64) -> Self {
        let storage = match layout {
            Layout::Contiguous | Layout::Reversed => random2(rows, cols, seed),
            Layout::Transposed => random2(cols, rows, seed),
            Layout::Stepped => random2(2 * rows, 3 * cols, seed),
        };
        Operand { storage, layout }
    }

    fn view(&self) -> ArrayView2<'_, T> {
        match self.layout {
            Layout::Contiguous => self.storage.view(),
            Layout::Transposed => self.storage.t(),
            Layout::Stepped => self.storage.slice(s![..;2, ..;3]),
            Layout::Reversed => self.storage.slice(s![..;-1, ..]),
        }
    }

    fn view_mut(&mut self) -> ArrayViewMut2<'_, T> {
        match self.layout {
            Layout::Contiguous => self.storage.view_mut(),
            Layout::Transposed => self.storage.view_mut().reversed_axes(),
            Layout::Stepped => self.storage.slice_mut(s![..;2, ..;3]),
            Layout::Reversed => self.storage.slice_mut(s![..;-1, ..]),
        }
    }
}

/// The exact `c0 + a * b` (c0 = 0 when `None`) in f64, and the `scale` of each entry.
fn reference<T: Element>(
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    c0: Option<ArrayView2<T>>,
) -> (Array2<f64>, Array2<f64>) {
    let (m, k, n) = (a.nrows(), a.ncols(), b.ncols());
    let mut want = Array2::zeros((m, n));
    let mut scale = Array2::zeros((m, n));
    for i in 0..m {
        for j in 0..n {
            let (mut sum, mut abs) = match c0 {
                Some(c0) => (c0[[i, j]].to_f64(), c0[[i, j]].to_f64().abs()),
                None => (0.0, 0.0),
            };
            for p in 0..k {
                let prod = a[[i, p]].to_f64() * b[[p, j]].to_f64();
                sum += prod;
                abs += prod.abs();
            }
            want[[i, j]] = sum;
            scale[[i, j]] = abs;
        }
    }
    (want, scale)
}

/// Asserts `got` is within `tol * scale` of `want`, entry by entry.
#[track_caller]
fn assert_close<T: Element>(
    got: ArrayView2<T>,
    want: &Array2<f64>,
    scale: &Array2<f64>,
    tol: f64,
    what: &str,
) {
    assert_eq!(got.dim(), want.dim(), "{what}: shape");
    for ((idx, g), (w, s)) in got.indexed_iter().zip(want.iter().zip(scale)) {
        let err = (g.to_f64() - w).abs();
        assert!(
            err <= tol * s,
            "{what}: entry {idx:?} is {g}, want {w} (error {err:e} > {tol:e} * scale {s})"
        );
    }
}

/// `matmul`, `matmul_into` (both modes) and the `Tensor` methods for one shape, all layouts.
fn check_shape<T: Element>(m: usize, k: usize, n: usize) {
    let tol = tolerance::<T>(k);
    let tag = format!("{} {m}x{k}x{n}", T::DTYPE);
    let mut seed = 1000 * (m * 31 + k * 7 + n) as u64;
    let mut next_seed = || {
        seed += 1;
        seed
    };

    for (la, lb) in LAYOUTS.iter().flat_map(|&la| LAYOUTS.iter().map(move |&lb| (la, lb))) {
        let a = Operand::<T>::new(m, k, la, next_seed());
        let b = Operand::<T>::new(k, n, lb, next_seed());
        let (want, scale) = reference(a.view(), b.view(), None);
        let what = format!("{tag} a {la:?} b {lb:?}");
        for threads in [1, 2] {
            let c = matmul(a.view(), b.view(), threads).unwrap();
            assert_close(c.view(), &want, &scale, tol, &format!("matmul {what} threads {threads}"));
        }

        for lc in LAYOUTS {
            // The output starts as random values, never zeros, so an overwrite that is skipped or
            // an accumulate flag that is ignored both show.
            let c0 = Operand::<T>::new(m, n, lc, next_seed());
            let what = format!("{what} c {lc:?}");

            let mut c = Operand::<T>::new(m, n, lc, next_seed());
            matmul_into(c.view_mut(), a.view(), b.view(), false, 1).unwrap();
            assert_close(c.view(), &want, &scale, tol, &format!("matmul_into(false) {what}"));

            let (want_acc, scale_acc) = reference(a.view(), b.view(), Some(c0.view()));
            let mut c = Operand { storage: c0.storage.clone(), layout: lc };
            matmul_into(c.view_mut(), a.view(), b.view(), true, 1).unwrap();
            assert_close(
                c.view(),
                &want_acc,
                &scale_acc,
                tol,
                &format!("matmul_into(true) {what}"),
            );
        }
    }

    let a = Tensor::<T>::random(&[m, k], next_seed());
    let b = Tensor::<T>::random(&[k, n], next_seed());
    let (av, bv) = (a.view2("test").unwrap(), b.view2("test").unwrap());
    let (want, scale) = reference(av, bv, None);
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.shape(), &[m, n]);
    assert_close(c.view2("test").unwrap(), &want, &scale, tol, &format!("Tensor::matmul {tag}"));
    let c2 = a.matmul_threads(&b, 2).unwrap();
    assert_close(
        c2.view2("test").unwrap(),
        &want,
        &scale,
        tol,
        &format!("Tensor::matmul_threads {tag}"),
    );
}

fn check_all_shapes<T: Element>() {
    for (m, k, n) in SHAPES {
        check_shape::<T>(m, k, n);
    }
}

common::test_dtypes!(
    check_all_shapes,
    matches_reference_f32,
    matches_reference_f64,
    matches_reference_f16,
    matches_reference_bf16,
);

/// threads = 2 and threads = 1 agree within the sum of their tolerances (each is within `tol` of
/// the exact product), on a size large enough for gemm to split the work.
fn check_threads_agree<T: Element>() {
    let (m, k, n) = (257, 300, 129);
    let a = Tensor::<T>::random(&[m, k], 11);
    let b = Tensor::<T>::random(&[k, n], 12);
    let (_, scale) = reference(a.view2("test").unwrap(), b.view2("test").unwrap(), None);
    let one = a.matmul_threads(&b, 1).unwrap();
    let two = a.matmul_threads(&b, 2).unwrap();
    let tol = 2.0 * tolerance::<T>(k);
    for ((x, y), s) in one.as_slice().iter().zip(two.as_slice()).zip(&scale) {
        let err = (x.to_f64() - y.to_f64()).abs();
        assert!(err <= tol * s, "{}: threads 1 gives {x}, threads 2 gives {y}", T::DTYPE);
    }
}

#[test]
fn two_threads_agree_with_one() {
    common::in_every_dtype!(check_threads_agree());
}

fn check_errors<T: Element>() {
    let a = random2::<T>(3, 4, 1);
    let b = random2::<T>(5, 2, 2);
    match matmul(a.view(), b.view(), 1) {
        Err(Error::InnerDimMismatch { op: "matmul", rank: 0, left, right, left_global: None }) => {
            assert_eq!((left, right), (vec![3, 4], vec![5, 2]));
        }
        other => panic!("{}: matmul of 3x4 by 5x2 gave {other:?}", T::DTYPE),
    }
    let mut c = random2::<T>(3, 2, 3);
    assert!(matches!(
        matmul_into(c.view_mut(), a.view(), b.view(), false, 1),
        Err(Error::InnerDimMismatch { op: "matmul_into", .. })
    ));

    let b = random2::<T>(4, 2, 2);
    for bad in [(3, 3), (2, 2), (2, 3), (0, 0)] {
        let mut c = random2::<T>(bad.0, bad.1, 4);
        let before = c.clone();
        for accumulate in [false, true] {
            match matmul_into(c.view_mut(), a.view(), b.view(), accumulate, 1) {
                Err(Error::InvalidShape { op: "matmul_into", .. }) => {}
                other => panic!("{}: output {bad:?} for a 3x2 product gave {other:?}", T::DTYPE),
            }
        }
        assert_eq!(c, before, "a rejected call must leave the output alone");
    }

    let a = Tensor::<T>::random(&[3, 4], 1);
    assert!(matches!(a.matmul(&Tensor::random(&[5, 2], 2)), Err(Error::InnerDimMismatch { .. })));
    assert!(matches!(a.matmul(&Tensor::random(&[4], 2)), Err(Error::InvalidShape { .. })));
    // Batched products broadcast their batch dimensions; batches of 2 and 3 do not.
    assert!(matches!(
        Tensor::<T>::random(&[2, 3, 4], 3).matmul_threads(&Tensor::random(&[3, 4, 2], 2), 2),
        Err(Error::InvalidShape { .. })
    ));
}

#[test]
fn shape_errors() {
    common::in_every_dtype!(check_errors());
}

/// `x` rounded to the nearest `T` (ties to even), computed in f64 from `T::EPSILON` alone, for a
/// positive normal `x` in `T`'s range.
fn round_to_type<T: Element>(x: f64) -> f64 {
    let ulp = ulp_of::<T>(x);
    (x / ulp).round_ties_even() * ulp
}

/// The spacing of `T` around positive normal `x` (the ulp of the binade `x` is in).
fn ulp_of<T: Element>(x: f64) -> f64 {
    2f64.powi(x.log2().floor() as i32) * T::EPSILON
}

/// The rounding-after-every-add dot product the crate must *not* compute.
fn naive_dot<T: Element>(a: &[T], b: &[T]) -> f64 {
    a.iter().zip(b).fold(0.0, |acc, (x, y)| {
        round_to_type::<T>(acc + round_to_type::<T>(x.to_f64() * y.to_f64()))
    })
}

/// A length-4096 dot product of positive terms (average 1/4, so the sum is about 1000): rounded in
/// `T` after every add it stalls once the ulp of the sum outgrows the terms (for bf16 near 64,
/// for f16 near 1000); accumulated in f32 and rounded once it is within 1 ulp of the exact sum.
fn check_accumulates_in_f32<T: Element>() {
    assert_eq!(<T::Acc as Element>::DTYPE, DType::F32);
    let len = 4096;
    let positive = |seed| -> Vec<T> {
        Tensor::<T>::random(&[len], seed)
            .as_slice()
            .iter()
            .map(|x| T::from_f64(x.to_f64().abs()))
            .collect()
    };
    let (a, b) = (positive(21), positive(22));
    let exact: f64 = a.iter().zip(&b).map(|(x, y)| x.to_f64() * y.to_f64()).sum();
    let want = round_to_type::<T>(exact);
    let ulp = ulp_of::<T>(want);

    let naive = naive_dot(&a, &b);
    assert!(
        (naive - want).abs() > 8.0 * ulp,
        "{}: the test must tell the two apart, but rounding every add gives {naive}, want {want}",
        T::DTYPE
    );

    let a = Tensor::from_shape_vec(&[1, len], a).unwrap();
    let b = Tensor::from_shape_vec(&[len, 1], b).unwrap();
    for threads in [1, 2] {
        let got = a.matmul_threads(&b, threads).unwrap().as_slice()[0].to_f64();
        assert!(
            (got - want).abs() <= ulp,
            "{} threads {threads}: got {got}, want {want} within 1 ulp ({ulp}); exact {exact}, \
             rounded after every add {naive}",
            T::DTYPE
        );
    }
}

#[test]
fn half_types_accumulate_in_f32_and_round_once() {
    check_accumulates_in_f32::<bf16>();
    check_accumulates_in_f32::<f16>();
}

/// `matmul_into(.., accumulate = true, ..)` for a half type into an output of the given layout.
fn check_half_accumulate_into<T: Element>(layout: Layout) {
    let (m, k, n) = (7, 13, 5);
    let a = Operand::<T>::new(m, k, Layout::Contiguous, 31);
    let b = Operand::<T>::new(k, n, Layout::Contiguous, 32);
    let mut c = Operand::<T>::new(m, n, layout, 33);
    let (want, scale) = reference(a.view(), b.view(), Some(c.view()));
    matmul_into(c.view_mut(), a.view(), b.view(), true, 1).unwrap();
    let what = format!("{} accumulate into {layout:?} output", T::DTYPE);
    assert_close(c.view(), &want, &scale, tolerance::<T>(k), &what);
}

/// Regression: the f32 accumulator was built with `c.mapv(..)`, which keeps `c`'s memory order
/// (column-major here), but handed to the kernel as row-major, so rows and columns were swapped.
#[test]
fn half_accumulate_into_column_major_output() {
    check_half_accumulate_into::<bf16>(Layout::Transposed);
    check_half_accumulate_into::<f16>(Layout::Transposed);
}

/// Regression: as above with a negative row stride, the accumulator's first element is at the
/// end of its buffer and the kernel, told row-major strides, wrote past it (heap corruption).
#[test]
fn half_accumulate_into_negative_stride_output_stays_in_bounds() {
    check_half_accumulate_into::<bf16>(Layout::Reversed);
    check_half_accumulate_into::<f16>(Layout::Reversed);
}
