//! Numerical edges on purpose: softmax, layer and RMS norm and the MSE loss on large inputs (f32
//! around 100 and 1000, f64 past `exp`'s range, f16 and bf16 near their largest values), shifted
//! inputs, NaN and infinities; every activation's derivative against central differences of its
//! forward pass in f64 over [-4, 4], and both against the formulas of `tests/common/reference.rs`.
//!
//! The other tests draw their inputs in [-3, 3], where a softmax that forgets to subtract the
//! row max or a one-pass variance still passes; these do not.
//!
//! # Tolerance
//! Probabilities and normalized values are of order 1: an output rounded once to `T` after a
//! computation in the accumulator type is within `u_T + n EPSILON_acc` of the f64 value, `n` the
//! row length (the sums); that bound is used with a factor of 4 for the products around them.
//! Inputs near 1000 lose `1000 EPSILON_acc` to the mean before it is subtracted: layer norm of
//! such rows is compared with that much more, still a thousand times below what a one-pass
//! variance loses.

mod common;

use common::reference;
use dist_tensor::nn::{Activation, mse_loss};
use dist_tensor::{DistTensor, Element, Placement, Tensor, World};
use half::{bf16, f16};

/// `u_T + n EPSILON_acc`, times 4: the bound for an output of order 1 of a row of `n`.
fn row_tol<T: Element>(n: usize) -> f64 {
    let acc = <T::Acc as Element>::EPSILON;
    let last = if T::DTYPE == <T::Acc as Element>::DTYPE { 0.0 } else { T::EPSILON / 2.0 };
    4.0 * (last + n as f64 * acc)
}

fn tensor<T: Element>(shape: &[usize], values: &[f64]) -> Tensor<T> {
    Tensor::from_shape_vec(shape, values.iter().map(|&v| T::from_f64(v)).collect()).unwrap()
}

/// The rows of a 2-D tensor's values in f64 (the values as `T` holds them).
fn rows_of<T: Element>(t: &Tensor<T>) -> Vec<Vec<f64>> {
    let n = t.shape()[1];
    t.as_slice().chunks(n).map(|r| r.iter().map(|v| v.to_f64()).collect()).collect()
}

/// The failures of `got` (rows) against `want` within `tol`, NaN only where `want` is NaN.
fn compare(what: &str, got: &[Vec<f64>], want: &[Vec<f64>], tol: f64) -> Vec<String> {
    let mut fails = Vec::new();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        for (j, (g, w)) in g.iter().zip(w).enumerate() {
            let ok = if w.is_nan() { g.is_nan() } else { (g - w).abs() <= tol };
            if !ok {
                fails
                    .push(format!("{what}: row {i} entry {j}: got {g}, want {w} (within {tol:e})"));
            }
        }
    }
    fails
}

// ---- softmax -----------------------------------------------------------------------------------

/// Rows whose `exp` overflows `T`'s accumulator unless the row max is subtracted first.
fn large_logits<T: Element>() -> Vec<Vec<f64>> {
    // The type's largest finite value.
    let big = match T::DTYPE {
        dist_tensor::DType::F16 => f64::from(f16::MAX),
        dist_tensor::DType::BF16 => f64::from(bf16::MAX),
        dist_tensor::DType::F32 => f64::from(f32::MAX),
        dist_tensor::DType::F64 => f64::MAX,
    };
    let mut rows = vec![
        vec![100.0, 0.0, -100.0],
        vec![1000.0, 999.0, 0.0],
        vec![-1000.0, -1001.0, -1002.5],
        vec![88.8, 88.7, 88.0], // exp(88.8) is past f32's largest
    ];
    if T::DTYPE == dist_tensor::DType::F64 {
        rows.push(vec![800.0, 799.0, 0.0]); // exp(710) is past f64's largest
    } else {
        // Near the type's largest value (f16: 65504, bf16: 3.4e38): rounded to T.
        rows.push(vec![big, big * 0.99, 0.0]);
    }
    rows.iter().map(|r| r.iter().map(|&v| T::from_f64(v).to_f64()).collect()).collect()
}

