//! Every differentiable local op: its backward pass against central finite differences in f64
//! (`gradcheck`), and in f32, f16 and bf16 against the f64 backward pass on the same inputs.

use dist_tensor::autograd::{GradcheckOptions, Var, gradcheck};
use dist_tensor::{Element, Result, Tensor};

/// The gradients of `sum(f(x) * r)` in `T`, widened to f64, for inputs given in f64 (rounded to
/// `T` first: the f64 reference then sees the same values).
fn grads<T: Element>(
    f: fn(&[Var<'static, T>]) -> Result<Var<'static, T>>,
    inputs: &[Tensor<f64>],
) -> Vec<Tensor<f64>> {
    let vars: Vec<Var<'static, T>> = inputs.iter().map(|t| Var::param(t.cast::<T>())).collect();
    let out = f(&vars).unwrap();
    let r = Tensor::<f64>::random(out.shape(), 99);
    out.backward_with(r.cast::<T>()).unwrap();
    vars.iter().map(|v| v.grad().expect("every input gets a gradient").cast::<f64>()).collect()
}

/// The largest difference between `T`'s gradients and f64's, relative to the largest f64
/// gradient.
fn dtype_error<T: Element>(
    f: fn(&[Var<'static, T>]) -> Result<Var<'static, T>>,
    f64_f: fn(&[Var<'static, f64>]) -> Result<Var<'static, f64>>,
    inputs: &[Tensor<f64>],
) -> f64 {
    let rounded: Vec<Tensor<f64>> = inputs.iter().map(|t| t.cast::<T>().cast::<f64>()).collect();
    let (got, want) = (grads(f, &rounded), grads(f64_f, &rounded));
    let mut worst: f64 = 0.0;
    for (g, w) in got.iter().zip(&want) {
        let scale = w.as_slice().iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        for (a, b) in g.as_slice().iter().zip(w.as_slice()) {
            worst = worst.max((a - b).abs() / scale);
        }
    }
    worst
}

macro_rules! op_test {
    ($name:ident, [$($shape:expr),*], |$x:ident| $body:expr) => {
        op_test!($name, [$($shape),*], GradcheckOptions::default(), |$x| $body);
    };
    ($name:ident, [$($shape:expr),*], $opts:expr, |$x:ident| $body:expr) => {
        mod $name {
            use super::*;
            fn f<T: Element>($x: &[Var<'static, T>]) -> Result<Var<'static, T>> {
                Ok($body)
            }
            fn inputs() -> Vec<Tensor<f64>> {
                let shapes: Vec<Vec<usize>> = vec![$($shape.to_vec()),*];
                shapes.iter().enumerate().map(|(i, s)| Tensor::random(s, 7 + i as u64)).collect()
            }
            #[test]
            fn gradcheck_f64() {
                let report = gradcheck(f::<f64>, &inputs(), $opts).unwrap();
                assert!(report.elements > 0);
            }
            #[test]
            fn f32_f16_bf16_against_f64() {
                let x = inputs();
                let e32 = dtype_error(f::<f32>, f::<f64>, &x);
                let e16 = dtype_error(f::<half::f16>, f::<f64>, &x);
                let eb16 = dtype_error(f::<half::bf16>, f::<f64>, &x);
                assert!(e32 < 1e-5, "f32: {e32}");
                assert!(e16 < 1e-2, "f16: {e16}");
                assert!(eb16 < 6e-2, "bf16: {eb16}");
            }
        }
    };
}

op_test!(add_broadcast, [[3, 4], [4]], |x| &x[0] + &x[1]);
op_test!(add_both_broadcast, [[3, 1], [1, 4]], |x| &x[0] + &x[1]);
op_test!(sub_broadcast, [[2, 3, 4], [3, 1]], |x| &x[0] - &x[1]);
op_test!(mul_broadcast, [[2, 3, 4], [1, 4]], |x| &x[0] * &x[1]);
op_test!(div_broadcast, [[3, 5], [5]], |x| &x[0] / &x[1].add_scalar(3.0));
op_test!(neg_scale_add_scalar, [[4, 3]], |x| (-&x[0]).scale(1.5).add_scalar(0.25));
op_test!(scalar_operand, [[4, 3]], |x| &(&x[0] * T::from_f64(2.5)) - T::from_f64(1.0));
op_test!(matmul_2d, [[3, 4], [4, 5]], |x| x[0].matmul(&x[1])?);
op_test!(matmul_batched_2d_weight, [[2, 3, 4], [4, 5]], |x| x[0].matmul(&x[1])?);
op_test!(matmul_batched, [[2, 3, 4], [2, 4, 5]], |x| x[0].matmul(&x[1])?);
op_test!(matmul_batch_broadcast, [[2, 1, 3, 4], [3, 4, 2]], |x| x[0].matmul(&x[1])?);
op_test!(reshape, [[2, 6]], |x| &x[0].reshape(&[3, 4])? * &x[0].reshape(&[3, 4])?);
op_test!(permute, [[2, 3, 4]], |x| x[0].permute(&[2, 0, 1])?.silu());
op_test!(transpose, [[2, 3, 4]], |x| x[0].transpose(0, 2)?.gelu());
op_test!(insert_axis, [[3, 4], [2, 1, 4]], |x| &x[0].insert_axis(0)? * &x[1]);
op_test!(sum, [[3, 4]], |x| (&x[0] * &x[0]).sum());
op_test!(mean, [[3, 4]], |x| (&x[0] * &x[0]).mean());
op_test!(sum_axis, [[3, 4, 2]], |x| (&x[0] * &x[0]).sum_axis(1)?);
op_test!(mean_axis, [[3, 4, 2]], |x| (&x[0] * &x[0]).mean_axis(0)?);
op_test!(gelu, [[5, 7]], |x| x[0].scale(2.0).gelu());
op_test!(gelu_tanh, [[5, 7]], |x| x[0].scale(2.0).gelu_tanh());
op_test!(silu, [[5, 7]], |x| x[0].scale(2.0).silu());
op_test!(relu, [[5, 7]], |x| x[0].relu());
op_test!(softmax_last, [[3, 7]], |x| x[0].scale(3.0).softmax(1)?);
op_test!(softmax_middle, [[2, 5, 3]], |x| x[0].scale(3.0).softmax(1)?);
op_test!(rms_norm, [[4, 6]], |x| x[0].rms_norm(None, 1e-6)?);
op_test!(rms_norm_weight, [[2, 3, 6], [6]], |x| x[0].rms_norm(Some(&x[1]), 1e-6)?);
op_test!(layer_norm, [[4, 6]], |x| x[0].layer_norm(None, None, 1e-5)?);
op_test!(layer_norm_affine, [[4, 6], [6], [6]], |x| {
    x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5)?
});
op_test!(layer_norm_weight_only, [[4, 6], [6]], |x| x[0].layer_norm(Some(&x[1]), None, 1e-5)?);

/// Through f32 the function is piecewise constant at f32's resolution: a larger step.
mod cast {
    use super::*;
    #[test]
    fn gradcheck_through_f32() {
        let opts = GradcheckOptions { eps: 1e-3, atol: 1e-4, ..Default::default() };
        let x = Tensor::<f64>::random(&[3, 4], 1);
        gradcheck(|x| Ok(x[0].cast::<f32>().silu().cast::<f64>()), &[x], opts).unwrap();
    }
}

#[test]
fn a_wrong_gradient_fails_gradcheck() {
    // relu's gradient where the step straddles the kink disagrees with finite differences: the
    // check must say so rather than pass.
    let x = Tensor::<f64>::from_shape_vec(&[3], vec![1e-8, 0.5, -0.5]).unwrap();
    let err = gradcheck(|x| Ok(x[0].relu()), &[x], GradcheckOptions::default()).unwrap_err();
    assert!(
        matches!(err, dist_tensor::Error::GradientMismatch { input: 0, index: 0, .. }),
        "{err}"
    );
}

#[test]
fn untracked_inputs_build_no_graph() {
    let x = Var::<f32>::constant(Tensor::random(&[4, 4], 1));
    let y = x.matmul(&x).unwrap().softmax(1).unwrap().sum();
    assert!(!y.is_tracked());
    assert!(y.backward().is_err());
}

#[test]
fn a_shared_input_gets_the_sum_of_its_uses_and_leaves_accumulate() {
    let w = Var::param(Tensor::<f64>::from_shape_vec(&[2], vec![1.0, 2.0]).unwrap());
    let y = (&(&w * &w) + &w).sum(); // dy/dw = 2w + 1
    y.backward().unwrap();
    assert_eq!(w.grad().unwrap().as_slice(), &[3.0, 5.0]);
    let y = w.sum();
    y.backward().unwrap();
    assert_eq!(w.grad().unwrap().as_slice(), &[4.0, 6.0]);
    w.zero_grad();
    assert!(w.grad().is_none());
}

#[test]
fn a_second_backward_on_the_same_graph_is_an_error() {
    let w = Var::param(Tensor::<f64>::random(&[3], 1));
    let y = w.gelu().sum();
    y.backward().unwrap();
    assert!(y.backward().is_err());
}

op_test!(narrow, [[3, 5]], |x| x[0].narrow(1, 1, 3)?.silu());
op_test!(gather_rows_repeated_and_missing, [[4, 3]], |x| {
    x[0].gather_rows(&[Some(2), None, Some(0), Some(2)])?.gelu()
});
