//! The fused attention op against a naive f64 attention (scores, mask, softmax, product), forward
//! and backward, at S = 1, 7, 128 and 1027, causal and not, in every element type; and its
//! gradients against central finite differences.

use dist_tensor::autograd::{GradcheckOptions, Var, gradcheck};
use dist_tensor::tensor::scaled_dot_product_attention;
use dist_tensor::{Element, Tensor};

/// The naive attention on `Var`s of f64: an `[S, S]` additive mask, softmax, products.
fn naive<'a>(q: &Var<'a, f64>, k: &Var<'a, f64>, v: &Var<'a, f64>, causal: bool) -> Var<'a, f64> {
    let n = q.shape().len();
    let (sq, sk, d) = (q.shape()[n - 2], k.shape()[n - 2], q.shape()[n - 1]);
    let s = q.matmul(&k.transpose(n - 2, n - 1).unwrap()).unwrap().scale(1.0 / (d as f64).sqrt());
    let s = if causal {
        let mask: Vec<f64> =
            (0..sq * sk).map(|i| if i % sk > i / sk { -1e300 } else { 0.0 }).collect();
        &s + &Var::constant(Tensor::from_shape_vec(&[sq, sk], mask).unwrap())
    } else {
        s
    };
    s.softmax(n - 1).unwrap().matmul(v).unwrap()
}

/// `|got - want|` over the largest `|want|`, at least 0.1 (a gradient that is zero in exact
/// arithmetic, dq at S = 1, is rounding noise).
fn rel_err(got: &Tensor<f64>, want: &Tensor<f64>) -> f64 {
    assert_eq!(got.shape(), want.shape());
    let scale = want.as_slice().iter().fold(0.1f64, |m, v| m.max(v.abs()));
    got.as_slice().iter().zip(want.as_slice()).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

fn check<T: Element>(b: usize, h: usize, s: usize, d: usize, causal: bool, tol: f64) {
    let shape = [b, h, s, d];
    let x: Vec<Tensor<f64>> =
        (0..3).map(|i| Tensor::<f64>::random(&shape, 11 + i).cast::<T>().cast()).collect();
    let dout = Tensor::<f64>::random(&[b, h, s, d], 5).cast::<T>().cast::<f64>();
    // The f64 reference, forward and backward.
    let r: Vec<Var<f64>> = x.iter().map(|t| Var::param(t.clone())).collect();
    let want = naive(&r[0], &r[1], &r[2], causal);
    want.backward_with(dout.clone()).unwrap();
    // The fused op in T.
    let f: Vec<Var<T>> = x.iter().map(|t| Var::param(t.cast::<T>())).collect();
    let got = f[0].scaled_dot_product_attention(&f[1], &f[2], causal).unwrap();
    let plain = scaled_dot_product_attention(f[0].value(), f[1].value(), f[2].value(), causal);
    assert_eq!(&plain.unwrap(), got.value());
    got.backward_with(dout.cast::<T>()).unwrap();
    let e = rel_err(&got.value().cast(), want.value());
    assert!(e < tol, "{} S={s} causal={causal}: output off by {e:e}", T::DTYPE);
    for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(f.iter().zip(&r)) {
        let e = rel_err(&g.grad().unwrap().cast(), &w.grad().unwrap());
        assert!(e < tol, "{} S={s} causal={causal}: {name} off by {e:e}", T::DTYPE);
    }
}

#[test]
fn against_naive_f64_every_length_and_dtype() {
    for &s in &[1, 7, 128] {
        for causal in [false, true] {
            check::<f64>(2, 3, s, 8, causal, 1e-12);
            check::<f32>(2, 3, s, 8, causal, 1e-5);
            check::<half::f16>(1, 2, s, 8, causal, 1e-2);
            check::<half::bf16>(1, 2, s, 8, causal, 5e-2);
        }
    }
}

#[test]
fn against_naive_f64_at_1027() {
    for causal in [false, true] {
        check::<f64>(1, 2, 1027, 16, causal, 1e-11);
        check::<f32>(1, 2, 1027, 16, causal, 1e-4);
        check::<half::bf16>(1, 1, 1027, 16, causal, 5e-2);
    }
}

#[test]
fn gradcheck_with_uneven_blocks() {
    // 70 queries: a full block of 64 and 6 more; different q and k lengths; Dv != D.
    let x = vec![
        Tensor::<f64>::random(&[1, 70, 3], 1),
        Tensor::<f64>::random(&[1, 130, 3], 2),
        Tensor::<f64>::random(&[1, 130, 2], 3),
    ];
    for causal in [false, true] {
        let f = |x: &[Var<'static, f64>]| x[0].scaled_dot_product_attention(&x[1], &x[2], causal);
        gradcheck(f, &x, GradcheckOptions::default()).unwrap();
    }
}

#[test]
fn no_keys_gives_zeros_and_bad_shapes_are_errors() {
    let q = Tensor::<f32>::random(&[2, 3, 4], 1);
    let (k, v) = (Tensor::<f32>::zeros(&[2, 0, 4]), Tensor::<f32>::zeros(&[2, 0, 4]));
    let o = scaled_dot_product_attention(&q, &k, &v, false).unwrap();
    assert!(o.shape() == [2, 3, 4] && o.as_slice().iter().all(|&x| x == 0.0));
    let bad = Tensor::<f32>::random(&[2, 3, 5], 2);
    assert!(scaled_dot_product_attention(&q, &bad, &bad, false).is_err());
    let other_batch = Tensor::<f32>::random(&[3, 3, 4], 2);
    assert!(scaled_dot_product_attention(&q, &other_batch, &other_batch, true).is_err());
}