fn check_large_logits<T: Element>() -> Vec<String> {
    let rows = large_logits::<T>();
    let n = rows[0].len();
    let flat: Vec<f64> = rows.concat();
    let x = tensor::<T>(&[rows.len(), n], &flat);
    let want: Vec<Vec<f64>> = rows.iter().map(|r| reference::softmax(r)).collect();
    let mut fails = compare(
        &format!("{} softmax(1) of large logits", T::DTYPE),
        &rows_of(&x.softmax(1).unwrap()),
        &want,
        row_tol::<T>(n),
    );
    // The same rows as columns: softmax over axis 0 takes the strided path.
    let columns: Vec<f64> = (0..n).flat_map(|j| rows.iter().map(move |r| r[j])).collect();
    let pt = tensor::<T>(&[n, rows.len()], &columns).softmax(0).unwrap();
    let back: Vec<Vec<f64>> =
        (0..rows.len()).map(|i| (0..n).map(|j| pt.view()[[j, i]].to_f64()).collect()).collect();
    fails.extend(compare(
        &format!("{} softmax(0) of large logits", T::DTYPE),
        &back,
        &want,
        row_tol::<T>(n),
    ));
    fails
}

/// Softmax must subtract each row's max before `exp`: f32 `[100, 0]` is `[1, e^-100]`, not
/// `[NaN, 0]`; likewise past f64's range and near f16's and bf16's largest values.
#[test]
fn softmax_subtracts_the_row_max_so_large_logits_do_not_overflow() {
    let mut fails = common::in_every_dtype!(check_large_logits()).concat();
    // The case the issue names, by value.
    let p = Tensor::<f32>::from(vec![100.0f32, 0.0]).softmax(0).unwrap();
    if p.as_slice()[0] != 1.0 || !(p.as_slice()[1] >= 0.0 && p.as_slice()[1] < 1e-40) {
        fails.push(format!("f32 softmax([100, 0]) = {:?}", p.as_slice()));
    }
    common::assert_none(fails);
}

/// `softmax(x + c) == softmax(x)`: against the f64 reference of the shifted values as `T` holds
/// them, and against the unshifted softmax within what rounding the shifted inputs costs.
#[test]
fn softmax_is_unchanged_by_a_shift_of_its_row() {
    let x = Tensor::<f64>::random(&[5, 17], 3) * 3.0;
    let mut fails = Vec::new();
    for shift in [500.0, -500.0, 1e4] {
        let shifted64 = &x + shift;
        let p64 = shifted64.softmax(1).unwrap();
        fails.extend(compare(
            &format!("f64 softmax(x + {shift}) against softmax(x)"),
            &rows_of(&p64),
            &rows_of(&x.softmax(1).unwrap()),
            1e-12 * shift.abs().max(1.0),
        ));
        let shifted = shifted64.cast::<f32>();
        let want: Vec<Vec<f64>> = rows_of(&shifted).iter().map(|r| reference::softmax(r)).collect();
        let got = rows_of(&shifted.softmax(1).unwrap());
        fails.extend(compare(
            &format!("f32 softmax(x + {shift})"),
            &got,
            &want,
            row_tol::<f32>(17),
        ));
        // Rounding x + shift to f32 moves each logit by up to |shift| u_f32.
        let moved = shift.abs() * f64::from(f32::EPSILON) + row_tol::<f32>(17);
        let unshifted = rows_of(&x.cast::<f32>().softmax(1).unwrap());
        fails.extend(compare(
            &format!("f32 softmax(x + {shift}) against softmax(x)"),
            &got,
            &unshifted,
            2.0 * moved,
        ));
    }
    common::assert_none(fails);
}

