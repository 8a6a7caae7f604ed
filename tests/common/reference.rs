//! f64 references that share no code with the library: ndarray's products and plain loops, and
//! activations, their derivatives, softmax and `erf` written out here. The library's
//! `Activation`, `Tensor` math and splits are never called; `Activation` is only read as a
//! label.

use dist_tensor::nn::Activation;
use ndarray::{Array1, Array2, ArrayD, ArrayView2, Axis, IxDyn, Slice, concatenate};

/// `erf(x)` by the series `2/sqrt(pi) exp(-x^2) sum_n 2^n x^(2n+1) / (1 3 5 ... (2n+1))`, whose
/// terms are all of one sign: no cancellation, within a few ulp wherever it is summed (|x| < 6;
/// beyond, erf is +-1 in f64).
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x.abs() >= 6.0 {
        return x.signum();
    }
    let x2 = x * x;
    let (mut term, mut sum, mut n) = (x, x, 0.0);
    while term.abs() > sum.abs() * 1e-17 {
        n += 1.0;
        term *= 2.0 * x2 / (2.0 * n + 1.0);
        sum += term;
    }
    2.0 / std::f64::consts::PI.sqrt() * (-x2).exp() * sum
}

/// The standard normal CDF.
pub fn phi(x: f64) -> f64 {
    0.5 * (1.0 + erf(x / 2f64.sqrt()))
}

/// The standard normal density.
pub fn pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `sqrt(2 / pi) (x + 0.044715 x^3)`, the argument of GELU-tanh's tanh, and its derivative.
fn gelu_tanh_inner(x: f64) -> (f64, f64) {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    (c * (x + 0.044715 * x * x * x), c * (1.0 + 3.0 * 0.044715 * x * x))
}

/// The activation `act` of `x`, in f64.
pub fn activation(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Gelu => x * phi(x),
        Activation::GeluTanh => 0.5 * x * (1.0 + gelu_tanh_inner(x).0.tanh()),
        Activation::Silu => x * sigmoid(x),
        Activation::Relu => x.max(0.0),
    }
}

/// The derivative of [`activation`] at `x` (ReLU's is 0 at 0, as PyTorch's).
pub fn activation_derivative(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Gelu => phi(x) + x * pdf(x),
        Activation::GeluTanh => {
            let (u, du) = gelu_tanh_inner(x);
            let t = u.tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
        }
        Activation::Silu => {
            let s = sigmoid(x);
            s + x * s * (1.0 - s)
        }
        Activation::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
    }
}

/// `values` as a `[rows, last]` matrix.
pub fn rows(values: &ArrayD<f64>) -> Array2<f64> {
    let n = *values.shape().last().unwrap();
    let m = values.len() / n.max(1);
    values.to_owned().into_shape_with_order((m, n)).unwrap()
}

/// A matrix or vector back in `shape`.
pub fn shaped<D: ndarray::Dimension>(
    values: ndarray::Array<f64, D>,
    shape: &[usize],
) -> ArrayD<f64> {
    values.into_shape_with_order(IxDyn(shape)).unwrap()
}

/// A vector as a matrix of one column.
fn col(v: &ArrayD<f64>) -> Array1<f64> {
    v.to_owned().into_shape_with_order(v.len()).unwrap()
}

/// A linear layer `y = x @ w + b` and its gradients for `dy`: `[y, dx, dw, db]`, each in the
/// shape of what it is the value or gradient of.
pub fn linear(
    x: &ArrayD<f64>,
    w: &ArrayD<f64>,
    b: &ArrayD<f64>,
    dy: &ArrayD<f64>,
) -> [ArrayD<f64>; 4] {
    let (xr, dyr) = (rows(x), rows(dy));
    let w2 = w.view().into_dimensionality::<ndarray::Ix2>().unwrap();
    let y = xr.dot(&w2) + &col(b);
    let dx = dyr.dot(&w2.t());
    let dw = xr.t().dot(&dyr);
    let db = dyr.sum_axis(Axis(0));
    [shaped(y, dy.shape()), shaped(dx, x.shape()), dw.into_dyn(), db.into_dyn()]
}

