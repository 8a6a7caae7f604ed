//! Local math on `Tensor` (operators, maps, activations, reductions, normalizations, batched
//! matmul) against references computed in f64 from the same inputs (already rounded to the
//! element type, so exact in f64), for every element type.
//!
//! Shapes on purpose: length 1, primes, a zero dimension, and broadcasts of every kind (a missing
//! leading dimension, a dimension of 1 on either side, both sides stretching).
//!
//! # Tolerance
//! Every op computes in the accumulator type (f32 for f16 and bf16, else the type itself) and
//! rounds once. A result `r` computed with `c` roundings in the accumulator type and one final
//! rounding to the element type is within `(u_T + c * eps_acc) * scale` of the exact value, with
//! `u_T = eps_T / 2` for the half types (0 otherwise) and `scale` the size of what was summed
//! (`|r|` for one operation, `sum |x_i|` for a sum). Each check names its `c`; a wrong broadcast,
//! a wrong axis or a missing term is off by about the size of a whole element, many times that.

use dist_tensor::{Element, Error, Tensor};
use half::{bf16, f16};
use ndarray::{ArrayD, Axis, IxDyn, Zip};

mod common;

use common::{assert_none, f64s};

// ---- helpers --------------------------------------------------------------------------------

/// Random values in [-1, 1), never zero, rounded to `T`.
fn random<T: Element>(shape: &[usize], seed: u64) -> Tensor<T> {
    Tensor::<T>::random(shape, seed)
}

/// The final rounding to `T` (half types only) plus `c` roundings in the accumulator type.
fn tol<T: Element>(c: f64) -> f64 {
    let acc = <T::Acc as Element>::EPSILON;
    let last = if T::DTYPE == <T::Acc as Element>::DTYPE { 0.0 } else { T::EPSILON / 2.0 };
    last + c * acc
}

/// The failures of `got` against `want`, element by element, allowing `tol * scale`.
fn close<T: Element>(
    what: &str,
    got: &Tensor<T>,
    want: &ArrayD<f64>,
    scale: &ArrayD<f64>,
    tol: f64,
) -> Vec<String> {
    if got.shape() != want.shape() {
        return vec![format!(
            "{what} ({}): shape {:?}, want {:?}",
            T::DTYPE,
            got.shape(),
            want.shape()
        )];
    }
    let mut worst: Option<(usize, f64)> = None;
    let (g, w, s) = (f64s(got), want, scale);
    for (i, ((g, w), s)) in g.iter().zip(w.iter()).zip(s.iter()).enumerate() {
        let both_nan = g.is_nan() && w.is_nan();
        let err = (g - w).abs();
        // NaN errors fail too (a NaN compares false).
        let within = err <= tol * s.max(f64::MIN_POSITIVE);
        if !both_nan && !within && worst.is_none_or(|(_, e)| err > e || e.is_nan()) {
            worst = Some((i, err));
        }
    }
    match worst {
        None => Vec::new(),
        Some((i, err)) => vec![format!(
            "{what} ({}, shape {:?}): element {i}: got {}, want {}, error {err:e} > {tol:e} * {}",
            T::DTYPE,
            got.shape(),
            g.iter().nth(i).unwrap(),
            w.iter().nth(i).unwrap(),
            s.iter().nth(i).unwrap()
        )],
    }
}

/// Pairs of shapes that broadcast, of every kind.
const BROADCASTS: [(&[usize], &[usize]); 9] = [
    (&[1], &[1]),
    (&[13], &[13]),
    (&[3, 5, 7], &[3, 5, 7]),
    (&[3, 5, 7], &[5, 7]),
    (&[3, 1, 7], &[5, 1]),
    (&[7, 1], &[1, 7]),
    (&[1], &[2, 13]),
    (&[0, 4], &[4]),
    (&[2, 0, 3], &[1, 3]),
];

/// `a op b` in f64, broadcast by ndarray.
fn reference(a: &ArrayD<f64>, b: &ArrayD<f64>, op: char) -> ArrayD<f64> {
    match op {
        '+' => a + b,
        '-' => a - b,
        '*' => a * b,
        '/' => a / b,
        _ => unreachable!(),
    }
}

// ---- operators ------------------------------------------------------------------------------