/// A NaN makes its row NaN and leaves the other rows alone; `-inf` gets 0 (masked); a row of
/// `-inf` only is NaN (as PyTorch); `+inf` makes its row NaN (`inf - inf`), others untouched.
#[test]
fn softmax_of_nan_and_infinities_stays_in_its_row() {
    let (inf, nan) = (f64::INFINITY, f64::NAN);
    let rows = [
        vec![1.0, nan, 2.0],
        vec![1.0, -inf, 2.0],
        vec![-inf, -inf, -inf],
        vec![inf, 0.0, 1.0],
        vec![0.5, -0.5, 3.0],
    ];
    let want = [
        vec![nan; 3],
        reference::softmax(&[1.0, f64::NEG_INFINITY, 2.0]),
        vec![nan; 3],
        vec![nan; 3],
        reference::softmax(&rows[4]),
    ];
    assert_eq!(want[1][1], 0.0);
    let mut fails = Vec::new();
    for dtype in 0..4 {
        let flat = rows.concat();
        let (name, got) = match dtype {
            0 => ("f32", rows_of(&tensor::<f32>(&[5, 3], &flat).softmax(1).unwrap())),
            1 => ("f64", rows_of(&tensor::<f64>(&[5, 3], &flat).softmax(1).unwrap())),
            2 => ("f16", rows_of(&tensor::<f16>(&[5, 3], &flat).softmax(1).unwrap())),
            _ => ("bf16", rows_of(&tensor::<bf16>(&[5, 3], &flat).softmax(1).unwrap())),
        };
        fails.extend(compare(
            &format!("{name} softmax with NaN and infinities"),
            &got,
            &want,
            1e-2,
        ));
        // Exactly 0 where the input was -inf.
        if got[1][1] != 0.0 {
            fails.push(format!("{name}: softmax of -inf is {}", got[1][1]));
        }
    }
    common::assert_none(fails);
}

// ---- norms -----------------------------------------------------------------------------------

fn layer_norm_reference(row: &[f64], eps: f64) -> Vec<f64> {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    row.iter().map(|v| (v - mean) / (var + eps).sqrt()).collect()
}

fn rms_norm_reference(row: &[f64], eps: f64) -> Vec<f64> {
    let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
    row.iter().map(|v| v / (ms + eps).sqrt()).collect()
}

/// Rows of `n` values `center + r`, `r` seeded in [-1, 1], as `T` holds them.
fn offset_rows<T: Element>(center: f64, n: usize, seed: u64) -> Tensor<T> {
    Tensor::<f64>::random(&[4, n], seed).map(|v| T::from_f64(center + v))
}

fn check_norms_far_from_zero<T: Element>(center: f64, n: usize) -> Vec<String> {
    let x = offset_rows::<T>(center, n, 7);
    let rows = rows_of(&x);
    let eps = 1e-5;
    // The mean is off by about `center EPSILON_acc` before it is subtracted; the rows' spread
    // is about 0.6.
    let tol = row_tol::<T>(n) + 16.0 * center * <T::Acc as Element>::EPSILON / 0.5;
    let want: Vec<Vec<f64>> = rows.iter().map(|r| layer_norm_reference(r, eps)).collect();
    let mut fails = compare(
        &format!("{} layer_norm of rows around {center}", T::DTYPE),
        &rows_of(&x.layer_norm(None, None, eps).unwrap()),
        &want,
        tol,
    );
    let want: Vec<Vec<f64>> = rows.iter().map(|r| rms_norm_reference(r, eps)).collect();
    fails.extend(compare(
        &format!("{} rms_norm of rows around {center}", T::DTYPE),
        &rows_of(&x.rms_norm(None, eps).unwrap()),
        &want,
        row_tol::<T>(n),
    ));
    fails
}

/// Layer norm subtracts the mean before squaring (a one-pass `E[x^2] - E[x]^2` loses every digit
/// of a row around 1000 in f32); RMS norm of values near a half type's largest squares them in
/// f32, not in the half type.
#[test]
fn norms_of_rows_far_from_zero_and_near_the_largest_half_values() {
    let mut fails = Vec::new();
    for center in [100.0, 1000.0] {
        fails.extend(check_norms_far_from_zero::<f32>(center, 33));
        fails.extend(check_norms_far_from_zero::<f64>(center, 33));
    }
    fails.extend(check_norms_far_from_zero::<f64>(1e6, 33));
    // f16 values up to 65504: their squares (4e9) only fit the f32 accumulator.
    let big = Tensor::<f64>::random(&[3, 9], 8).map(|v| f16::from_f64(v * 65504.0));
    let rows = rows_of(&big);
    let want: Vec<Vec<f64>> = rows.iter().map(|r| rms_norm_reference(r, 1e-5)).collect();
    fails.extend(compare(
        "f16 rms_norm near 65504",
        &rows_of(&big.rms_norm(None, 1e-5).unwrap()),
        &want,
        row_tol::<f16>(9),
    ));
    let want: Vec<Vec<f64>> = rows.iter().map(|r| layer_norm_reference(r, 1e-5)).collect();
    fails.extend(compare(
        "f16 layer_norm near 65504",
        &rows_of(&big.layer_norm(None, None, 1e-5).unwrap()),
        &want,
        row_tol::<f16>(9),
    ));
    common::assert_none(fails);
}