/// An MLP `y = act(x @ w1 + b1) @ w2 + b2` and its gradients for `dy`: the output, the input
/// gradient and the gradients of W1, b1, W2, b2.
pub fn mlp(
    x: &ArrayD<f64>,
    w: &[ArrayD<f64>; 4],
    act: Activation,
    dy: &ArrayD<f64>,
) -> [ArrayD<f64>; 6] {
    let (xr, dyr) = (rows(x), rows(dy));
    let m2 = |t: &ArrayD<f64>| t.view().into_dimensionality::<ndarray::Ix2>().unwrap().to_owned();
    let (w1, w2) = (m2(&w[0]), m2(&w[2]));
    let h = xr.dot(&w1) + &col(&w[1]);
    let a = h.mapv(|v| activation(act, v));
    let y = a.dot(&w2) + &col(&w[3]);
    let da = dyr.dot(&w2.t());
    let dh = &da * &h.mapv(|v| activation_derivative(act, v));
    let dx = dh.dot(&w1.t());
    [
        shaped(y, dy.shape()),
        shaped(dx, x.shape()),
        xr.t().dot(&dh).into_dyn(),
        dh.sum_axis(Axis(0)).into_dyn(),
        a.t().dot(&dyr).into_dyn(),
        dyr.sum_axis(Axis(0)).into_dyn(),
    ]
}

/// Softmax of one lane in f64, the row max subtracted.
pub fn softmax(lane: &[f64]) -> Vec<f64> {
    let max = lane.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = lane.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// Attention of `[B, S, H, D]` tensors, `softmax(q k^T / sqrt(D) + mask) v` per batch and head,
/// with plain loops; `causal` masks every key after its query.
pub fn attention(q: &ArrayD<f64>, k: &ArrayD<f64>, v: &ArrayD<f64>, causal: bool) -> ArrayD<f64> {
    let &[b, s, h, d] = q.shape() else {
        panic!("attention takes [B, S, H, D], not {:?}", q.shape())
    };
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = ArrayD::<f64>::zeros(q.shape());
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..s {
                let scores: Vec<f64> = (0..s)
                    .map(|j| {
                        if causal && j > i {
                            return f64::NEG_INFINITY;
                        }
                        (0..d).map(|x| q[[bi, i, hi, x]] * k[[bi, j, hi, x]]).sum::<f64>() * scale
                    })
                    .collect();
                let p = softmax(&scores);
                for x in 0..d {
                    out[[bi, i, hi, x]] = (0..s).map(|j| p[j] * v[[bi, j, hi, x]]).sum();
                }
            }
        }
    }
    out
}

/// The Ulysses all_to_all (`[B, s_r, H, D]` on each rank to `[B, S, h_r, D]`): rank `r`'s
/// output from every rank's input, the heads cut as `numpy.array_split`.
pub fn heads_all_to_all(inputs: &[ArrayD<f64>], r: usize) -> ArrayD<f64> {
    let heads = inputs[0].shape()[2];
    let mine = super::pieces(heads, inputs.len())[r].clone();
    let parts: Vec<ArrayD<f64>> = inputs
        .iter()
        .map(|x| x.slice_axis(Axis(2), Slice::from(mine.clone())).to_owned())
        .collect();
    let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
    concatenate(Axis(1), &views).unwrap()
}

/// `a @ b` and its scale `|a| @ |b|`, with plain loops (for inputs of a few rows).
pub fn product(a: ArrayView2<f64>, b: ArrayView2<f64>) -> (Array2<f64>, Array2<f64>) {
    let (m, k, n) = (a.nrows(), a.ncols(), b.ncols());
    assert_eq!(b.nrows(), k, "inner dimensions");
    let mut want = Array2::zeros((m, n));
    let mut scale = Array2::zeros((m, n));
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                want[[i, j]] += a[[i, p]] * b[[p, j]];
                scale[[i, j]] += (a[[i, p]] * b[[p, j]]).abs();
            }
        }
    }
    (want, scale)
}

/// The largest `|got - want|` relative to the largest `|want|` (NaN when `got` has a NaN).
pub fn rel_err(got: &ArrayD<f64>, want: &ArrayD<f64>) -> f64 {
    assert_eq!(got.shape(), want.shape(), "shapes");
    let size = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = got.iter().zip(want).fold(0.0f64, |m, (x, y)| {
        let d = (x - y).abs();
        if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) }
    });
    diff / size.max(f64::MIN_POSITIVE)
}