fn check_operators<T: Element>() -> Vec<String> {
    let mut fails = Vec::new();
    for (i, &(sa, sb)) in BROADCASTS.iter().enumerate() {
        let a = random::<T>(sa, 2 * i as u64);
        let b = random::<T>(sb, 2 * i as u64 + 1);
        let (fa, fb) = (f64s(&a), f64s(&b));
        for op in ['+', '-', '*', '/'] {
            let want = reference(&fa, &fb, op);
            let scale = want.mapv(f64::abs);
            let by_ref = match op {
                '+' => &a + &b,
                '-' => &a - &b,
                '*' => &a * &b,
                _ => &a / &b,
            };
            let all = [
                ("&a op &b", by_ref),
                ("a op &b", apply(a.clone(), &b, op)),
                ("&a op b", apply_rev(&a, b.clone(), op)),
                ("a op b", apply_owned(a.clone(), b.clone(), op)),
                ("zip_map", a.zip_map(&b, |x, y| widen_op(x, y, op)).unwrap()),
            ];
            for (form, got) in all {
                let what = format!("{sa:?} {op} {sb:?} as {form}");
                fails.extend(close(&what, &got, &want, &scale, tol::<T>(1.0)));
            }
            // Assigning forms, where b broadcasts to a's shape.
            if ndarray::ArrayViewD::<f64>::from_shape(IxDyn(sb), &vec![0.0; sb.iter().product()])
                .unwrap()
                .broadcast(IxDyn(sa))
                .is_some()
            {
                let mut got = a.clone();
                match op {
                    '+' => got += &b,
                    '-' => got -= &b,
                    '*' => got *= &b,
                    _ => got /= b.clone(),
                }
                fails.extend(close(
                    &format!("{sa:?} {op}= {sb:?}"),
                    &got,
                    &want,
                    &scale,
                    tol::<T>(1.0),
                ));
            }
        }
        // Scalars on either side, and negation.
        let s = T::from_f64(0.375);
        let want = fa.mapv(|x| x * 0.375);
        fails.extend(close("a * s", &(&a * s), &want, &want.mapv(f64::abs), tol::<T>(1.0)));
        fails.extend(close(
            "a * s (owned)",
            &(a.clone() * s),
            &want,
            &want.mapv(f64::abs),
            tol::<T>(1.0),
        ));
        let want = fa.mapv(|x| x / 0.375);
        let mut got = a.clone();
        got /= s;
        fails.extend(close("a /= s", &got, &want, &want.mapv(f64::abs), tol::<T>(1.0)));
        let want = fa.mapv(|x| -x);
        fails.extend(close("-a", &-&a, &want, &want.mapv(f64::abs), 0.0));
        fails.extend(close("-a (owned)", &-a.clone(), &want, &want.mapv(f64::abs), 0.0));
    }
    fails
}

fn widen_op<T: Element>(x: T, y: T, op: char) -> T {
    let (x, y) = (x.to_f64(), y.to_f64());
    T::from_f64(reference_scalar(x, y, op))
}

fn reference_scalar(x: f64, y: f64, op: char) -> f64 {
    match op {
        '+' => x + y,
        '-' => x - y,
        '*' => x * y,
        _ => x / y,
    }
}

fn apply<T: Element>(a: Tensor<T>, b: &Tensor<T>, op: char) -> Tensor<T> {
    match op {
        '+' => a + b,
        '-' => a - b,
        '*' => a * b,
        _ => a / b,
    }
}

fn apply_rev<T: Element>(a: &Tensor<T>, b: Tensor<T>, op: char) -> Tensor<T> {
    match op {
        '+' => a + b,
        '-' => a - b,
        '*' => a * b,
        _ => a / b,
    }
}

fn apply_owned<T: Element>(a: Tensor<T>, b: Tensor<T>, op: char) -> Tensor<T> {
    match op {
        '+' => a + b,
        '-' => a - b,
        '*' => a * b,
        _ => a / b,
    }
}

#[test]
fn operators_broadcast_and_match_f64_in_every_type() {
    assert_none(common::in_every_dtype!(check_operators()).concat());
}