/// A NaN or an infinity in a row makes that row's normalized values NaN and no other's.
#[test]
fn norms_of_nan_and_infinities_stay_in_their_row() {
    let (inf, nan) = (f64::INFINITY, f64::NAN);
    let rows = [vec![1.0, nan, 2.0, 3.0], vec![1.0, inf, 2.0, 3.0], vec![1.0, -2.0, 0.5, 3.0]];
    let x = tensor::<f32>(&[3, 4], &rows.concat());
    let want_ln = [vec![nan; 4], vec![nan; 4], layer_norm_reference(&rows[2], 1e-5)];
    let mut fails = compare(
        "f32 layer_norm with NaN and infinities",
        &rows_of(&x.layer_norm(None, None, 1e-5).unwrap()),
        &want_ln,
        row_tol::<f32>(4),
    );
    // RMS norm of a row with +inf: inf / inf is NaN, finite / inf is 0.
    let want_rms = [vec![nan; 4], vec![0.0, nan, 0.0, 0.0], rms_norm_reference(&rows[2], 1e-5)];
    fails.extend(compare(
        "f32 rms_norm with NaN and infinities",
        &rows_of(&x.rms_norm(None, 1e-5).unwrap()),
        &want_rms,
        row_tol::<f32>(4),
    ));
    common::assert_none(fails);
}

// ---- the loss ------------------------------------------------------------------------------

fn check_mse_large<T: Element>(pred: &[f64], target: &[f64], world: usize) -> Vec<String> {
    let n = pred.len();
    let (p, t) = (tensor::<T>(&[n, 1], pred), tensor::<T>(&[n, 1], target));
    let (pv, tv) = (rows_of(&p).concat(), rows_of(&t).concat());
    let want_loss = pv.iter().zip(&tv).map(|(a, b)| (a - b) * (a - b)).sum::<f64>() / n as f64;
    let want_grad: Vec<f64> = pv.iter().zip(&tv).map(|(a, b)| 2.0 * (a - b) / n as f64).collect();
    let outs = World::threads(world)
        .unwrap()
        .run(|rank| {
            let ps = DistTensor::from_global(rank, &p, Placement::Shard(0))?;
            let ts = DistTensor::from_global(rank, &t, Placement::Shard(0))?;
            let (loss, grad) = mse_loss(&ps, &ts)?;
            Ok((loss, grad.to_global()?))
        })
        .unwrap();
    let mut fails = Vec::new();
    let what = format!("{} mse_loss of {pred:?} against {target:?} on {world} ranks", T::DTYPE);
    for (r, (loss, grad)) in outs.iter().enumerate() {
        if !common::within((loss - want_loss).abs(), 1e-12 * want_loss) {
            fails.push(format!("{what}: rank {r}'s loss {loss}, want {want_loss}"));
        }
        let got = rows_of(grad).concat();
        let scale = want_grad.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        fails.extend(compare(
            &format!("{what}: gradient"),
            &[got],
            std::slice::from_ref(&want_grad),
            row_tol::<T>(2) * scale,
        ));
    }
    fails
}

/// The loss of large predictions: squared errors summed in f64 (f32 errors of 2000 square to
/// 4e6, f16 ones of 64000 far past f16's range, bf16 ones of 2e38 past f32's), the gradient in
/// the accumulator type.
#[test]
fn mse_loss_of_large_values_sums_in_f64() {
    let pred = [1000.5, -999.25, 1003.0, 100.0, -0.5];
    let target = [-1000.0, 998.75, 1000.0, -100.0, 0.25];
    let mut fails = Vec::new();
    for world in [1, 2, 3] {
        fails.extend(check_mse_large::<f32>(&pred, &target, world));
        fails.extend(check_mse_large::<f64>(&pred, &target, world));
        // Errors of 64000: their squares are far past f16's range, the gradient 42667 is not.
        let (p16, t16) = ([30000.0, -32000.0, 0.5], [-34000.0, 32000.0, 1.0]);
        fails.extend(check_mse_large::<f16>(&p16, &t16, world));
        let (pb, tb) = ([1.0e38, -1.0, 2.0], [-1.0e38, 1.0, 2.0]);
        fails.extend(check_mse_large::<bf16>(&pb, &tb, world));
    }
    common::assert_none(fails);
}

// ---- activations ---------------------------------------------------------------------------

const ACTIVATIONS: [Activation; 4] =
    [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu];

/// Every activation's derivative (`Activation::backward` with `dy = 1`) against central
/// differences of its own forward pass, in f64 at 801 points of [-4, 4] (ReLU's kink at 0
/// left out), and against the derivative written out in `tests/common/reference.rs`.
#[test]
fn every_activation_derivative_matches_central_differences_of_its_forward() {
    let xs: Vec<f64> = (0..=800).map(|i| -4.0 + i as f64 * 0.01 + 1e-3).collect();
    let x = Tensor::<f64>::from(xs.clone());
    let ones = Tensor::<f64>::from(vec![1.0; xs.len()]);
    let h = 1e-5;
    let mut fails = Vec::new();
    for act in ACTIVATIONS {
        let grad = act.backward(&x, &ones).unwrap();
        let (up, down) = (act.forward(&(&x + h)), act.forward(&(&x - h)));
        for (i, &v) in xs.iter().enumerate() {
            let numeric = (up.as_slice()[i] - down.as_slice()[i]) / (2.0 * h);
            let analytic = grad.as_slice()[i];
            // Truncation h^2 |f'''| / 6 and rounding eps / h: both below 1e-9 here.
            if !common::within((analytic - numeric).abs(), 1e-8) {
                fails.push(format!(
                    "{act:?}'({v}): backward {analytic}, central difference {numeric}"
                ));
            }
            let written = reference::activation_derivative(act, v);
            if !common::within((analytic - written).abs(), 1e-12) {
                fails.push(format!("{act:?}'({v}): backward {analytic}, reference {written}"));
            }
        }
    }
    common::assert_none(fails);
}

fn check_activations_against_reference<T: Element>() -> Vec<String> {
    let xs: Vec<f64> = (0..=400).map(|i| -6.0 + i as f64 * 0.03 + 1e-3).collect();
    let x = tensor::<T>(&[xs.len()], &xs);
    let dy = Tensor::<f64>::random(&[xs.len()], 5).cast::<T>();
    let mut fails = Vec::new();
    for act in ACTIVATIONS {
        let (fwd, bwd) = (act.forward(&x), act.backward(&x, &dy).unwrap());
        for (i, xv) in x.as_slice().iter().enumerate() {
            let v = xv.to_f64();
            let (f, df) = (reference::activation(act, v), reference::activation_derivative(act, v));
            let dyv = dy.as_slice()[i].to_f64();
            // Rounded once to T, after a handful of operations in the accumulator type.
            let tol = row_tol::<T>(8);
            let (got_f, got_b) = (fwd.as_slice()[i].to_f64(), bwd.as_slice()[i].to_f64());
            if !common::within((got_f - f).abs(), tol * f.abs().max(1.0)) {
                fails.push(format!("{} {act:?}({v}) = {got_f}, want {f}", T::DTYPE));
            }
            if !common::within((got_b - dyv * df).abs(), tol * (dyv * df).abs().max(1.0)) {
                fails.push(format!(
                    "{} {act:?}'({v}) * {dyv} = {got_b}, want {}",
                    T::DTYPE,
                    dyv * df
                ));
            }
        }
    }
    fails
}

/// Forward and backward of every activation in every type against the f64 formulas written
/// out in `tests/common/reference.rs`, over [-6, 6].
#[test]
fn activations_and_derivatives_match_written_out_f64_formulas_in_every_type() {
    let fails = common::in_every_dtype!(check_activations_against_reference()).concat();
    common::assert_none(fails);
}