/// `scalar op tensor`, implemented per concrete type.
macro_rules! check_scalar_left {
    ($fails:ident, $($t:ty),*) => {$({
        let a = random::<$t>(&[3, 5], 9);
        let s = <$t as Element>::from_f64(0.375);
        let fa = f64s(&a);
        let cases = [
            ("s + a", s + &a, fa.mapv(|x| 0.375 + x)),
            ("s - a", s - &a, fa.mapv(|x| 0.375 - x)),
            ("s * a", s * a.clone(), fa.mapv(|x| 0.375 * x)),
            ("s / a", s / a.clone(), fa.mapv(|x| 0.375 / x)),
        ];
        for (what, got, want) in cases {
            $fails.extend(close(what, &got, &want, &want.mapv(f64::abs), tol::<$t>(1.0)));
        }
    })*};
}

#[test]
fn scalars_on_the_left() {
    let mut fails = Vec::new();
    check_scalar_left!(fails, f32, f64, f16, bf16);
    assert_none(fails);
}

#[test]
#[should_panic(expected = "do not broadcast")]
fn an_operator_on_shapes_that_do_not_broadcast_panics_with_the_shapes() {
    let _ = &Tensor::<f32>::zeros(&[2, 3]) + &Tensor::<f32>::zeros(&[2]);
}

#[test]
#[should_panic(expected = "does not broadcast to [3]")]
fn an_assigning_operator_cannot_grow_its_left_side() {
    let mut a = Tensor::<f32>::zeros(&[3]);
    a += &Tensor::<f32>::zeros(&[2, 3]);
}

#[test]
fn zip_map_reports_shapes_that_do_not_broadcast() {
    let a = Tensor::<f64>::zeros(&[4, 3]);
    match a.zip_map(&Tensor::<f64>::zeros(&[4]), |x, y| x + y) {
        Err(Error::InvalidShape { op: "Tensor::zip_map", reason }) => {
            assert!(reason.contains("[4, 3]") && reason.contains("[4]"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn generic_code_over_element_does_arithmetic() {
    // The point of the operators: a residual block written once for every element type.
    fn residual<T: Element>(x: &Tensor<T>, f: &Tensor<T>) -> Tensor<T> {
        x + &(f * T::from_f64(0.5))
    }
    let (x, f) = (random::<bf16>(&[3, 4], 1), random::<bf16>(&[4], 2));
    let want = &f64s(&x) + &(f64s(&f) * 0.5);
    let got = residual(&x, &f);
    assert_none(close("residual", &got, &want, &want.mapv(f64::abs), tol::<bf16>(2.0)));
}

// ---- activations ----------------------------------------------------------------------------

/// The standard normal CDF by Simpson's rule on `exp(-t^2 / 2)` (1e-13 or better on [-4, 4]):
/// independent of the `erf` the crate calls.
fn phi(x: f64) -> f64 {
    let n = 4000;
    let h = x / n as f64;
    let f = |t: f64| (-t * t / 2.0).exp();
    let mut sum = f(0.0) + f(x);
    for i in 1..n {
        sum += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
    }
    0.5 + sum * h / 3.0 / (2.0 * std::f64::consts::PI).sqrt()
}

fn check_activations<T: Element>() -> Vec<String> {
    let mut fails = Vec::new();
    for (i, shape) in [&[1][..], &[13], &[3, 7], &[0, 5]].into_iter().enumerate() {
        // Inputs in [-4, 4): the range where activations bend.
        let x = random::<f64>(shape, 10 + i as u64).map(|v| T::from_f64(4.0 * v));
        let fx = f64s(&x);
        // (name, result, f64 formula, roundings in the accumulator type)
        type Case<T> = (&'static str, Tensor<T>, fn(f64) -> f64, f64);
        let cases: [Case<T>; 4] = [
            ("gelu", x.gelu(), |v| v * phi(v), 4.0),
            (
                "gelu_tanh",
                x.gelu_tanh(),
                |v| {
                    0.5 * v
                        * (1.0
                            + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3)))
                                .tanh())
                },
                16.0,
            ),
            ("silu", x.silu(), |v| v / (1.0 + (-v).exp()), 8.0),
            ("relu", x.relu(), |v| v.max(0.0), 0.0),
        ];
        for (name, got, f, c) in cases {
            let want = fx.mapv(f);
            // Relative to |x| rather than |f(x)|: near the zeros of f, the error of the
            // inner terms is relative to x.
            let scale = fx.mapv(f64::abs);
            let tol = tol::<T>(c).max(if name == "gelu" { 1e-12 } else { 0.0 });
            fails.extend(close(&format!("{name} of {shape:?}"), &got, &want, &scale, tol));
        }
    }
    fails
}

#[test]
fn activations_match_f64_formulas_in_every_type() {
    assert_none(common::in_every_dtype!(check_activations()).concat());
}

#[test]
fn exact_gelu_is_odd_around_the_identity() {
    // gelu(x) - gelu(-x) = x (Phi(x) + Phi(-x) = 1), a check independent of any reference erf.
    let x = random::<f64>(&[101], 5).map(|v| 6.0 * v);
    let (a, b) = (x.gelu(), (-&x).gelu());
    for ((a, b), x) in a.as_slice().iter().zip(b.as_slice()).zip(x.as_slice()) {
        assert!((a - b - x).abs() <= 4.0 * f64::EPSILON * x.abs(), "{a} - {b} != {x}");
    }
}

fn check_softmax<T: Element>() -> Vec<String> {
    let mut fails = Vec::new();
    for (i, shape) in [&[1][..], &[13], &[3, 7], &[2, 5, 3], &[4, 0]].into_iter().enumerate() {
        let x = random::<f64>(shape, 20 + i as u64).map(|v| T::from_f64(3.0 * v));
        let fx = f64s(&x);
        for axis in 0..shape.len() {
            let mut want = fx.clone();
            for mut lane in want.lanes_mut(Axis(axis)) {
                let max = lane.fold(f64::NEG_INFINITY, |m, &v| m.max(v));
                lane.mapv_inplace(|v| (v - max).exp());
                let sum = lane.sum();
                lane.mapv_inplace(|v| v / sum);
            }
            let got = x.softmax(axis).unwrap();
            let c = shape[axis] as f64 + 8.0;
            fails.extend(close(
                &format!("softmax({axis}) of {shape:?}"),
                &got,
                &want,
                &want,
                tol::<T>(c),
            ));
        }
        assert!(matches!(x.softmax(shape.len()), Err(Error::DimOutOfRange { .. })));
    }
    // Masked entries (-inf) get exactly 0.
    let mut masked = random::<T>(&[3, 4], 1);
    masked.view_mut()[[1, 2]] = T::from_f64(f64::NEG_INFINITY);
    let p = masked.softmax(1).unwrap();
    if p.view()[[1, 2]].to_f64() != 0.0 {
        fails.push(format!("{}: a masked entry got {}", T::DTYPE, p.view()[[1, 2]]));
    }
    fails
}

#[test]
fn softmax_over_every_axis_matches_f64() {
    assert_none(common::in_every_dtype!(check_softmax()).concat());
}

// ---- reductions and norms -------------------------------------------------------------------

fn check_reductions<T: Element>() -> Vec<String> {
    let mut fails = Vec::new();
    for (i, shape) in
        [&[1][..], &[13], &[1, 1], &[7, 1, 11], &[3, 0], &[1000]].into_iter().enumerate()
    {
        let x = random::<T>(shape, 30 + i as u64);
        let fx = f64s(&x);
        let n = x.len() as f64;
        let abs_sum = fx.mapv(f64::abs).sum();
        let scalar = |v: f64| ArrayD::from_elem(IxDyn(&[]), v);
        let got_sum = Tensor::from_shape_vec(&[], vec![x.sum()]).unwrap();
        fails.extend(close(
            &format!("sum of {shape:?}"),
            &got_sum,
            &scalar(fx.sum()),
            &scalar(abs_sum),
            tol::<T>(n + 1.0),
        ));
        if !x.is_empty() {
            let got_mean = Tensor::from_shape_vec(&[], vec![x.mean()]).unwrap();
            let want = scalar(fx.sum() / n);
            fails.extend(close(
                &format!("mean of {shape:?}"),
                &got_mean,
                &want,
                &scalar(abs_sum / n),
                tol::<T>(n + 2.0),
            ));
        }
        for axis in 0..shape.len() {
            let len = shape[axis] as f64;
            let want = fx.sum_axis(Axis(axis));
            let scale = fx.mapv(f64::abs).sum_axis(Axis(axis));
            let got = x.sum_axis(axis).unwrap();
            fails.extend(close(
                &format!("sum_axis({axis}) of {shape:?}"),
                &got,
                &want,
                &scale,
                tol::<T>(len + 1.0),
            ));
            if shape[axis] > 0 {
                let got = x.mean_axis(axis).unwrap();
                fails.extend(close(
                    &format!("mean_axis({axis}) of {shape:?}"),
                    &got,
                    &(want / len),
                    &(scale / len),
                    tol::<T>(len + 2.0),
                ));
            }
        }
        assert!(matches!(x.sum_axis(shape.len()), Err(Error::DimOutOfRange { .. })));
    }
    fails
}

#[test]
fn sums_and_means_match_f64() {
    assert_none(common::in_every_dtype!(check_reductions()).concat());
}

#[test]
fn half_sums_accumulate_in_f32() {
    // 4096 ones in bf16: stepwise bf16 addition stalls at 256; f32 accumulation gives 4096.
    let ones = Tensor::<bf16>::from_shape_vec(&[4096], vec![bf16::ONE; 4096]).unwrap();
    assert_eq!(ones.sum().to_f64(), 4096.0);
    assert_eq!(ones.mean().to_f64(), 1.0);
}

fn check_norms<T: Element>() -> Vec<String> {
    let mut fails = Vec::new();
    for (i, shape) in [&[1][..], &[13], &[3, 7], &[2, 5, 64]].into_iter().enumerate() {
        let n = *shape.last().unwrap();
        let x = random::<T>(shape, 40 + i as u64);
        let w = random::<T>(&[n], 50 + i as u64);
        let b = random::<T>(&[n], 60 + i as u64);
        let (fx, fw, fb) = (f64s(&x), f64s(&w), f64s(&b));
        let eps = 1e-5;
        let last = Axis(shape.len() - 1);
        // rms_norm
        let ms = fx.mapv(|v| v * v).mean_axis(last).unwrap().insert_axis(last);
        let inv = ms.mapv(|m| 1.0 / (m + eps).sqrt());
        let want = &(&fx * &inv) * &fw;
        let scale = want.mapv(f64::abs);
        let got = x.rms_norm(Some(&w), eps).unwrap();
        fails.extend(close(
            &format!("rms_norm of {shape:?}"),
            &got,
            &want,
            &scale,
            tol::<T>(n as f64 + 8.0),
        ));
        let got = x.rms_norm(None, eps).unwrap();
        let want = &fx * &inv;
        fails.extend(close(
            &format!("rms_norm of {shape:?}, no weight"),
            &got,
            &want,
            &want.mapv(f64::abs),
            tol::<T>(n as f64 + 8.0),
        ));
        // layer_norm
        let mean = fx.mean_axis(last).unwrap().insert_axis(last);
        let centered = &fx - &mean;
        let var = centered.mapv(|v| v * v).mean_axis(last).unwrap().insert_axis(last);
        let inv = var.mapv(|v| 1.0 / (v + eps).sqrt());
        let want = &(&(&centered * &inv) * &fw) + &fb;
        let mut scale = (&fx.mapv(f64::abs) + &mean.mapv(f64::abs)) * &inv * fw.mapv(f64::abs);
        scale += &fb.mapv(f64::abs);
        let got = x.layer_norm(Some(&w), Some(&b), eps).unwrap();
        fails.extend(close(
            &format!("layer_norm of {shape:?}"),
            &got,
            &want,
            &scale,
            tol::<T>(2.0 * n as f64 + 8.0),
        ));
        // Module of the wrong shape are an error naming them.
        match x.layer_norm(None, Some(&x), eps) {
            Err(Error::InvalidShape { reason, .. })
                if reason.contains("bias") || shape.len() == 1 => {}
            Ok(_) if shape.len() == 1 => {} // a 1-D x is its own [n]-shaped bias
            other => fails.push(format!("layer_norm with a bias of shape {shape:?}: {other:?}")),
        }
    }
    let scalar = Tensor::<T>::from_shape_vec(&[], vec![T::from_f64(1.0)]).unwrap();
    if !matches!(scalar.rms_norm(None, 1e-6), Err(Error::InvalidShape { .. })) {
        fails.push(format!("{}: rms_norm of a 0-D tensor is not an error", T::DTYPE));
    }
    fails
}

#[test]
fn rms_and_layer_norms_match_f64() {
    assert_none(common::in_every_dtype!(check_norms()).concat());
}

// ---- batched matmul, layout, conversions ----------------------------------------------------

fn check_batched_matmul<T: Element>() -> Vec<String> {
    let mut fails = Vec::new();
    let cases: [(&[usize], &[usize]); 6] = [
        (&[3, 5, 4], &[3, 4, 7]),
        (&[2, 3, 5, 4], &[4, 7]),
        (&[5, 4], &[2, 1, 4, 7]),
        (&[2, 1, 1, 13], &[1, 3, 13, 1]),
        (&[0, 5, 4], &[4, 3]),
        (&[3, 2, 0], &[3, 0, 2]),
    ];
    for (i, (sa, sb)) in cases.into_iter().enumerate() {
        let (a, b) = (random::<T>(sa, 70 + i as u64), random::<T>(sb, 80 + i as u64));
        let got = a.matmul(&b).unwrap();
        // Reference: broadcast the batch by hand, one f64 product per matrix.
        let batch: Vec<usize> = {
            let (ba, bb) = (&sa[..sa.len() - 2], &sb[..sb.len() - 2]);
            let nd = ba.len().max(bb.len());
            (0..nd)
                .map(|i| {
                    let d = |s: &[usize]| if i < nd - s.len() { 1 } else { s[i - (nd - s.len())] };
                    if d(ba) == 1 { d(bb) } else { d(ba) }
                })
                .collect()
        };
        let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
        let full = |last: [usize; 2]| [batch.clone(), last.to_vec()].concat();
        let fa = f64s(&a).broadcast(IxDyn(&full([m, k]))).unwrap().to_owned();
        let fb = f64s(&b).broadcast(IxDyn(&full([k, n]))).unwrap().to_owned();
        let count: usize = batch.iter().product();
        let fa = fa.into_shape_with_order((count, m, k)).unwrap();
        let fb = fb.into_shape_with_order((count, k, n)).unwrap();
        let mut want = ndarray::Array3::<f64>::zeros((count, m, n));
        let mut scale = want.clone();
        Zip::from(want.outer_iter_mut())
            .and(scale.outer_iter_mut())
            .and(fa.outer_iter())
            .and(fb.outer_iter())
            .for_each(|mut w, mut s, a, b| {
                w.assign(&a.dot(&b));
                s.assign(&a.mapv(f64::abs).dot(&b.mapv(f64::abs)));
            });
        let out_shape = full([m, n]);
        let want = want.into_shape_with_order(IxDyn(&out_shape)).unwrap();
        let scale = scale.into_shape_with_order(IxDyn(&out_shape)).unwrap();
        fails.extend(close(
            &format!("{sa:?} @ {sb:?}"),
            &got,
            &want,
            &scale,
            tol::<T>(k as f64 + 1.0),
        ));
    }
    fails
}

#[test]
fn batched_matmul_broadcasts_batches_and_matches_f64() {
    assert_none(common::in_every_dtype!(check_batched_matmul()).concat());
}

#[test]
fn transpose_and_insert_axis_move_elements_as_ndarray_does() {
    let t = random::<f32>(&[2, 3, 5], 1);
    let want = t.view().permuted_axes(vec![2, 1, 0]).to_owned();
    assert_eq!(t.transpose(0, 2).unwrap().to_array(), want);
    assert_eq!(t.transpose(1, 1).unwrap(), t);
    let u = t.insert_axis(3).unwrap();
    assert_eq!(u.shape(), &[2, 3, 5, 1]);
    assert_eq!(u.as_slice(), t.as_slice());
    assert!(matches!(t.insert_axis(4), Err(Error::DimOutOfRange { .. })));
}

#[test]
fn conversions_from_arrays_of_any_dimension() {
    let a2 = ndarray::Array2::<f64>::from_shape_fn((3, 4), |(i, j)| (i * 4 + j) as f64);
    let t = Tensor::from(a2.clone());
    assert_eq!(t.shape(), &[3, 4]);
    assert_eq!(Tensor::from(a2.t()).to_array(), a2.t().into_dyn().to_owned());
    assert_eq!(Tensor::from(&a2), t);
    let a0 = ndarray::arr0(2.5f32);
    assert_eq!(Tensor::from(a0).shape(), &[] as &[usize]);
    let a5 = ndarray::Array::<bf16, _>::zeros((1, 2, 1, 3, 1));
    assert_eq!(Tensor::from(a5.view()).shape(), &[1, 2, 1, 3, 1]);
    let back: ArrayD<f64> = t.into();
    assert_eq!(back, a2.into_dyn());
    // The re-exported crates are the ones the tensors use.
    let _: Tensor<dist_tensor::half::f16> = Tensor::from(dist_tensor::ndarray::arr1(&[f16::ONE]));
}

#[test]
fn display_abbreviates_large_tensors_and_names_shape_and_type() {
    let big = Tensor::<f32>::zeros(&[100, 100]);
    let text = big.to_string();
    assert!(text.contains("..."), "{text}");
    assert!(text.ends_with("shape=[100, 100], dtype=f32"), "{text}");
    let b = Tensor::<bf16>::from_shape_vec(&[2], vec![bf16::ONE, bf16::from_f32(-0.5)]).unwrap();
    assert_eq!(b.to_string(), "[1, -0.5], shape=[2], dtype=bf16");
}

// ---- activation derivatives and the fallible forms ------------------------------------------

/// A tensor's activation backward method: `x.gelu_backward(dy)` and its siblings.
type Backward<T> = fn(&Tensor<T>, &Tensor<T>) -> dist_tensor::Result<Tensor<T>>;

/// `x.gelu_backward(dy)` (and the tanh, SiLU, ReLU forms) against `dy * f'(x)` in f64 on the
/// same rounded inputs: computed in f64 and rounded once, so within one rounding of `T` (f64:
/// the reference's erf series and libm's differ by up to about 2e-13 relative where the
/// derivative cancels near 0, so 1e-12). `dy` of one row broadcasts.
fn activation_backward_in<T: Element>(fails: &mut Vec<String>) {
    use common::reference::activation_derivative;
    use dist_tensor::nn::Activation;
    let x = random::<T>(&[13, 7], 31) * T::from_f64(4.0);
    for dy in [random::<T>(&[13, 7], 32), random::<T>(&[7], 33)] {
        let wide = |t: &Tensor<T>| common::checks::widen(t.as_slice());
        let (xs, ds) = (wide(&x), wide(&dy));
        let methods: [(Activation, Backward<T>); 4] = [
            (Activation::Gelu, Tensor::gelu_backward),
            (Activation::GeluTanh, Tensor::gelu_tanh_backward),
            (Activation::Silu, Tensor::silu_backward),
            (Activation::Relu, Tensor::relu_backward),
        ];
        for (act, method) in methods {
            let got = method(&x, &dy).unwrap();
            assert_eq!(got.shape(), x.shape());
            let got = wide(&got);
            let tol = if T::DTYPE == dist_tensor::DType::F64 { 1e-12 } else { T::EPSILON / 2.0 };
            for (i, &g) in got.iter().enumerate() {
                let want = ds[i % ds.len()] * activation_derivative(act, xs[i]);
                if (g - want).abs() > tol * want.abs().max(1e-4) {
                    fails.push(format!("{act:?} backward {} [{i}]: {g}, want {want}", T::DTYPE));
                    break;
                }
            }
            // The same through nn's Activation.
            if act.backward(&x, &dy).unwrap() != method(&x, &dy).unwrap() {
                fails.push(format!("{act:?}: Activation::backward differs in {}", T::DTYPE));
            }
        }
    }
    let err = x.gelu_backward(&random::<T>(&[5], 1)).unwrap_err();
    assert!(matches!(err, Error::InvalidShape { .. }), "{err}");
}

#[test]
fn activation_backward_methods_match_f64_derivatives_in_every_type() {
    let mut fails = Vec::new();
    common::in_every_dtype!(activation_backward_in(&mut fails));
    assert_none(fails);
}

fn fallible_forms_in<T: Element>() {
    for shape in [&[1][..], &[0], &[17, 3]] {
        let x = random::<T>(shape, 41);
        assert_eq!(x.try_sum().unwrap().to_f64(), x.sum().to_f64(), "{shape:?}");
        let (m, tm) = (x.mean().to_f64(), x.try_mean().unwrap().to_f64());
        assert!(m == tm || (m.is_nan() && tm.is_nan()), "{shape:?}: {m} vs {tm}");
        let mut y = x.clone();
        y.try_map_inplace(|v| T::from_f64(v.to_f64() * 3.0)).unwrap();
        assert_eq!(y, x.map(|v| T::from_f64(v.to_f64() * 3.0)), "{shape:?}");
    }
}

#[test]
fn fallible_sum_mean_and_map_inplace_agree_with_the_panicking_forms() {
    common::in_every_dtype!(fallible_forms_in());
}
